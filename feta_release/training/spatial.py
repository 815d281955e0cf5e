"""Spatial warm-up (DP-FETA / FETA-Pro stage 1): train the denoiser on the noisy central images.

The central images are already differentially private, so this is ordinary training (no privacy
cost): Adam, EMA, 10% label dropout, and the RandAugment-style bag re-drawn every epoch because ~50
images alone would be memorised within a few hundred steps (method-details §2).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..config import JobConfig
from ..errors import ConfigError
from ..models.edm import EDMDenoiser
from .augment import rand_augment, to_model_range
from .warmup_loop import Progress, WarmupResult, as_image_tensors, train_denoiser


def augmented_batches(
    images: torch.Tensor,
    labels: torch.Tensor,
    batch: int,
    *,
    n_ops: int,
    magnitude_max: int,
    generator: torch.Generator,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless epochs: augment every image afresh, shuffle, then batches of ``batch`` (last may be short)."""
    n = images.shape[0]
    while True:
        aug, _ = rand_augment(images, n_ops=n_ops, magnitude_max=magnitude_max, generator=generator)
        x = to_model_range(aug)
        perm = torch.randperm(n, generator=generator)
        for start in range(0, n, batch):
            idx = perm[start : start + batch]
            yield x[idx], labels[idx]


def spatial_warmup(
    denoiser: EDMDenoiser,
    images,
    labels,
    cfg: JobConfig,
    *,
    generator: torch.Generator,
    progress: Progress | None = None,
) -> WarmupResult:
    """Train ``denoiser`` in place on central images (M, C, H, W) in [0, 1]; EMA weights end up in it.

    ``cfg.warmup.spatial_iterations`` steps of batch ``cfg.warmup.spatial_batch`` (an epoch is one pass
    over the M images, so with M <= batch every step is one epoch with a fresh augmentation draw).
    """
    w = cfg.warmup
    if w.spatial_batch < 1:
        raise ConfigError(f"[warmup] spatial_batch must be >= 1, got {w.spatial_batch}")
    if w.lr <= 0 or not 0 <= w.ema < 1:
        raise ConfigError(f"[warmup] need lr > 0 and 0 <= ema < 1, got lr={w.lr}, ema={w.ema}")
    x, y = as_image_tensors(images, labels, denoiser.n_classes, "spatial warm-up (central images)")
    if tuple(x.shape[1:]) != tuple(denoiser.image_shape):
        raise ConfigError(
            f"spatial warm-up: central images are {tuple(x.shape[1:])} but the model is built for "
            f"{denoiser.image_shape}"
        )
    batches = augmented_batches(
        x, y, w.spatial_batch, n_ops=w.augment_ops, magnitude_max=w.augment_magnitude, generator=generator
    )
    return train_denoiser(
        denoiser,
        batches,
        w.spatial_iterations,
        stage="spatial",
        lr=w.lr,
        ema_decay=w.ema,
        label_dropout=cfg.model.label_dropout,
        generator=generator,
        progress=progress,
    )
