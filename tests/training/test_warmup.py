"""EMA and the spatial warm-up on (tiny) central images."""

from __future__ import annotations

import pytest
import torch

from feta_release.errors import ConfigError, DataError
from feta_release.models import build_denoiser
from feta_release.training.ema import EMA
from feta_release.training.spatial import spatial_warmup
from tests.support.single_thread import single_thread  # noqa: F401  (autouse fixture)
from tests.support.training import TINY, bars, fixed_noise_loss, job


def test_ema_math_and_copy() -> None:
    m = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        m.weight.fill_(0.0)
    ema = EMA(m, 0.9, warmup=False)
    with torch.no_grad():
        m.weight.fill_(1.0)
    ema.update()
    ema.update(m)
    assert torch.allclose(ema.shadow["weight"], torch.full((1, 2), 1 - 0.81))
    state = ema.state_dict()
    ema2 = EMA(m, 0.5)
    ema2.load_state_dict(state)
    ema2.copy_to(m)
    assert torch.allclose(m.weight, torch.full((1, 2), 0.19))
    # Warm-up: the first updates follow the model closely rather than the initialisation.
    w = EMA(m, 0.999)
    assert w.current_decay() == pytest.approx(0.1)
    w.num_updates = 10**6
    assert w.current_decay() == pytest.approx(0.999)
    with pytest.raises(ValueError):
        EMA(m, 1.0)


def test_spatial_warmup_reduces_loss_and_carries_ema() -> None:
    torch.manual_seed(0)
    x, y = bars()
    d = build_denoiser(TINY, (1, 16, 16), 2)
    cfg = job(warmup={"spatial_iterations": 120, "spatial_batch": 4, "lr": 2e-3, "ema": 0.99})
    before = fixed_noise_loss(d, x, y)
    calls: list[tuple[int, int, float]] = []
    res = spatial_warmup(
        d,
        x,
        y,
        cfg,
        generator=torch.Generator().manual_seed(0),
        progress=lambda s, t, loss: calls.append((s, t, loss)),
    )
    after = fixed_noise_loss(d, x, y)
    assert after < 0.7 * before, (before, after)
    # 6 images: batches of 4 then 2
    assert res.steps == 120 and len(res.losses) == 120 and res.examples == 60 * 4 + 60 * 2
    assert [c[0] for c in calls] == list(range(1, 121)) and all(c[1] == 120 for c in calls)
    assert res.final_loss < sum(res.losses[:12]) / 12


def test_spatial_warmup_deterministic_given_generator() -> None:
    x, y = bars(1)
    cfg = job(warmup={"spatial_iterations": 5, "spatial_batch": 2})
    outs = []
    for _ in range(2):
        torch.manual_seed(1)
        d = build_denoiser(TINY, (1, 16, 16), 2)
        spatial_warmup(d, x, y, cfg, generator=torch.Generator().manual_seed(4))
        outs.append(torch.cat([p.flatten() for p in d.parameters()]))
    assert torch.equal(outs[0], outs[1])


def test_spatial_warmup_zero_iterations_leaves_model_unchanged() -> None:
    x, y = bars(1)
    d = build_denoiser(TINY, (1, 16, 16), 2)
    before = {k: v.clone() for k, v in d.state_dict().items()}
    res = spatial_warmup(d, x, y, job(warmup={"spatial_iterations": 0}), generator=torch.Generator())
    assert res.steps == 0
    assert all(torch.equal(before[k], v) for k, v in d.state_dict().items())


def test_spatial_warmup_bad_inputs() -> None:
    d = build_denoiser(TINY, (1, 16, 16), 2)
    x, y = bars(1)
    cfg = job(warmup={"spatial_iterations": 1})
    g = torch.Generator()
    with pytest.raises(DataError, match="labels"):
        spatial_warmup(d, x, torch.tensor([0, 2]), cfg, generator=g)
    with pytest.raises(DataError, match="pixels"):
        spatial_warmup(d, x * 3, y, cfg, generator=g)
    with pytest.raises(DataError):
        spatial_warmup(d, x[:0], y[:0], cfg, generator=g)
    with pytest.raises(ConfigError, match="built for"):
        spatial_warmup(d, torch.zeros(2, 1, 8, 8), y, cfg, generator=g)
    with pytest.raises(ConfigError):
        spatial_warmup(d, x, y, cfg.replace(warmup={"spatial_batch": 0}), generator=g)
