"""The DP-SGD signal the trainer computes (``clipped_gradient_sum`` with the layer hooks, in physical chunks)
equals a reference written here from the definition: each example's gradient by ``torch.func``
``vmap(grad(...))`` of its own loss, clipped to L2 norm C over ALL trainable parameters together, summed.

The model is a small EDM denoiser with every layer kind the hooks have a rule for: convolutions (3x3, 1x1,
stride 2, and the single-output-channel image conv), GroupNorm, Linear, Embedding, and a self-attention
block (its 1x1 q/k/v and output convs around a matmul and softmax). The reference shares nothing with the
engine but the loss and its randomness (the same generator stream, chunk by chunk)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from feta_release.config import ModelSection
from feta_release.models.edm import EDMLoss, build_denoiser
from feta_release.training.dpsgd import clipped_gradient_sum, select_engine
from tests.support.dpsgd import assert_same_gradients

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # a tiny model: OpenMP sync would dominate

IMG = (1, 8, 8)
CLASSES = 3


def _attention_denoiser(seed: int) -> nn.Module:
    """8x8 grey images, two levels, attention at 4x4; every weight perturbed (the zero-initialised output
    convs would otherwise leave residual branches with a zero gradient)."""
    torch.manual_seed(seed)
    cfg = ModelSection(channels=8, channel_mult=(1, 2), num_res_blocks=1, attn_resolutions=(4,))
    model = build_denoiser(cfg, IMG, CLASSES)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.train()


def _reference_per_example(
    model: nn.Module, loss: EDMLoss, x: Tensor, y: Tensor, chunk: int, seed: int
) -> dict[str, Tensor]:
    """Each example's gradient of its own loss (name -> (B, *shape)), the randomness drawn per chunk from
    ``seed``'s generator, in the engine's order."""
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    buffers = dict(model.named_buffers())

    def one(p: dict[str, Tensor], xi: Tensor, yi: Tensor, ri: dict[str, Tensor]) -> Tensor:
        return loss(lambda *a: functional_call(model, (p, buffers), a), xi, yi, ri)

    gen = torch.Generator().manual_seed(seed)
    rows: list[dict[str, Tensor]] = []
    for s in range(0, x.shape[0], chunk):
        rand = loss.draw(min(chunk, x.shape[0] - s), gen)
        rows.append(
            vmap(grad(one), in_dims=(None, 0, 0, 0))(params, x[s : s + chunk], y[s : s + chunk], rand)
        )
    return {n: torch.cat([r[n] for r in rows]) for n in params}


def _clipped_sum(per_example: dict[str, Tensor], clip: float) -> dict[str, Tensor]:
    """sum_i min(1, C / ||g_i||) g_i, the norm over all parameters together."""
    norms = torch.cat([g.flatten(1) for g in per_example.values()], dim=1).norm(dim=1)
    factor = torch.clamp(clip / norms, max=1.0)
    return {n: torch.einsum("b,b...->...", factor, g) for n, g in per_example.items()}


@settings(max_examples=10, deadline=None)
@given(
    b=st.integers(1, 5),
    k=st.integers(1, 2),
    chunk=st.integers(1, 4),
    clip_q=st.floats(0.05, 1.5),
    seed=st.integers(0, 2**16),
)
def test_the_hooks_clipped_sum_equals_a_per_example_reference_on_an_attention_denoiser(
    b, k, chunk, clip_q, seed
):
    model = _attention_denoiser(seed % 7)
    loss = EDMLoss(IMG, CLASSES, k)
    assert select_engine(model, loss, "hooks", check=True) == "hooks"
    g = torch.Generator().manual_seed(seed)
    x, y = torch.rand(b, *IMG, generator=g) * 2 - 1, torch.randint(0, CLASSES + 1, (b,), generator=g)
    per_example = _reference_per_example(model, loss, x, y, chunk, seed)
    norms = torch.cat([v.flatten(1) for v in per_example.values()], dim=1).norm(dim=1)
    clip = clip_q * float(norms.median())  # below the median: some examples clipped; above the max: none
    got, _, n_clipped = clipped_gradient_sum(
        model, loss, x, y, torch.arange(b), clip, chunk, torch.Generator().manual_seed(seed), engine="hooks"
    )
    # an example whose norm is the clip within rounding may be counted either way
    assert int((norms > clip * (1 + 1e-4)).sum()) <= n_clipped <= int((norms > clip * (1 - 1e-4)).sum())
    assert_same_gradients(got, _clipped_sum(per_example, clip))
