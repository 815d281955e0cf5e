"""Stage 2: the spatial warm-up (post-processing of the released central images)."""

from __future__ import annotations

from ..config import JobConfig
from ..training.checkpoint import load_torch, save_torch
from ..training.spatial import spatial_warmup
from .base import sample_grid
from .context import RunContext


class SpatialWarmup:
    name = "spatial"

    def enabled(self, cfg: JobConfig) -> bool:
        return cfg.central.rounds > 0 and cfg.warmup.spatial_iterations > 0

    def run(self, ctx: RunContext) -> None:
        assert ctx.central is not None, "the spatial warm-up runs after the central release"
        ck = ctx.rd.ckpt("after-spatial.pt")
        if ck.exists():
            ctx.denoiser.load_state_dict(load_torch(ck)["model"])
            ctx.rep.log("spatial warm-up: loaded from checkpoint")
        else:
            with ctx.rep.task("spatial warm-up", ctx.cfg.warmup.spatial_iterations) as adv:
                res = spatial_warmup(ctx.denoiser, ctx.central[0], ctx.central[1], ctx.cfg,
                                     generator=ctx.public_gen("spatial"),
                                     progress=lambda i, n, loss: adv(1, info=f"loss {loss:.3f}"))
            save_torch(ck, {"model": ctx.denoiser.state_dict()})
            ctx.mark("spatial", final_loss=res.final_loss, steps=res.steps)
        sample_grid(ctx, "after-spatial", ctx.denoiser)
