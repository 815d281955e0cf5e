"""Stage 6: the synthetic set and the model file (sampling the trained model: post-processing)."""

from __future__ import annotations

import math

import numpy as np

from ..config import JobConfig
from ..models.edm import EDMDenoiser, denoiser_spec
from ..models.sampler import generate
from ..training.checkpoint import MODEL_FILE, atomic_write_bytes, npz_bytes, write_model_file
from .context import RunContext, seed_from


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


def _write_synthetic(ctx: RunContext, model: EDMDenoiser, n: int) -> None:
    k, cfg = ctx.data.n_classes, ctx.cfg
    # Balanced: class c gets ceil or floor of n/k; interleave so a prefix is balanced too.
    labels = np.tile(np.arange(k, dtype=np.int64), math.ceil(n / k))[:n]
    out = []
    with ctx.rep.task("synthesis", n) as adv:
        for start in range(0, n, 256):
            part = labels[start:start + 256]
            imgs, _ = generate(model, part, seed_from(cfg.job.seed, "synthetic", start), cfg.sampler)
            out.append(imgs.numpy().astype(np.float32))
            adv(len(part))
    images = np.concatenate(out) if out else np.zeros((0, *ctx.data.image_shape), np.float32)
    atomic_write_bytes(ctx.rd.root / "synthetic.npz",
                       npz_bytes(images=images, labels=labels, class_names=np.array(ctx.data.class_names)))
