"""The released central images inside a release, and the SDEdit start images drawn from them: numpy only.

A release whose job says ``[sampler] start_sigma`` carries ``central_images.npz``: the central images the
sites RELEASED (the DP-FETA central-image stage, already charged in every site's ledger and attested in the
manifest's event histories), post-processed as the warm-up used them. Shipping them is post-processing: they
cost no further epsilon. ``synthesize`` then draws each image by denoising an augmented released image of its
class plus N(0, start_sigma^2) noise (SDEdit), as ``train``'s own synthetic set is drawn
(``release.jobdir.synthetic_set``).

The augmentation is a numpy port of the warm-up's RandAugment bag (``training.augment``, which is torch): the
same ops, strengths and uint8 quantisation; nearest-neighbour affine ops follow ``grid_sample``'s pixel
mapping. One difference, on purpose: the magnitude is drawn per image instead of per call, so the starts of a
seed do not depend on the batch size. Everything is a function of the given ``numpy.random.Generator``; no
torch.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ReleaseError

STARTS_FILE = "central_images.npz"
AUX_FILE = "aux_images.npz"  # [sampler] start_source aux/mix: the aux-generator pool (same layout)
N_BINS = 31  # RandAugment's magnitude bins, as training.augment
# The ops of training.augment.OPS, in the same order (the index drawn picks the op).
OP_NAMES = (
    "identity",
    "rotate",
    "shear_x",
    "shear_y",
    "translate_x",
    "translate_y",
    "brightness",
    "contrast",
    "sharpness",
    "posterize",
    "solarize",
    "autocontrast",
    "equalize",
    "color",
)


def quantize(x: np.ndarray) -> np.ndarray:
    return (np.round(np.clip(x, 0.0, 1.0) * np.float32(255.0)) / np.float32(255.0)).astype(np.float32)


def _col(v: np.ndarray) -> np.ndarray:
    return v.reshape(-1, 1, 1, 1).astype(np.float32)


def _blend(img: np.ndarray, other: np.ndarray, factor: np.ndarray) -> np.ndarray:
    return np.clip(other + _col(factor) * (img - other), 0.0, 1.0)


def _grey(x: np.ndarray) -> np.ndarray:
    if x.shape[1] == 3:
        w = np.array([0.299, 0.587, 0.114], np.float32).reshape(1, 3, 1, 1)
        return (x * w).sum(1, keepdims=True)
    return x.mean(1, keepdims=True)


def affine_nearest(x: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """``grid_sample(x, affine_grid(theta), nearest, zeros, align_corners=False)``: theta (n, 2, 3) maps
    output to input coordinates in [-1, 1]; pixels mapped outside the image are black."""
    n, c, h, w = x.shape
    xs = ((2.0 * np.arange(w, dtype=np.float32) + 1.0) / w - 1.0).astype(np.float32)
    ys = ((2.0 * np.arange(h, dtype=np.float32) + 1.0) / h - 1.0).astype(np.float32)
    gx = (
        theta[:, 0, 0, None, None] * xs[None, None, :]
        + theta[:, 0, 1, None, None] * ys[None, :, None]
        + theta[:, 0, 2, None, None]
    ).astype(np.float32)
    gy = (
        theta[:, 1, 0, None, None] * xs[None, None, :]
        + theta[:, 1, 1, None, None] * ys[None, :, None]
        + theta[:, 1, 2, None, None]
    ).astype(np.float32)
    # rint: half to even, as grid_sample's nearbyint
    ix = np.rint(((gx + 1.0) * w - 1.0) / 2.0).astype(np.int64)
    iy = np.rint(((gy + 1.0) * h - 1.0) / 2.0).astype(np.int64)
    inside = (ix >= 0) & (ix < w) & (iy >= 0) & (iy < h)
    flat = x.reshape(n, c, h * w)
    src = np.where(inside, iy * w + ix, 0).reshape(n, 1, h * w)
    out = np.take_along_axis(flat, np.broadcast_to(src, (n, c, h * w)), axis=2).reshape(n, c, h, w)
    return np.where(inside[:, None], out, np.float32(0.0)).astype(np.float32)


def _eye(n: int) -> np.ndarray:
    return np.repeat(np.eye(2, 3, dtype=np.float32)[None], n, axis=0)


def _rotate(x: np.ndarray, f: np.ndarray, s: np.ndarray) -> np.ndarray:
    a = (s * np.float32(math.radians(30.0)) * f).astype(np.float32)
    t = _eye(len(x))
    t[:, 0, 0], t[:, 0, 1], t[:, 1, 0], t[:, 1, 1] = np.cos(a), -np.sin(a), np.sin(a), np.cos(a)
    return affine_nearest(x, t)


def _shear(axis: int) -> Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    def op(x: np.ndarray, f: np.ndarray, s: np.ndarray) -> np.ndarray:
        t = _eye(len(x))
        t[:, axis, 1 - axis] = s * np.float32(0.3) * f
        return affine_nearest(x, t)

    return op


def _translate(axis: int) -> Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    def op(x: np.ndarray, f: np.ndarray, s: np.ndarray) -> np.ndarray:
        t = _eye(len(x))
        t[:, axis, 2] = s * np.float32(2.0 * (150.0 / 331.0)) * f
        return affine_nearest(x, t)

    return op


def _sharpness(x: np.ndarray, f: np.ndarray, s: np.ndarray) -> np.ndarray:
    k = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float32) / np.float32(13.0)
    p = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    h, w = x.shape[2:]
    smooth = sum(k[i, j] * p[:, :, i : i + h, j : j + w] for i in range(3) for j in range(3)).astype(
        np.float32
    )
    smooth[..., 0, :], smooth[..., -1, :] = x[..., 0, :], x[..., -1, :]  # PIL keeps the border
    smooth[..., :, 0], smooth[..., :, -1] = x[..., :, 0], x[..., :, -1]
    return _blend(x, smooth, 1.0 + s * np.float32(0.9) * f)


def _posterize(x: np.ndarray, f: np.ndarray, s: np.ndarray) -> np.ndarray:
    bits = np.array([8 - int(round(float(v) * 4.0)) for v in f])
    step = _col(2.0 ** (8 - bits))
    return (np.floor(np.round(x * np.float32(255.0)) / step) * step / np.float32(255.0)).astype(np.float32)


def _autocontrast(x: np.ndarray, f: np.ndarray, s: np.ndarray) -> np.ndarray:
    lo, hi = x.min(axis=(2, 3), keepdims=True), x.max(axis=(2, 3), keepdims=True)
    span = hi - lo
    return np.where(span > 0, (x - lo) / np.maximum(span, np.float32(1e-8)), x).astype(np.float32)


def _equalize(x: np.ndarray, f: np.ndarray, s: np.ndarray) -> np.ndarray:
    n, c, h, w = x.shape
    v = np.clip(np.round(x * 255.0), 0, 255).astype(np.int64).reshape(n * c, h * w)
    hist = np.stack([np.bincount(row, minlength=256) for row in v])
    cdf = hist.cumsum(1).astype(np.float32)
    cdf_min = np.where(hist > 0, cdf, np.float32(h * w)).min(1, keepdims=True)
    denom = np.float32(h * w) - cdf_min
    lut = np.clip(np.round((cdf - cdf_min) / np.maximum(denom, 1.0) * np.float32(255.0)), 0, 255)
    out = np.take_along_axis(lut, v, axis=1) / np.float32(255.0)
    return np.where(denom > 0, out, v / np.float32(255.0)).reshape(n, c, h, w).astype(np.float32)


OPS: dict[str, Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]] = {
    "identity": lambda x, f, s: x,
    "rotate": _rotate,
    "shear_x": _shear(0),
    "shear_y": _shear(1),
    "translate_x": _translate(0),
    "translate_y": _translate(1),
    "brightness": lambda x, f, s: _blend(x, np.zeros_like(x), 1.0 + s * np.float32(0.9) * f),
    "contrast": lambda x, f, s: _blend(
        x,
        np.broadcast_to(_grey(x).mean(axis=(1, 2, 3), keepdims=True), x.shape),
        1.0 + s * np.float32(0.9) * f,
    ),
    "sharpness": _sharpness,
    "posterize": _posterize,
    "solarize": lambda x, f, s: np.where(x >= _col(1.0 - f), 1.0 - x, x).astype(np.float32),
    "autocontrast": _autocontrast,
    "equalize": _equalize,
    "color": lambda x, f, s: (
        x if x.shape[1] != 3 else _blend(x, np.broadcast_to(_grey(x), x.shape), 1.0 + s * np.float32(0.9) * f)
    ),
}
assert tuple(OPS) == OP_NAMES


# Upper bound on the ops per image: the record (and job) is signed by the coordinator, so the size is bounded
# before anything is allocated (one row of 1 + 2 ops uniforms per image). The warm-up uses 2.
MAX_OPS = 16


def rand_augment(
    images: np.ndarray, rng: np.random.Generator, *, n_ops: int, magnitude_max: int
) -> np.ndarray:
    """RandAugment-ed copies of ``images`` (n, C, H, W) in [0, 1]. Per image, in image order, one row of
    ``1 + 2 n_ops`` uniforms from ``rng``: the magnitude in 1..magnitude_max, then each op and its sign. Drawn
    row by row from one stream, so image k's augmentation does not depend on how the images are batched."""
    if not 1 <= magnitude_max < N_BINS or not 0 <= n_ops <= MAX_OPS:
        raise ReleaseError(
            f"augmentation needs 0 <= ops <= {MAX_OPS} and 1 <= magnitude <= {N_BINS - 1}, got "
            f"{n_ops}, {magnitude_max}"
        )
    n = len(images)
    u = rng.random((n, 1 + 2 * n_ops))
    f = ((1 + np.floor(u[:, 0] * magnitude_max)) / (N_BINS - 1)).astype(np.float32)
    x = quantize(np.asarray(images, np.float32))
    for k in range(n_ops):
        which = np.floor(u[:, 1 + k] * len(OP_NAMES)).astype(np.int64)
        sign = np.where(u[:, 1 + n_ops + k] < 0.5, -1.0, 1.0).astype(np.float32)
        out = x.copy()
        for j, name in enumerate(OP_NAMES):
            idx = np.flatnonzero(which == j)
            if idx.size:
                out[idx] = quantize(OPS[name](x[idx], f[idx], sign[idx]))
        x = out
    return x


def cycle_index(
    rel_labels: np.ndarray, labels: np.ndarray, first: np.ndarray, what: str = "central images"
) -> np.ndarray:
    """Row of each start: image k of class c (``first[i]`` = k) takes the class's row ``k mod (count of c)``,
    cycling over the class's images as ``train`` does."""
    idx = np.empty(len(labels), np.int64)
    for i, (c, k) in enumerate(zip(labels, first)):
        own = np.flatnonzero(rel_labels == c)
        if own.size == 0:
            raise ReleaseError(f"the release's {what} hold no image of class {int(c)}; use --from noise")
        idx[i] = own[int(k) % own.size]
    return idx


def start_images(
    images: np.ndarray,
    rel_labels: np.ndarray,
    labels: np.ndarray,
    first: np.ndarray,
    rng: np.random.Generator,
    *,
    n_ops: int,
    magnitude_max: int,
) -> np.ndarray:
    """Start images for ``labels``: image k of class c (``first[i]`` = its index within its class) augments
    the class's released image ``k mod (count of c)``, cycling over the class's images as ``train`` does."""
    idx = cycle_index(rel_labels, labels, first)
    return rand_augment(images[idx], rng, n_ops=n_ops, magnitude_max=magnitude_max)


def aux_mask(source: str, within: np.ndarray) -> np.ndarray:
    """THE mix rule, one copy for ``train``'s synthetic set (``release.jobdir``) and ``synthesize``: which
    starts come from the aux generator / its pool. ``within[i]``: image i's index among the set's images of
    its class (k).
    "aux": all; "mix": those with k even, so each class alternates aux, central, aux, ... (as the bench's
    class-sorted mix did; not position parity: the set's labels are interleaved, and with an even class count
    position parity gives whole classes to one source)."""
    within = np.asarray(within)
    return np.ones(len(within), bool) if source == "aux" else within % 2 == 0


def index_within_class(labels: np.ndarray) -> np.ndarray:
    """Each image's index among the earlier images of its class (k of :func:`aux_mask`)."""
    labels = np.asarray(labels)
    within = np.empty(len(labels), np.int64)
    for c in np.unique(labels):
        own = np.flatnonzero(labels == c)
        within[own] = np.arange(own.size)
    return within


def mixed_start_images(
    central: tuple[np.ndarray, np.ndarray] | None,
    aux: tuple[np.ndarray, np.ndarray] | None,
    source: str,
    labels: np.ndarray,
    first: np.ndarray,
    rng: np.random.Generator,
    *,
    n_ops: int,
    magnitude_max: int,
) -> np.ndarray:
    """Start images for ``start_source`` central / aux / mix. "mix": image k of its class starts from the aux
    pool when k is even (:func:`aux_mask`, the rule ``train`` draws by too), from the central images when odd,
    each source cycled by k // 2 so both are walked in order. One augmentation call over the batch in image
    order, so image k's augmentation does not depend on the batch size or on which source it came from (the
    rng rows are per image)."""
    if source == "central":
        assert central is not None
        return start_images(*central, labels, first, rng, n_ops=n_ops, magnitude_max=magnitude_max)
    assert aux is not None
    if source == "aux":
        return rand_augment(
            aux[0][cycle_index(aux[1], labels, first, "aux images")],
            rng,
            n_ops=n_ops,
            magnitude_max=magnitude_max,
        )
    assert central is not None and source == "mix"
    from_aux = aux_mask(source, first)
    half = np.asarray(first) // 2
    src = np.empty((len(labels), *aux[0].shape[1:]), np.float32)
    src[from_aux] = aux[0][cycle_index(aux[1], labels[from_aux], half[from_aux], "aux images")]
    src[~from_aux] = central[0][cycle_index(central[1], labels[~from_aux], half[~from_aux])]
    return rand_augment(src, rng, n_ops=n_ops, magnitude_max=magnitude_max)


def starts_bytes(images: np.ndarray, labels: np.ndarray) -> bytes:
    """The release's ``central_images.npz``: float32 images in [0, 1] and int64 labels, nothing else."""
    buf = io.BytesIO()
    np.savez(buf, images=np.asarray(images, np.float32), labels=np.asarray(labels, np.int64))
    return buf.getvalue()


def load_starts(
    data: bytes,
    where: str,
    image_shape: tuple[int, ...],
    n_classes: int,
    what: str = "central-images",
    count: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Parse and check the released central images (or the aux pool: ``what``; no pickles); one clear error
    naming ``where``. Read by ``files.read_npz``: the arrays' headers must be float32 images of
    ``image_shape`` and int64 labels (``count`` of each when the signed record says how many) before any data
    is inflated."""
    from ..files import read_npz

    def check(headers: dict[str, Any]) -> None:
        problems = _header_problems(headers["images"], headers["labels"], image_shape, count)
        if problems:
            raise ReleaseError(f"{where}: " + "; ".join(problems))

    per_image = 4 * math.prod(image_shape) + 8
    arrays = read_npz(
        data,
        f"{where} ({what} file)",
        names=("images", "labels"),
        error=ReleaseError,
        check=check,
        max_bytes=per_image * count if count is not None else MAX_STARTS_ARRAY_BYTES,
    )
    images, labels = arrays["images"], arrays["labels"]
    problems = []
    if not np.all(np.isfinite(images)) or (images.size and (images.min() < 0 or images.max() > 1)):
        problems.append("images are not finite values in [0, 1]")
    if labels.size and (labels.min() < 0 or labels.max() >= n_classes):
        problems.append(f"labels outside 0..{n_classes - 1}")
    if problems:
        raise ReleaseError(f"{where}: " + "; ".join(problems))
    return images, labels


# Without a signed count (export reading its own job directory): at most this many bytes of arrays.
MAX_STARTS_ARRAY_BYTES = 1 << 30


def _header_problems(images: Any, labels: Any, image_shape: tuple[int, ...], count: int | None) -> list[str]:
    """What is wrong with the declared images / labels arrays (shape and dtype, from their headers only)."""
    problems = []
    m = images.shape[0] if len(images.shape) else 0
    if images.dtype != np.float32 or len(images.shape) != 4 or tuple(images.shape[1:]) != tuple(image_shape):
        problems.append(
            f"images are {images.dtype} {images.shape}, expected float32 (M, "
            f"{', '.join(map(str, image_shape))})"
        )
    elif count is not None and m != count:
        problems.append(
            f"{m} images, but the signed job releases {count} (central rounds x cells per class, or the aux "
            "pool's per class count, times the classes)"
        )
    if labels.dtype != np.int64 or labels.shape != (m,):
        problems.append(f"labels are {labels.dtype} {labels.shape}, expected int64 ({m},)")
    return problems


__all__ = [
    "STARTS_FILE",
    "AUX_FILE",
    "OP_NAMES",
    "rand_augment",
    "start_images",
    "mixed_start_images",
    "aux_mask",
    "index_within_class",
    "cycle_index",
    "starts_bytes",
    "load_starts",
    "quantize",
]
