"""The ordinary (non-private) denoiser training loop shared by the spatial and frequency warm-ups.

Warm-up data are already private (noisy central images, or images of a generator fitted to noisy
statistics), so this is plain Adam on the EDM loss with label dropout, plus an EMA whose weights
are copied into the denoiser at the end (the weights the next stage starts from).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from ..allocator import release_freed_pages
from ..errors import DataError
from ..models.edm import EDMDenoiser, edm_loss
from .ema import EMA

Progress = Callable[[int, int, float], None]  # (step done, total steps, loss of that step)


@dataclass
class WarmupResult:
    stage: str
    steps: int
    examples: int
    seconds: float
    losses: list[float] = field(default_factory=list)  # mean loss of every step, in order

    @property
    def final_loss(self) -> float:
        """Mean loss over the last 10% of steps (a single step's loss is too noisy to compare)."""
        if not self.losses:
            return float("nan")
        tail = self.losses[-max(1, len(self.losses) // 10) :]
        return float(np.mean(tail))


def as_image_tensors(images, labels, n_classes: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate and convert (images in [0,1] (N,C,H,W), labels (N,)) from numpy or torch."""
    x = torch.as_tensor(np.asarray(images) if not isinstance(images, torch.Tensor) else images)
    y = torch.as_tensor(np.asarray(labels) if not isinstance(labels, torch.Tensor) else labels)
    if x.dim() != 4 or y.dim() != 1 or x.shape[0] != y.shape[0]:
        raise DataError(
            f"{where}: need images (N, C, H, W) and labels (N,), got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    if x.shape[0] == 0:
        raise DataError(f"{where}: no training images")
    x = x.to(torch.float32)
    if not torch.isfinite(x).all() or x.min() < 0 or x.max() > 1:
        raise DataError(f"{where}: pixels must be finite and in [0, 1]")
    y = y.to(torch.long)
    if y.min() < 0 or y.max() >= n_classes:
        raise DataError(
            f"{where}: labels must be in [0, {n_classes}), got range [{int(y.min())}, {int(y.max())}]"
        )
    return x, y


def train_denoiser(
    denoiser: EDMDenoiser,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    total_steps: int,
    *,
    stage: str,
    lr: float,
    ema_decay: float,
    label_dropout: float,
    generator: torch.Generator,
    progress: Progress | None = None,
) -> WarmupResult:
    """``total_steps`` Adam steps on batches of (x in [-1,1], labels); EMA weights copied in at the end."""
    device = next(denoiser.parameters()).device
    opt = torch.optim.Adam(denoiser.parameters(), lr=lr)
    ema = EMA(denoiser, ema_decay)
    result = WarmupResult(stage=stage, steps=0, examples=0, seconds=0.0)
    t0 = time.perf_counter()
    denoiser.train()
    for step in range(total_steps):
        x, y = next(batches)
        x, y = x.to(device), y.to(device)
        loss = edm_loss(denoiser, x, y, label_dropout=label_dropout, generator=generator).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"{stage} warm-up: loss became {loss.item()} at step {step + 1}; lower the lr"
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ema.update(denoiser)
        value = float(loss.detach())
        result.losses.append(value)
        result.steps += 1
        result.examples += int(x.shape[0])
        if progress is not None:
            progress(step + 1, total_steps, value)
    if total_steps > 0:
        ema.copy_to(denoiser)
    release_freed_pages()  # the next stage's blocks differ in size: hand these back (feta_release.allocator)
    result.seconds = time.perf_counter() - t0
    return result
