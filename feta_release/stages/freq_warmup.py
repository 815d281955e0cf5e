"""The aux generator fitted to the released embedding, and the frequency warm-up on its images (+
RandAugment-ed released central images when ``[warmup] frequency_mix_central``): post-processing only.

The computation is :func:`fit_aux` -> :func:`frequency_set` (:func:`aux_images` -> :func:`warmup_set`) ->
:func:`frequency_train`, run by the coordinator on the sites' combined embedding
(``feta_release.federation.warmup``). Each reports its progress to the sink it is given
(``progress_events``: the aux fit's steps, the set's images, the warm-up's steps).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..config import JobConfig
from ..mechanisms.feature_map import job_feature_map
from ..models.auxgen import AuxModel
from ..models.edm import EDMDenoiser
from ..progress_events import AUX_FIT, AUX_IMAGES, FREQUENCY_WARMUP, Meter, Sink
from ..release.jobfiles import AUX_POOL_PER_CLASS
from ..training.augment import rand_augment
from ..training.frequency import (
    aux_draw,
    aux_iterations,
    fit_aux_restarts,
    frequency_warmup,
    generate_aux_images,
)
from ..training.warmup_loop import WarmupResult
from .context import public_generator


def frequency_enabled(cfg: JobConfig) -> bool:
    return cfg.frequency.sigma is not None


def fit_aux(
    embedding: np.ndarray,
    cfg: JobConfig,
    image_shape: tuple[int, int, int],
    n_classes: int,
    n_public: int,
    device: torch.device,
    sink: Sink | None = None,
) -> AuxModel:
    """The aux generator fitted to a released (or federated, combined) embedding (``[auxgen] restarts``
    starts, the ``keep`` lowest-loss ones); its random features are the job's public ``[frequency]`` ones,
    which every site's release used. Its steps are reported to ``sink``."""
    fmap = job_feature_map(cfg.frequency, image_shape)
    a, iters = cfg.auxgen, aux_iterations(cfg, n_public)
    meter = Meter(
        sink,
        AUX_FIT,
        "steps",
        a.restarts * a.epochs * iters,
        f"fit to the released embedding (public size {n_public}): {a.restarts} fit(s) of {a.epochs} epochs "
        f"x {iters} steps",
    )
    aux = fit_aux_restarts(
        embedding,
        fmap,
        image_shape,
        n_classes,
        cfg,
        n_public,
        generator=public_generator(cfg, "auxgen"),
        device=device,
        progress=meter,
    )
    meter.end()
    return aux


def aux_images(
    aux: AuxModel, cfg: JobConfig, progress: Meter | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[warmup] frequency_images`` images (and balanced labels) of the fitted aux generator."""
    return generate_aux_images(
        aux, cfg.warmup.frequency_images, public_generator(cfg, "auxgen-images"), progress=progress
    )


def frequency_set(
    aux: AuxModel, central: tuple[np.ndarray, np.ndarray] | None, cfg: JobConfig, sink: Sink | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The frequency warm-up set (:func:`aux_images`, then :func:`warmup_set`), its images reported to
    ``sink``."""
    n = cfg.warmup.frequency_images
    mixed = cfg.warmup.frequency_mix_central and central is not None
    meter = Meter(
        sink,
        AUX_IMAGES,
        "images",
        2 * n if mixed else n,
        f"for the frequency warm-up: {n} aux-generator images"
        + (f" + {n} augmented central images" if mixed else ""),
    )
    out = warmup_set(*aux_images(aux, cfg, meter), central, cfg, meter)
    meter.end()
    return out


def warmup_set(
    images: torch.Tensor,
    labels: torch.Tensor,
    central: tuple[np.ndarray, np.ndarray] | None,
    cfg: JobConfig,
    progress: Meter | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the frequency warm-up trains on: the aux images (+ augmented released central images, see
    :func:`mix_central`)."""
    return mix_central(images, labels, central, cfg, public_generator(cfg, "freq-mix"), progress)


def frequency_steps(n_images: int, cfg: JobConfig) -> int:
    """Optimiser steps of the frequency warm-up on ``n_images`` (0: it does not run)."""
    w = cfg.warmup
    return math.ceil(n_images / w.frequency_batch) * w.frequency_epochs if w.frequency_epochs > 0 else 0


def frequency_train(
    model: EDMDenoiser,
    images: torch.Tensor,
    labels: torch.Tensor,
    cfg: JobConfig,
    sink: Sink | None = None,
) -> WarmupResult | None:
    """Train ``model`` in place on the warm-up set, its steps reported to ``sink``; None when it has no
    steps."""
    steps = frequency_steps(len(labels), cfg)
    if steps == 0:
        return None
    w = cfg.warmup
    meter = Meter(
        sink, FREQUENCY_WARMUP, "steps", steps, f"on {len(labels)} images x {w.frequency_epochs} epochs"
    )
    res = frequency_warmup(
        model, images, labels, cfg, generator=public_generator(cfg, "freq-warmup"), progress=meter
    )
    meter.end(f"final loss {res.final_loss:.4f}")
    return res


def aux_pool(aux: AuxModel, cfg: JobConfig) -> tuple[np.ndarray, np.ndarray]:
    """The release's fixed pool of aux-generator images: :data:`AUX_POOL_PER_CLASS` per class in class order,
    float32 in [0, 1] and int64 labels, from the PUBLIC generator ``aux-pool``. Privacy: the generator is a
    function of the noised frequency release and public randomness only: post-processing."""
    labels = np.repeat(np.arange(aux.n_classes, dtype=np.int64), AUX_POOL_PER_CLASS)
    return aux_draw(aux, labels, public_generator(cfg, "aux-pool")).numpy(), labels


def mix_central(
    images: torch.Tensor,
    labels: torch.Tensor,
    central: tuple[np.ndarray, np.ndarray] | None,
    cfg: JobConfig,
    generator: torch.Generator,
    progress: Meter | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The frequency warm-up set: aux images, plus (``[warmup] frequency_mix_central``) as many RandAugment-ed
    copies of the released central images, cycled over them. Only released images are used:
    post-processing. ``progress``: (images of the set made, of all) after each chunk."""
    if not cfg.warmup.frequency_mix_central or central is None or len(labels) == 0:
        return images, labels
    idx = np.resize(np.arange(len(central[1])), len(labels))
    src = torch.from_numpy(np.asarray(central[0], np.float32)[idx])
    w = cfg.warmup
    chunks = []
    for i in range(0, len(src), 256):
        chunks.append(
            rand_augment(
                src[i : i + 256], n_ops=w.augment_ops, magnitude_max=w.augment_magnitude, generator=generator
            )[0]
        )
        if progress is not None:
            progress(len(labels) + i + len(chunks[-1]), 2 * len(labels))
    aug = torch.cat(chunks)
    # both sets are in [0, 1]; the warm-up maps them to [-1, 1] itself
    return torch.cat([images, aug.to(images.dtype)]), torch.cat(
        [labels, torch.from_numpy(central[1][idx]).long()]
    )
