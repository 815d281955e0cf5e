"""Warm-up on released statistics only (post-processing: no privacy cost), reusing the synthesizer's stages.

Central images: the sites' released images are averaged with public-size weights (``combine_central``), the
spatial stage trains on them. Frequency statistics: the sites' noisy embeddings are combined into one
(``mechanisms.combine_frequency``, weighted by public sizes) and the frequency stage fits the auxiliary
generator and warms the denoiser on its images.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..mechanisms.central import CentralRelease, combine_central, postprocess_central
from ..mechanisms.frequency import combine_frequency
from ..training.frequency import frequency_warmup_from_release
from ..training.spatial import spatial_warmup


def warm_up(model: Any, central: dict[str, dict[str, np.ndarray]], freq: dict[str, dict[str, np.ndarray]],
            cfg: Any, sizes: dict[str, int], shape: tuple[int, ...], n_classes: int,
            log: Callable[[str], None]) -> None:
    g = torch.Generator().manual_seed(cfg.job.seed + 17)
    if central and cfg.warmup.spatial_iterations > 0:
        images, labels = pooled_central(central, sizes)
        log(f"spatial warm-up on {len(images)} central images (combined from {len(central)} site(s)), "
            f"{cfg.warmup.spatial_iterations} iterations")
        every = max(1, cfg.warmup.spatial_iterations // 10)
        res = spatial_warmup(model, images, labels, cfg, generator=g,
                             progress=lambda i, n, loss: log(f"spatial {i}/{n} loss {loss:.4f}") if i % every == 0 else None)
        log(f"spatial warm-up done in {res.seconds:.1f} s (final loss {res.final_loss:.4f})")
    if freq and cfg.warmup.frequency_epochs > 0:
        sites = sorted(freq)
        release = combine_frequency([freq[s] for s in sites], [sizes[s] for s in sites])
        log(f"frequency warm-up: aux generator fit on the combined embedding of {len(sites)} site(s), then "
            f"{cfg.warmup.frequency_images} images x {cfg.warmup.frequency_epochs} epochs")
        res, _gen = frequency_warmup_from_release(model, release, cfg, generator=g)
        log(f"frequency warm-up done in {res.seconds:.1f} s (final loss {res.final_loss:.4f})")


def pooled_central(central: dict[str, dict[str, np.ndarray]], sizes: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """The sites' central images averaged with public-size weights, then post-processed (no privacy cost)."""
    sites = sorted(central)
    combined = combine_central([CentralRelease.from_arrays(central[s]) for s in sites], [sizes[s] for s in sites])
    return postprocess_central(combined)
