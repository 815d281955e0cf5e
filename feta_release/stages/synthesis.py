"""Stage 6: the synthetic set and the model file (sampling the trained model: post-processing)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from ..config import JobConfig
from ..errors import DataError
from ..models.edm import EDMDenoiser, denoiser_spec
from ..models.sampler import generate
from ..training.augment import rand_augment
from ..training.checkpoint import MODEL_FILE, atomic_write_bytes, npz_bytes, write_model_file
from .context import RunContext, public_generator, seed_from


class Synthesis:
    name = "synthesis"

    def enabled(self, cfg: JobConfig) -> bool:
        return True

    def run(self, ctx: RunContext) -> None:
        model = ctx.final_model or ctx.denoiser
        n = ctx.n_public if ctx.n_synthetic is None else int(ctx.n_synthetic)
        _write_synthetic(ctx, model, n)
        d = ctx.data
        write_model_file(ctx.rd.root / MODEL_FILE, spec=denoiser_spec(ctx.cfg.model, d.image_shape, d.n_classes),
                         state_dict=model.state_dict(), class_names=list(d.class_names),
                         job_hash=ctx.state["job_hash"], sampler=ctx.cfg.to_dict()["sampler"])


def release_starts(central: tuple[np.ndarray, np.ndarray], labels: np.ndarray, cfg: JobConfig,
                   generator: torch.Generator) -> torch.Tensor:
    """SDEdit start images for ``labels``: RandAugment-ed released central images of each label, cycled over the
    class's images (the warm-up's augmentation; PUBLIC randomness). Post-processing of the release."""
    images, rel_labels = np.asarray(central[0], np.float32), np.asarray(central[1], np.int64)
    pos = np.zeros(int(rel_labels.max()) + 1, np.int64)
    idx = np.empty(len(labels), np.int64)
    for i, c in enumerate(labels):
        own = np.flatnonzero(rel_labels == c)
        if own.size == 0:
            raise DataError(f"[sampler] start_sigma: no released central image of class {int(c)}; leave start_sigma out")
        idx[i], pos[c] = own[pos[c] % own.size], pos[c] + 1
    w = cfg.warmup
    return rand_augment(torch.from_numpy(images[idx]), n_ops=w.augment_ops, magnitude_max=w.augment_magnitude,
                        generator=generator)[0].clamp(0, 1)


def _write_synthetic(ctx: RunContext, model: EDMDenoiser, n: int) -> None:
    k, cfg = ctx.data.n_classes, ctx.cfg
    # Balanced: class c gets ceil or floor of n/k; interleave so a prefix is balanced too.
    labels = np.tile(np.arange(k, dtype=np.int64), math.ceil(n / k))[:n]
    scfg, gen, central = cfg.sampler, public_generator(cfg, "synthetic-starts"), ctx.central
    if scfg.start_sigma is not None and central is not None:  # SDEdit: denoise from the start level only
        scfg = dataclasses.replace(scfg, sigma_max=scfg.start_sigma)
    else:
        central = None
    out = []
    with ctx.rep.task("synthesis", n) as adv:
        for start in range(0, n, 256):
            part = labels[start:start + 256]
            init = None if central is None else release_starts(central, part, cfg, gen)
            imgs, _ = generate(model, part, seed_from(cfg.job.seed, "synthetic", start), scfg, init=init)
            out.append(imgs.numpy().astype(np.float32))
            adv(len(part))
    images = np.concatenate(out) if out else np.zeros((0, *ctx.data.image_shape), np.float32)
    atomic_write_bytes(ctx.rd.root / "synthetic.npz",
                       npz_bytes(images=images, labels=labels, class_names=np.array(ctx.data.class_names)))
