"""Stage 2: the spatial warm-up (post-processing of the released central images).

:func:`spatial_stage` is the computation; both drivers run it: the local driver's :class:`SpatialWarmup` on
the site's own released images, the coordinator (``feta_release.federation.warmup``) on the sites' combined
ones.
"""

from __future__ import annotations

import numpy as np

from ..config import JobConfig
from ..models.edm import EDMDenoiser
from ..training.spatial import spatial_warmup
from ..training.warmup_loop import Progress, WarmupResult
from .base import stage_grid
from .context import RunContext, public_generator, resume_denoiser, save_denoiser


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


def polish_stage(ctx: RunContext) -> None:
    """Run :func:`central_polish` in ``ctx`` (the caller checkpoints the result with its own stage)."""
    n = ctx.cfg.warmup.polish_iterations
    if n == 0 or ctx.central is None:
        return
    with ctx.rep.task("central polish", n) as adv:
        res = central_polish(
            ctx.denoiser, ctx.central, ctx.cfg, progress=lambda i, t, loss: adv(1, info=f"loss {loss:.3f}")
        )
    assert res is not None
    ctx.mark("polish", final_loss=res.final_loss, steps=res.steps)


class SpatialWarmup:
    name = "spatial"

    def enabled(self, cfg: JobConfig) -> bool:
        return spatial_enabled(cfg)

    def run(self, ctx: RunContext) -> None:
        assert ctx.central is not None, "the spatial warm-up runs after the central release"
        if not resume_denoiser(ctx, "spatial", "spatial warm-up"):
            with ctx.rep.task("spatial warm-up", ctx.cfg.warmup.spatial_iterations) as adv:
                res = spatial_stage(
                    ctx.denoiser,
                    ctx.central,
                    ctx.cfg,
                    progress=lambda i, n, loss: adv(1, info=f"loss {loss:.3f}"),
                )
            if ctx.cfg.frequency.sigma is None:  # no frequency warm-up follows: the polish ends this stage
                polish_stage(ctx)
            save_denoiser(ctx, "spatial")
            ctx.mark("spatial", final_loss=res.final_loss, steps=res.steps)
        stage_grid(ctx, "after-spatial", ctx.denoiser)
