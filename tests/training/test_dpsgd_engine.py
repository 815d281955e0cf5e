"""DP-SGD engine: per-example gradients, clipping, noise scale, noise multiplicity, empty batches, resume."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from feta_release.errors import ConfigError, DataError
from feta_release.models.edm import EDMLoss
from feta_release.training.dpsgd import (
    DPSGDTrainer,
    clip_and_sum,
    per_example_grads,
    poisson_sample,
)
from tests.support.dpsgd import SHAPE, TinyDenoiser
from tests.support.dpsgd import dpsgd_batch as _data
from tests.support.dpsgd import dpsgd_job as _cfg


def _naive_grads(model, loss, x, y, rand):
    out = []
    for i in range(x.shape[0]):
        model.zero_grad()
        ri = {k: v[i] for k, v in rand.items()}
        loss(model, x[i], y[i], ri).backward()
        out.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return out


def test_per_example_grads_match_naive_loop():
    torch.manual_seed(0)
    model = TinyDenoiser()
    loss = EDMLoss(SHAPE, 3, noise_multiplicity=3, label_dropout=0.3)
    x, y = _data(7)
    rand = loss.draw(7, torch.Generator().manual_seed(1))
    grads, losses = per_example_grads(model, loss, x, y, rand, chunk_size=3)
    naive = _naive_grads(model, loss, x, y, rand)
    for i in range(7):
        for n, g in naive[i].items():
            torch.testing.assert_close(grads[n][i], g, rtol=1e-4, atol=1e-6)
        ri = {k: v[i] for k, v in rand.items()}
        with torch.no_grad():
            assert math.isclose(float(losses[i]), float(loss(model, x[i], y[i], ri)), rel_tol=1e-5)


def test_clip_and_sum_bounds_every_contribution():
    g = torch.Generator().manual_seed(0)
    grads = {"a": torch.randn(5, 3, 4, generator=g), "b": torch.randn(5, 7, generator=g)}
    grads["a"][2] *= 1e6  # one example with a huge gradient
    for i in range(5):
        one = {n: v[i : i + 1] for n, v in grads.items()}
        summed, norms = clip_and_sum(one, 0.5)
        total = math.sqrt(sum(float(v.pow(2).sum()) for v in summed.values()))
        assert total <= 0.5 + 1e-6
        if norms[0] <= 0.5:  # small gradients pass unchanged
            for n in grads:
                torch.testing.assert_close(summed[n], grads[n][i])


class HugeLoss:
    """Per-example loss whose gradient scale is set per example (to make one example's gradient enormous)."""

    def draw(self, n, generator):
        return {"z": torch.randn(n, 4, generator=generator)}

    def __call__(self, model, x, y, rand):
        return (model(x.unsqueeze(0)).squeeze(0) * rand["z"]).sum() * x.abs().sum()


def test_clipping_bound_through_trainer_with_huge_gradient_example():
    torch.manual_seed(0)
    model = nn.Linear(3, 4)
    x = torch.tensor([[1e6, 1e6, 1e6]])
    y = torch.zeros(1, dtype=torch.long)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tr = DPSGDTrainer(
        model, _cfg(batch=1, clip=0.7), 1e-9, 1.0, torch.Generator().manual_seed(0), loss=HugeLoss()
    )
    noisy, stats = tr.noisy_gradient(x, y)
    assert stats.batch_size == 1 and stats.clipped_fraction == 1.0
    norm = math.sqrt(sum(float(v.pow(2).sum()) for v in noisy.values()))
    # expected batch = q*N = 1, so the released gradient is the clipped contribution itself
    assert norm == pytest.approx(0.7, rel=1e-5)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # no step taken


class ZeroGradLoss:
    def draw(self, n, generator):
        return {"z": torch.zeros(n, 1)}

    def __call__(self, model, x, y, rand):
        return (model(x.unsqueeze(0)) * 0.0).sum() + rand["z"].sum()


def test_noise_std_equals_sigma_c_over_expected_batch():
    model = nn.Linear(100, 200)  # 20,200 parameters, all with zero gradient
    n, q, sigma, clip = 50, 0.2, 3.0, 0.5
    x, y = torch.randn(n, 100), torch.zeros(n, dtype=torch.long)
    tr = DPSGDTrainer(model, _cfg(clip=clip), sigma, q, torch.Generator().manual_seed(3), loss=ZeroGradLoss())
    noisy, stats = tr.noisy_gradient(x, y)
    values = torch.cat([v.flatten() for v in noisy.values()])
    want = sigma * clip / (q * n)  # expected batch q*N = 10, whatever the realised batch size
    # 20,200 iid normal draws: the sample std has relative s.e. 1/sqrt(2*20200) ~ 0.5%; 3% is > 5 s.e.
    assert float(values.std()) == pytest.approx(want, rel=0.03)
    assert abs(float(values.mean())) < 5 * want / math.sqrt(values.numel())
    assert stats.expected_batch == pytest.approx(10.0)


class DirectionalLoss:
    """K draws per example, each with a huge gradient; draws point in opposite directions."""

    def __init__(self, k):
        self.k = k

    def draw(self, n, generator):
        signs = torch.ones(n, self.k)
        signs[:, 1::2] = -1.05
        return {"s": signs * 1e3}

    def __call__(self, model, x, y, rand):
        out = model(x.unsqueeze(0).expand(self.k, -1)).sum(1)  # (K,)
        return (out * rand["s"]).mean()


def test_noise_multiplicity_averages_before_clipping():
    torch.manual_seed(0)
    k, clip = 4, 1.0
    model = nn.Linear(5, 2)
    x, y = torch.randn(1, 5), torch.zeros(1, dtype=torch.long)
    loss = DirectionalLoss(k)
    tr = DPSGDTrainer(
        model,
        _cfg(batch=1, clip=clip, noise_multiplicity=k),
        1e-9,
        1.0,
        torch.Generator().manual_seed(0),
        loss=loss,
    )
    noisy, _ = tr.noisy_gradient(x, y)
    # reference: per-draw gradients by hand, averaged, THEN clipped
    per_draw = []
    for j in range(k):
        model.zero_grad()
        (model(x).sum() * loss.draw(1, None)["s"][0, j]).backward()
        per_draw.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    mean = torch.stack(per_draw).mean(0)
    expect = mean * min(1.0, clip / float(mean.norm()))
    got = torch.cat([noisy[n].flatten() for n, _ in model.named_parameters()])
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-6)
    assert float(got.norm()) <= clip + 1e-6  # one clipped vector per example, not K*C
    # clip-then-average would give a much smaller vector here (opposite draws cancel after clipping)
    clipped_each = torch.stack([g * min(1.0, clip / float(g.norm())) for g in per_draw]).mean(0)
    assert float((got - clipped_each).norm()) > 0.5


def test_empty_poisson_batch_still_adds_noise_and_counts_a_step():
    model = nn.Linear(3, 2)
    x, y = torch.randn(5, 3), torch.zeros(5, dtype=torch.long)
    before = [p.detach().clone() for p in model.parameters()]
    charged = []
    tr = DPSGDTrainer(model, _cfg(), 2.0, 1e-9, torch.Generator().manual_seed(0), loss=ZeroGradLoss())
    stats = tr.run(x, y, 2, before_step=charged.append)
    assert [s.batch_size for s in stats] == [0, 0]
    assert charged == [1, 2] and tr.steps_done == 2
    assert math.isnan(stats[0].loss)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_before_step_failure_prevents_the_step():
    model = nn.Linear(3, 2)
    x, y = torch.randn(5, 3), torch.zeros(5, dtype=torch.long)
    tr = DPSGDTrainer(model, _cfg(), 2.0, 0.5, torch.Generator().manual_seed(0), loss=ZeroGradLoss())

    def charge(i):
        if i == 3:
            raise RuntimeError("budget")

    before_third = {}
    with pytest.raises(RuntimeError):
        tr.run(
            x,
            y,
            5,
            before_step=charge,
            after_step=lambda s: before_third.update({k: v.clone() for k, v in model.state_dict().items()}),
        )
    assert tr.steps_done == 2
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before_third.items())


def test_poisson_sample_rate():
    g = torch.Generator().manual_seed(0)
    sizes = torch.tensor([poisson_sample(1000, 0.05, g).numel() for _ in range(200)], dtype=torch.float)
    # Binomial(1000, 0.05): mean 50, sd 6.9; the mean of 200 draws has s.e. 0.49
    assert float(sizes.mean()) == pytest.approx(50, abs=2.5)
    assert 3 < float(sizes.std()) < 11


def test_resume_from_state_dict_is_bit_identical():
    x, y = _data(12)
    kw = dict(image_shape=SHAPE, n_classes=3)

    def make():
        torch.manual_seed(0)
        m = TinyDenoiser()
        return DPSGDTrainer(m, _cfg(), 1.5, 0.4, torch.Generator().manual_seed(7), **kw)

    a = make()
    a.run(x, y, 4)
    b = make()
    b.run(x, y, 2)
    state = b.state_dict()
    c = make()
    c.load_state_dict(state)
    c.run(x, y, 2)
    assert c.steps_done == 4
    for (n, pa), pc in zip(a.model.state_dict().items(), c.model.state_dict().values()):
        assert torch.equal(pa, pc), n
    for k, v in a.ema.shadow.items():
        assert torch.equal(v, c.ema.shadow[k]), k
    assert not torch.equal(a.ema_model().conv.weight, make().model.conv.weight)


class _FixedDrawLoss(EDMLoss):
    """The EDM loss with the same noise and noise level for every row: its draw takes nothing from the
    generator, so trainers at different physical batches consume the same random stream."""

    def draw(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        return {
            "noise": torch.full((n, self.k, *self.image_shape), 0.3),
            "sigma": torch.full((n, self.k), 0.8),
            "drop": torch.zeros((n, self.k), dtype=torch.bool),
        }


def test_the_physical_batch_changes_the_calls_not_the_update():
    """Rows per per-example-gradient call are a memory and time setting (the job rules' CPU rule moved from 32
    to 64 rows at 28 px): each row is clipped alone and the step sums the clipped rows, so the same sample,
    randomness and noise give the same weights at any physical batch, padded or not, up to the float order."""
    x, y = _data(24)
    weights = {}
    for physical in (3, 4, 8, 64):
        torch.manual_seed(0)
        m = TinyDenoiser()
        cfg = _cfg(batch=12, physical_batch=physical, noise_multiplicity=2)
        loss = _FixedDrawLoss(SHAPE, 3, 2, 0.0)
        gen = torch.Generator().manual_seed(7)
        DPSGDTrainer(m, cfg, 1.0, 0.5, gen, loss=loss, pad_to=16).run(x, y, 3)
        weights[physical] = m.state_dict()
    torch.manual_seed(0)
    start = TinyDenoiser().state_dict()
    assert any(not torch.equal(v, start[k]) for k, v in weights[4].items())  # the steps moved the weights
    for physical, w in weights.items():
        for name, v in w.items():
            torch.testing.assert_close(v, weights[4][name], rtol=1e-5, atol=1e-6, msg=f"{physical} {name}")


def test_edm_training_reduces_loss_with_weak_noise():
    x, y = _data(32, seed=1)
    torch.manual_seed(0)
    m = TinyDenoiser()
    cfg = _cfg(batch=16, lr=3e-2, noise_multiplicity=4, physical_batch=8, clip=10.0)
    tr = DPSGDTrainer(m, cfg, 0.01, 0.5, torch.Generator().manual_seed(0), image_shape=SHAPE, n_classes=3)
    loss = EDMLoss(SHAPE, 3, 8, 0.0)
    rand = loss.draw(32, torch.Generator().manual_seed(5))

    def full_loss():
        with torch.no_grad():
            return float(
                torch.stack(
                    [loss(m, x[i], y[i], {k: v[i] for k, v in rand.items()}) for i in range(32)]
                ).mean()
            )

    start = full_loss()
    tr.run(x, y, 25)
    assert full_loss() < 0.8 * start


def test_bad_parameters_are_refused():
    m = nn.Linear(2, 2)
    with pytest.raises(DataError, match="fewer examples"):
        DPSGDTrainer(m, _cfg(), 1.0, 1.5, torch.Generator(), loss=ZeroGradLoss())
    with pytest.raises(ConfigError):
        DPSGDTrainer(m, _cfg(), 0.0, 0.5, torch.Generator(), loss=ZeroGradLoss())
    with pytest.raises(ConfigError):
        DPSGDTrainer(m, _cfg(), 1.0, 0.5, torch.Generator())  # no loss and no shape to build one
    tr = DPSGDTrainer(m, _cfg(), 1.0, 0.5, torch.Generator(), loss=ZeroGradLoss())
    other = DPSGDTrainer(nn.Linear(2, 2), _cfg(), 2.0, 0.5, torch.Generator(), loss=ZeroGradLoss())
    with pytest.raises(ConfigError, match="different plan"):
        other.load_state_dict(tr.state_dict())
