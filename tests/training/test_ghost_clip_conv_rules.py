"""Every Conv2d rule of the hook engine (training.ghost_clip._conv_grads: shifted slices, unfolded patches,
the per-example loop, 1x1 matmuls, the grouped kernel) gives each example's own weight and bias gradient.

The clip bounds one example's contribution only if the vector it clips is that example's gradient: a rule that
mixed examples' rows, dropped a copy k or misread a stride would hand the clip a wrong vector. Each rule is
checked against the definition (autograd through an ordinary conv of the example's own rows), over shapes
that reach every branch."""

from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from feta_release.training.ghost_clip import _conv_grads


def _per_example_reference(m: nn.Conv2d, a: torch.Tensor, g: torch.Tensor, b: int):
    """Example i's gradient: autograd of <conv(rows of i), output gradient of those rows> (K-major rows)."""
    weights, biases = [], []
    for i in range(b):
        rows = torch.arange(i, a.shape[0], b)
        out = m(a[rows])
        gw = torch.autograd.grad((out * g[rows]).sum(), [p for p in (m.weight, m.bias) if p is not None])
        weights.append(gw[0])
        biases.append(gw[1] if m.bias is not None else None)
    return torch.stack(weights), (torch.stack(biases) if m.bias is not None else None)


@settings(max_examples=40, deadline=None)
# the shifted slices (<= 2 outputs, stride 1), the unfolded patches (C_in*kh*kw <= 36), the loop (<= 4
# outputs), the 1x1 matmuls and the grouped kernel
@example(b=3, k=2, c_in=8, c_out=2, kernel=3, stride=1, padding=1, dilation=1, bias=True, size=6, seed=0)
@example(b=3, k=2, c_in=1, c_out=8, kernel=3, stride=2, padding=1, dilation=1, bias=True, size=7, seed=1)
@example(b=2, k=3, c_in=4, c_out=6, kernel=3, stride=1, padding=2, dilation=2, bias=False, size=6, seed=2)
@example(b=3, k=1, c_in=8, c_out=4, kernel=3, stride=2, padding=0, dilation=1, bias=True, size=7, seed=3)
@example(b=3, k=2, c_in=40, c_out=8, kernel=1, stride=1, padding=0, dilation=1, bias=True, size=5, seed=4)
@example(b=3, k=2, c_in=8, c_out=8, kernel=3, stride=1, padding=1, dilation=1, bias=True, size=6, seed=5)
@given(
    b=st.integers(1, 4),
    k=st.integers(1, 3),
    c_in=st.sampled_from([1, 2, 3, 4, 8, 40]),
    c_out=st.sampled_from([1, 2, 3, 4, 6, 8]),
    kernel=st.integers(1, 3),
    stride=st.integers(1, 2),
    padding=st.integers(0, 2),
    dilation=st.integers(1, 2),
    bias=st.booleans(),
    size=st.integers(5, 8),
    seed=st.integers(0, 2**16),
)
def test_every_conv_rule_gives_each_examples_own_weight_gradient(
    b, k, c_in, c_out, kernel, stride, padding, dilation, bias, size, seed
):
    torch.manual_seed(seed)
    m = nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=padding, dilation=dilation, bias=bias)
    a = torch.randn(b * k, c_in, size, size)  # K-major rows: row j*b + i is copy j of example i
    with torch.no_grad():
        g = torch.randn_like(m(a))
    weight, bias_grad = _conv_grads(m, a, g, b)
    ref_w, ref_b = _per_example_reference(m, a, g, b)
    assert weight.shape == (b, *m.weight.shape)
    assert torch.allclose(weight, ref_w, rtol=1e-4, atol=1e-4)
    if bias:
        assert bias_grad is not None and torch.allclose(bias_grad, ref_b, rtol=1e-4, atol=1e-4)
    else:
        assert bias_grad is None


def test_a_strided_output_gradient_gives_the_same_per_example_gradients():
    # an output gradient that reaches the rule as a slice of a wider one (a conv whose output feeds a
    # concatenation) must give what its contiguous copy gives
    torch.manual_seed(0)
    for c_in in (1, 16):
        m = nn.Conv2d(c_in, 6, 3, padding=1)
        a = torch.randn(6, c_in, 7, 7)
        wide = torch.randn(6, 10, 7, 7)
        g = wide[:, 2:8]
        assert not g.is_contiguous()
        got, ref = _conv_grads(m, a, g, 3), _conv_grads(m, a, g.contiguous(), 3)
        assert torch.allclose(got[0], ref[0], rtol=1e-5, atol=1e-6)
