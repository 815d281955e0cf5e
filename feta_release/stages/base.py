"""The stage protocol and the helpers stages share (released files, event checks, sample grids)."""

from __future__ import annotations

import math
import time
from typing import Protocol

from ..accounting import PrivacyEvent, epsilon
from ..config import JobConfig
from ..errors import PrivacyError
from ..models.edm import EDMDenoiser
from ..models.sampler import generate
from ..viz import epsilon_title, save_grid
from .context import RunContext, seed_from


class Stage(Protocol):
    """One step of a run: ``enabled`` reads only the (sized, method-switched) job; ``run`` reads and fills the
    context, and on resume loads what it already released or trained instead of doing it again."""

    name: str

    def enabled(self, cfg: JobConfig) -> bool: ...

    def run(self, ctx: RunContext) -> None: ...


def now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def check_event(event: PrivacyEvent | None, planned: PrivacyEvent | None) -> None:
    """The event a mechanism reports must be the planned (and charged) one, or nothing is kept."""
    if event is None or planned is None:
        return
    if (
        (event.stage, event.steps) != (planned.stage, planned.steps)
        or not math.isclose(event.sigma, planned.sigma, rel_tol=1e-9)
        or not math.isclose(event.q, planned.q, rel_tol=1e-9)
    ):
        raise PrivacyError(f"mechanism reported {event} but the plan charged {planned}: refusing to continue")


def refuse_requery(ctx: RunContext, stage: str, path: object) -> None:
    """A release charged but not on disk (killed between charge and save) cannot be drawn again for free."""
    if ctx.account.charged(stage) > 0:
        raise PrivacyError(
            f"{path} is missing but the {stage} release was already charged (the run was killed between "
            "charging and saving it); it cannot be re-queried without spending more: start a new run "
            "directory"
        )


def grid_title(ctx: RunContext, what: str) -> str:
    """A grid's title: what it shows and the ε charged so far (the model has seen nothing more)."""
    b, events = ctx.account.budget, ctx.account.events
    spent = epsilon(events, b.delta, b.accountant) if events else None
    label = what if what.startswith("released") else f"samples {what.replace('-', ' ')}"
    unit = (
        "a patient (DP-SGD) / an image (warm-up) of one site"
        if any(e.unit == "patient" for e in events)
        else "one image of one site"
    )
    return epsilon_title(label, spent, b.delta, unit)


def stage_grid(ctx: RunContext, stage: str, model: EDMDenoiser) -> None:
    images, labels = generate(model, ctx.grid_per_class, seed_from(ctx.cfg.job.seed, "grid"), ctx.cfg.sampler)
    d = ctx.data
    save_grid(
        images.numpy(),
        labels.numpy(),
        ctx.next_grid(stage),
        per_class=ctx.grid_per_class,
        n_classes=d.n_classes,
        class_names=d.class_names,
        title=grid_title(ctx, stage),
    )
