"""Small image figures written with Pillow only (usable in the torch-free release path)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import numpy as np
from PIL import Image

from .errors import DataError


def grid_array(
    images: np.ndarray,
    labels: np.ndarray | None = None,
    *,
    per_class: int = 10,
    n_classes: int | None = None,
    columns: int | None = None,
    pad: int = 2,
    scale: int = 1,
) -> np.ndarray:
    """uint8 (H, W, 3) mosaic of ``images`` (N, C, H, W) in [0, 1].

    With labels: one row per class (label order), its first ``per_class`` images left to right; a
    class with fewer images leaves blank cells. Without labels: row-major, ``columns`` wide
    (default ceil(sqrt(N))). Cells are separated by ``pad`` grey pixels and enlarged ``scale`` times
    (nearest neighbour, so pixels stay visible).
    """
    images = np.asarray(images)
    if images.ndim != 4 or images.shape[1] not in (1, 3) or images.shape[0] == 0:
        raise DataError(f"save_grid: images must be a non-empty (N, C, H, W) array with C = 1 or 3; got {images.shape}")
    n, c, h, w = images.shape
    if labels is not None:
        labels = np.asarray(labels).astype(np.int64)
        if labels.shape != (n,):
            raise DataError(f"save_grid: {n} images but labels of shape {labels.shape}")
        k = int(n_classes if n_classes is not None else labels.max() + 1)
        cells = [[int(i) for i in np.flatnonzero(labels == cl)[:per_class]] for cl in range(k)]
        rows, cols = k, per_class
    else:
        cols = columns or int(np.ceil(np.sqrt(n)))
        rows = int(np.ceil(n / cols))
        cells = [list(range(r * cols, min((r + 1) * cols, n))) for r in range(rows)]
    pix = np.rint(np.clip(np.nan_to_num(images, nan=0.0), 0.0, 1.0) * 255).astype(np.uint8)
    if c == 1:
        pix = np.repeat(pix, 3, axis=1)
    out = np.full((rows * (h + pad) + pad, cols * (w + pad) + pad, 3), 128, dtype=np.uint8)
    for r, idxs in enumerate(cells):
        for col, i in enumerate(idxs):
            y, x = pad + r * (h + pad), pad + col * (w + pad)
            out[y : y + h, x : x + w] = pix[i].transpose(1, 2, 0)
    if scale > 1:
        out = np.repeat(np.repeat(out, scale, axis=0), scale, axis=1)
    return out


def save_grid(
    images: np.ndarray,
    labels: np.ndarray | None,
    path: str | os.PathLike,
    *,
    per_class: int = 10,
    n_classes: int | None = None,
    columns: int | None = None,
    scale: int = 2,
    pad: int = 2,
    class_names: Sequence[str] | None = None,
    title: str | None = None,
) -> Path:
    """Write a PNG sample grid (see ``grid_array``) atomically; returns the path. With ``class_names`` each
    row is labelled, with ``title`` (say, from ``epsilon_title``) a title band is drawn above."""
    if class_names is not None or title is not None:
        return save_labelled_grid(images, labels, path, class_names=class_names, title=title, per_class=per_class,
                                  n_classes=n_classes, columns=columns, scale=scale, pad=pad)
    arr = grid_array(images, labels, per_class=per_class, n_classes=n_classes, columns=columns, pad=pad, scale=scale)
    return _write_png(Image.fromarray(arr, mode="RGB"), Path(path))


def _write_png(img: Image.Image, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            img.save(fh, format="PNG")
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out



def save_budget_chart(
    per_stage: dict[str, float],
    path: str | os.PathLike,
    *,
    target: float | None = None,
    delta: float | None = None,
    width: int = 560,
) -> Path:
    """PNG bar chart of the privacy budget: one bar per stage (epsilon of that stage ALONE) and the total.

    Composition is sub-additive, so the stage bars need not add up to the total; the total is what counts
    and is drawn last (dark). ``target`` draws a vertical line at the budget. Pillow's default font only.
    """
    from PIL import ImageDraw

    rows = [(k, float(v)) for k, v in per_stage.items() if k != "total"]
    if "total" in per_stage:
        rows.append(("total", float(per_stage["total"])))
    if not rows:
        raise DataError("save_budget_chart: no stages to draw")
    top = max([v for _, v in rows] + ([target] if target else [])) or 1.0
    left, right, bar_h, gap, head = 90, 70, 22, 10, 30
    height = head + len(rows) * (bar_h + gap) + 20
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    title = "privacy budget (epsilon per stage alone; total composed)"
    if delta is not None:
        title += f", delta={delta:g}"
    d.text((8, 8), title, fill="black")
    span = width - left - right
    for i, (name, v) in enumerate(rows):
        y = head + i * (bar_h + gap)
        colour = (40, 40, 110) if name == "total" else (110, 150, 210)
        d.rectangle([left, y, left + max(1, int(span * v / top)), y + bar_h], fill=colour)
        d.text((8, y + 5), name, fill="black")
        d.text((left + int(span * v / top) + 6, y + 5), f"{v:.3f}", fill="black")
    if target:
        x = left + int(span * target / top)
        d.line([x, head - 6, x, height - 12], fill=(200, 30, 30), width=2)
        d.text((min(x + 4, width - 60), height - 16), f"target {target:g}", fill=(200, 30, 30))
    return _write_png(img, Path(path))


# -- labelled figures ---------------------------------------------------------------------------------------


def _font(size: int) -> tuple[Any, bool]:
    """(font, has Greek): DejaVu Sans where installed (ε, δ), else Pillow's bundled font (ASCII words)."""
    from PIL import ImageFont

    try:
        return ImageFont.truetype("DejaVuSans.ttf", size), True  # found on the font path of most Linux systems
    except OSError:
        pass
    for p in ("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", "/usr/share/fonts/dejavu/DejaVuSans.ttf"):
        if Path(p).is_file():
            return ImageFont.truetype(p, size), True
    try:
        return ImageFont.load_default(size=size), False  # Pillow's bundled TrueType font (needs FreeType)
    except (TypeError, OSError, ImportError):  # old Pillow or no FreeType: the fixed bitmap font
        return ImageFont.load_default(), False


def _ascii(text: str) -> str:
    return text.replace("ε", "eps").replace("δ", "delta").replace("σ", "sigma").replace("≤", "<=")


def epsilon_title(what: str, epsilon: float | dict[str, float] | None, delta: float | None = None) -> str:
    """``"<what> - ε = 1.00, δ = 1e-05 (unit: one image of one site)"``; per-site figures as ``a: 1.00, b: 0.98``."""
    if epsilon is None:
        return f"{what} - no privacy budget spent yet (no data touched)"
    if isinstance(epsilon, dict):
        eps = ", ".join(f"{k}: {float(v):.3g}" for k, v in sorted(epsilon.items()))
        eps = f"ε per site {eps}"
    else:
        eps = f"ε = {float(epsilon):.3g}"
    d = f", δ = {delta:g}" if delta is not None else ""
    return f"{what} - {eps}{d} (unit: one image of one site)"


def labelled_grid_image(
    images: np.ndarray,
    labels: np.ndarray | None,
    *,
    class_names: Sequence[str] | None = None,
    title: str | None = None,
    per_class: int = 10,
    n_classes: int | None = None,
    columns: int | None = None,
    scale: int = 2,
    pad: int = 2,
) -> Image.Image:
    """The grid of ``grid_array`` with a title band above and, with labels, the class name left of each row."""
    from PIL import ImageDraw

    if class_names is not None and labels is not None and n_classes is None:
        n_classes = len(class_names)
    arr = grid_array(images, labels, per_class=per_class, n_classes=n_classes, columns=columns, pad=pad, scale=scale)
    (font, greek), (tfont, _) = _font(13), _font(14)
    if title and not greek:
        title = _ascii(title)
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    names = [str(n) for n in class_names] if (class_names is not None and labels is not None) else []
    left = (max(int(probe.textlength(n, font=font)) for n in names) + 12) if names else 0
    top = 26 if title else 0
    width = max(left + arr.shape[1], int(probe.textlength(title, font=tfont)) + 16 if title else 0)
    img = Image.new("RGB", (width, top + arr.shape[0]), "white")
    img.paste(Image.fromarray(arr, mode="RGB"), (left, top))
    d = ImageDraw.Draw(img)
    if title:
        d.text((8, 5), title, fill="black", font=tfont)
    if names:
        h = images.shape[2] * scale
        for r, name in enumerate(names):
            y = top + pad * scale + r * (h + pad * scale) + h // 2
            d.text((left - 6, y), name, fill="black", font=font, anchor="rm")
    return img


def save_labelled_grid(images: np.ndarray, labels: np.ndarray | None, path: str | os.PathLike, **kw) -> Path:  # type: ignore[no-untyped-def]
    """Write ``labelled_grid_image`` as PNG atomically; returns the path."""
    return _write_png(labelled_grid_image(images, labels, **kw), Path(path))


STAGE_COLOURS = {"central": "#7aa6d8", "frequency": "#9ccf9c", "dpsgd": "#e7b46a"}
STAGE_LABELS = {"central": "central images", "frequency": "frequency statistics", "dpsgd": "DP-SGD"}


def _nice_step(top: float, ticks: int = 5) -> float:
    import math

    raw = top / ticks
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)


def budget_svg(sites: dict[str, dict[str, Any]], *, width: int = 720) -> str:
    """SVG bar chart, one group per site: ε of each stage ALONE (light) and the composed total (dark), the
    site's per-job cap as a red tick where known. ``sites[sid] = {"by_stage": {stage: eps, "total": eps},
    "delta": d, "cap": eps | None}``. Self-contained: no fonts or scripts fetched."""
    from html import escape

    rows: list[tuple[str, str, float, str]] = []  # (site, name, value, kind)
    top = 0.0
    for sid, s in sites.items():
        for stage, v in s["by_stage"].items():
            if stage != "total":
                rows.append((sid, stage, float(v), "stage"))
        rows.append((sid, "total", float(s["by_stage"]["total"]), "total"))
        top = max([top, float(s["by_stage"]["total"]), *[float(v) for v in s["by_stage"].values()],
                   float(s.get("cap") or 0.0)])
    top = top * 1.12 or 1.0
    left, right, bar, gap, head, group_gap = 160, 60, 18, 6, 40, 22
    span = width - left - right
    groups = list(sites)
    height = head + len(rows) * (bar + gap) + len(groups) * group_gap + 48
    x = lambda v: left + span * v / top  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           f'font-family="Helvetica, Arial, sans-serif" font-size="12" role="img" aria-label="privacy budget chart">',
           '<text x="8" y="18" font-size="13" font-weight="bold">ε per site: each stage alone (light) and composed '
           'total (dark); dashed red line = per-job cap</text>']
    y = head
    for sid in groups:
        s = sites[sid]
        out.append(f'<text x="8" y="{y + 12}" font-weight="bold">site {escape(sid)}</text>')
        y += group_gap
        y0 = y
        for rsid, name, v, kind in rows:
            if rsid != sid:
                continue
            colour = "#27306e" if kind == "total" else STAGE_COLOURS.get(name, "#aab4c8")
            label = "total (composed)" if kind == "total" else STAGE_LABELS.get(name, name)
            out.append(f'<text x="{left - 8}" y="{y + 13}" text-anchor="end">{escape(label)}</text>')
            out.append(f'<rect x="{left}" y="{y}" width="{max(1.0, x(v) - left):.1f}" height="{bar}" fill="{colour}"/>')
            out.append(f'<text x="{x(v) + 5:.1f}" y="{y + 13}">{v:.3g}</text>')
            y += bar + gap
        if s.get("cap"):
            cx = x(float(s["cap"]))
            out.append(f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{y0 - 2}" y2="{y - gap + 2}" stroke="#c0392b" '
                       f'stroke-width="2" stroke-dasharray="4 3"/>')
            out.append(f'<text x="{cx:.1f}" y="{y0 - 4}" text-anchor="middle" fill="#c0392b" font-size="11">'
                       f'per-job cap {float(s["cap"]):g}</text>')
    axis_y = y + 6
    out.append(f'<line x1="{left}" x2="{left + span}" y1="{axis_y}" y2="{axis_y}" stroke="#888"/>')
    step = _nice_step(top)
    v = 0.0
    while v <= top + 1e-12:
        out.append(f'<line x1="{x(v):.1f}" x2="{x(v):.1f}" y1="{axis_y}" y2="{axis_y + 4}" stroke="#888"/>')
        out.append(f'<text x="{x(v):.1f}" y="{axis_y + 16}" text-anchor="middle" fill="#555" font-size="10">{v:g}</text>')
        v = round(v + step, 10)
    out.append(f'<text x="{left + span / 2:.1f}" y="{axis_y + 30}" text-anchor="middle" fill="#555" font-size="11">'
               'ε (privacy loss; smaller is more private)</text>')
    out.append("</svg>")
    return "\n".join(out)


def save_budget_svg(sites: dict[str, dict[str, Any]], path: str | os.PathLike) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(budget_svg(sites), "utf-8")
    os.replace(tmp, out)
    return out
