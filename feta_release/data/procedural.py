"""Procedurally generated labelled image sets: made offline, deterministic by seed, numpy only.

Three kinds, the first two built to test something the embedded digits cannot, the third a PUBLIC set for
them:

- ``medical``: chest-radiograph-like grey images (body outline, two lung fields, mediastinum and heart, ribs)
  with random size, position, contrast, gamma and detector noise. Four classes:
  ``normal``;
  ``finding``: normal anatomy plus ONE small bright spot (a few pixels) at a random place inside a lung field.
  Its class mean image nearly coincides with ``normal``'s: a release that keeps only per-class means (central
  images) cannot tell the two apart, a generator must keep local detail;
  ``effusion``: a basal opacity that fills the bottom of one or both lung fields (a blunted angle): visible in
  the class mean;
  ``opacity``: a patchy, diffuse ground-glass texture over the lung fields (a texture, partly visible in the
  mean). ``population="B"`` is another hospital: other exposure and contrast, stronger noise, another
  acquisition gamma and another class balance, so a set of population B can stand for PUBLIC data that is not
  the private (A) data.
- ``rgb``: 3-channel images of one coloured, textured object (disk, square, triangle, ring or cross) on a
  cluttered background of coloured blobs and a colour gradient. Ten classes = five shapes x two colour
  families (warm: red to yellow hues; cool: green to blue). A generator that loses colour (or a grey release)
  loses half the label.
- ``strokes``: grey pen strokes on a dark ground (a line, an arc, a closed loop or a curve, thick and
  anti-aliased, plus sometimes a short second stroke): public pretraining data for hand-drawn digits that is
  derived from no digit set at all (not the embedded MNIST subset, not any scored set). It teaches a denoiser
  what strokes look like (thickness, smooth edges, a black background) and nothing about the digits' shapes.
  Four classes named after the stroke, none a digit: pretraining on it is unconditional for a digit job
  (docs/explanation/ public-pretraining.md).

The same (kind, n, size, seed, population) gives the same pixels on any machine: labels come from
``numpy.random.default_rng(seed)`` and the images of each block of ``BLOCK`` rows from their own seeded
stream. 100,000 medical images of 64x64 take a few tens of seconds on one core (``bench/generality.py`` times
it).
"""

from __future__ import annotations

import csv
import dataclasses
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from ..errors import ConfigError, DataError
from .dataset import ImageDataset, check_dataset_memory, save_npz

KINDS = ("medical", "rgb", "strokes")
MEDICAL_CLASSES = ("normal", "finding", "effusion", "opacity")
SHAPES = ("disk", "square", "triangle", "ring", "cross")
RGB_CLASSES = tuple(f"{shape}-{family}" for shape in SHAPES for family in ("warm", "cool"))
STROKE_CLASSES = ("line", "arc", "loop", "curve")
CLASSES = {"medical": MEDICAL_CLASSES, "rgb": RGB_CLASSES, "strokes": STROKE_CLASSES}
CHANNELS = {"medical": 1, "rgb": 3, "strokes": 1}
POPULATIONS = ("A", "B")
DEFAULT_SIZE = {"medical": 64, "rgb": 32, "strokes": 28}
SIZE_RANGE = {"medical": (28, 128), "rgb": (16, 128), "strokes": (16, 128)}
MAX_N = 10_000_000
BLOCK = 512  # rows generated together; each block has its own seeded stream (memory stays flat in n)
_KIND_TAG = {"medical": 1, "rgb": 2, "strokes": 3}


@dataclass(frozen=True)
class Acquisition:
    """How one hospital's scanner renders the same anatomy (population-level ranges, drawn per image)."""

    class_shares: tuple[float, ...]  # one per MEDICAL_CLASSES entry
    exposure: tuple[float, float]  # additive brightness offset range
    contrast: tuple[float, float]  # multiplicative contrast range around mid-grey
    gamma: tuple[float, float]  # per-image gamma range (applied after the acquisition gamma)
    acquisition_gamma: float  # the site's fixed detector response curve
    noise: tuple[float, float]  # detector noise standard deviation range


ACQUISITION = {
    "A": Acquisition((0.25, 0.25, 0.25, 0.25), (-0.04, 0.04), (0.85, 1.15), (0.85, 1.18), 1.0, (0.01, 0.03)),
    # another hospital: brighter, flatter images, stronger noise, a harder detector curve, mostly normal cases
    "B": Acquisition((0.55, 0.15, 0.20, 0.10), (0.02, 0.10), (0.65, 0.95), (0.80, 1.25), 1.45, (0.03, 0.06)),
}


def generate_dataset(
    kind: str, n: int, *, size: int | None = None, seed: int = 0, population: str = "A"
) -> ImageDataset:
    """``n`` labelled images of ``kind`` (``medical``, ``rgb`` or ``strokes``) as the canonical
    ``ImageDataset``.

    size: side length in pixels (medical 28..128, default 64; rgb 16..128, default 32; strokes 16..128,
    default 28). population: ``A`` (default)
    or ``B``, medical only. Bad arguments raise ``ConfigError`` naming the argument and its allowed values.
    """
    size = checked_size(kind, n, size, population)
    if kind == "medical":
        return medical(n, size=size, seed=seed, population=population)
    if kind == "strokes":
        return strokes(n, size=size, seed=seed)
    return rgb(n, size=size, seed=seed)


def checked_size(kind: str, n: int, size: int | None, population: str) -> int:
    """The side length to use, after checking every argument (one ``ConfigError`` line on the first bad
    one)."""
    if kind not in KINDS:
        raise ConfigError(f"unknown data kind {kind!r}; choose one of {', '.join(KINDS)}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= MAX_N:
        raise ConfigError(f"n must be an integer in 1..{MAX_N:,}, not {n!r}")
    lo, hi = SIZE_RANGE[kind]
    size = DEFAULT_SIZE[kind] if size is None else size
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or not lo <= size <= hi:
        raise ConfigError(f"size of {kind} images must be an integer in {lo}..{hi}, not {size!r}")
    if population not in POPULATIONS:
        raise ConfigError(f"population must be one of {', '.join(POPULATIONS)}, not {population!r}")
    if kind != "medical" and population != "A":
        raise ConfigError(f"population {population!r} is for the medical kind only; drop it for {kind}")
    channels = 1 if kind == "medical" else 3
    # held whole
    check_dataset_memory(int(n), channels * int(size) ** 2, f"data generate {kind} --n {n} --size {size}")
    return int(size)


def class_counts_for(n: int, shares: tuple[float, ...]) -> np.ndarray:
    """Exact per-class counts for ``n`` images in proportion to ``shares`` (largest remainders; sums to
    ``n``)."""
    raw = np.asarray(shares, np.float64) / float(np.sum(shares)) * n
    counts = np.floor(raw).astype(np.int64)
    order = np.argsort(-(raw - counts), kind="stable")
    counts[order[: n - int(counts.sum())]] += 1
    return counts


def _labels(n: int, shares: tuple[float, ...], seed: int, kind: str) -> np.ndarray:
    counts = class_counts_for(n, shares)
    labels = np.repeat(np.arange(len(shares), dtype=np.int64), counts)
    return np.random.default_rng([seed, _KIND_TAG[kind], 0]).permutation(labels)


def _blocks(kind: str, labels: np.ndarray, seed: int, channels: int, size: int, draw: object) -> np.ndarray:
    """Run ``draw(rng, labels_of_block) -> (b, C, H, W)`` block by block, each block on its own seeded
    stream."""
    out = np.empty((len(labels), channels, size, size), np.float32)
    for b, start in enumerate(range(0, len(labels), BLOCK)):
        rng = np.random.default_rng([seed, _KIND_TAG[kind], 1, b])
        out[start : start + BLOCK] = draw(rng, labels[start : start + BLOCK])  # type: ignore[operator]
    return out


# ------------------------------------------------------------------------------------------------
# shared geometry
# ------------------------------------------------------------------------------------------------
def _grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel-centre coordinates in [-1, 1]: (1, H, 1) rows and (1, 1, W) columns, broadcast against (b, 1,
    1)."""
    t = ((np.arange(size, dtype=np.float32) + 0.5) / size * 2.0 - 1.0).astype(np.float32)
    return t[None, :, None], t[None, None, :]


def _col(v: np.ndarray) -> np.ndarray:
    """Per-image values (b,) as (b, 1, 1), to broadcast over the pixels."""
    return np.asarray(v, np.float32)[:, None, None]


def _soft_inside(level: np.ndarray, edge: float | np.ndarray) -> np.ndarray:
    """1 inside (level < 1), 0 outside, a linear ramp ``edge`` wide across the boundary (anti-aliased, no
    exp)."""
    out = (1.0 + 0.5 * edge - level) / edge
    return np.clip(out, 0.0, 1.0, out=out)


def _ellipse(
    y: np.ndarray, x: np.ndarray, cy: np.ndarray, cx: np.ndarray, ry: np.ndarray, rx: np.ndarray, edge: float
) -> np.ndarray:
    return _soft_inside(((y - cy) / ry) ** 2 + ((x - cx) / rx) ** 2, edge)


def _pixel_noise(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Zero-mean, unit-std pixel noise: the sum of four uniform random bytes (Irwin-Hall, close to Gaussian),
    about 4x faster than ``standard_normal`` in float32, which dominated the generation time."""
    m = int(np.prod(shape))
    q = np.frombuffer(rng.bytes(4 * m), np.uint8).reshape(4, m)
    total = q[0].astype(np.float32)
    for k in range(1, 4):
        total += q[k]
    total -= np.float32(510.0)
    total *= np.float32(1.0 / np.sqrt(4 * (256**2 - 1) / 12))
    return total.reshape(shape)


def _smooth_noise(rng: np.random.Generator, b: int, size: int, cells: int) -> np.ndarray:
    """(b, size, size) low-frequency noise, ~unit std: a ``cells`` x ``cells`` Gaussian grid, bilinear
    upsampled."""
    # few values: the exact sampler is cheap
    coarse = rng.standard_normal((b, cells, cells), dtype=np.float32)
    pos = (np.arange(size, dtype=np.float32) + 0.5) / size * (cells - 1)
    lo = np.minimum(pos.astype(np.int64), cells - 2)
    frac = pos - lo
    up = np.zeros((cells, size), np.float32)  # (cells, size): row i weighs coarse cell i into each pixel
    up[lo, np.arange(size)] = 1.0 - frac
    up[lo + 1, np.arange(size)] = frac
    # stacked matmul: ~10x faster than the equivalent einsum, and the result is contiguous
    return (up.T @ coarse @ up) * np.float32(1.6)


# ------------------------------------------------------------------------------------------------
# medical-like radiographs
# ------------------------------------------------------------------------------------------------
def medical(
    n: int, *, size: int = 64, seed: int = 0, population: str = "A", labels: np.ndarray | None = None
) -> ImageDataset:
    """``n`` chest-radiograph-like grey images (N, 1, size, size); classes ``MEDICAL_CLASSES`` (see the
    module).

    labels: the class of each image instead of the population's balance. The anatomy, acquisition and noise of
    image i depend on the seed only, so the same seed with other labels gives the same patients with other
    signs (e.g. each normal image and its copy with a finding).
    """
    size = checked_size("medical", n, size, population)
    acq = ACQUISITION[population]
    if labels is None:
        labels = _labels(n, acq.class_shares, seed, "medical")
    labels = np.asarray(labels, np.int64)
    if labels.shape != (n,) or labels.min(initial=0) < 0 or labels.max(initial=0) >= len(MEDICAL_CLASSES):
        raise ConfigError(f"labels must be {n} class indices in 0..{len(MEDICAL_CLASSES) - 1}")
    images = _blocks(
        "medical", labels, seed, 1, size, lambda rng, lab: _medical_block(rng, lab, size, acq)[:, None]
    )
    return ImageDataset(
        images,
        labels,
        MEDICAL_CLASSES,
        source=f"procedural:medical[population {population}, {size}x{size}, seed {seed}]",
    )


@dataclass
class _Anatomy:
    """One block's per-image anatomy, each field (b, 1, 1): centres, radii, lung geometry."""

    cy: np.ndarray
    cx: np.ndarray
    scale: np.ndarray
    lung_cx: np.ndarray  # distance of each lung's centre from the midline
    lung_cy: np.ndarray
    lung_rx: np.ndarray
    lung_ry: np.ndarray
    heart: np.ndarray  # heart half-width

    def rows(self, idx: np.ndarray) -> _Anatomy:
        """The anatomy of the images ``idx`` of the block."""
        return _Anatomy(*(getattr(self, f.name)[idx] for f in dataclasses.fields(self)))


def _draw_anatomy(rng: np.random.Generator, b: int) -> _Anatomy:
    u = lambda lo, hi: _col(rng.uniform(lo, hi, b))  # noqa: E731 - one-line sampler
    scale = u(0.82, 1.04)
    return _Anatomy(
        cy=u(-0.07, 0.07),
        cx=u(-0.07, 0.07),
        scale=scale,
        lung_cx=scale * u(0.33, 0.40),
        lung_cy=scale * u(-0.12, -0.02),
        lung_rx=scale * u(0.22, 0.27),
        lung_ry=scale * u(0.46, 0.56),
        heart=scale * u(0.20, 0.26),
    )


def _lungs(y: np.ndarray, x: np.ndarray, a: _Anatomy, edge: float) -> tuple[np.ndarray, np.ndarray]:
    """(right, left) lung-field masks in [0, 1]."""
    cy = a.cy + a.lung_cy
    return (
        _ellipse(y, x, cy, a.cx - a.lung_cx, a.lung_ry, a.lung_rx, edge),
        _ellipse(y, x, cy, a.cx + a.lung_cx, a.lung_ry, a.lung_rx, edge),
    )


def _anatomy_image(
    y: np.ndarray, x: np.ndarray, a: _Anatomy, lungs: np.ndarray, rng: np.random.Generator, edge: float
) -> np.ndarray:
    """The normal chest: soft tissue, mediastinum and heart, ribs over the lungs, dark lung fields."""
    b = len(a.cy)
    body = _ellipse(y, x, a.cy + 0.05, a.cx, a.scale * 1.02, a.scale * 0.86, edge)
    medi = _ellipse(y, x, a.cy - 0.15, a.cx, a.scale * 0.62, a.scale * 0.11, edge)
    heart = _ellipse(y, x, a.cy + 0.22 * a.scale, a.cx + 0.05 * a.scale, 0.22 * a.scale, a.heart, edge)
    img = 0.08 + 0.42 * body + 0.22 * np.maximum(medi, heart)
    # ribs: curved bright bands, their spacing and phase drawn per image
    freq, phase = _col(rng.uniform(4.2, 5.4, b)), _col(rng.uniform(0, 2 * np.pi, b))
    bend = (x - a.cx) ** 2 * np.float32(1.4)
    ribs = np.cos(np.float32(2 * np.pi) * freq * (y - a.cy + bend) / a.scale + phase)
    ribs = np.clip(ribs - 0.55, 0.0, None) * np.float32(1 / 0.45)
    lung_dark = _col(rng.uniform(0.30, 0.38, b))
    return img - lungs * (lung_dark - 0.11 * ribs)


def _finding(y: np.ndarray, x: np.ndarray, a: _Anatomy, rng: np.random.Generator, size: int) -> np.ndarray:
    """One bright spot of a few pixels (sigma ~1.1 px at 64x64) at a uniform place inside one lung field."""
    b = len(a.cy)
    side = np.where(rng.random(b) < 0.5, -1.0, 1.0).astype(np.float32)
    r, t = np.sqrt(rng.uniform(0.0, 0.72**2, b)), rng.uniform(0, 2 * np.pi, b)
    fy = a.cy + a.lung_cy + _col(r * np.sin(t)) * a.lung_ry
    fx = a.cx + _col(side) * a.lung_cx + _col(r * np.cos(t)) * a.lung_rx
    sigma = np.float32(max(0.8, 1.1 * size / 64) * 2.0 / size)
    amp = _col(rng.uniform(0.22, 0.34, b))
    return amp * np.exp(-((y - fy) ** 2 + (x - fx) ** 2) / (2 * sigma**2))


def _effusion(
    y: np.ndarray,
    x: np.ndarray,
    a: _Anatomy,
    right: np.ndarray,
    left: np.ndarray,
    rng: np.random.Generator,
    edge: float,
) -> np.ndarray:
    """Fluid filling the lowest part of one or both lung fields; its top a meniscus climbing the outer wall
    (the costophrenic angle blunted)."""
    b = len(a.cy)
    depth = a.lung_ry * _col(rng.uniform(0.45, 0.85, b))
    lateral = np.clip((np.abs(x - a.cx) - a.lung_cx) / a.lung_rx, 0.0, 1.0)  # 0 at the lung's centre line
    top = a.cy + a.lung_cy + a.lung_ry - depth - 0.35 * a.lung_ry * lateral**2
    fluid = _soft_inside((top - y) / a.lung_ry + 1.0, 0.08)
    sides = rng.integers(0, 3, b)  # 0: right, 1: left, 2: both
    mask = right * _col(sides != 1) + left * _col(sides != 0)
    return fluid * mask * _col(rng.uniform(0.22, 0.30, b))


def _medical_block(rng: np.random.Generator, lab: np.ndarray, size: int, acq: Acquisition) -> np.ndarray:
    b = len(lab)
    y, x = _grid(size)
    edge = 4.0 / size
    # Three streams: the anatomy and the acquisition (noise included) do not depend on the labels, so the same
    # seed with another label changes only the class sign (what tests/data/test_data_procedural.py checks).
    anatomy_rng, sign_rng, acquisition_rng = rng.spawn(3)
    a = _draw_anatomy(anatomy_rng, b)
    right, left = _lungs(y, x, a, edge)
    lungs = np.maximum(right, left)
    img = _anatomy_image(y, x, a, lungs, anatomy_rng, edge)
    img += np.float32(0.02) * _smooth_noise(anatomy_rng, b, size, 6)  # soft-tissue unevenness, every class
    rows = np.flatnonzero(lab == 1)
    img[rows] += _finding(y, x, a.rows(rows), sign_rng, size)
    rows = np.flatnonzero(lab == 2)
    img[rows] += _effusion(y, x, a.rows(rows), right[rows], left[rows], sign_rng, edge)
    rows = np.flatnonzero(lab == 3)
    texture = np.clip(_smooth_noise(sign_rng, len(rows), size, 12) * 0.5 + 0.35, 0.0, 1.0)
    img[rows] += lungs[rows] * texture * _col(sign_rng.uniform(0.12, 0.20, len(rows)))
    return _acquire(img, acquisition_rng, acq)


def _acquire(img: np.ndarray, rng: np.random.Generator, acq: Acquisition) -> np.ndarray:
    """The site's rendering: per-image contrast and exposure, then one power curve (the detector's acquisition
    gamma times a per-image gamma), detector noise; clipped to [0, 1]."""
    b = len(img)
    img = (
        0.5
        + (np.clip(img, 0.0, 1.0) - 0.5) * _col(rng.uniform(*acq.contrast, b))
        + _col(rng.uniform(*acq.exposure, b))
    )
    img = np.clip(img, 0.0, 1.0, out=img) ** (acq.acquisition_gamma * _col(rng.uniform(*acq.gamma, b)))
    img += _col(rng.uniform(*acq.noise, b)) * _pixel_noise(rng, img.shape)
    return np.clip(img, 0.0, 1.0, out=img)


# ------------------------------------------------------------------------------------------------
# RGB objects on clutter
# ------------------------------------------------------------------------------------------------
def rgb(n: int, *, size: int = 32, seed: int = 0) -> ImageDataset:
    """``n`` RGB images (N, 3, size, size), balanced over ``RGB_CLASSES`` (shape x colour family)."""
    size = checked_size("rgb", n, size, "A")
    labels = _labels(n, (1.0,) * len(RGB_CLASSES), seed, "rgb")
    images = _blocks("rgb", labels, seed, 3, size, lambda rng, lab: _rgb_block(rng, lab, size))
    return ImageDataset(images, labels, RGB_CLASSES, source=f"procedural:rgb[{size}x{size}, seed {seed}]")


def _hsv(h: np.ndarray, s: np.ndarray, v: np.ndarray) -> np.ndarray:
    """(b,) hue in [0, 1), saturation, value -> (b, 3) RGB (the standard HSV hexcone)."""
    k = np.stack([(5 + h * 6) % 6, (3 + h * 6) % 6, (1 + h * 6) % 6], axis=1)
    return (v[:, None] - v[:, None] * s[:, None] * np.clip(np.minimum(k, 4 - k), 0, 1)).astype(np.float32)


def _shape_mask(shape_id: np.ndarray, u: np.ndarray, v: np.ndarray, edge: np.ndarray) -> np.ndarray:
    """Anti-aliased mask of each image's shape in its own rotated, scaled frame (u, v: radius 1 = object
    size)."""
    rad = np.sqrt(u * u + v * v)
    tri = np.maximum(np.maximum(-v - 0.5, 0.866 * u + 0.5 * v - 0.5), -0.866 * u + 0.5 * v - 0.5) * 2.0 + 1.0
    cross = np.minimum(np.maximum(np.abs(u) / 0.32, np.abs(v)), np.maximum(np.abs(v) / 0.32, np.abs(u)))
    levels = np.stack([rad, np.maximum(np.abs(u), np.abs(v)) / 0.8, tri, np.abs(rad - 0.68) / 0.3, cross])
    chosen = np.take_along_axis(levels, shape_id[None, :, None, None], axis=0)[0]
    return _soft_inside(chosen, edge)


def _clutter(rng: np.random.Generator, y: np.ndarray, x: np.ndarray, b: int, size: int) -> np.ndarray:
    """(b, 3, H, W) background: a colour gradient, colour noise and a few random soft blobs of any hue."""
    base = _hsv(rng.random(b), rng.uniform(0.1, 0.5, b), rng.uniform(0.35, 0.8, b))
    tilt = _col(rng.uniform(-0.25, 0.25, b)) * y + _col(rng.uniform(-0.25, 0.25, b)) * x
    bg = (
        base[:, :, None, None]
        + tilt[:, None]
        + 0.08 * np.stack([_smooth_noise(rng, b, size, 5) for _ in range(3)], 1)
    )
    for _ in range(4):
        col = _hsv(rng.random(b), rng.uniform(0.2, 0.8, b), rng.uniform(0.3, 0.9, b))
        r = _col(rng.uniform(0.08, 0.25, b))
        blob = _ellipse(y, x, _col(rng.uniform(-1, 1, b)), _col(rng.uniform(-1, 1, b)), r, r, 4.0 / size)
        bg = bg * (1 - blob[:, None]) + col[:, :, None, None] * blob[:, None]
    return bg


def _rgb_block(rng: np.random.Generator, lab: np.ndarray, size: int) -> np.ndarray:
    b = len(lab)
    y, x = _grid(size)
    shape_id, warm = lab // 2, lab % 2 == 0
    bg = _clutter(rng, y, x, b, size)
    r = _col(rng.uniform(0.38, 0.62, b))
    cy, cx = _col(rng.uniform(-0.3, 0.3, b)), _col(rng.uniform(-0.3, 0.3, b))
    ang = rng.uniform(0, 2 * np.pi, b)
    c, s = _col(np.cos(ang)), _col(np.sin(ang))
    u, v = (c * (x - cx) + s * (y - cy)) / r, (-s * (x - cx) + c * (y - cy)) / r
    mask = _shape_mask(shape_id, u, v, np.float32(4.0 / size) / r)  # the ramp one pixel-ish wide per image
    hue = np.where(warm, rng.uniform(-0.02, 0.15, b) % 1.0, rng.uniform(0.30, 0.66, b))  # warm: red..yellow
    colour = _hsv(hue, rng.uniform(0.65, 1.0, b), rng.uniform(0.7, 1.0, b))
    # object texture
    stripes = 0.82 + 0.18 * np.cos(u * _col(rng.uniform(4, 12, b)) + _col(rng.uniform(0, 6.3, b)))
    obj = colour[:, :, None, None] * stripes[:, None]
    img = bg * (1 - mask[:, None]) + obj * mask[:, None]
    img += _col(rng.uniform(0.01, 0.04, b))[:, None] * _pixel_noise(rng, img.shape)
    return np.clip(img, 0.0, 1.0).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# pen strokes (public pretraining data for hand-drawn images)
# ------------------------------------------------------------------------------------------------
STROKE_POINTS = 48  # points sampled along a stroke; the ink is the distance to the nearest one


def strokes(n: int, *, size: int = 28, seed: int = 0) -> ImageDataset:
    """``n`` grey stroke images (N, 1, size, size), balanced over ``STROKE_CLASSES``."""
    size = checked_size("strokes", n, size, "A")
    labels = _labels(n, (1.0,) * len(STROKE_CLASSES), seed, "strokes")
    images = _blocks("strokes", labels, seed, 1, size, lambda rng, lab: _strokes_block(rng, lab, size))
    return ImageDataset(
        images, labels, STROKE_CLASSES, source=f"procedural:strokes[{size}x{size}, seed {seed}]"
    )


def _stroke_path(rng: np.random.Generator, kind: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(b, P) y and x of each image's stroke of class ``kind`` (0 line, 1 arc, 2 loop, 3 curve), in [-1,
    1]."""
    b = len(kind)
    t = np.linspace(0.0, 1.0, STROKE_POINTS, dtype=np.float32)[None, :]
    cy, cx = _col(rng.uniform(-0.2, 0.2, b))[:, :, 0], _col(rng.uniform(-0.2, 0.2, b))[:, :, 0]
    ry, rx = _col(rng.uniform(0.3, 0.75, b))[:, :, 0], _col(rng.uniform(0.25, 0.65, b))[:, :, 0]
    a0 = _col(rng.uniform(0, 2 * np.pi, b))[:, :, 0]
    span = np.where(kind[:, None] == 2, 2 * np.pi, _col(rng.uniform(0.6, 1.6, b))[:, :, 0] * np.pi)
    arc_y, arc_x = cy + ry * np.sin(a0 + span * t), cx + rx * np.cos(a0 + span * t)
    p = rng.uniform(-0.8, 0.8, (b, 3, 2)).astype(np.float32)  # a quadratic Bezier's control points
    bez = (
        (1 - t)[..., None] ** 2 * p[:, None, 0]
        + 2 * ((1 - t) * t)[..., None] * p[:, None, 1]
        + (t * t)[..., None] * p[:, None, 2]
    )
    # a line long enough to read as a stroke
    ang, length = rng.uniform(0, 2 * np.pi, b), rng.uniform(0.7, 1.4, b)
    step = (length[:, None] * np.stack([np.sin(ang), np.cos(ang)], 1)).astype(np.float32)
    start = np.clip(p[:, 0], -0.9 + np.maximum(-step, 0), 0.9 - np.maximum(step, 0))
    line = start[:, None] + t[..., None] * step[:, None]
    is_arc = (kind == 1) | (kind == 2)
    y = np.where(is_arc[:, None], arc_y, np.where((kind == 0)[:, None], line[..., 0], bez[..., 0]))
    x = np.where(is_arc[:, None], arc_x, np.where((kind == 0)[:, None], line[..., 1], bez[..., 1]))
    return y.astype(np.float32), x.astype(np.float32)


def _ink(
    y: np.ndarray, x: np.ndarray, py: np.ndarray, px: np.ndarray, width: np.ndarray, size: int
) -> np.ndarray:
    """(b, H, W) anti-aliased ink of a stroke through the points (py, px) (b, P) of half-width ``width`` (b,
    1, 1)."""
    d2 = np.full((py.shape[0], y.shape[1], x.shape[2]), np.inf, np.float32)
    for k in range(py.shape[1]):  # running minimum: memory b x H x W, never b x H x W x P
        np.minimum(d2, (y - py[:, k, None, None]) ** 2 + (x - px[:, k, None, None]) ** 2, out=d2)
    return np.clip((width - np.sqrt(d2)) * size / 2.0 + 0.5, 0.0, 1.0)


def _strokes_block(rng: np.random.Generator, lab: np.ndarray, size: int) -> np.ndarray:
    b = len(lab)
    y, x = _grid(size)
    width = _col(rng.uniform(0.06, 0.13, b))
    py, px = _stroke_path(rng, lab)
    ink = _ink(y, x, py, px, width, size)
    extra = rng.random(b) < 0.4  # a short second stroke on some images: strokes meet and cross
    qy, qx = _stroke_path(rng, np.zeros(b, np.int64))
    half = STROKE_POINTS // 2
    ink = np.maximum(ink, _ink(y, x, qy[:, :half], qx[:, :half], width, size) * extra[:, None, None])
    ink = ink * _col(rng.uniform(0.75, 1.0, b)) + _col(rng.uniform(0.0, 0.02, b)) * _pixel_noise(
        rng, ink.shape
    )
    return np.clip(ink, 0.0, 1.0)[:, None].astype(np.float32)


# ------------------------------------------------------------------------------------------------
# writers: the formats ``load_dataset`` reads
# ------------------------------------------------------------------------------------------------
def write_dataset(ds: ImageDataset, out: str | os.PathLike) -> Path:
    """Write ``ds`` where ``load_dataset`` reads it back; returns the path to give it.

    ``OUT.npz``: one compressed ``.npz`` (uint8 pixels, class names). Anything else: a NEW folder with
    ``images/<class>/<index>.png`` (8-bit PNG) and ``labels.csv`` (``path,label``):
    ``load_dataset(OUT/labels.csv)`` and ``load_dataset(OUT/images)`` both read it. An existing non-empty
    folder is refused (nothing is overwritten).
    """
    path = Path(out)
    if path.suffix.lower() == ".npz":
        return save_npz(ds, path, dtype="uint8")
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise DataError(
            f"{path}: already exists and is not an empty folder; give a new folder or an .npz path"
        )
    return _write_folder(ds, path)


def _write_folder(ds: ImageDataset, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))  # renamed into place when complete
    width = len(str(max(ds.n - 1, 0)))
    rows = []
    for c in np.unique(ds.labels):  # present classes only: an empty class folder is refused by the loader
        (tmp / "images" / ds.class_names[int(c)]).mkdir(parents=True)
    pixels = np.rint(ds.images * 255.0).astype(np.uint8)
    for i in range(ds.n):
        name = ds.class_names[int(ds.labels[i])]
        rel = f"images/{name}/{i:0{width}d}.png"
        im = pixels[i, 0] if pixels.shape[1] == 1 else pixels[i].transpose(1, 2, 0)
        Image.fromarray(im).save(tmp / rel)
        rows.append((rel, name))
    with open(tmp / "labels.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "label"])
        w.writerows(rows)
    if path.exists():
        path.rmdir()  # checked empty by the caller
    os.replace(tmp, path)
    return path / "labels.csv"
