"""``[dpsgd] public_batch``: already-released examples mixed into every DP-SGD step (``PublicMix``).

What must hold: the private randomness (Poisson sample, Gaussian noise) is the same stream with or without the
mix; the divisor grows by the PUBLIC batch; one private example still moves the released gradient by at most
C / divisor (the public part does not depend on the private data); the option is typed and refused where it
cannot apply.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from feta_release.config import JobConfig, load_preset
from feta_release.errors import ConfigError
from feta_release.training.dpsgd import DPSGDTrainer, PublicMix, released_mix


def _cfg(**dpsgd) -> JobConfig:
    base = {"batch": 4, "steps": 3, "physical_batch": 3, "noise_multiplicity": 1, "clip": 1.0, "lr": 1e-2}
    return JobConfig.from_dict({"dpsgd": {**base, **dpsgd}})


class LinearLoss:
    """Deterministic per-example loss <model(x), onehot(y)>: consumes no randomness from the generator."""

    def draw(self, n, generator):
        return {"z": torch.zeros(n, 1)}

    def __call__(self, model, x, y, rand):
        return (model(x.unsqueeze(0)).squeeze(0) * (torch.arange(2) == y).float()).sum() + rand["z"].sum()


class ZeroGradLoss(LinearLoss):
    def __call__(self, model, x, y, rand):
        return (model(x.unsqueeze(0)) * 0.0).sum() + rand["z"].sum()


def _public(batch: int, dim: int = 3, seed: int = 5, scale: float = 1.0) -> PublicMix:
    def draw(m, g):
        return torch.randn(m, dim, generator=g) * scale, torch.randint(0, 2, (m,), generator=g)

    return PublicMix(draw, batch, torch.Generator().manual_seed(seed))


def test_private_noise_stream_unchanged_and_divisor_grows_by_public_batch():
    n, q, sigma, clip, b_pub = 40, 0.25, 2.0, 0.5, 7
    x, y = torch.randn(n, 30), torch.zeros(n, dtype=torch.long)
    outs = []
    for public in (None, _public(b_pub, dim=30)):
        model = nn.Linear(30, 50)
        tr = DPSGDTrainer(
            model,
            _cfg(clip=clip),
            sigma,
            q,
            torch.Generator().manual_seed(3),
            loss=ZeroGradLoss(),
            public=public,
        )
        outs.append(tr.noisy_gradient(x, y)[0])
    expected = q * n
    # zero gradients everywhere: only the (same) noise, divided by a larger public divisor
    for name in outs[0]:
        torch.testing.assert_close(outs[1][name] * (expected + b_pub) / expected, outs[0][name])


def test_public_part_is_clipped_like_a_private_example():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    b_pub, clip = 5, 0.3
    x, y = torch.randn(10, 3), torch.zeros(10, dtype=torch.long)
    # q tiny: the private batch is empty; sigma tiny: no noise; all that is left is the public sum / divisor
    tr = DPSGDTrainer(
        model,
        _cfg(clip=clip),
        1e-12,
        1e-9,
        torch.Generator().manual_seed(0),
        loss=LinearLoss(),
        public=_public(b_pub, scale=1e3),
    )
    g, stats = tr.noisy_gradient(x, y)
    assert stats.batch_size == 0
    norm = math.sqrt(sum(float(v.pow(2).sum()) for v in g.values()))
    divisor = 1e-9 * 10 + b_pub
    assert 0 < norm <= clip * b_pub / divisor + 1e-6


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 12), st.integers(1, 6), st.floats(0.1, 2.0), st.integers(0, 10_000))
def test_one_private_example_moves_the_gradient_by_at_most_c_over_divisor(n, b_pub, clip, seed):
    """Add/remove of one private example with the same generators: sigma ~ 0 and q = 1, so everything else is
    equal; the public part (the same public draws for both) must cancel."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 3, generator=g) * 10, torch.randint(0, 2, (n,), generator=g)
    outs = []
    for m in (n, n - 1):
        model = nn.Linear(3, 2)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.linspace(-1, 1, p.numel()).reshape(p.shape))
        tr = DPSGDTrainer(
            model,
            _cfg(clip=clip),
            1e-12,
            1.0,
            torch.Generator().manual_seed(1),
            loss=LinearLoss(),
            n_public=n,
            public=_public(b_pub, seed=seed),
        )
        outs.append(tr.noisy_gradient(x[:m], y[:m])[0])
    diff = math.sqrt(sum(float((outs[0][k] - outs[1][k]).pow(2).sum()) for k in outs[0]))
    assert diff <= clip / (n + b_pub) + 1e-5


def test_checkpoint_restores_the_public_generator():
    x, y = torch.randn(8, 3), torch.zeros(8, dtype=torch.long)

    def trainer(seed: int) -> DPSGDTrainer:
        model = nn.Linear(3, 2)
        torch.nn.init.constant_(model.weight, 0.1)
        torch.nn.init.zeros_(model.bias)
        return DPSGDTrainer(
            model,
            _cfg(),
            1.0,
            0.5,
            torch.Generator().manual_seed(0),
            loss=LinearLoss(),
            public=_public(3, seed=seed),
        )

    a = trainer(5)
    a.step(x, y)
    state = a.state_dict()
    b = trainer(99)  # another public seed: the checkpoint must bring back a's stream
    b.load_state_dict(state)
    ga, gb = a.noisy_gradient(x, y)[0], b.noisy_gradient(x, y)[0]
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k])


def test_config_public_batch_typed_and_checked():
    assert JobConfig().dpsgd.public_batch == 0
    assert load_preset("cpu-eps1").replace(dpsgd={"public_batch": 100}).dpsgd.public_batch == 100
    with pytest.raises(ConfigError, match="public_batch must be >= 0"):
        JobConfig.from_dict({"dpsgd": {"steps": 1, "public_batch": -1}})
    federated = {"dpsgd": {"steps": 1, "public_batch": 4}, "federation": {"sites": ["a", "b"]}}
    assert JobConfig.from_dict(federated).dpsgd.public_batch == 4  # per-site rounds get the central images
    with pytest.raises(ConfigError, match="not mixed into FedSGD rounds"):
        JobConfig.from_dict({**federated, "federation": {"sites": ["a", "b"], "fedsgd": True}})
    with pytest.raises(ConfigError, match="unknown key"):
        JobConfig.from_dict({"dpsgd": {"steps": 1, "public_batches": 4}})


def _mix(public_batch: int, central):
    cfg = load_preset("cpu-eps1").replace(dpsgd={"public_batch": public_batch})
    return released_mix(cfg, central, torch.Generator().manual_seed(7))


def test_a_round_draws_augmented_released_central_images_in_model_range():
    imgs = np.random.default_rng(0).random((20, 1, 28, 28)).astype(np.float32)
    labels = np.repeat(np.arange(10), 2)
    mix = _mix(16, (imgs, labels))
    assert mix is not None and mix.batch == 16
    x, y = mix.draw(16, mix.generator)
    assert x.shape == (16, 1, 28, 28) and y.dtype == torch.int64
    assert float(x.min()) >= -1 - 1e-6 and float(x.max()) <= 1 + 1e-6
    assert set(y.tolist()) <= set(labels.tolist())
    assert _mix(0, (imgs, labels)) is None


def test_a_round_refuses_public_batch_without_central_release():
    with pytest.raises(ConfigError, match="needs released central images"):
        _mix(8, None)
