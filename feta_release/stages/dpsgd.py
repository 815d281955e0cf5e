"""Stage 5: DP-SGD on the site's images, charged one chunk of ``checkpoint_every`` steps at a time BEFORE the
chunk runs (a local "round", as a federated site charges each round's ``local_steps``).

The trainer state is checkpointed at the end of every chunk and the chunk's ledger request recorded then. After
a kill, the steps charged since the last checkpoint are lost progress, never re-charged: the run continues
from the checkpoint with the REMAINING planned steps, so the final history equals the plan.
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
from ..planning import round_sizes
from ..errors import ConfigError
from ..training.augment import rand_augment
from ..training.dpsgd import DPSGDTrainer, PublicMix, StepStats
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
        trainer = DPSGDTrainer(ctx.denoiser, ctx.cfg, sgd.sigma, sgd.q, ctx.private_gen("dpsgd"),
                               image_shape=ctx.data.image_shape, n_classes=ctx.data.n_classes,
                               n_public=ctx.n_public if pat is None else pat.n_public,
                               patient_rows=None if pat is None else pat.rows,  # grouped once, at load
                               images_per_patient=None if pat is None else pat.cap,
                               public=_public_mix(ctx))
        saved = load_checkpoint(ctx, "dpsgd.pt")
        if saved is not None:
            trainer.load_state_dict(saved)
        charged = ctx.account.charged("dpsgd")
        lost = charged - trainer.steps_done
        if lost > 0:
            ctx.rep.log(f"DP-SGD: resuming at step {trainer.steps_done}; {lost} step(s) charged after the last "
                        "checkpoint are lost progress (not re-charged)")
            ctx.state["dpsgd_steps_lost"] = int(ctx.state.get("dpsgd_steps_lost", 0)) + lost
        _train(ctx, trainer, sgd, charged)
        save_checkpoint(ctx, "dpsgd.pt", trainer.state_dict())
        # trainable = "lora": the adapters folded into the weights; what follows sees the plain denoiser
        model = cast(EDMDenoiser, merge_lora(trainer.ema_model()))
        merge_lora(ctx.denoiser)
        ctx.final_model, ctx.dpsgd_trained = model, trainer.steps_done
        ctx.mark("dpsgd", steps_trained=ctx.dpsgd_trained, steps_charged=ctx.account.charged("dpsgd"))
        stage_grid(ctx, "after-dpsgd", model)


def _public_mix(ctx: RunContext) -> PublicMix | None:
    """``[dpsgd] public_batch`` RandAugment-ed copies of the RELEASED central images per step (see ``PublicMix``:
    post-processing of the central release, no privacy cost)."""
    n, w = ctx.cfg.dpsgd.public_batch, ctx.cfg.warmup
    if n == 0:
        return None
    if ctx.central is None or len(ctx.central[1]) == 0:
        raise ConfigError("[dpsgd] public_batch > 0 needs released central images ([central] rounds > 0 and a method "
                          "with a central release); set public_batch = 0")
    src = torch.from_numpy(np.asarray(ctx.central[0], np.float32))
    lab = torch.from_numpy(np.asarray(ctx.central[1], np.int64))

    def draw(m: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(lab), (m,), generator=g)
        aug, _ = rand_augment(src[idx], n_ops=w.augment_ops, magnitude_max=w.augment_magnitude, generator=g)
        return aug * 2 - 1, lab[idx]  # [0, 1] -> the model's [-1, 1]

    return PublicMix(draw, n, ctx.public_gen("dpsgd-public"))


def _train(ctx: RunContext, trainer: DPSGDTrainer, sgd: PrivacyEvent, charged: int) -> None:
    x = torch.from_numpy(np.ascontiguousarray(ctx.data.images, dtype=np.float32)) * 2 - 1
    y = torch.from_numpy(np.asarray(ctx.data.labels, dtype=np.int64))
    rid, left, done_here = "", 0, 0

    def before(i: int) -> None:
        nonlocal rid, left
        if left == 0:  # the next chunk (the planner's next round) is on disk in the ledger before its first step runs
            left = round_sizes(sgd.steps - ctx.account.charged("dpsgd"), ctx.checkpoint_every)[0]
            rid = ctx.account.charge("dpsgd", left)
        left -= 1

    def after(s: StepStats) -> None:
        nonlocal done_here
        done_here += 1
        if left == 0:  # end of the chunk: checkpoint, then the request is complete
            save_checkpoint(ctx, "dpsgd.pt", trainer.state_dict())
            ctx.account.record(rid, json.dumps({"steps_done": trainer.steps_done}).encode())
        adv(1, info=f"batch {s.batch_size} loss {s.loss:.3f} clipped {s.clipped_fraction:.0%}")
        if ctx.kill_after_steps is not None and done_here >= ctx.kill_after_steps:
            raise SimulatedKill(f"simulated kill after {done_here} DP-SGD steps")

    with ctx.rep.task("DP-SGD", sgd.steps) as adv:
        adv(charged)
        if sgd.steps - charged > 0:
            trainer.run(x, y, sgd.steps - charged, before_step=before, after_step=after)
