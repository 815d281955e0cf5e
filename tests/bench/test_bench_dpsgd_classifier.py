"""bench/dpsgd_classifier.py, the DP-SGD anchor of bench/generality.py: it trains on a tiny set, spends no
more than its target ε by Opacus's own accountant, and uses no batch-mixing layer."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
from torch import nn

from feta_release.data.procedural import generate_dataset
from tests.support.bench_script import load_bench


def _bench() -> ModuleType:
    return load_bench("dpsgd_classifier.py", "dpsgd_classifier")


@pytest.mark.parametrize(("kind", "epsilon"), [("medical", 1.0), ("rgb", 10.0)])
def test_the_anchor_runs_on_a_tiny_set_within_its_target_epsilon(kind: str, epsilon: float) -> None:
    bench = _bench()
    train = generate_dataset(kind, 64, size=28 if kind == "medical" else 16, seed=1)
    test = generate_dataset(kind, 20, size=train.image_shape[1], seed=2)
    res = bench.dpsgd_anchor(train, test, epsilon=epsilon, delta=1e-5, epochs=2, batch=16, seed=0)
    assert 0.0 < res.epsilon <= epsilon  # Opacus's RDP accountant after every step taken
    assert res.epsilon > 0.5 * epsilon  # the noise was calibrated for this target, not far below it
    assert res.steps == 2 * round(1 / res.sampling_rate) and res.noise_multiplier > 0
    assert 0.0 <= res.accuracy <= 1.0 and res.n_train == 64


def test_the_anchor_model_has_no_batch_norm_and_gives_per_example_outputs() -> None:
    import torch

    bench = _bench()
    model = bench.GroupNormCNN(3, 10).eval()
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    x = torch.rand(5, 3, 32, 32)
    alone = model(x[:1])
    assert torch.allclose(model(x)[:1], alone, atol=1e-5)  # one image's output ignores the rest of the batch


def test_embedded_subsets_have_the_asked_training_size_and_stay_balanced() -> None:
    from feta_release.eval_protocol import protocol_splits

    bench = _bench()
    train, held = protocol_splits(bench.load_kind("embedded", 400), "test")
    assert train.n == 400 and held.n == 100
    assert np.ptp(train.class_counts()) <= 1
    with pytest.raises(Exception, match="at most 4000"):
        bench.load_kind("embedded", 20_000)
