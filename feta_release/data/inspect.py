"""Data-quality checks for ``feta-release data inspect`` (torch-free)."""

from __future__ import annotations

import hashlib
from collections import defaultdict

import numpy as np

from .dataset import ImageDataset
from .loading import LoadReport

IMBALANCE_RATIO = 2.0  # largest / smallest class above this is worth a warning
FEW_IMAGES = 100  # per class; DP noise is calibrated to the whole set, so tiny classes drown


def find_problems(ds: ImageDataset, report: LoadReport | None = None) -> list[str]:
    """Problems in an already valid dataset that a user should know before spending privacy on it.

    One line per problem kind, naming the files where the loader knows them, and the fix."""
    files = report.files if report is not None and len(report.files) == ds.n else None
    problems = _duplicates(ds, files, report)
    flat = ds.images.reshape(ds.n, -1)
    const = np.flatnonzero(flat.max(axis=1) == flat.min(axis=1)) if ds.n else np.array([], int)
    if len(const):
        problems.append(
            f"{len(const)} constant (single-colour) image(s){_named(const, files)}: check the export "
            "(blank frames, wrong window); remove them if they are not real images"
        )
    counts = ds.class_counts()
    if counts.min() > 0 and counts.max() / counts.min() > IMBALANCE_RATIO:
        problems.append(
            f"class imbalance: largest class {counts.max()} images vs smallest {counts.min()} "
            f"(ratio {counts.max() / counts.min():.1f}); the synthetic data is balanced, so rare classes are "
            "learnt from little signal: add images of the small classes or merge them"
        )
    small = [f"{ds.class_names[c]} ({counts[c]})" for c in range(ds.n_classes) if counts[c] < FEW_IMAGES]
    if small:
        problems.append(
            f"class(es) with fewer than {FEW_IMAGES} images: {', '.join(small)}; DP noise is "
            "calibrated to the whole set, so tiny classes drown in it: add images or merge classes"
        )
    return problems


def _named(indices: np.ndarray, files: list[str] | None, limit: int = 5) -> str:
    if files is None:
        return (
            f" (indices {', '.join(str(int(i)) for i in indices[:limit])}"
            f"{', ...' if len(indices) > limit else ''})"
        )
    shown = [files[int(i)] for i in indices[:limit]]
    return f": {', '.join(shown)}{f' and {len(indices) - limit} more' if len(indices) > limit else ''}"


def _duplicates(ds: ImageDataset, files: list[str] | None, report: LoadReport | None) -> list[str]:
    groups: dict[bytes, list[int]] = defaultdict(list)
    for i, img in enumerate(ds.images):
        groups[hashlib.sha256(img.tobytes()).digest()].append(i)
    dups = [g for g in groups.values() if len(g) > 1]
    if not dups:
        return []
    n_dup = sum(len(g) - 1 for g in dups)
    first = dups[0]
    where = (
        f"; e.g. {', '.join(files[i] for i in first[:3])}"
        if files is not None
        else f"; e.g. indices {', '.join(map(str, first[:3]))}"
    )
    unit = (
        "the unit of privacy is the patient; copies still overweight that image and use up the patient's "
        "image cap"
        if report is not None and report.patients is not None
        else "the unit of privacy is one image, so a person whose image "
        "appears twice is protected at half strength"
    )
    return [
        f"{n_dup} exact duplicate image(s) in {len(dups)} group(s){where}: {unit}; delete the copies before "
        "release"
    ]


def _pixel_moments(images: np.ndarray, rows: int = 4096) -> dict[str, float]:
    """Mean and standard deviation of every pixel value, accumulated in float64 chunk by chunk:
    ``images.std()`` makes a temporary the size of the whole set (1.6 GB more at 100,000 images of 64x64)."""
    size = max(images.size, 1)
    mean = sum(float(images[i : i + rows].sum(dtype=np.float64)) for i in range(0, len(images), rows)) / size
    square = sum(
        float(np.square(images[i : i + rows] - mean, dtype=np.float64).sum())
        for i in range(0, len(images), rows)
    )
    return {"pixel_mean": mean, "pixel_std": (square / size) ** 0.5}


def inspect_summary(ds: ImageDataset, report: LoadReport) -> dict:
    """Everything ``data inspect`` shows, JSON-ready."""
    out = ds.summary()
    out.update(
        kind=report.kind,
        **_pixel_moments(ds.images),
        skipped_files=report.skipped_files,
        n_skipped=report.n_skipped,
        conversions=report.conversions,
        n_resized=report.n_resized,
        n_patients=report.n_patients,
        max_images_per_patient=report.to_dict()["max_images_per_patient"],
        warnings=report.warnings + find_problems(ds, report),
    )
    return out
