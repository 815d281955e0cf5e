"""Deterministic EDM sampling: Karras sigma schedule, Euler and Heun steps, classifier-free guidance.

Exact arithmetic (the ONNX release reproduces it step for step):

* schedule: ``t_i = (smax^(1/rho) + i/(N-1) (smin^(1/rho) - smax^(1/rho)))^rho`` for i < N, and ``t_N = 0``
  (N = 1 gives ``t_0 = smax``); computed in float64 then cast to float32.
* start: ``x_0 = noise * t_0`` with ``noise`` standard normal (B, C, H, W).
* guided denoiser: ``D_w(x, t, y) = D(x, t, y)`` if w == 0 else ``(1+w) D(x, t, y) - w D(x, t, null)``.
* one step, :func:`sampler_step` with ``(x, t_cur, t_next)``:
  ``d = (x - D_w(x, t_cur)) / t_cur``; ``x_e = x + (t_next - t_cur) * d``;
  Euler returns ``x_e``. Heun, when ``t_next > 0``: ``d2 = (x_e - D_w(x_e, t_next)) / t_next``,
  returns ``x + (t_next - t_cur) * (0.5 * d + 0.5 * d2)``. Heun's last step (``t_next == 0``) is an Euler
  step, so a branch-free export runs N-1 Heun steps then one Euler step.
* output: ``clamp((x_N + 1) / 2, 0, 1)``.

No stochastic churn: the map noise -> image is a pure function of the weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..allocator import release_freed_pages
from ..config import SamplerSection
from ..data.splits import balanced_labels
from ..errors import ConfigError
from .edm import EDMDenoiser

# the progress callback of a draw: (images done, images in all), after each batch (a progress_events.Meter)
Progress = Callable[[int, int], None]

# Noise is drawn in fixed blocks so the images of a seed do not depend on the generation batch size.
NOISE_BLOCK = 1024


def karras_sigmas(
    steps: int, sigma_min: float = 0.002, sigma_max: float = 80.0, rho: float = 7.0
) -> torch.Tensor:
    """float32 tensor of ``steps + 1`` noise levels from sigma_max down to sigma_min, then 0."""
    if steps < 1:
        raise ConfigError(f"[sampler] steps must be >= 1, got {steps}")
    if not 0 < sigma_min < sigma_max:
        raise ConfigError(f"[sampler] need 0 < sigma_min < sigma_max, got {sigma_min}, {sigma_max}")
    i = torch.arange(steps, dtype=torch.float64)
    if steps == 1:
        t = torch.tensor([float(sigma_max)], dtype=torch.float64)
    else:
        a, b = sigma_max ** (1.0 / rho), sigma_min ** (1.0 / rho)
        t = (a + i / (steps - 1) * (b - a)) ** rho
    return torch.cat([t, torch.zeros(1, dtype=torch.float64)]).to(torch.float32)


def guided_denoise(
    denoiser: EDMDenoiser, x: torch.Tensor, sigma: torch.Tensor, labels: torch.Tensor, guidance: float
) -> torch.Tensor:
    """``(1+w) D(x,y) - w D(x,null)``; exactly ``D(x,y)`` for w == 0 (one network call)."""
    sig = sigma.expand(x.shape[0]) if sigma.dim() == 0 else sigma
    if guidance == 0:
        return denoiser(x, sig, labels)
    null = torch.full_like(labels, denoiser.null_label)
    both = denoiser(torch.cat([x, x]), torch.cat([sig, sig]), torch.cat([labels, null]))
    cond, uncond = both.chunk(2)
    return (1.0 + guidance) * cond - guidance * uncond


def sampler_step(
    denoiser: EDMDenoiser,
    x: torch.Tensor,
    t_cur: torch.Tensor,
    t_next: torch.Tensor,
    labels: torch.Tensor,
    *,
    heun: bool,
    guidance: float = 0.0,
) -> torch.Tensor:
    """One deterministic step from noise level ``t_cur`` to ``t_next`` (0-d float32 tensors).

    ``heun`` must be False when ``t_next == 0`` (the caller knows: it is the last step).
    """
    d = (x - guided_denoise(denoiser, x, t_cur, labels, guidance)) / t_cur
    x_e = x + (t_next - t_cur) * d
    if not heun:
        return x_e
    d2 = (x_e - guided_denoise(denoiser, x_e, t_next, labels, guidance)) / t_next
    return x + (t_next - t_cur) * (0.5 * d + 0.5 * d2)


def sample(
    denoiser: EDMDenoiser,
    labels: torch.Tensor,
    noise: torch.Tensor,
    *,
    solver: str = "heun",
    steps: int = 18,
    guidance: float = 0.0,
    sigma_min: float = 0.002,
    sigma_max: float = 80.0,
    rho: float = 7.0,
    init: torch.Tensor | None = None,
) -> torch.Tensor:
    """Images in [0, 1] (B, C, H, W) from standard-normal ``noise``; deterministic given the noise.

    ``init`` (images in [0, 1], SDEdit): start from ``2 init - 1 + noise * sigma_max`` instead of pure noise,
    so the model denoises noised copies of given images (``[sampler] start_sigma``)."""
    if solver not in ("euler", "heun"):
        raise ConfigError(f"[sampler] solver must be 'euler' or 'heun', got {solver!r}")
    # a block, not torch's decorator (which made sample Any to mypy and its callers' arguments unchecked);
    # no_grad, not inference mode: the images go on as ordinary tensors (a start set, a grid, a test's
    # reference) and the denoiser may train on after a grid drawn mid-run
    with torch.no_grad():
        t = karras_sigmas(steps, sigma_min, sigma_max, rho).to(device=noise.device, dtype=noise.dtype)
        labels = labels.to(device=noise.device, dtype=torch.long)
        x = noise * t[0]
        if init is not None:
            x = x + (init.to(device=noise.device, dtype=noise.dtype) * 2.0 - 1.0)
        for i in range(steps):
            last = i == steps - 1
            x = sampler_step(
                denoiser, x, t[i], t[i + 1], labels, heun=(solver == "heun" and not last), guidance=guidance
            )
        return ((x + 1.0) / 2.0).clamp(0.0, 1.0)


def seeded_noise(seed: int, n: int, image_shape: Sequence[int]) -> torch.Tensor:
    """Standard-normal noise for ``n`` images, drawn in fixed blocks: a prefix of a larger draw."""
    g = torch.Generator().manual_seed(int(seed))
    blocks = []
    left = n
    while left > 0:
        block = torch.randn((NOISE_BLOCK, *image_shape), generator=g)
        blocks.append(block[: min(left, NOISE_BLOCK)])
        left -= NOISE_BLOCK
    if not blocks:
        return torch.zeros((0, *image_shape))
    return torch.cat(blocks)


def generate(
    denoiser: EDMDenoiser,
    labels: int | Sequence[int] | np.ndarray | torch.Tensor,
    seed: int,
    sampler_cfg: SamplerSection,
    batch: int = 256,
    *,
    progress: Progress | None = None,
    init: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample images for ``labels`` (or ``n_per_class`` images of every class when an int).

    Returns ``(images float32 (N,C,H,W) in [0,1] on CPU, labels int64 (N,))``. The result depends only
    on (weights, labels, seed, sampler settings), not on ``batch`` (up to float rounding of batched convs).
    ``progress(done, total)`` is optional. ``init`` (N, C, H, W) in [0, 1]: SDEdit start images
    (see :func:`sample`).
    """
    if isinstance(labels, int):
        labels_t = torch.from_numpy(balanced_labels(labels * denoiser.n_classes, denoiser.n_classes))
    else:
        labels_t = torch.as_tensor(np.asarray(labels), dtype=torch.long).reshape(-1)
    if labels_t.numel() and (labels_t.min() < 0 or labels_t.max() > denoiser.n_classes):
        raise ConfigError(f"labels must be in [0, {denoiser.n_classes}] (the last is the null label)")
    was_training = denoiser.training
    denoiser.eval()
    try:
        # a block, not torch's decorator: torch is untyped here (mypy skips it), and the decorated function
        # was Any to every caller, so none of its arguments (``progress`` included) was checked
        with torch.no_grad():
            out = _sample_batches(denoiser, labels_t, seed, sampler_cfg, batch, progress, init)
    finally:
        denoiser.train(was_training)
    images = torch.cat(out) if out else torch.zeros((0, *denoiser.image_shape))
    # the batches' copies (and, in _sample_batches, the draw's noise) are freed before the trim, so that
    # their pages go back with the sampler's: trimmed with them alive, a draw of 8,000 64 px images (125 MiB)
    # ended 363 MiB above its start, now 121 (feta_release.allocator)
    del out
    release_freed_pages()
    return images, labels_t


def _sample_batches(
    denoiser: EDMDenoiser,
    labels_t: torch.Tensor,
    seed: int,
    sampler_cfg: SamplerSection,
    batch: int,
    progress: Progress | None,
    init: torch.Tensor | None,
) -> list[torch.Tensor]:
    """:func:`generate`'s images, batch by batch on the CPU (the denoiser in eval mode)."""
    n = labels_t.numel()
    noise = seeded_noise(seed, n, denoiser.image_shape)
    device = next(denoiser.parameters()).device
    out = []
    for start in range(0, n, batch):
        stop = min(n, start + batch)
        imgs = sample(
            denoiser,
            labels_t[start:stop].to(device),
            noise[start:stop].to(device),
            solver=sampler_cfg.solver,
            steps=sampler_cfg.steps,
            guidance=sampler_cfg.guidance,
            sigma_min=sampler_cfg.sigma_min,
            sigma_max=sampler_cfg.sigma_max,
            rho=sampler_cfg.rho,
            init=None if init is None else init[start:stop],
        )
        out.append(imgs.cpu())
        if progress is not None:
            progress(stop, n)
    return out
