"""Small image figures written with Pillow only (usable in the torch-free release path)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

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
) -> Path:
    """Write a PNG sample grid (see ``grid_array``) atomically; returns the path."""
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
