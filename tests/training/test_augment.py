"""RandAugment-style bag: determinism, range, per-op behaviour."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.errors import ConfigError
from feta_release.training.augment import OPS, rand_augment, to_model_range
from tests.support.single_thread import single_thread  # noqa: F401  (autouse fixture)


def _images(n: int = 12, c: int = 1, size: int = 12, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand((n, c, size, size), generator=g)


def test_deterministic_given_generator_and_varies_with_seed() -> None:
    x = _images()
    a, ma = rand_augment(x, n_ops=2, magnitude_max=9, generator=torch.Generator().manual_seed(5))
    b, mb = rand_augment(x, n_ops=2, magnitude_max=9, generator=torch.Generator().manual_seed(5))
    c, _ = rand_augment(x, n_ops=2, magnitude_max=9, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and ma == mb
    assert not torch.equal(a, c)


def test_range_quantisation_and_model_range() -> None:
    x = _images(c=3)
    out, _ = rand_augment(x, n_ops=2, magnitude_max=20, generator=torch.Generator().manual_seed(1))
    assert out.shape == x.shape and out.min() >= 0 and out.max() <= 1
    assert torch.allclose(out * 255, (out * 255).round(), atol=1e-4)  # stands for uint8
    m = to_model_range(out)
    assert m.min() >= -1 and m.max() <= 1


def test_magnitude_redrawn_per_call_in_range() -> None:
    g = torch.Generator().manual_seed(0)
    seen = {rand_augment(_images(2), n_ops=1, magnitude_max=3, generator=g)[1] for _ in range(60)}
    assert seen == {1, 2, 3}


def test_identity_only_bag_is_the_quantised_input() -> None:
    x = _images()
    out, _ = rand_augment(x, n_ops=2, magnitude_max=3, generator=torch.Generator(), ops=("identity",))
    assert torch.equal(out, (x * 255).round() / 255)


def test_each_image_gets_its_own_ops() -> None:
    # Same image repeated: with 14 ops and 2 slots, the copies cannot all get identical treatment.
    x = _images(1).repeat(16, 1, 1, 1)
    out, _ = rand_augment(x, n_ops=2, magnitude_max=9, generator=torch.Generator().manual_seed(3))
    distinct = {tuple(o.flatten().tolist()) for o in out}
    assert len(distinct) > 4


def test_specific_ops() -> None:
    ramp = torch.linspace(0.2, 0.6, 16).reshape(1, 1, 4, 4)
    auto = OPS["autocontrast"](ramp, 0.1, torch.ones(1))
    assert auto.min().item() == pytest.approx(0.0) and auto.max().item() == pytest.approx(1.0)
    eq = OPS["equalize"](ramp, 0.1, torch.ones(1))
    assert eq.max().item() == pytest.approx(1.0) and eq.min().item() == pytest.approx(0.0)
    flat = torch.full((1, 1, 4, 4), 0.5)
    assert torch.equal(OPS["equalize"](flat, 0.1, torch.ones(1)), torch.round(flat * 255) / 255)
    sol = OPS["solarize"](torch.tensor([0.1, 0.95]).reshape(1, 1, 1, 2), 0.1, torch.ones(1))
    assert torch.allclose(sol.flatten(), torch.tensor([0.1, 0.05]))
    # Translating right moves mass right; a positive/negative sign moves it opposite ways.
    img = torch.zeros(2, 1, 8, 8)
    img[:, :, :, 3] = 1.0
    moved = OPS["translate_x"](img, 0.3, torch.tensor([1.0, -1.0]))
    cols = torch.arange(8, dtype=torch.float32)
    centre = (moved.sum(dim=(1, 2)) * cols).sum(1) / moved.sum(dim=(1, 2, 3))
    assert centre[0] != centre[1] and (centre - 3).abs().min() > 0.5
    post = OPS["posterize"](torch.tensor([[[[200 / 255]]]]), 1.0, torch.ones(1))
    assert post.item() * 255 == pytest.approx(192)  # 4 bits kept


@settings(max_examples=25, deadline=None)
@given(
    op=st.sampled_from(sorted(OPS)),
    f=st.floats(0.0, 1.0),
    c=st.sampled_from([1, 3]),
    seed=st.integers(0, 1000),
)
def test_every_op_keeps_shape_and_range(op: str, f: float, c: int, seed: int) -> None:
    x = _images(3, c=c, size=8, seed=seed)
    sign = torch.tensor([1.0, -1.0, 1.0])
    out = OPS[op](x, f, sign)
    assert out.shape == x.shape
    assert out.min() >= -1e-6 and out.max() <= 1 + 1e-6


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        rand_augment(_images(), magnitude_max=0, generator=torch.Generator())
    with pytest.raises(ConfigError):
        rand_augment(_images(), ops=("warp",), generator=torch.Generator())
    with pytest.raises(ConfigError):
        rand_augment(torch.rand(4, 4), generator=torch.Generator())
