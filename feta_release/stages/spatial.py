"""The spatial warm-up (post-processing of the released central images): :func:`spatial_stage` and the
central polish, run by the coordinator (``feta_release.federation.warmup``) on the sites' combined images.
"""

from __future__ import annotations

import numpy as np

from ..config import JobConfig
from ..models.edm import EDMDenoiser
from ..progress_events import POLISH, SPATIAL, Meter, Sink
from ..training.spatial import spatial_warmup
from ..training.warmup_loop import WarmupResult
from .context import public_generator


def spatial_enabled(cfg: JobConfig) -> bool:
    return cfg.central.rounds > 0 and cfg.warmup.spatial_iterations > 0


def spatial_stage(
    model: EDMDenoiser,
    central: tuple[np.ndarray, np.ndarray],
    cfg: JobConfig,
    sink: Sink | None = None,
) -> WarmupResult:
    """Train ``model`` in place on released, post-processed central images (M, C, H, W) in [0, 1]; its steps
    reported to ``sink``."""
    n = cfg.warmup.spatial_iterations
    meter = Meter(sink, SPATIAL, "steps", n, f"on {len(central[1])} central images, {n} iterations")
    res = spatial_warmup(
        model, central[0], central[1], cfg, generator=public_generator(cfg, "spatial"), progress=meter
    )
    meter.end(f"final loss {res.final_loss:.4f}")
    return res


def central_polish(
    model: EDMDenoiser,
    central: tuple[np.ndarray, np.ndarray],
    cfg: JobConfig,
    sink: Sink | None = None,
) -> WarmupResult | None:
    """``[warmup] polish_iterations`` low-lr steps on the released central images only, after the last warm-up
    stage (post-processing of the release), its steps reported to ``sink``; None when off."""
    w = cfg.warmup
    if w.polish_iterations == 0:
        return None
    pcfg = cfg.replace(warmup={"spatial_iterations": w.polish_iterations, "lr": w.polish_lr})
    meter = Meter(sink, POLISH, "steps", w.polish_iterations, f"on the central images, lr {w.polish_lr:g}")
    res = spatial_warmup(
        model, central[0], central[1], pcfg, generator=public_generator(cfg, "polish"), progress=meter
    )
    meter.end(f"final loss {res.final_loss:.4f}")
    return res
