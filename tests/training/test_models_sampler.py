"""Karras schedule, Euler/Heun sampling, guidance, determinism."""

from __future__ import annotations

import math

import pytest
import torch

from feta_release.config import SamplerSection
from feta_release.errors import ConfigError
from feta_release.models import generate, karras_sigmas, sample, sampler_step
from feta_release.models.sampler import guided_denoise
from tests.support.single_thread import single_thread  # noqa: F401  (autouse fixture)
from tests.support.training import tiny_denoiser


class GaussianDenoiser(torch.nn.Module):
    """Exact denoiser for data ~ N(0, s^2 I): D(x, sigma) = s^2 / (s^2 + sigma^2) x (labels ignored)."""

    n_classes = 2
    null_label = 2

    def __init__(self, s: float) -> None:
        super().__init__()
        self.s = s

    def forward(self, x, sigma, labels):
        sig = sigma.reshape(-1, 1, 1, 1)
        return self.s**2 / (self.s**2 + sig**2) * x


def test_karras_schedule_endpoints_and_monotone() -> None:
    t = karras_sigmas(18, 0.002, 80.0, 7.0)
    assert t.shape == (19,) and t.dtype == torch.float32
    assert t[0].item() == pytest.approx(80.0) and t[-2].item() == pytest.approx(0.002) and t[-1] == 0
    assert (t[:-1] > t[1:]).all()
    # rho = 1 is a linear ramp.
    assert torch.allclose(karras_sigmas(5, 1.0, 5.0, 1.0)[:-1], torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0]))
    assert torch.equal(karras_sigmas(1), torch.tensor([80.0, 0.0]))
    with pytest.raises(ConfigError):
        karras_sigmas(0)
    with pytest.raises(ConfigError):
        karras_sigmas(5, 1.0, 0.5)


def test_solvers_converge_to_the_exact_ode_solution() -> None:
    s = 0.3
    d = GaussianDenoiser(s)
    noise = torch.randn(4, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    labels = torch.zeros(4, dtype=torch.long)
    # Probability-flow ODE for Gaussian data: x(sigma) = x(sigma_max) * sqrt((s^2 + sigma^2) / (s^2 +
    # sigma_max^2)).
    exact_x = noise * 80.0 * math.sqrt(s**2 / (s**2 + 80.0**2))
    exact = ((exact_x + 1) / 2).clamp(0, 1)

    def err(solver: str, n: int) -> float:
        return (sample(d, labels, noise, solver=solver, steps=n) - exact).abs().max().item()

    e_euler = [err("euler", n) for n in (8, 32, 128)]
    e_heun = [err("heun", n) for n in (8, 32, 128)]
    assert e_euler[0] > e_euler[1] > e_euler[2]
    assert e_heun[0] > e_heun[1] and e_heun[2] < 1e-3
    assert e_heun[1] < e_euler[1]  # second order beats first order at the same step count
    euler_vs_heun = [
        (sample(d, labels, noise, solver="euler", steps=n) - sample(d, labels, noise, solver="heun", steps=n))
        .abs()
        .max()
        .item()
        for n in (8, 128)
    ]
    assert euler_vs_heun[1] < euler_vs_heun[0] and euler_vs_heun[1] < 0.02


def test_sampler_step_arithmetic() -> None:
    d = GaussianDenoiser(0.5)
    x = torch.randn(2, 1, 2, 2)
    lab = torch.zeros(2, dtype=torch.long)
    t0, t1 = torch.tensor(2.0), torch.tensor(1.0)
    dx = (x - d(x, t0.expand(2), lab)) / t0
    xe = x + (t1 - t0) * dx
    assert torch.allclose(sampler_step(d, x, t0, t1, lab, heun=False), xe)
    d2 = (xe - d(xe, t1.expand(2), lab)) / t1
    assert torch.allclose(sampler_step(d, x, t0, t1, lab, heun=True), x + (t1 - t0) * (0.5 * dx + 0.5 * d2))


def test_guidance_formula_and_zero_guidance_is_conditional() -> None:
    d = tiny_denoiser().eval()
    x = torch.randn(3, 1, 16, 16)
    sig = torch.tensor(1.5)
    y = torch.tensor([0, 1, 2])
    with torch.no_grad():
        cond = d(x, sig.expand(3), y)
        uncond = d(x, sig.expand(3), torch.full_like(y, 3))
        assert torch.equal(guided_denoise(d, x, sig, y, 0.0), cond)
        assert torch.allclose(guided_denoise(d, x, sig, y, 2.0), 3.0 * cond - 2.0 * uncond, atol=1e-5)


def test_real_network_sampling_is_deterministic_given_noise() -> None:
    d = tiny_denoiser().eval()
    noise = torch.randn(4, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2, 0])
    a = sample(d, y, noise, solver="heun", steps=4, guidance=0.5)
    b = sample(d, y, noise, solver="heun", steps=4, guidance=0.5)
    c = sample(d, y, noise * 0.9, solver="heun", steps=4, guidance=0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == (4, 1, 16, 16) and a.min() >= 0 and a.max() <= 1
    with pytest.raises(ConfigError):
        sample(d, y, noise, solver="dpm", steps=4)


def test_generate_balanced_seeded_and_batch_independent() -> None:
    d = tiny_denoiser()
    cfg = SamplerSection(solver="euler", steps=3)
    imgs, labels = generate(d, 2, seed=7, sampler_cfg=cfg, batch=6)
    assert imgs.shape == (6, 1, 16, 16) and labels.tolist() == [0, 0, 1, 1, 2, 2]
    imgs2, _ = generate(d, [0, 0, 1, 1, 2, 2], seed=7, sampler_cfg=cfg, batch=4)
    assert torch.allclose(imgs, imgs2, atol=1e-5)
    imgs3, _ = generate(d, 2, seed=8, sampler_cfg=cfg, batch=6)
    assert not torch.allclose(imgs, imgs3)
    assert d.training  # generate() restores the mode it found
    with pytest.raises(ConfigError):
        generate(d, [0, 5], seed=0, sampler_cfg=cfg)
