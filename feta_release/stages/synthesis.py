"""Stage 6: the synthetic set and the model file (sampling the trained model: post-processing)."""

from __future__ import annotations

import dataclasses
import hashlib
import math

import numpy as np
import torch

from ..config import JobConfig
from ..errors import DataError
from ..models.auxgen import AuxModel
from ..models.edm import EDMDenoiser, denoiser_spec
from ..models.model_file import MODEL_FILE, write_model_file
from ..models.sampler import generate
from ..release.jobfiles import RELEASED_AUX
from ..release.starts import aux_mask, cycle_index, index_within_class
from ..training.augment import rand_augment
from ..training.checkpoint import atomic_write_bytes, npz_bytes
from .context import RunContext, public_generator, seed_from
from .freq_warmup import aux_draw, aux_pool, trained_aux


class Synthesis:
    name = "synthesis"

    def enabled(self, cfg: JobConfig) -> bool:
        return True

    def run(self, ctx: RunContext) -> None:
        model = ctx.final_model or ctx.denoiser
        n = ctx.n_public if ctx.n_synthetic is None else int(ctx.n_synthetic)
        _write_synthetic(ctx, model, n)
        # the pool the release ships; its sha256 goes into the closed ledger record
        if ctx.cfg.sampler.uses_aux:
            images, labels = aux_pool(trained_aux(ctx), ctx.cfg)
            blob = npz_bytes(images=images, labels=labels)
            atomic_write_bytes(ctx.rd.root / RELEASED_AUX, blob)
            ctx.aux_pool_sha256 = hashlib.sha256(blob).hexdigest()
        d = ctx.data
        write_model_file(
            ctx.rd.root / MODEL_FILE,
            spec=denoiser_spec(ctx.cfg.model, d.image_shape, d.n_classes),
            state_dict=model.state_dict(),
            class_names=list(d.class_names),
            job_hash=ctx.state["job_hash"],
            sampler=ctx.cfg.to_dict()["sampler"],
        )


def sdedit_starts(
    central: tuple[np.ndarray, np.ndarray], labels: np.ndarray, cfg: JobConfig, generator: torch.Generator
) -> torch.Tensor:
    """SDEdit start images for ``labels``: RandAugment-ed released central images of each label, cycled over
    the class's images (the warm-up's augmentation; PUBLIC randomness). Post-processing of the release."""
    images, rel_labels = np.asarray(central[0], np.float32), np.asarray(central[1], np.int64)
    if missing := sorted(set(np.asarray(labels).tolist()) - set(rel_labels.tolist())):
        raise DataError(
            f"[sampler] start_sigma: no released central image of class {int(missing[0])}; leave "
            "start_sigma out"
        )
    idx = cycle_index(rel_labels, np.asarray(labels), index_within_class(labels))  # synthesize's cycling rule
    w = cfg.warmup
    return rand_augment(
        torch.from_numpy(images[idx]),
        n_ops=w.augment_ops,
        magnitude_max=w.augment_magnitude,
        generator=generator,
    )[0].clamp(0, 1)


def aux_taken(labels: np.ndarray, source: str) -> np.ndarray:
    """Which starts of the set with ``labels`` come from the aux generator: ``release.starts.aux_mask`` (the
    one mix rule, shared with ``synthesize``) over each image's index within its class."""
    return aux_mask(source, index_within_class(labels))


def aux_starts(
    aux: AuxModel,
    labels: np.ndarray,
    take: np.ndarray,
    central_init: torch.Tensor | None,
    generator: torch.Generator,
) -> torch.Tensor:
    """SDEdit starts where ``take`` (:func:`aux_taken`) from the aux generator, an image of the position's
    label drawn with ``generator`` (PUBLIC), in [0, 1]; the others stay ``central_init``'s augmented central
    images. Privacy: the aux generator was fitted to the noised frequency release only, so its images, like
    the central ones, are post-processing of a release: no privacy cost."""
    drawn = aux_draw(aux, labels[take], generator)
    if bool(take.all()):
        return drawn
    if central_init is None:
        raise DataError(
            '[sampler] start_source = "mix": no released central images for the other half; set '
            '[central] rounds > 0 or start_source = "aux"'
        )
    init = central_init.clone()
    init[torch.from_numpy(take)] = drawn.to(init.dtype)
    return init


def _write_synthetic(ctx: RunContext, model: EDMDenoiser, n: int) -> None:
    k, cfg = ctx.data.n_classes, ctx.cfg
    # Balanced: class c gets ceil or floor of n/k; interleave so a prefix is balanced too.
    labels = np.tile(np.arange(k, dtype=np.int64), math.ceil(n / k))[:n]
    scfg, gen, central = cfg.sampler, public_generator(cfg, "synthetic-starts"), ctx.central
    source = scfg.start_source if cfg.sampler.uses_aux else "central"
    # the aux generator and its own PUBLIC stream only for aux/mix: the central path draws exactly as before
    aux = trained_aux(ctx) if source != "central" else None
    aux_gen = public_generator(cfg, "synthetic-aux") if aux is not None else None
    # SDEdit: from the start level
    if scfg.start_sigma is not None and (central is not None or aux is not None):
        scfg = dataclasses.replace(scfg, sigma_max=scfg.start_sigma)
    else:
        central = None
    out = []
    take = aux_taken(labels, source) if aux is not None else None
    with ctx.rep.task("synthesis", n) as adv:
        for start in range(0, n, 256):
            part = labels[start : start + 256]
            init = None if central is None or source == "aux" else sdedit_starts(central, part, cfg, gen)
            if aux is not None and aux_gen is not None and take is not None:
                init = aux_starts(aux, part, take[start : start + 256], init, aux_gen)
            imgs, _ = generate(model, part, seed_from(cfg.job.seed, "synthetic", start), scfg, init=init)
            out.append(imgs.numpy().astype(np.float32))
            adv(len(part))
    images = np.concatenate(out) if out else np.zeros((0, *ctx.data.image_shape), np.float32)
    atomic_write_bytes(
        ctx.rd.root / "synthetic.npz",
        npz_bytes(images=images, labels=labels, class_names=np.array(ctx.data.class_names)),
    )
