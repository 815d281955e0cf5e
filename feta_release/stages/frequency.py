"""Stage 3: the frequency statistics (FETA-Pro's release): a noisy random-Fourier-feature mean embedding."""

from __future__ import annotations

import io

import numpy as np

from ..config import JobConfig
from ..mechanisms.frequency import frequency_statistics
from ..training.checkpoint import atomic_write_bytes, npz_bytes
from .base import check_event, refuse_requery
from .context import RunContext


class FrequencyStage:
    """``early``: the instance placed before the central release, which runs instead of the later one when the
    central cells need the aux generator's prototypes (``[central] cell_rule = "aux"``). Same charge either
    way."""

    name = "frequency-release"

    def __init__(self, early: bool = False) -> None:
        self.early = early

    def enabled(self, cfg: JobConfig) -> bool:
        first = cfg.central.rounds > 0 and cfg.central.cell_rule == "aux"
        return cfg.frequency.sigma is not None and self.early == first

    def run(self, ctx: RunContext) -> None:
        path = ctx.rd.released("frequency.npz")
        if path.exists():
            ctx.rep.log("frequency statistics: loaded the released statistics (not re-queried)")
            ctx.embedding = np.load(io.BytesIO(ctx.account.saved_release("frequency", path)))["embedding"]
            return
        refuse_requery(ctx, "frequency", path)
        ctx.embedding = _release(ctx)


def _release(ctx: RunContext) -> np.ndarray:
    f, d = ctx.cfg.frequency, ctx.data
    assert f.sigma is not None, "enabled only with [frequency] sigma"
    rid = ctx.account.charge("frequency", 1)
    release, event = frequency_statistics(
        d.images,
        d.labels,
        d.n_classes,
        features=f.features,
        sigma=f.sigma,
        bandwidth2=f.bandwidth2,
        seed=f.seed,
        chunk=f.chunk,
        n_public=ctx.n_public,
        rng=ctx.private_rng("frequency"),
        patch=f.patch,
        stride=f.stride,
    )
    check_event(event, ctx.account.planned("frequency"))
    blob = npz_bytes(
        embedding=release.embedding,
        n_public=np.int64(release.n_public),
        features=np.int64(release.features),
        bandwidth2=np.float64(release.bandwidth2),
        seed=np.int64(release.seed),
        sigma=np.float64(release.sigma),
        **({"patch": np.int64(release.patch), "stride": np.int64(release.stride)} if release.patch else {}),
    )
    atomic_write_bytes(ctx.rd.released("frequency.npz"), blob)
    ctx.account.record(rid, blob)
    ctx.rep.log(f"frequency statistics: released a {release.embedding.shape} embedding (sigma {f.sigma})")
    return release.embedding
