"""Small image figures written with Pillow only (usable in the torch-free release path)."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

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
        raise DataError(
            f"save_grid: images must be a non-empty (N, C, H, W) array with C = 1 or 3; got {images.shape}"
        )
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
        return save_labelled_grid(
            images,
            labels,
            path,
            class_names=class_names,
            title=title,
            per_class=per_class,
            n_classes=n_classes,
            columns=columns,
            scale=scale,
            pad=pad,
        )
    arr = grid_array(
        images, labels, per_class=per_class, n_classes=n_classes, columns=columns, pad=pad, scale=scale
    )
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


# -- labelled figures ---------------------------------------------------------------------------------------


def _font(size: int) -> tuple[Any, bool]:
    """(font, has Greek): DejaVu Sans where installed (ε, δ), else Pillow's bundled font (ASCII words)."""
    try:
        # found on the font path of most Linux systems
        return ImageFont.truetype("DejaVuSans.ttf", size), True
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


def epsilon_title(
    what: str,
    epsilon: float | dict[str, float] | None,
    delta: float | None = None,
    unit: str = "one image of one site",
) -> str:
    """``"<what> - ε = 1.00, δ = 1e-05 (unit: one image of one site)"``; per-site figures as ``a: 1.00, b:
    0.98``; ``unit``: what the figure protects (patient-level DP-SGD: a patient for that stage)."""
    if epsilon is None:
        return f"{what} - no privacy budget spent yet (no data touched)"
    if isinstance(epsilon, dict):
        eps = ", ".join(f"{k}: {float(v):.3g}" for k, v in sorted(epsilon.items()))
        eps = f"ε per site {eps}"
    else:
        eps = f"ε = {float(epsilon):.3g}"
    d = f", δ = {delta:g}" if delta is not None else ""
    return f"{what} - {eps}{d} (unit: {unit})"


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
    """The grid of ``grid_array`` with a title band above and, with labels, the class name left of each
    row."""
    if class_names is not None and labels is not None and n_classes is None:
        n_classes = len(class_names)
    arr = grid_array(
        images, labels, per_class=per_class, n_classes=n_classes, columns=columns, pad=pad, scale=scale
    )
    (font, greek), (tfont, _) = _font(13), _font(14)
    if title and not greek:
        title = _ascii(title)
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    names = [str(n) for n in class_names] if (class_names is not None and labels is not None) else []
    left = (max(int(measure.textlength(n, font=font)) for n in names) + 12) if names else 0
    top = 26 if title else 0
    width = max(left + arr.shape[1], int(measure.textlength(title, font=tfont)) + 16 if title else 0)
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
    raw = top / ticks
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)


def _budget_rows(s: dict[str, Any]) -> list[tuple[str, float, float | None]]:
    """(stage, ε this job, ε lifetime or None) per stage alone, then the composed total; stages the site spent
    on in earlier jobs only (lifetime, not this job) get a row too, with 0 for this job."""
    job = {k: float(v) for k, v in s["by_stage"].items()}
    life = {k: float(v) for k, v in (s.get("lifetime_by_stage") or {}).items()}
    stages = [k for k in job if k != "total"] + [k for k in life if k != "total" and k not in job]
    rows: list[tuple[str, float, float | None]] = [
        (k, job.get(k, 0.0), life.get(k) if life else None) for k in stages
    ]
    rows.append(("total", job["total"], life.get("total") if life else None))
    return rows


def _budget_top(sites: dict[str, dict[str, Any]]) -> float:
    values = [0.0]
    for s in sites.values():
        for _, job, life in _budget_rows(s):
            values += [job, life or 0.0]
        values += [float(s.get("cap") or 0.0), float(s.get("lifetime_cap") or 0.0)]
    return max(values) * 1.12 or 1.0


def _cap_line(x: float, y0: float, y1: float, text: str, colour: str, dash: str) -> list[str]:
    return [
        f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y0 - 2}" y2="{y1 + 2}" stroke="{colour}" stroke-width="2" '
        f'stroke-dasharray="{dash}"/>',
        f'<text x="{x:.1f}" y="{y0 - 4}" text-anchor="middle" fill="{colour}" font-size="11">{text}</text>',
    ]


def _budget_site(
    sid: str, s: dict[str, Any], y: float, x: Any, geo: dict[str, int]
) -> tuple[list[str], float]:
    """One site's group: per stage a solid bar for THIS job and, where the site states it, a pale outlined bar
    for its LIFETIME spend on the same images (all jobs); the per-job and lifetime caps as dashed lines."""
    left, bar, gap = geo["left"], geo["bar"], geo["gap"]
    # a patient-level site's figures and caps are per patient: its header says so
    unit = " (ε per patient)" if s.get("unit") == "patient" else ""
    out = [f'<text x="8" y="{y + 12}" font-weight="bold">site {escape(sid)}{unit}</text>']
    y += geo["group_gap"]
    y0 = y
    for name, job, life in _budget_rows(s):
        colour = "#27306e" if name == "total" else STAGE_COLOURS.get(name, "#aab4c8")
        label = "total (composed)" if name == "total" else STAGE_LABELS.get(name, name)
        out.append(f'<text x="{left - 8}" y="{y + 13}" text-anchor="end">{escape(label)}</text>')
        bars = [("this job", job, 'fill="{c}"')] + (
            [("lifetime", life, 'fill="{c}" fill-opacity="0.3" stroke="{c}"')] if life is not None else []
        )
        for kind, v, style in bars:
            out.append(
                f'<rect x="{left}" y="{y}" width="{max(1.0, x(v) - left):.1f}" height="{bar}" '
                f"{style.format(c=colour)}><title>{escape(label)}, {kind}: ε {v:.4g}</title></rect>"
            )
            out.append(f'<text x="{x(v) + 5:.1f}" y="{y + 13}">{v:.3g} {kind}</text>')
            y += bar + 2
        y += gap
    if s.get("cap"):
        out += _cap_line(
            x(float(s["cap"])), y0, y - gap, f"per-job cap {float(s['cap']):g}", "#c0392b", "4 3"
        )
    if s.get("lifetime_cap"):
        out += _cap_line(
            x(float(s["lifetime_cap"])),
            y0 - 12,
            y - gap,
            f"lifetime cap {float(s['lifetime_cap']):g}",
            "#7b1e12",
            "1 3",
        )
    return out, y


def budget_svg(sites: dict[str, dict[str, Any]], *, width: int = 720) -> str:
    """SVG bar chart, one group per site: per stage, ε of that stage ALONE for this job (solid) and for the
    site's whole LIFETIME on the same images (pale, outlined), then the composed totals (dark); the site's
    per-job and lifetime caps as dashed lines where known.  ``sites[sid] = {"by_stage": {stage: eps, "total":
    eps}, "lifetime_by_stage": {...} | None, "delta": d, "cap": eps | None, "lifetime_cap": eps | None,
    "unit": "image" | "patient"}``: every figure and cap in the site's unit.
    Self-contained: no fonts or scripts fetched."""
    top = _budget_top(sites)
    geo = {"left": 170, "right": 90, "bar": 16, "gap": 8, "head": 52, "group_gap": 26}
    span = width - geo["left"] - geo["right"]
    n_bars = sum(len(_budget_rows(s)) * (2 if s.get("lifetime_by_stage") else 1) for s in sites.values())
    n_rows = sum(len(_budget_rows(s)) for s in sites.values())
    height = (
        geo["head"] + n_bars * (geo["bar"] + 2) + n_rows * geo["gap"] + len(sites) * geo["group_gap"] + 48
    )
    x = lambda v: geo["left"] + span * v / top  # noqa: E731
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} '
        f'{height}" font-family="Helvetica, Arial, sans-serif" font-size="12" role="img" aria-label="privacy '
        'budget chart">',
        '<text x="8" y="18" font-size="13" font-weight="bold">ε per site and stage: this job (solid) and the '
        "site's lifetime (pale)</text>",
        '<text x="8" y="34" font-size="11" fill="#555">each stage alone, then composed totals (dark); dashed '
        "red: "
        "per-job cap, dotted: lifetime cap</text>",
    ]
    y = float(geo["head"])
    for sid, s in sites.items():
        part, y = _budget_site(sid, s, y, x, geo)
        out += part
    out += _budget_axis(x, geo["left"], span, y + 6, top)
    out.append("</svg>")
    return "\n".join(out)


def _budget_axis(x: Any, left: int, span: int, axis_y: float, top: float) -> list[str]:
    out = [f'<line x1="{left}" x2="{left + span}" y1="{axis_y}" y2="{axis_y}" stroke="#888"/>']
    step = _nice_step(top)
    v = 0.0
    while v <= top + 1e-12:
        out.append(f'<line x1="{x(v):.1f}" x2="{x(v):.1f}" y1="{axis_y}" y2="{axis_y + 4}" stroke="#888"/>')
        out.append(
            f'<text x="{x(v):.1f}" y="{axis_y + 16}" text-anchor="middle" fill="#555" '
            f'font-size="10">{v:g}</text>'
        )
        v = round(v + step, 10)
    out.append(
        f'<text x="{left + span / 2:.1f}" y="{axis_y + 30}" text-anchor="middle" fill="#555" font-size="11">'
        "ε (privacy loss; smaller is more private)</text>"
    )
    return out


def save_budget_svg(sites: dict[str, dict[str, Any]], path: str | os.PathLike) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(budget_svg(sites), "utf-8")
    os.replace(tmp, out)
    return out
