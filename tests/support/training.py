"""Tiny models and data for the training tests: a small UNet, two-class bar images, a subset of the embedded
digits and a frequency release of the bars."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from feta_release.config import JobConfig, ModelSection
from feta_release.data import ImageDataset, load_embedded
from feta_release.mechanisms.frequency import frequency_statistics
from feta_release.models import EDMDenoiser, build_denoiser, draw_loss_randomness, edm_loss_from_randomness

TINY = ModelSection(channels=8, channel_mult=(1, 2), num_res_blocks=1, attn_resolutions=(8,))
AUX = {"width": 8, "batch": 20, "epochs": 3, "iterations_per_epoch": 30, "lr": 0.01, "z_dim": 8}


def tiny_denoiser(seed: int = 0, size: int = 16, channels: int = 1) -> EDMDenoiser:
    torch.manual_seed(seed)
    d = build_denoiser(TINY, (channels, size, size), 3)
    # Zero-initialised output convs make F == 0 at start; perturb so tests see a real network.
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return d


def embedded_subset(n: int = 240, seed: int = 0) -> ImageDataset:
    full = load_embedded()
    rng = np.random.default_rng(seed)
    # stratified so every class is present
    idx = np.concatenate(
        [rng.choice(np.flatnonzero(full.labels == c), n // 10, replace=False) for c in range(10)]
    )
    return full.subset(np.sort(idx))


def bars(n_per_class: int = 3, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Class 0: a horizontal bar, class 1: a vertical bar (positions vary)."""
    imgs, labels = [], []
    for i in range(n_per_class):
        for c in range(2):
            x = torch.zeros(1, size, size)
            p = 4 + 3 * i
            if c == 0:
                x[:, p : p + 2, 2:-2] = 1.0
            else:
                x[:, 2:-2, p : p + 2] = 1.0
            imgs.append(x)
            labels.append(c)
    return torch.stack(imgs), torch.tensor(labels)


def job(**sections) -> JobConfig:
    """A valid JobConfig (the bare defaults leave [dpsgd] steps/epochs open) with overrides."""
    return JobConfig().replace(**{"dpsgd": {"steps": 1}, **sections})


def fixed_noise_loss(d, x01: torch.Tensor, y: torch.Tensor) -> float:
    rnd = draw_loss_randomness(
        x01.shape[0],
        tuple(x01.shape[1:]),
        noise_multiplicity=16,
        label_dropout=0.0,
        generator=torch.Generator().manual_seed(123),
    )
    with torch.no_grad():
        return edm_loss_from_randomness(d, x01 * 2 - 1, y, rnd).mean().item()


def frequency_release(sigma: float = 0.01):
    """A frequency release of ``bars(3, size=8)``, with those bars."""
    x, y = bars(3, size=8)
    rel, _ = frequency_statistics(
        x.numpy(),
        y.numpy(),
        2,
        features=400,
        sigma=sigma,
        bandwidth2=8.0,
        seed=1,
        n_public=len(y),
        rng=np.random.default_rng(0),
    )
    return rel, x, y


def train_run(cfg: JobConfig, data: ImageDataset, out: Any, **options: Any) -> Any:
    """``feta-release train``'s run (``coordinator.local_run.run_train``) with ``TrainOptions`` fields as
    keywords; small grids and no synthetic set unless asked."""
    from coordinator.local_run import TrainOptions, run_train

    opts = {"grid_per_class": 1, "n_synthetic": 0, **options}
    return run_train(cfg, data, Path(out), TrainOptions(**opts))


def site_requests(run_dir: Any, job_id: str | None = None) -> list[dict[str, Any]]:
    """The requests a ``train`` run's site ledger holds (its own job's, or ``job_id``'s)."""
    import json

    from feta_release.ledger import Ledger

    root = Path(run_dir)
    if job_id is None:
        job_id = json.loads((root / "signed_job.json").read_text("utf-8"))["job"]["job_id"]
    with Ledger(root / "site" / "ledger.sqlite") as led:
        return led.requests(job_id)
