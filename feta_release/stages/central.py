"""Stage 1: the central images (DP-FETA's release): charged once, computed once, saved once."""

from __future__ import annotations

import io

import numpy as np

from ..config import JobConfig
from ..mechanisms.central import central_images, postprocess_central
from ..training.checkpoint import atomic_write_bytes, npz_bytes
from ..viz import save_grid
from .base import check_event, grid_title, refuse_requery
from .context import RunContext
from .freq_warmup import trained_aux
from .prototypes import cell_prototypes


class CentralStage:
    name = "central"

    def enabled(self, cfg: JobConfig) -> bool:
        return cfg.central.rounds > 0

    def run(self, ctx: RunContext) -> None:
        ctx.central = _load(ctx) or _release(ctx)
        images, labels = ctx.central
        save_grid(
            images,
            labels,
            ctx.next_grid("central-images"),
            per_class=min(ctx.grid_per_class, ctx.cfg.central.rounds * ctx.cfg.central.cells),
            n_classes=ctx.data.n_classes,
            class_names=ctx.data.class_names,
            title=grid_title(ctx, "released central images"),
        )


def _load(ctx: RunContext) -> tuple[np.ndarray, np.ndarray] | None:
    path = ctx.rd.released("central.npz")
    if not path.exists():
        refuse_requery(ctx, "central", path)
        return None
    z = np.load(io.BytesIO(ctx.account.saved_release("central", path)))
    ctx.rep.log(f"central images: loaded {len(z['labels'])} released images (not re-queried)")
    return z["images"], z["labels"]


def _prototypes(ctx: RunContext) -> np.ndarray | None:
    """``cell_rule = "aux"``: the public prototypes from the aux generator (fitted, or loaded, here: the
    frequency release ran first); None for the slant rule."""
    if ctx.cfg.central.cell_rule != "aux":
        return None
    return cell_prototypes(trained_aux(ctx), ctx.cfg)


def _release(ctx: RunContext) -> tuple[np.ndarray, np.ndarray]:
    """Charge -> query -> save -> record; the post-processed images (M, C, H, W) in [0, 1] and their
    labels."""
    c, d = ctx.cfg.central, ctx.data
    prototypes = _prototypes(ctx)  # before the charge: fitting the aux generator may take minutes
    rid = ctx.account.charge("central", c.rounds)
    release, event = central_images(
        d.images,
        d.labels,
        d.n_classes,
        kind=c.kind,
        rounds=c.rounds,
        batch=c.batch,
        sigma=c.sigma,
        clip=c.clip,
        downsample=c.downsample,
        bins=c.bins,
        n_public=ctx.n_public,
        rng=ctx.private_rng("central"),
        cells=c.cells,
        prototypes=prototypes,
    )
    check_event(event, ctx.account.planned("central"))
    images, labels = postprocess_central(release, stretch=ctx.cfg.central.stretch)
    images, labels = images.astype(np.float32), labels.astype(np.int64)
    arrays = {f"raw_{k}": v for k, v in release.to_arrays().items()}
    blob = npz_bytes(images=images, labels=labels, **arrays)
    atomic_write_bytes(ctx.rd.released("central.npz"), blob)
    ctx.account.record(rid, blob)
    ctx.rep.log(
        f"central images: released {len(labels)} {c.kind} images ({c.rounds} round(s), {c.cells} "
        f"{c.cell_rule} cell(s), sigma {c.sigma})"
    )
    return images, labels
