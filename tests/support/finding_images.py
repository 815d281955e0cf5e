"""A small medical-like image set for the evaluator's tests: noisy textured backgrounds where one class
differs from "normal" ONLY by a small bright spot at a random place (a local finding), and one by a faint
diffuse opacity.

The spot adds as much to the image mean as a tiny fraction of the background's own variation, so a classifier
that averages its feature maps cannot see it; one that keeps local evidence (max pooling) can.
"""

from __future__ import annotations

import numpy as np
from scipy.ndimage import gaussian_filter

from feta_release.data import ImageDataset

CLASSES = ("normal", "finding", "opacity")


def _backgrounds(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """Smooth random texture (unit-std field, ~size/8 px correlation) plus pixel noise, around mid-grey."""
    white = rng.standard_normal((n, size, size))
    field = np.stack([gaussian_filter(w, sigma=size / 16, mode="wrap") for w in white])
    field /= field.std(axis=(1, 2), keepdims=True)
    return 0.45 + 0.1 * field + 0.04 * rng.standard_normal((n, size, size))


def finding_images(
    n_per_class: int,
    size: int = 48,
    seed: int = 0,
    spot: int = 2,
    contrast: float = 0.3,
) -> ImageDataset:
    """``n_per_class`` images of each class in :data:`CLASSES`, (1, size, size), in [0, 1]."""
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(len(CLASSES)), n_per_class)
    imgs = _backgrounds(rng, len(labels), size)
    # finding: a spot x spot bright square anywhere (2 px from the border)
    for i in np.flatnonzero(labels == 1):
        a, b = rng.integers(2, size - spot - 2, size=2)
        imgs[i, a : a + spot, b : b + spot] += contrast
    yy, xx = np.mgrid[:size, :size]
    for i in np.flatnonzero(labels == 2):  # opacity: a faint wide Gaussian haze at a random place
        cy, cx = rng.uniform(0.25 * size, 0.75 * size, size=2)
        imgs[i] += 0.25 * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * (size / 6) ** 2))
    order = rng.permutation(len(labels))
    return ImageDataset(
        np.clip(imgs[order], 0, 1).astype(np.float32)[:, None],
        labels[order].astype(np.int64),
        CLASSES,
        source=f"finding-images {size}px seed {seed}",
    )
