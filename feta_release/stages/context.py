"""The public seeding rule every computation on released statistics shares.

Randomness: the public ``[job] seed`` drives model init, warm-up training, sampling and every other draw
that is post-processing (:func:`public_generator`); all noise that protects the site's images is drawn on
the site from fresh OS bits (``edge.protocol.ReleaseRng``), never from a seed.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from ..config import JobConfig
from ..models.edm import EDMDenoiser, build_denoiser


def seed_from(*parts: Any) -> int:
    h = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def public_generator(cfg: JobConfig, name: str) -> torch.Generator:
    """PUBLIC randomness of one named use (model init, warm-ups, sampling), from ``[job] seed``: the one
    seeding rule, so the coordinator's warm-up is a public function of the releases."""
    return torch.Generator().manual_seed(seed_from(cfg.job.seed, name))


def initial_denoiser(cfg: JobConfig, image_shape: tuple[int, int, int], n_classes: int) -> EDMDenoiser:
    """The denoiser before any stage (its weights from the public seed)."""
    torch.manual_seed(seed_from(cfg.job.seed, "init"))
    return build_denoiser(cfg.model, image_shape, n_classes)
