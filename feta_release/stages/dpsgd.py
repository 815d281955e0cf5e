"""Stage 5: DP-SGD on the site's images: ONE round of all the planned steps, charged once BEFORE its first
step (the planner's local schedule, ``planning.dpsgd_rounds``: the events a federation of one charges for the
same job).

The trainer state (model, EMA, Adam, the private generator) is checkpointed every ``checkpoint_every`` steps
and the round's ledger request recorded when its last step is done. After a kill, the run continues from the
checkpoint with the SAME generator state, so the steps after it are the same computation done again: nothing
of the killed process was released (checkpoints are site-private), nothing is charged twice and no charged
step is lost (docs/architecture.md, "resume inside a charged round").
"""

from __future__ import annotations

import json
from typing import cast

import numpy as np
import torch

from ..accounting import PrivacyEvent
from ..config import JobConfig
from ..models.edm import EDMDenoiser
from ..models.lora import merge_lora
from ..training.dpsgd import DPSGDTrainer, PublicMix, StepStats, released_mix
from .base import stage_grid
from .context import RunContext, load_checkpoint, save_checkpoint


class SimulatedKill(RuntimeError):
    """Raised by the test hook ``kill_after_steps`` to simulate a crash in the middle of DP-SGD."""


class DpsgdTraining:
    name = "dpsgd"

    def enabled(self, cfg: JobConfig) -> bool:
        return cfg.dpsgd.steps is None or cfg.dpsgd.steps > 0

    def run(self, ctx: RunContext) -> None:
        sgd = ctx.account.planned("dpsgd")
        assert sgd is not None, "DP-SGD is enabled but not planned"
        pat = ctx.patients  # patient-level: Poisson-sample patients, divide by q x the PUBLIC patient count
        trainer = DPSGDTrainer(
            ctx.denoiser,
            ctx.cfg,
            sgd.sigma,
            sgd.q,
            ctx.private_gen("dpsgd"),
            image_shape=ctx.data.image_shape,
            n_classes=ctx.data.n_classes,
            n_public=ctx.n_public if pat is None else pat.n_public,
            patient_rows=None if pat is None else pat.rows,  # grouped once, at load
            images_per_patient=None if pat is None else pat.cap,
            public=_public_mix(ctx),
        )
        saved = load_checkpoint(ctx, "dpsgd.pt")
        if saved is not None:
            trainer.load_state_dict(saved)
            ctx.rep.log(f"DP-SGD: resuming the charged round at step {trainer.steps_done} of {sgd.steps}")
        _train(ctx, trainer, sgd)
        save_checkpoint(ctx, "dpsgd.pt", trainer.state_dict())
        # trainable = "lora": the adapters folded into the weights; what follows sees the plain denoiser
        model = cast(EDMDenoiser, merge_lora(trainer.ema_model()))
        merge_lora(ctx.denoiser)
        ctx.final_model, ctx.dpsgd_trained = model, trainer.steps_done
        ctx.mark("dpsgd", steps_trained=ctx.dpsgd_trained, steps_charged=ctx.account.charged("dpsgd"))
        stage_grid(ctx, "after-dpsgd", model)


def _public_mix(ctx: RunContext) -> PublicMix | None:
    """``[dpsgd] public_batch`` copies of the run's released central images per step
    (``training.dpsgd.released_mix``: post-processing of the central release, no privacy cost)."""
    return released_mix(ctx.cfg, ctx.central, ctx.public_gen("dpsgd-public"))


def _train(ctx: RunContext, trainer: DPSGDTrainer, sgd: PrivacyEvent) -> None:
    rid = _round_request(ctx, sgd)  # charged (and committed) before the round's first step
    x = torch.from_numpy(np.ascontiguousarray(ctx.data.images, dtype=np.float32)) * 2 - 1
    y = torch.from_numpy(np.asarray(ctx.data.labels, dtype=np.int64))
    done_here = 0

    def after(s: StepStats) -> None:
        nonlocal done_here
        done_here += 1
        if trainer.steps_done % ctx.checkpoint_every == 0 or trainer.steps_done == sgd.steps:
            save_checkpoint(ctx, "dpsgd.pt", trainer.state_dict())
        adv(1, info=f"batch {s.batch_size} loss {s.loss:.3f} clipped {s.clipped_fraction:.0%}")
        if ctx.kill_after_steps is not None and done_here >= ctx.kill_after_steps:
            raise SimulatedKill(f"simulated kill after {done_here} DP-SGD steps")

    with ctx.rep.task("DP-SGD", sgd.steps) as adv:
        adv(trainer.steps_done)
        if sgd.steps - trainer.steps_done > 0:
            trainer.run(x, y, sgd.steps - trainer.steps_done, after_step=after)
    if ctx.account.pending("dpsgd"):  # the round is complete: its request too (a replay gets this record)
        ctx.account.record(rid, json.dumps({"steps_done": trainer.steps_done}).encode())


def _round_request(ctx: RunContext, sgd: PrivacyEvent) -> str:
    """The ledger request of the run's one DP-SGD round: charged now for all its steps, or (a resumed run) the
    one already charged."""
    if ctx.account.charged("dpsgd") == 0:
        return ctx.account.charge("dpsgd", sgd.steps)
    return ctx.account.request_id("dpsgd", 0)
