"""The hook engine's GroupNorm rule gives each example's own weight and bias gradient, and the layers below a
GroupNorm get their true per-example gradients through it, whether the norm's input wants a gradient (a norm
between trained layers) or not (a norm on the input); a GroupNorm whose input or output is changed in place
after the forward is refused, never differentiated at the changed values.

A wrong per-example vector is still clipped, but it is not the example's gradient: the clip would bound
something else than that example's contribution."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from feta_release.training.dpsgd import per_example_grads
from feta_release.training.ghost_clip import hook_grads, unsupported
from tests.support.dpsgd import RowLoss, assert_same_gradients


class _NormStack(nn.Module):
    """[GroupNorm on the input ->] conv -> GroupNorm -> conv -> GroupNorm -> Linear: a norm first (no input
    gradient wanted), then norms between trained layers (the input gradient reaches the conv below)."""

    def __init__(self, groups: int, norm_first: bool) -> None:
        super().__init__()
        self.first = nn.GroupNorm(1, 2) if norm_first else nn.Identity()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.norm1 = nn.GroupNorm(groups, 4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, stride=2)
        self.norm2 = nn.GroupNorm(groups, 4)
        self.lin = nn.Linear(4 * 16, 3)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_()

    def forward(self, x: Tensor, sigma: Tensor, labels: Tensor) -> Tensor:
        h = self.first(x * sigma[:, None, None, None])
        h = torch.tanh(self.norm1(self.conv1(h)))
        h = torch.tanh(self.norm2(self.conv2(h)))
        return self.lin(h.flatten(1))


@settings(max_examples=15, deadline=None)
@given(
    b=st.integers(1, 4),
    k=st.integers(1, 3),
    groups=st.sampled_from([1, 2, 4]),
    norm_first=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_group_norms_input_and_per_example_gradients_are_the_true_ones(b, k, groups, norm_first, seed):
    torch.manual_seed(seed)
    model, loss = _NormStack(groups, norm_first), RowLoss(k)
    assert not unsupported(model)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(b, 2, 7, 7, generator=g), torch.randint(0, 4, (b,), generator=g)
    rand = loss.draw(b, g)
    got, lh = hook_grads(model, loss, x, y, rand)
    ref, lr = per_example_grads(model, loss, x, y, rand, engine="vmap")
    assert_same_gradients(got, ref)
    assert torch.allclose(lh, lr, rtol=1e-5, atol=1e-5)


class _ChangedInPlace(nn.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.conv, self.norm, self.lin = (
            nn.Conv2d(2, 4, 3, padding=1),
            nn.GroupNorm(2, 4),
            nn.Linear(4 * 49, 3),
        )
        self.where = where

    def forward(self, x: Tensor, sigma: Tensor, labels: Tensor) -> Tensor:
        h = self.conv(x * sigma[:, None, None, None]) + 1.0  # a fresh tensor, not the conv's tapped output
        out = self.norm(h)
        if self.where == "input":
            h.mul_(2.0)  # the value the norm's backward would read is no longer the one it normalised
        else:
            out = nn.functional.silu(out, inplace=True)
        return self.lin(out.flatten(1))


@pytest.mark.parametrize("where", ["input", "output"])
def test_a_group_norm_whose_input_or_output_changes_in_place_is_refused(where):
    model, loss = _ChangedInPlace(where), RowLoss(2)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 2, 7, 7, generator=g), torch.randint(0, 4, (3,), generator=g)
    with pytest.raises(RuntimeError, match="inplace"):
        hook_grads(model, loss, x, y, loss.draw(3, g))
