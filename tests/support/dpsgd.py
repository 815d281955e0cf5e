"""Toy models, losses and batches for the DP-SGD and per-example gradient tests: small enough that every
per-example vector can be checked against its closed form or the torch.func one."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import torch
from torch import Tensor, nn

from feta_release.config import JobConfig
from feta_release.privacy_unit import group_patient_rows
from feta_release.training.ghost_clip import K_MAJOR

SHAPE = (1, 6, 6)


class TinyDenoiser(nn.Module):
    """EDMDenoiser-shaped toy: forward(x, sigma, labels) with a class embedding (null label = n_classes)."""

    def __init__(self, n_classes: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.emb = nn.Embedding(n_classes + 1, 4)
        self.out = nn.Conv2d(4, 1, 3, padding=1)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.conv(x)) + self.emb(labels)[:, :, None, None] + sigma.log()[:, None, None, None]
        return self.out(torch.tanh(h))


def dpsgd_job(**dpsgd) -> JobConfig:
    base = {"batch": 4, "steps": 3, "physical_batch": 3, "noise_multiplicity": 2, "clip": 1.0, "lr": 1e-2}
    return JobConfig().replace(dpsgd={**base, **dpsgd})


def dpsgd_batch(n: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, *SHAPE, generator=g) * 2 - 1, torch.randint(0, 3, (n,), generator=g)


def random_site(n: int, seed: int, cfg: JobConfig) -> tuple[SimpleNamespace, dict[str, np.ndarray]]:
    """A site of ``n`` random 1x16x16 images of 10 classes (the fields ``edge.releases.dpsgd_round`` reads),
    and the initial weights of ``cfg``'s model for it."""
    from feta_release.models import build_denoiser

    rng = np.random.default_rng(seed)
    ds = SimpleNamespace(
        images=rng.random((n, 1, 16, 16), dtype=np.float32),
        labels=rng.integers(0, 10, n),
        image_shape=(1, 16, 16),
        n_classes=10,
    )
    weights = {k: v.numpy() for k, v in build_denoiser(cfg.model, ds.image_shape, 10).state_dict().items()}
    return ds, weights


class Weights(nn.Module):
    """Only parameter w in R^d; with DotLoss an example x has gradient exactly x."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w


class DotLoss:
    def draw(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        return {"unused": torch.zeros(n)}

    def __call__(self, model, x, y, rand):  # noqa: ANN001, ANN204
        return (model(x) * x).sum()


def patient_layout_bound() -> int:
    """The public row bound of the step :func:`patient_layouts_work` runs (12 images, 6 patients, cap 3, q
    2/6)."""
    from feta_release.training.padding import step_bound

    return step_bound(12, 2 / 6, 3, SimpleNamespace(cap=3))


def patient_layouts_work(counted: list[int], seeds: int) -> set[tuple[int, int]]:
    """One padded patient-level step per private layout of 6 patients' 12 images (all single, all pairs, 3+1
    alternating) and per seed: the set of (sum, count) of what a spy appended to ``counted`` during each step
    (rows per call, rows per clip...). One element: the work does not depend on the layout."""
    import feta_release.training.dpsgd as dp

    bound, seen = patient_layout_bound(), set()
    for sizes in ([1] * 6, [2] * 6, [3, 1] * 3):
        for seed in range(seeds):
            ids = np.repeat(np.arange(len(sizes)), sizes)
            x, y = dpsgd_batch(len(ids), seed=seed)
            torch.manual_seed(0)
            tr = dp.DPSGDTrainer(
                TinyDenoiser(),
                dpsgd_job(batch=2, physical_batch=3),
                1.3,
                2 / 6,
                torch.Generator().manual_seed(seed),
                image_shape=SHAPE,
                n_classes=3,
                n_public=6,
                patient_rows=group_patient_rows(ids),
                images_per_patient=3,
                pad_to=bound,
            )
            counted.clear()
            tr.noisy_gradient(x, y)
            seen.add((sum(counted), len(counted)))
    return seen


def assert_same_gradients(a: dict[str, Tensor], b: dict[str, Tensor], rtol: float = 1e-4) -> None:
    """Equal up to float32 rounding, relative to the largest entry of the whole gradient (a parameter whose
    exact gradient is 0, e.g. a conv bias a GroupNorm cancels, holds rounding noise of that size in both
    paths)."""
    assert list(a) == list(b)
    scale = max(float(v.abs().max()) for v in b.values()) + 1e-8
    for n in b:
        assert a[n].shape == b[n].shape, n
        assert float((a[n] - b[n]).abs().max()) <= rtol * scale, n


class LayerStack(nn.Module):
    """Conv2d -> GroupNorm -> tanh -> Linear over a sequence axis, plus an Embedding of the label: every
    rule."""

    def __init__(
        self,
        c: int,
        kernel: int,
        stride: int,
        padding: int,
        dilation: int,
        bias: bool,
        groups: int,
        padding_idx: int | None,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, c, kernel, stride=stride, padding=padding, dilation=dilation, bias=bias)
        self.norm = nn.GroupNorm(groups, c, affine=True)
        self.lin = nn.Linear(c, 3, bias=bias)
        self.emb = nn.Embedding(4, 3, padding_idx=padding_idx)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_()

    def forward(self, x: Tensor, sigma: Tensor, labels: Tensor) -> Tensor:
        h = torch.tanh(self.norm(self.conv(x * sigma[:, None, None, None])))  # (R, c, h, w)
        seq = h.flatten(2).transpose(1, 2)  # (R, positions, c): a Linear over a sequence axis
        return self.lin(seq).sum(1) * self.emb(labels)  # (R, 3)


class RowLoss:
    """K rows per example (noise + sigma per row), loss = mean over rows of sum(out^2): a BatchedLoss."""

    row_order = K_MAJOR

    def __init__(self, k: int) -> None:
        self.k = k

    def draw(self, n: int, generator: torch.Generator) -> dict[str, Tensor]:
        return {
            "noise": torch.randn(n, self.k, 2, 7, 7, generator=generator),
            "sigma": torch.rand(n, self.k, generator=generator) + 0.5,
        }

    def __call__(self, model: Callable[..., Tensor], x: Tensor, y: Tensor, rand: dict[str, Tensor]) -> Tensor:
        out = model(x.unsqueeze(0) + rand["noise"], rand["sigma"], y.reshape(1).expand(self.k))
        return out.pow(2).sum(1).mean()

    def batched(self, model: Callable[..., Tensor], x: Tensor, y: Tensor, rand: dict[str, Tensor]) -> Tensor:
        b = x.shape[0]  # K-major rows: row k*b + i is copy k of example i
        rows = (x.unsqueeze(0) + rand["noise"].transpose(0, 1)).reshape(b * self.k, *x.shape[1:])
        out = model(rows, rand["sigma"].t().reshape(-1), y.unsqueeze(0).expand(self.k, b).reshape(-1))
        return out.pow(2).sum(1).reshape(self.k, b).mean(0)


class InPlaceAfterLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(2 * 7 * 7, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor, sigma: Tensor, labels: Tensor) -> Tensor:
        return self.out(torch.nn.functional.silu(self.lin(x.flatten(1) * sigma[:, None]), inplace=True))
