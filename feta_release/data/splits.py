"""Deterministic, stratified splits: train / held-out, and one dataset into disjoint sites.

Both use ``numpy.random.default_rng(seed)`` and visit classes in label order, so the same
(dataset, parameters, seed) always gives the same split on any machine. Indices inside each part
keep the dataset's original order.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError, DataError
from .dataset import ImageDataset


def train_heldout_split(
    ds: ImageDataset, heldout_fraction: float = 0.2, seed: int = 0
) -> tuple[ImageDataset, ImageDataset]:
    """Per class, ``round(fraction * n_c)`` images (at least 1, at most n_c - 1) go to held-out.

    Every class appears in both parts, so a class with fewer than 2 images is an error.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise ConfigError(f"heldout_fraction must be in (0, 1), not {heldout_fraction}")
    rng = np.random.default_rng(seed)
    counts = ds.class_counts()
    small = [ds.class_names[c] for c in range(ds.n_classes) if counts[c] < 2]
    if small:
        raise DataError(f"{ds.source}: cannot split class(es) {small}: each needs at least 2 images")
    held: list[np.ndarray] = []
    for c in range(ds.n_classes):
        idx = rng.permutation(np.flatnonzero(ds.labels == c))
        k = min(max(int(round(heldout_fraction * len(idx))), 1), len(idx) - 1)
        held.append(idx[:k])
    mask = np.zeros(ds.n, dtype=bool)
    mask[np.concatenate(held)] = True
    tag = f"fraction {heldout_fraction:g}, seed {seed}"
    return (
        ds.subset(np.flatnonzero(~mask), source=f"{ds.source} [train; {tag}]"),
        ds.subset(np.flatnonzero(mask), source=f"{ds.source} [heldout; {tag}]"),
    )


def split_sites(ds: ImageDataset, n_sites: int, seed: int = 0) -> list[ImageDataset]:
    """Split into ``n_sites`` disjoint parts with (near-)equal per-class counts.

    Each class is shuffled and dealt round-robin, the deal continuing across classes, so both
    per-class and total sizes differ by at most one between sites. Every class must have at least
    ``n_sites`` images (each site gets every class).
    """
    if not isinstance(n_sites, int) or n_sites < 1:
        raise ConfigError(f"n_sites must be a positive integer, not {n_sites!r}")
    counts = ds.class_counts()
    small = [f"{ds.class_names[c]} ({counts[c]})" for c in range(ds.n_classes) if counts[c] < n_sites]
    if small:
        raise DataError(
            f"{ds.source}: cannot give each of {n_sites} sites every class; too few images in class(es) "
            f"{small}"
        )
    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(np.flatnonzero(ds.labels == c)) for c in range(ds.n_classes)])
    site_of = np.empty(ds.n, dtype=np.int64)
    site_of[order] = np.arange(ds.n) % n_sites
    return [
        ds.subset(np.flatnonzero(site_of == s), source=f"{ds.source} [site {s + 1}/{n_sites}; seed {seed}]")
        for s in range(n_sites)
    ]


def balanced_labels(n: int, n_classes: int) -> np.ndarray:
    """``n`` labels in class order, class counts differing by at most one (the first ``n % n_classes`` classes
    get one more): a synthetic set's labels (``n_per_class`` each when ``n`` is a multiple)."""
    if n < 0 or n_classes < 1:
        raise ConfigError(f"balanced_labels needs n >= 0 and n_classes >= 1, got {n}, {n_classes}")
    return np.sort(np.arange(n) % n_classes).astype(np.int64)
