"""Parameter and input checks shared by the mechanisms: refuse anything whose privacy claim would not hold."""

from __future__ import annotations

import math

import numpy as np

from ..bounds import MIN_CLIP
from ..errors import DataError, PrivacyError


def require_generator(rng: object, where: str) -> np.random.Generator:
    """The caller's numpy Generator, nothing else: an integer seed is refused, because a seed that a request,
    a config or a coordinator could choose makes the noise known and subtractable. Every mechanism draws its
    noise from one (the node passes a fresh OS-seeded one, ``train`` one derived from the run's 256-bit
    secret); a test that wants reproducible noise builds its own ``np.random.default_rng(seed)`` and passes it
    explicitly."""
    if isinstance(rng, np.random.Generator):
        return rng
    raise PrivacyError(
        f"{where}: rng must be a numpy Generator (seeded from the OS, e.g. "
        f"mechanisms.skellam.os_generator()), got {type(rng).__name__}; integer seeds are refused"
    )


def check_images(
    images: np.ndarray, labels: np.ndarray, n_classes: int, where: str
) -> tuple[np.ndarray, np.ndarray]:
    """(N,C,H,W) float pixels in [0,1] and int labels in [0, n_classes); returns float32 / int64 views."""
    images = np.asarray(images)
    labels = np.asarray(labels)
    if images.ndim != 4:
        raise DataError(f"{where}: images must have shape (N, C, H, W), got {images.shape}")
    if images.shape[0] == 0:
        raise DataError(f"{where}: no images (empty dataset)")
    if not np.issubdtype(images.dtype, np.floating):
        raise DataError(f"{where}: images must be float pixels in [0, 1], got dtype {images.dtype}")
    if labels.shape != (images.shape[0],):
        raise DataError(f"{where}: {labels.shape} labels for {images.shape[0]} images")
    if not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{where}: labels must be integers, got dtype {labels.dtype}")
    if isinstance(n_classes, bool) or not isinstance(n_classes, (int, np.integer)) or n_classes < 1:
        raise DataError(f"{where}: n_classes must be an integer >= 1, got {n_classes!r}")
    if labels.min() < 0 or labels.max() >= n_classes:
        raise DataError(f"{where}: labels must lie in [0, {n_classes}), found {labels.min()}..{labels.max()}")
    # Sensitivity bounds assume bounded pixels: NaN or out-of-range values would void them.
    if not np.isfinite(images).all():
        raise DataError(
            f"{where}: images contain NaN or infinite pixels ({int((~np.isfinite(images)).sum())} values)"
        )
    lo, hi = float(images.min()), float(images.max())
    if lo < 0.0 or hi > 1.0:
        raise DataError(f"{where}: pixels must lie in [0, 1], found {lo:.4g}..{hi:.4g}")
    return images.astype(np.float32, copy=False), labels.astype(np.int64, copy=False)


def check_clip(clip: float, where: str, name: str = "clip") -> float:
    if (
        isinstance(clip, bool)
        or not isinstance(clip, (int, float, np.floating))
        or not math.isfinite(clip)
        or clip < MIN_CLIP
    ):
        raise PrivacyError(f"{where}: {name} must be a finite number >= {MIN_CLIP:g}, got {clip!r}")
    return float(clip)


def check_sigma(sigma: float, where: str) -> float:
    if (
        isinstance(sigma, bool)
        or not isinstance(sigma, (int, float, np.floating))
        or not math.isfinite(sigma)
        or sigma <= 0
    ):
        raise PrivacyError(f"{where}: noise multiplier sigma must be a finite number > 0, got {sigma!r}")
    return float(sigma)


def check_positive_int(value: int, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise PrivacyError(f"{where}: {name} must be an integer >= 1, got {value!r}")
    return int(value)


def sampling_rate(batch: int, n_public: int, where: str) -> float:
    batch = check_positive_int(batch, "batch", where)
    n_public = check_positive_int(n_public, "n_public (public dataset size)", where)
    if batch > n_public:
        raise PrivacyError(
            f"{where}: batch {batch} exceeds the public dataset size {n_public}, so the sampling rate "
            f"q = {batch}/{n_public} is not in (0, 1]; lower the batch"
        )
    return batch / n_public
