"""Warm-up on released statistics only (post-processing: no privacy cost), reusing the synthesizer's stages.

Central images: every site's released images are pooled (``mechanisms.combine_central``) and the
spatial stage trains on them. Frequency statistics: the sites' noisy embeddings are combined into one
(``mechanisms.combine_frequency``, weighted by public sizes) and the frequency stage fits the auxiliary
generator and warms the denoiser on its images.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def warm_up(model: Any, central: dict[str, dict[str, np.ndarray]], freq: dict[str, dict[str, np.ndarray]],
            cfg: Any, sizes: dict[str, int], shape: tuple[int, ...], n_classes: int,
            log: Callable[[str], None]) -> None:
    import torch

    g = torch.Generator().manual_seed(cfg.job.seed + 17)
    if central and cfg.warmup.spatial_iterations > 0:
        from ..training.spatial import spatial_warmup

        images, labels = pooled_central(central, cfg)
        log(f"spatial warm-up on {len(images)} central images from {len(central)} site(s), "
            f"{cfg.warmup.spatial_iterations} iterations")
        every = max(1, cfg.warmup.spatial_iterations // 10)
        res = spatial_warmup(model, images, labels, cfg, generator=g,
                             progress=lambda i, n, loss: log(f"spatial {i}/{n} loss {loss:.4f}") if i % every == 0 else None)
        log(f"spatial warm-up done in {res.seconds:.1f} s (final loss {res.final_loss:.4f})")
    if freq and cfg.warmup.frequency_epochs > 0:
        from ..training.frequency import frequency_warmup  # type: ignore[import-not-found]

        stats = combined_frequency(freq, sizes, cfg)
        log(f"frequency warm-up from {len(freq)} site(s)' statistics")
        frequency_warmup(model, stats, cfg, generator=g, progress=None)


def pooled_central(central: dict[str, dict[str, np.ndarray]], cfg: Any) -> tuple[np.ndarray, np.ndarray]:
    """All sites' released central images (post-processed), in site order."""
    from .. import mechanisms

    parts = [central[s] for s in sorted(central)]
    combine = getattr(mechanisms, "combine_central", None)
    if combine is not None:
        out = combine(parts, cfg.central) if _arity(combine) > 1 else combine(parts)
        return np.asarray(out[0]), np.asarray(out[1])
    return (np.concatenate([p["images"] for p in parts]), np.concatenate([p["labels"] for p in parts]))


def combined_frequency(freq: dict[str, dict[str, np.ndarray]], sizes: dict[str, int], cfg: Any) -> Any:
    from .. import mechanisms

    sites = sorted(freq)
    return mechanisms.combine_frequency([freq[s] for s in sites], [sizes[s] for s in sites])


def _arity(f: Callable[..., Any]) -> int:
    import inspect

    return len([p for p in inspect.signature(f).parameters.values() if p.default is inspect.Parameter.empty])
