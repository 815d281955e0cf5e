"""Stage 4: the aux generator fitted to the released embedding, and the frequency warm-up on its images
(+ RandAugment-ed released central images when ``[warmup] frequency_mix_central``): post-processing only."""

from __future__ import annotations

import math

import numpy as np
import torch

from ..config import JobConfig
from ..mechanisms.frequency import rff_frequencies
from ..models.auxgen import AuxGenerator
from ..training.augment import rand_augment
from ..training.checkpoint import load_torch, save_torch
from ..training.frequency import fit_aux_generator, frequency_warmup, generate_aux_images
from ..viz import save_grid
from .base import sample_grid
from .context import RunContext


class FrequencyWarmup:
    name = "frequency-warmup"

    def enabled(self, cfg: JobConfig) -> bool:
        return cfg.frequency.sigma is not None

    def run(self, ctx: RunContext) -> None:
        ck = ctx.rd.ckpt("after-frequency.pt")
        if ck.exists():
            ctx.denoiser.load_state_dict(load_torch(ck)["model"])
            ctx.rep.log("frequency warm-up: loaded from checkpoint")
        else:
            _warm_up(ctx, _aux_generator(ctx))
            save_torch(ck, {"model": ctx.denoiser.state_dict()})
        sample_grid(ctx, "after-frequency", ctx.denoiser)


def _aux_generator(ctx: RunContext) -> AuxGenerator:
    """Fitted to the released embedding (checkpointed: a resume does not fit it again)."""
    c, h, w = ctx.data.image_shape
    f, a = ctx.cfg.frequency, ctx.cfg.auxgen
    gen_ck = ctx.rd.ckpt("auxgen.pt")
    if gen_ck.exists():
        aux = AuxGenerator(c, h, ctx.data.n_classes, z_dim=a.z_dim, width=a.width)
        aux.load_state_dict(load_torch(gen_ck)["model"])
        return aux.to(ctx.device).eval()
    assert ctx.embedding is not None, "the aux generator is fitted after the frequency release"
    omega = rff_frequencies(c * h * w, f.features, f.bandwidth2, f.seed)
    iters = a.iterations_per_epoch if a.iterations_per_epoch is not None else max(1, ctx.n_public // a.batch)
    with ctx.rep.task("aux generator", a.epochs * iters) as adv:
        aux = fit_aux_generator(ctx.embedding, omega, ctx.data.image_shape, ctx.data.n_classes, ctx.cfg,
                                ctx.n_public, generator=ctx.public_gen("auxgen"), device=ctx.device,
                                progress=lambda i, n, loss: adv(1, info=f"loss {loss:.3g}"))
    save_torch(gen_ck, {"model": aux.state_dict()})
    return aux


def _warm_up(ctx: RunContext, aux: AuxGenerator) -> None:
    w, d = ctx.cfg.warmup, ctx.data
    images, labels = generate_aux_images(aux, w.frequency_images, ctx.public_gen("auxgen-images"))
    save_grid(images.numpy(), labels.numpy(), ctx.rd.root / "grids" / "auxgen-images.png", n_classes=d.n_classes,
              class_names=d.class_names, title="auxiliary generator images (post-processing of released statistics)")
    images, labels = mix_central(images, labels, ctx.central, ctx.cfg, ctx.public_gen("freq-mix"))
    if w.frequency_epochs > 0 and len(labels) > 0:
        total = math.ceil(len(labels) / w.frequency_batch) * w.frequency_epochs
        with ctx.rep.task("frequency warm-up", total) as adv:
            res = frequency_warmup(ctx.denoiser, images, labels, ctx.cfg, generator=ctx.public_gen("freq-warmup"),
                                   progress=lambda i, n, loss: adv(1, info=f"loss {loss:.3f}"))
        ctx.mark("frequency", final_loss=res.final_loss, steps=res.steps)


def mix_central(images: torch.Tensor, labels: torch.Tensor, central: tuple[np.ndarray, np.ndarray] | None,
                cfg: JobConfig, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The frequency warm-up set: aux images, plus (``[warmup] frequency_mix_central``) as many RandAugment-ed
    copies of the released central images, cycled over them. Only released images are used: post-processing."""
    if not cfg.warmup.frequency_mix_central or central is None or len(labels) == 0:
        return images, labels
    idx = np.resize(np.arange(len(central[1])), len(labels))
    src = torch.from_numpy(np.asarray(central[0], np.float32)[idx])
    w = cfg.warmup
    aug = torch.cat([rand_augment(src[i : i + 256], n_ops=w.augment_ops, magnitude_max=w.augment_magnitude,
                                  generator=generator)[0] for i in range(0, len(src), 256)])
    # both sets are in [0, 1]; the warm-up maps them to [-1, 1] itself
    return torch.cat([images, aug.to(images.dtype)]), torch.cat([labels, torch.from_numpy(central[1][idx]).long()])
