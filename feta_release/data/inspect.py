"""Data-quality checks for ``feta-release data inspect`` (torch-free)."""

from __future__ import annotations

import hashlib

from .dataset import ImageDataset
from .loading import LoadReport

IMBALANCE_RATIO = 2.0  # largest / smallest class above this is worth a warning
FEW_IMAGES = 100  # per class; DP noise is calibrated to the whole set, so tiny classes drown


def find_problems(ds: ImageDataset) -> list[str]:
    """Problems in an already valid dataset that a user should know before spending privacy on it."""
    problems: list[str] = []
    digests = [hashlib.sha256(img.tobytes()).digest() for img in ds.images]
    n_dup = len(digests) - len(set(digests))
    if n_dup:
        problems.append(
            f"{n_dup} exact duplicate image(s): the privacy unit is one image, so a person whose image appears "
            "twice is protected at half strength; deduplicate before release"
        )
    flat = ds.images.reshape(ds.n, -1)
    n_const = int((flat.max(axis=1) == flat.min(axis=1)).sum()) if ds.n else 0
    if n_const:
        problems.append(f"{n_const} constant (single-colour) image(s)")
    counts = ds.class_counts()
    if counts.min() > 0 and counts.max() / counts.min() > IMBALANCE_RATIO:
        problems.append(
            f"class imbalance: largest class {counts.max()} images vs smallest {counts.min()} "
            f"(ratio {counts.max() / counts.min():.1f})"
        )
    small = [f"{ds.class_names[c]} ({counts[c]})" for c in range(ds.n_classes) if counts[c] < FEW_IMAGES]
    if small:
        problems.append(f"class(es) with fewer than {FEW_IMAGES} images: {', '.join(small)}")
    return problems


def inspect_summary(ds: ImageDataset, report: LoadReport) -> dict:
    """Everything ``data inspect`` shows, JSON-ready."""
    out = ds.summary()
    out.update(
        kind=report.kind,
        pixel_mean=float(ds.images.mean()),
        pixel_std=float(ds.images.std()),
        skipped_files=report.skipped_files,
        n_skipped=report.n_skipped,
        conversions=report.conversions,
        n_resized=report.n_resized,
        warnings=report.warnings + find_problems(ds),
    )
    return out
