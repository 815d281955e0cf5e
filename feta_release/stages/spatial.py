"""The spatial warm-up (post-processing of the released central images): :func:`spatial_stage` and the
central polish, run by the coordinator (``feta_release.federation.warmup``) on the sites' combined images.
"""

from __future__ import annotations

import numpy as np

from ..config import JobConfig
from ..models.edm import EDMDenoiser
from ..training.spatial import spatial_warmup
from ..training.warmup_loop import Progress, WarmupResult
from .context import public_generator


def spatial_enabled(cfg: JobConfig) -> bool:
    return cfg.central.rounds > 0 and cfg.warmup.spatial_iterations > 0


def spatial_stage(
    model: EDMDenoiser,
    central: tuple[np.ndarray, np.ndarray],
    cfg: JobConfig,
    progress: Progress | None = None,
) -> WarmupResult:
    """Train ``model`` in place on released, post-processed central images (M, C, H, W) in [0, 1]."""
    return spatial_warmup(
        model, central[0], central[1], cfg, generator=public_generator(cfg, "spatial"), progress=progress
    )


def central_polish(
    model: EDMDenoiser,
    central: tuple[np.ndarray, np.ndarray],
    cfg: JobConfig,
    progress: Progress | None = None,
) -> WarmupResult | None:
    """``[warmup] polish_iterations`` low-lr steps on the released central images only, after the last warm-up
    stage (post-processing of the release); None when off."""
    w = cfg.warmup
    if w.polish_iterations == 0:
        return None
    pcfg = cfg.replace(warmup={"spatial_iterations": w.polish_iterations, "lr": w.polish_lr})
    return spatial_warmup(
        model, central[0], central[1], pcfg, generator=public_generator(cfg, "polish"), progress=progress
    )
