"""The clip of screened per-example gradients (``ghost_clip.hook_grads(screen=True)``: each parameter's norms
taken and its non-finite entries zeroed inside the backward) releases exactly what the clip's own passes do.

Threat: the screening zeroes a non-finite example's entries BEFORE the clip sees them. Were its norm taken
after that, or from the zeroed entries again, the example would look finite and enter the sum; were a zeroed
copy kept apart from the tensor the clip reads, a NaN would reach the release exactly when that example was
sampled (a membership channel). So: the norms must be those of the raw gradients, the clipped sums
bit-identical to the unscreened clip's, over every layer rule, a module called twice, a parameter no tap
reaches, and examples with NaN or inf gradients."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from feta_release.training.dpsgd import clip_and_sum, per_example_grads
from feta_release.training.flat_grads import FlatGrads, ScreenedGrads, add_into, flat_zeros
from feta_release.training.ghost_clip import hook_grads, unsupported
from tests.support.dpsgd import LayerStack, RowLoss


class TwiceStack(LayerStack):
    """The conv called twice (its two calls' contributions add up) and a Linear no tap reaches (zeros)."""

    def __init__(self, c: int, bias: bool) -> None:
        super().__init__(c, 3, 1, 1, 1, bias, 1, None)
        self.back = nn.Conv2d(c, 2, 1)
        self.unused = nn.Linear(3, 2)

    def forward(self, x: Tensor, sigma: Tensor, labels: Tensor) -> Tensor:
        h = torch.tanh(self.conv(x * sigma[:, None, None, None]))
        h = torch.tanh(self.norm(self.conv(self.back(h))))  # self.conv again
        return self.lin(h.flatten(2).transpose(1, 2)).sum(1) * self.emb(labels)


def _batch(b: int, k: int, seed: int, poison: list[tuple[int, float]]) -> tuple[Tensor, Tensor, dict]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(b, 2, 7, 7, generator=g), torch.randint(0, 4, (b,), generator=g)
    for i, value in poison:  # this example's gradient is non-finite, the others' are not (rows independent)
        x[i % b, 0, 3, 3] = value
    return x, y, RowLoss(k).draw(b, g)


def _raw_norms(grads: dict[str, Tensor]) -> Tensor:
    """Each example's norm as the clip takes it from raw gradients: the norm of its per-parameter norms."""
    return torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(v.reshape(v.shape[0], -1), dim=1) for v in grads.values()]),
        dim=0,
    )


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 5),
    k=st.integers(1, 3),
    twice=st.booleans(),
    c=st.sampled_from([2, 4]),
    bias=st.booleans(),
    poison=st.lists(
        st.tuples(st.integers(0, 4), st.sampled_from([float("nan"), float("inf"), -float("inf")])),
        max_size=2,
    ),
    seed=st.integers(0, 2**16),
    clip_q=st.floats(0.1, 0.9),
)
def test_a_screened_clip_releases_bit_identically_the_unscreened_one(
    b, k, twice, c, bias, poison, seed, clip_q
):
    torch.manual_seed(seed)
    model = TwiceStack(c, bias) if twice else LayerStack(c, 3, 1, 1, 1, bias, 1, None)
    assert not unsupported(model)
    loss = RowLoss(k)
    x, y, rand = _batch(b, k, seed, poison)
    raw, _ = hook_grads(model, loss, x, y, rand)
    screened, _ = hook_grads(model, loss, x, y, rand, screen=True)
    assert isinstance(screened, ScreenedGrads) and list(screened) == list(raw)
    # the norms are the raw gradients' (NaN or inf for a poisoned example), not the zeroed entries'
    torch.testing.assert_close(screened.norms, _raw_norms(raw), rtol=0, atol=0, equal_nan=True)
    assert all(bool(torch.isfinite(v).all()) for v in screened.values())
    finite = torch.isfinite(screened.norms)
    clip = float(torch.quantile(screened.norms[finite], clip_q)) + 1e-6 if finite.any() else 1.0
    got, got_norms = clip_and_sum(screened, clip, in_place=True)
    ref, ref_norms = clip_and_sum(raw, clip, in_place=True)
    assert list(got) == list(ref)
    for n in ref:
        assert torch.equal(got[n], ref[n]), n
        assert bool(torch.isfinite(got[n]).all()), n
    assert torch.equal(got_norms, ref_norms)
    if twice:  # no tap reached it: zero gradient, zero norm share
        assert not screened["unused.weight"].any()


def test_screened_gradients_split_into_calls_keep_each_examples_norm():
    torch.manual_seed(0)
    model, loss = LayerStack(4, 3, 1, 1, 1, True, 2, None), RowLoss(2)
    x, y, rand = _batch(5, 2, 1, [(3, float("nan"))])
    whole, _ = hook_grads(model, loss, x, y, rand, screen=True)
    split, _ = per_example_grads(model, loss, x, y, rand, 2, engine="hooks", screen=True)  # 3 calls
    assert isinstance(split, ScreenedGrads)
    torch.testing.assert_close(split.norms, whole.norms, equal_nan=True)
    assert not torch.isfinite(split.norms[3]) and bool(torch.isfinite(split.norms[[0, 1, 2, 4]]).all())
    for n in whole:
        torch.testing.assert_close(split[n], whole[n])


def test_a_screened_entry_replaced_after_screening_is_refused():
    torch.manual_seed(0)
    model, loss = LayerStack(2, 3, 1, 1, 1, True, 1, None), RowLoss(1)
    x, y, rand = _batch(3, 1, 2, [])
    screened, _ = hook_grads(model, loss, x, y, rand, screen=True)
    name = next(iter(screened))
    screened[name] = screened[name].clone()  # its norms no longer describe what the dict holds
    with pytest.raises(ValueError, match="replaced after screening"):
        clip_and_sum(screened, 1.0, in_place=True)


def test_a_flat_total_adds_a_clipped_sum_as_the_per_parameter_loop_does():
    named = [("a", torch.zeros(2, 3)), ("b", torch.zeros(4)), ("c", torch.zeros(()))]
    total, part = flat_zeros(named), flat_zeros(named)
    assert isinstance(total, FlatGrads) and isinstance(part, FlatGrads)
    for n, v in part.items():
        v.copy_(torch.arange(v.numel(), dtype=v.dtype).reshape(v.shape) + len(n))
    add_into(total, part)
    add_into(total, part)
    for n in part:
        assert torch.equal(total[n], 2 * part[n])
    # a replaced entry: the flat buffer no longer holds it, so the loop runs (and adds the new tensor)
    part["b"] = torch.ones(4)
    add_into(total, part)
    assert torch.equal(total["b"], 2 * (torch.arange(4.0) + 1) + 1)
    plain = {n: torch.zeros_like(p) for n, p in named}
    add_into(plain, total)
    for n in plain:
        assert torch.equal(plain[n], total[n])
