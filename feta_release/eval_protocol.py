"""The fixed evaluation protocol behind every quality figure (``bench/eval_protocol.py``, docs/evaluation.md).

One protocol, so that figures from different runs, presets and methods can be compared:

- Splits (deterministic, per class): the dataset -> ``train`` / ``heldout`` (20 %, seed 0). The held-out part
  is the TEST set: scored once per final configuration, never used to choose anything. For tuning, ``train``
  is split again -> ``fit`` / ``validation`` (20 %, seed 1): the mechanisms see ``fit`` only and scores are
  taken on ``validation`` (``mode="validation"``).
- Synthetic images: ``n_synthetic`` (10,000) per run, exactly balanced over the classes (more samples are
  free: post-processing).
- Classifier: the evaluation ResNet (``feta_release.eval_classifier``: global max + mean pooling, small random
  translations, AdamW), early-stopped on a stratified 10 % validation part of ITS OWN training images (never
  the scored images), ``classifier_epochs`` the epoch cap (None: automatic), seeded; the same classifier
  trained on the REAL training part is the ceiling.
- FD (classifier features) and precision/recall/density/coverage: in the pooled features of the same network
  trained (cap ``feature_epochs``) on the evaluation set's real images; equal n per side. Not FID.
- Seeds: the run (training) seed and the classifier seed are the same; ``seeds`` = (0, 1, 2); figures are
  mean ± sample std (ddof = 1) over seeds.
- Release-only baseline: the same classifier trained on ``n_synthetic`` augmented copies of the released
  central images (or any released images), so a diffusion model that adds nothing over its warm-up data shows
  it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .data import ImageDataset
from .data.splits import balanced_labels, train_heldout_split
from .errors import ConfigError, DataError

Mode = Literal["validation", "test"]


@dataclass(frozen=True)
class Protocol:
    n_synthetic: int = 10_000
    classifier_epochs: int | None = None  # epoch cap; early stopping below it (None: automatic)
    feature_epochs: int | None = None
    seeds: tuple[int, ...] = (0, 1, 2)
    heldout_fraction: float = 0.2
    split_seed: int = 0
    validation_fraction: float = 0.2
    validation_seed: int = 1
    augment_magnitude: int = 3  # release-only baseline: RandAugment magnitude bound (as the warm-up)

    def __post_init__(self) -> None:
        caps = [e for e in (self.classifier_epochs, self.feature_epochs) if e is not None]
        if self.n_synthetic < 1 or any(e < 1 for e in caps) or not self.seeds:
            raise ConfigError(
                f"evaluation protocol: sizes, epochs and seeds must be positive/non-empty: {self}"
            )


PROTOCOL = Protocol()


def protocol_splits(
    ds: ImageDataset, mode: Mode, protocol: Protocol = PROTOCOL
) -> tuple[ImageDataset, ImageDataset]:
    """(training data the pipeline sees, real images it is scored on) for ``mode``.

    ``test``: (train, heldout). ``validation``: (fit, validation), both inside ``train``: the held-out part is
    never returned in validation mode, so nothing tuned there can have seen it.
    """
    train, heldout = train_heldout_split(ds, protocol.heldout_fraction, protocol.split_seed)
    if mode == "test":
        return train, heldout
    if mode == "validation":
        return train_heldout_split(train, protocol.validation_fraction, protocol.validation_seed)
    raise ConfigError(f"evaluation mode must be 'validation' or 'test', got {mode!r}")


def release_only(
    images: np.ndarray,
    labels: np.ndarray,
    class_names: Sequence[str],
    n: int,
    seed: int,
    protocol: Protocol = PROTOCOL,
) -> ImageDataset:
    """The release-only baseline's training set: ``n`` augmented copies of released images, balanced by class.

    Each class's released images are cycled to its share of ``n`` and every copy batch is RandAugment-ed
    (2 ops, magnitude re-drawn per chunk): pure post-processing of the release.
    """
    import torch

    from .training.augment import rand_augment

    labels = np.asarray(labels, np.int64)
    want = balanced_labels(n, len(class_names))
    missing = [class_names[c] for c in range(len(class_names)) if not (labels == c).any()]
    if missing:
        raise DataError(f"release-only baseline: no released image of class(es) {missing}")
    idx = np.concatenate(
        [np.resize(np.flatnonzero(labels == c), int((want == c).sum())) for c in range(len(class_names))]
    )
    src = torch.from_numpy(np.asarray(images, np.float32)[idx])
    gen = torch.Generator().manual_seed(seed)
    chunks = [
        rand_augment(src[i : i + 256], n_ops=2, magnitude_max=protocol.augment_magnitude, generator=gen)[0]
        for i in range(0, len(src), 256)
    ]
    return ImageDataset(
        torch.cat(chunks).clamp(0, 1).numpy(),
        labels[idx],
        tuple(class_names),
        source="release-only (augmented released images)",
    )


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std (ddof = 1; 0 for a single value) over seeds."""
    xs = [float(v) for v in values]
    if not xs or not all(math.isfinite(v) for v in xs):
        raise DataError(f"mean_std needs finite values, got {xs}")
    return float(np.mean(xs)), float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0


def format_row(name: str, accs: Sequence[float], fds: Sequence[float] | None = None) -> str:
    """One markdown table row: ``| name | acc mean ± std | FD mean ± std | seeds |``."""
    m, s = mean_std(accs)
    fd = "–" if not fds else "{:.0f} ± {:.0f}".format(*mean_std(fds))
    return f"| {name} | {m:.3f} ± {s:.3f} | {fd} | {len(accs)} |"
