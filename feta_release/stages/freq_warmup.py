"""Stage 4: the aux generator fitted to the released embedding, and the frequency warm-up on its images
(+ RandAugment-ed released central images when ``[warmup] frequency_mix_central``): post-processing only.

The computation is :func:`fit_aux` -> :func:`aux_images` -> :func:`warmup_set` -> :func:`frequency_train`;
both drivers run it (the coordinator on the sites' combined embedding, ``feta_release.federation.warmup``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..config import JobConfig
from ..mechanisms.feature_map import job_feature_map
from ..models.auxgen import AuxModel, new_aux_model
from ..models.edm import EDMDenoiser
from ..release.jobfiles import AUX_POOL_PER_CLASS
from ..training.augment import rand_augment
from ..training.frequency import (
    aux_draw,
    aux_iterations,
    fit_aux_restarts,
    frequency_warmup,
    generate_aux_images,
)
from ..training.warmup_loop import Progress, WarmupResult
from ..viz import save_grid
from .base import stage_grid
from .context import (
    RunContext,
    load_checkpoint,
    public_generator,
    resume_denoiser,
    save_checkpoint,
    save_denoiser,
)
from .spatial import polish_stage


def frequency_enabled(cfg: JobConfig) -> bool:
    return cfg.frequency.sigma is not None


def fit_aux(
    embedding: np.ndarray,
    cfg: JobConfig,
    image_shape: tuple[int, int, int],
    n_classes: int,
    n_public: int,
    device: torch.device,
    progress: Progress | None = None,
) -> AuxModel:
    """The aux generator fitted to a released (or federated, combined) embedding (``[auxgen] restarts``
    starts, the ``keep`` lowest-loss ones); its random features are the job's public ``[frequency]`` ones,
    which every site's release used."""
    fmap = job_feature_map(cfg.frequency, image_shape)
    return fit_aux_restarts(
        embedding,
        fmap,
        image_shape,
        n_classes,
        cfg,
        n_public,
        generator=public_generator(cfg, "auxgen"),
        device=device,
        progress=progress,
    )


def aux_images(aux: AuxModel, cfg: JobConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``[warmup] frequency_images`` images (and balanced labels) of the fitted aux generator."""
    return generate_aux_images(aux, cfg.warmup.frequency_images, public_generator(cfg, "auxgen-images"))


def warmup_set(
    images: torch.Tensor, labels: torch.Tensor, central: tuple[np.ndarray, np.ndarray] | None, cfg: JobConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the frequency warm-up trains on: the aux images (+ augmented released central images, see
    :func:`mix_central`)."""
    return mix_central(images, labels, central, cfg, public_generator(cfg, "freq-mix"))


def frequency_steps(n_images: int, cfg: JobConfig) -> int:
    """Optimiser steps of the frequency warm-up on ``n_images`` (0: it does not run)."""
    w = cfg.warmup
    return math.ceil(n_images / w.frequency_batch) * w.frequency_epochs if w.frequency_epochs > 0 else 0


def frequency_train(
    model: EDMDenoiser,
    images: torch.Tensor,
    labels: torch.Tensor,
    cfg: JobConfig,
    progress: Progress | None = None,
) -> WarmupResult | None:
    """Train ``model`` in place on the warm-up set; None when it has no steps."""
    if frequency_steps(len(labels), cfg) == 0:
        return None
    return frequency_warmup(
        model, images, labels, cfg, generator=public_generator(cfg, "freq-warmup"), progress=progress
    )


class FrequencyWarmup:
    name = "frequency-warmup"

    def enabled(self, cfg: JobConfig) -> bool:
        return frequency_enabled(cfg)

    def run(self, ctx: RunContext) -> None:
        if not resume_denoiser(ctx, "frequency", "frequency warm-up"):
            ctx.aux = _aux_generator(ctx)
            _warm_up(ctx, ctx.aux)
            save_denoiser(ctx, "frequency")
        stage_grid(ctx, "after-frequency", ctx.denoiser)


def trained_aux(ctx: RunContext) -> AuxModel:
    """The run's fitted aux generator: the frequency stage's, or its checkpoint when a resumed run skipped the
    stage (``auxgen.pt`` is saved before ``after-frequency.pt``, so a finished stage always left it)."""
    if ctx.aux is None:
        ctx.aux = _aux_generator(ctx)
    return ctx.aux


def aux_pool(aux: AuxModel, cfg: JobConfig) -> tuple[np.ndarray, np.ndarray]:
    """The release's fixed pool of aux-generator images: :data:`AUX_POOL_PER_CLASS` per class in class order,
    float32 in [0, 1] and int64 labels, from the PUBLIC generator ``aux-pool`` (both drivers draw it
    so). Privacy: the generator is a function of the noised frequency release and public randomness only:
    post-processing."""
    labels = np.repeat(np.arange(aux.n_classes, dtype=np.int64), AUX_POOL_PER_CLASS)
    return aux_draw(aux, labels, public_generator(cfg, "aux-pool")).numpy(), labels


def _aux_generator(ctx: RunContext) -> AuxModel:
    """Fitted to the released embedding (checkpointed: a resume does not fit it again)."""
    c, h, w = ctx.data.image_shape
    a = ctx.cfg.auxgen
    saved = load_checkpoint(ctx, "auxgen.pt")
    if saved is not None:
        aux = new_aux_model(c, h, ctx.data.n_classes, z_dim=a.z_dim, width=a.width, members=a.keep)
        aux.load_state_dict(saved["model"])
        return aux.to(ctx.device).eval()
    assert ctx.embedding is not None, "the aux generator is fitted after the frequency release"
    with ctx.rep.task("aux generator", a.restarts * a.epochs * aux_iterations(ctx.cfg, ctx.n_public)) as adv:
        aux = fit_aux(
            ctx.embedding,
            ctx.cfg,
            ctx.data.image_shape,
            ctx.data.n_classes,
            ctx.n_public,
            ctx.device,
            progress=lambda i, n, loss: adv(1, info=f"loss {loss:.3g}"),
        )
    save_checkpoint(ctx, "auxgen.pt", {"model": aux.state_dict()})
    return aux


def _warm_up(ctx: RunContext, aux: AuxModel) -> None:
    d = ctx.data
    images, labels = aux_images(aux, ctx.cfg)
    save_grid(
        images.numpy(),
        labels.numpy(),
        ctx.rd.root / "grids" / "auxgen-images.png",
        n_classes=d.n_classes,
        class_names=d.class_names,
        title="auxiliary generator images (post-processing of released statistics)",
    )
    images, labels = warmup_set(images, labels, ctx.central, ctx.cfg)
    steps = frequency_steps(len(labels), ctx.cfg)
    if steps > 0:
        with ctx.rep.task("frequency warm-up", steps) as adv:
            res = frequency_train(
                ctx.denoiser,
                images,
                labels,
                ctx.cfg,
                progress=lambda i, n, loss: adv(1, info=f"loss {loss:.3f}"),
            )
        assert res is not None
        ctx.mark("frequency", final_loss=res.final_loss, steps=res.steps)
    polish_stage(ctx)  # the last warm-up stage ends with the central polish ([warmup] polish_iterations)


def mix_central(
    images: torch.Tensor,
    labels: torch.Tensor,
    central: tuple[np.ndarray, np.ndarray] | None,
    cfg: JobConfig,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The frequency warm-up set: aux images, plus (``[warmup] frequency_mix_central``) as many RandAugment-ed
    copies of the released central images, cycled over them. Only released images are used:
    post-processing."""
    if not cfg.warmup.frequency_mix_central or central is None or len(labels) == 0:
        return images, labels
    idx = np.resize(np.arange(len(central[1])), len(labels))
    src = torch.from_numpy(np.asarray(central[0], np.float32)[idx])
    w = cfg.warmup
    aug = torch.cat(
        [
            rand_augment(
                src[i : i + 256], n_ops=w.augment_ops, magnitude_max=w.augment_magnitude, generator=generator
            )[0]
            for i in range(0, len(src), 256)
        ]
    )
    # both sets are in [0, 1]; the warm-up maps them to [-1, 1] itself
    return torch.cat([images, aug.to(images.dtype)]), torch.cat(
        [labels, torch.from_numpy(central[1][idx]).long()]
    )
