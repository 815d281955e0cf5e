"""A LoRA layer (``models.lora``: one call with the summed weight ``W + up . down``) computes what its
adapters define, ``W x + b + up(down(x))``, and the hook engine's rule for it (``training.ghost_clip``: the
summed weight's per-example gradient, then ``G_i down^T`` and ``up^T G_i``) gives each example's own adapter
gradients.

The clip bounds one example's contribution only if the vector it clips is that example's gradient of the
trained adapters: a rule that mixed examples' rows or transposed a factor would hand the clip another vector.
Each is checked against the definition (autograd through the adapters as two plain layers, one example's
rows at a time) over random shapes, strides and ranks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from feta_release.errors import ConfigError
from feta_release.models.lora import LoRAConv2d, LoRALinear, attach_lora, has_lora, merge_lora
from feta_release.training.ghost_clip import _lora_conv2d, _lora_linear, _ZeroPool


def _adapted(layer: nn.Module, rank: int, seed: int) -> nn.Module:
    """``layer`` inside a container, with adapters attached and ``up`` off its zero start."""
    holder = nn.Sequential(layer)
    attach_lora(holder, rank)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        up = holder[0].lora_up.weight
        up.copy_(torch.randn(up.shape, generator=g))
    return holder[0]


def _by_definition(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The adapters as the two plain layers they are: the layer's output plus up(down(x))."""
    plain = (
        m._conv_forward(x, m.weight, m.bias)
        if isinstance(m, nn.Conv2d)
        else nn.functional.linear(x, m.weight, m.bias)
    )
    return plain + m.lora_up(m.lora_down(x))


def _reference(m: nn.Module, a: torch.Tensor, g: torch.Tensor, b: int) -> dict[str, torch.Tensor]:
    """Example i's adapter gradients: autograd of <the adapters' definition on i's rows, their output
    gradient> (K-major rows: row j*b + i is copy j of example i)."""
    params = [m.lora_down.weight, m.lora_up.weight]
    rows = [torch.autograd.grad((_by_definition(m, a[i::b]) * g[i::b]).sum(), params) for i in range(b)]
    return {
        "lora_down.weight": torch.stack([r[0] for r in rows]),
        "lora_up.weight": torch.stack([r[1] for r in rows]),
    }


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 4),
    k=st.integers(1, 3),
    c_in=st.sampled_from([1, 3, 8, 40]),
    c_out=st.sampled_from([1, 2, 4, 8]),
    kernel=st.integers(1, 3),
    stride=st.integers(1, 2),
    padding=st.integers(0, 1),
    rank=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_a_lora_conv_is_its_adapters_and_its_rule_gives_each_examples_own_adapter_gradients(
    b, k, c_in, c_out, kernel, stride, padding, rank, seed
):
    torch.manual_seed(seed)
    m = _adapted(nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=padding), rank, seed)
    assert isinstance(m, LoRAConv2d)
    a = torch.randn(b * k, c_in, 6, 6)
    out = m(a)
    assert torch.allclose(out, _by_definition(m, a), rtol=1e-4, atol=1e-4)
    g = torch.randn_like(out)
    got = _lora_conv2d(m, a, g, b, _ZeroPool())
    for name, want in _reference(m, a, g, b).items():
        assert got[name].shape == want.shape
        assert torch.allclose(got[name], want, rtol=1e-4, atol=1e-4), name


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 4),
    k=st.integers(1, 3),
    d_in=st.integers(1, 9),
    d_out=st.integers(1, 9),
    rank=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_a_lora_linear_is_its_adapters_and_its_rule_gives_each_examples_own_adapter_gradients(
    b, k, d_in, d_out, rank, seed
):
    torch.manual_seed(seed)
    m = _adapted(nn.Linear(d_in, d_out), rank, seed)
    assert isinstance(m, LoRALinear)
    a = torch.randn(b * k, d_in)
    out = m(a)
    assert torch.allclose(out, _by_definition(m, a), rtol=1e-4, atol=1e-4)
    g = torch.randn_like(out)
    got = _lora_linear(m, a, g, b)
    for name, want in _reference(m, a, g, b).items():
        assert torch.allclose(got[name], want, rtol=1e-4, atol=1e-4), name


def test_merging_gives_the_plain_layer_the_adapted_layer_was_bit_for_bit():
    # the forward's summed weight is the merge's: the merged layer computes the very same floats
    m = _adapted(nn.Conv2d(4, 6, 3, padding=1), 2, 0)
    x = torch.randn(3, 4, 5, 5)
    want = m(x)
    holder = merge_lora(nn.Sequential(m))
    assert type(holder[0]) is nn.Conv2d and not hasattr(holder[0], "lora_down")
    assert torch.equal(holder[0](x), want)


class _OwnConv(nn.Conv2d):
    """A conv subclass with its own forward: switching its class would drop it."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 2


@pytest.mark.parametrize(
    ("model", "named"),
    [
        (nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.Conv2d(4, 2, 1)), "0 (Conv2d, groups 2)"),
        (nn.Sequential(_OwnConv(2, 2, 3), nn.Linear(4, 4)), "0 (_OwnConv, groups 1)"),
        (nn.Sequential(nn.MultiheadAttention(4, 2)), "0.out_proj (NonDynamicallyQuantizableLinear)"),
        (nn.Sequential(nn.GroupNorm(1, 4)), "no nn.Conv2d or nn.Linear layer"),
    ],
)
def test_a_model_lora_would_adapt_only_in_part_is_refused_untouched(model: nn.Module, named: str) -> None:
    """A grouped conv (no grouped form of W + up . down), a subclass (its forward replaced, or never called as
    in MultiheadAttention) or no layer at all: refused naming the layer and the fix, nothing frozen."""
    with pytest.raises(ConfigError, match="trainable") as exc:
        attach_lora(model, 2)
    assert named in str(exc.value) and "norm_attention" in str(exc.value)
    assert all(p.requires_grad for p in model.parameters()) and not has_lora(model)
