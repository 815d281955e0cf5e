"""The clip of a chunk with the hooks' own norms (training.dpsgd.clipped_chunk over
ghost_clip.hook_grads_zeroed: each layer's norms and zeroing taken as its rule makes its gradients) is
``clip_and_sum`` of the true per-example gradients: the same sum, the same norms, the same clipped count, also
when some examples' gradients are NaN or infinite.

Threat: a norm taken after the zeroing (or a row left with a NaN) would let a crafted example through
unclipped or turn the whole sum into NaN exactly when that example was sampled (the NaN/inf membership
channel, tests/security/test_privacy_hardening.py); the dropped example must contribute exactly zero."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.training.dpsgd import clip_and_sum, clipped_chunk, per_example_grads
from tests.support.dpsgd import LayerStack, RowLoss, assert_same_gradients


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 5),
    k=st.integers(1, 3),
    poisoned=st.lists(st.sampled_from([None, "nan", "inf"]), min_size=5, max_size=5),
    clip_q=st.floats(0.1, 2.0),
    seed=st.integers(0, 2**16),
)
def test_the_hooks_clipped_chunk_is_clip_and_sum_of_the_true_gradients(b, k, poisoned, clip_q, seed):
    torch.manual_seed(seed)
    model, loss = LayerStack(4, 3, 1, 1, 1, True, 2, None), RowLoss(k)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(b, 2, 7, 7, generator=g), torch.randint(0, 4, (b,), generator=g)
    for i, bad in enumerate(poisoned[:b]):
        if bad is not None:  # one pixel: that example's loss, and so its whole gradient, is not finite
            x[i, 0, 3, 3] = math.nan if bad == "nan" else math.inf
    rand = loss.draw(b, g)
    ref_rows, ref_losses = per_example_grads(model, loss, x, y, rand, engine="vmap")
    finite_norms = torch.stack([v.flatten(1).norm(dim=1) for v in ref_rows.values()]).norm(dim=0)
    clip = (
        clip_q * float(finite_norms[torch.isfinite(finite_norms)].median())
        if finite_norms.isfinite().any()
        else 1.0
    )
    ref_sum, ref_norms = clip_and_sum(ref_rows, clip)
    got_sum, got_norms, got_losses = clipped_chunk(model, loss, x, y, rand, clip, engine="hooks")
    assert all(torch.isfinite(v).all() for v in got_sum.values())
    assert_same_gradients(got_sum, ref_sum)
    assert torch.equal(torch.isinf(got_norms), torch.isinf(ref_norms))
    assert torch.equal(torch.isinf(got_norms), torch.tensor([p is not None for p in poisoned[:b]]))
    finite = torch.isfinite(ref_norms)
    assert torch.allclose(got_norms[finite], ref_norms[finite], rtol=1e-4)
    assert torch.allclose(got_losses, ref_losses, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_a_poisoned_example_contributes_exactly_what_a_zero_gradient_example_does():
    # the same chunk with the poisoned example's rows replaced by zeros in the reference: the hooks' sum
    # must not carry anything of it
    torch.manual_seed(0)
    model, loss = LayerStack(4, 3, 1, 1, 1, True, 2, None), RowLoss(2)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 2, 7, 7, generator=g), torch.randint(0, 4, (3,), generator=g)
    x[1, 1, 0, 0] = math.inf
    rand = loss.draw(3, g)
    got, norms, _ = clipped_chunk(model, loss, x, y, rand, 0.5, engine="hooks")
    ref_rows, _ = per_example_grads(model, loss, x, y, rand, engine="vmap")
    ref_rows = {n: torch.cat([v[:1], torch.zeros_like(v[1:2]), v[2:]]) for n, v in ref_rows.items()}
    assert_same_gradients(got, clip_and_sum(ref_rows, 0.5)[0])
    assert math.isinf(float(norms[1])) and torch.isfinite(norms[[0, 2]]).all()
