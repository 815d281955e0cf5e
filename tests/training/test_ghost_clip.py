"""The layer-hook per-example gradients (training.ghost_clip) are the torch.func ones: same vectors, same
clipped sum.

The DP-SGD privacy argument needs each example's gradient (of its K-draw mean loss) clipped to C before the
noise; the hook engine must compute exactly the vectors the torch.func path computes, on the real denoiser and
on random small layers, and must never skip a trainable parameter (unsupported layers fall back or are
refused)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from feta_release.config import JobConfig, load_preset
from feta_release.errors import ConfigError
from feta_release.models.edm import EDMLoss, build_denoiser
from feta_release.training.dpsgd import (
    DPSGDTrainer,
    clip_and_sum,
    clipped_gradient_sum,
    per_example_grads,
    select_engine,
)
from feta_release.training.ghost_clip import _group_norm_stats, hook_grads, unsupported
from tests.support.dpsgd import SHAPE, TinyDenoiser
from tests.support.dpsgd import InPlaceAfterLinear as _InPlaceAfterLinear
from tests.support.dpsgd import LayerStack as _Stack
from tests.support.dpsgd import RowLoss as _RowLoss
from tests.support.dpsgd import assert_same_gradients as _assert_same
from tests.support.dpsgd import dpsgd_batch as _data
from tests.support.dpsgd import dpsgd_job as _cfg

IMG = (1, 28, 28)


def _denoiser(seed: int = 0) -> nn.Module:
    """The cpu-eps1 denoiser with every weight perturbed: the zero-initialised output convs would otherwise
    leave whole residual branches with zero gradient, and a comparison of zeros proves nothing."""
    torch.manual_seed(seed)
    model = build_denoiser(load_preset("cpu-eps1").model, IMG, 10)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("k", [1, 4])
def test_the_real_denoisers_clipped_sum_equals_the_torch_func_one(k):
    model = _denoiser()
    loss = EDMLoss(IMG, 10, k)
    g = torch.Generator().manual_seed(3)
    x, y = torch.rand(6, *IMG, generator=g) * 2 - 1, torch.randint(0, 10, (6,), generator=g)
    rand = loss.draw(6, g)
    hooks, lh = per_example_grads(model, loss, x, y, rand, 6, engine="hooks")
    ref, lr = per_example_grads(model, loss, x, y, rand, 4, engine="vmap")
    _assert_same(hooks, ref)
    assert torch.allclose(lh, lr, rtol=1e-5, atol=1e-6)
    norms = torch.stack([v.flatten(1).pow(2).sum(1) for v in ref.values()]).sum(0).sqrt()
    clip = float(norms.median())  # some examples clipped, some not
    s_hooks, n_hooks = clip_and_sum(hooks, clip)
    s_ref, n_ref = clip_and_sum(ref, clip)
    assert (n_ref > clip).any() and (n_ref < clip).any()
    assert torch.allclose(n_hooks, n_ref, rtol=1e-4)
    _assert_same(s_hooks, s_ref)


def test_every_trainable_parameter_of_the_denoiser_gets_its_gradient_and_frozen_ones_none():
    model = _denoiser(1)
    model.net.map0.bias.requires_grad_(False)
    loss = EDMLoss(IMG, 10, 2)
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(3, *IMG, generator=g) * 2 - 1, torch.randint(0, 10, (3,), generator=g)
    grads, _ = per_example_grads(model, loss, x, y, loss.draw(3, g), engine="hooks")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert list(grads) == trainable and "net.map0.bias" not in grads
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert grads[n].shape == (3, *p.shape) and bool(grads[n].abs().sum() > 0), n


def test_the_trainers_step_is_the_same_with_either_engine():
    x, y = _data(12, seed=5)
    out = []
    for engine in ("hooks", "vmap"):
        torch.manual_seed(0)
        model = TinyDenoiser()
        tr = DPSGDTrainer(
            model,
            _cfg(per_example=engine),
            1.1,
            0.5,
            torch.Generator().manual_seed(7),
            image_shape=SHAPE,
            n_classes=3,
            n_public=12,
        )
        assert tr.engine == engine
        tr.run(x, y, 3)
        out.append(tr.ema_model().state_dict())
    for n in out[0]:
        assert torch.allclose(out[0][n], out[1][n], rtol=1e-4, atol=1e-6), n


def test_clipped_gradient_sum_with_either_engine_draws_the_same_stream():
    model, loss = TinyDenoiser(), EDMLoss(SHAPE, 3, 3)
    x, y = _data(9, seed=2)
    idx = torch.arange(9)
    a, _, ca = clipped_gradient_sum(
        model, loss, x, y, idx, 0.05, 4, torch.Generator().manual_seed(1), "hooks"
    )
    b, _, cb = clipped_gradient_sum(model, loss, x, y, idx, 0.05, 4, torch.Generator().manual_seed(1), "vmap")
    assert ca == cb
    _assert_same(a, b)


class _LayerNormed(TinyDenoiser):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(6)

    def forward(self, x: Tensor, sigma: Tensor, labels: Tensor) -> Tensor:
        return self.ln(super().forward(x, sigma, labels))


class _BatchNormed(TinyDenoiser):
    def __init__(self) -> None:
        super().__init__()
        # no parameter, but mixes the rows
        self.bn = nn.BatchNorm2d(1, affine=False, track_running_stats=False)

    def forward(self, x: Tensor, sigma: Tensor, labels: Tensor) -> Tensor:
        return self.bn(super().forward(x, sigma, labels))


class _NoBatched:
    """A per-example loss without a batched form (only the torch.func path can use it)."""

    def __init__(self) -> None:
        self.inner = EDMLoss(SHAPE, 3, 1)

    def draw(self, n: int, generator: torch.Generator) -> dict[str, Tensor]:
        return self.inner.draw(n, generator)

    def __call__(self, model: Callable[..., Tensor], x: Tensor, y: Tensor, rand: dict[str, Tensor]) -> Tensor:
        return self.inner(model, x, y, rand)


@pytest.mark.parametrize("model_cls", [_LayerNormed, _BatchNormed])
def test_unsupported_layers_fall_back_to_torch_func_or_are_refused(model_cls):
    model, loss = model_cls(), EDMLoss(SHAPE, 3, 2)
    assert unsupported(model)
    assert select_engine(model, loss, "auto") == "vmap"
    with pytest.raises(ConfigError, match="per_example"):
        select_engine(model, loss, "hooks")
    with pytest.raises(ConfigError, match="per_example"):
        DPSGDTrainer(
            model, _cfg(per_example="hooks"), 1.0, 0.5, torch.Generator(), image_shape=SHAPE, n_classes=3
        )
    tr = DPSGDTrainer(model, _cfg(), 1.0, 0.5, torch.Generator(), image_shape=SHAPE, n_classes=3)
    assert tr.engine == "vmap"
    x, y = _data(4)
    grads, _ = per_example_grads(model, loss, x, y, loss.draw(4, torch.Generator()), engine="auto")
    assert list(grads) == [n for n, p in model.named_parameters() if p.requires_grad]  # the LayerNorm's too


def test_a_loss_without_a_batched_form_uses_torch_func_and_the_engine_name_is_checked():
    assert select_engine(TinyDenoiser(), _NoBatched(), "auto") == "vmap"
    assert select_engine(TinyDenoiser(), EDMLoss(SHAPE, 3, 1), "auto") == "hooks"
    with pytest.raises(ConfigError, match="per_example"):
        select_engine(TinyDenoiser(), _NoBatched(), "hooks")
    with pytest.raises(ConfigError, match="per_example"):
        select_engine(TinyDenoiser(), EDMLoss(SHAPE, 3, 1), "fast")
    with pytest.raises(ConfigError):
        JobConfig().replace(dpsgd={"per_example": "fast"})


# -- property: random small layers
# ------------------------------------------------------------------------------


class _ExampleMajorRows(_RowLoss):
    """The row layout before K-major (rows of example i are i*K .. i*K+K-1): read K-major, an "example"
    gradient would sum rows of several examples (one example reaching several clipped vectors)."""

    row_order = "example-major"

    def batched(self, model: Callable[..., Tensor], x: Tensor, y: Tensor, rand: dict[str, Tensor]) -> Tensor:
        b = x.shape[0]
        rows = (x.unsqueeze(1) + rand["noise"]).reshape(b * self.k, *x.shape[1:])
        out = model(rows, rand["sigma"].reshape(-1), y.unsqueeze(1).expand(b, self.k).reshape(-1))
        return out.pow(2).sum(1).reshape(b, self.k).mean(1)


def test_a_batched_loss_that_does_not_declare_k_major_rows_never_reaches_the_hooks():
    model = _Stack(4, 3, 1, 1, 1, True, 2, None)
    assert select_engine(model, _RowLoss(2), "auto") == "hooks"
    assert select_engine(model, _ExampleMajorRows(2), "auto") == "vmap"
    with pytest.raises(ConfigError, match="K-major"):
        select_engine(model, _ExampleMajorRows(2), "hooks")


def test_the_group_norm_rule_without_the_forwards_saved_statistics_recomputes_the_same_ones():
    norm = nn.GroupNorm(3, 6)
    a = torch.randn(8, 6, 5, 5) * 3 + 1
    out = norm(a.requires_grad_())
    saved = _group_norm_stats(norm, a.detach(), out)
    with torch.no_grad():  # no autograd node: the stats come from the native op again
        again = _group_norm_stats(norm, a.detach(), norm(a))
    for s, t in zip(saved, again):
        assert s.shape == (8, 3) and torch.allclose(s, t, rtol=1e-6, atol=1e-7)


def test_a_model_that_changes_a_layer_output_in_place_is_refused_not_given_wrong_gradients():
    # asking autograd for the gradient of an output changed in place gives that of the changed values: the
    # former hooks returned such wrong per-example gradients without a word
    model, loss = _InPlaceAfterLinear(), _RowLoss(2)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 2, 7, 7, generator=g), torch.randint(0, 4, (3,), generator=g)
    with pytest.raises(RuntimeError, match="modified inplace"):
        hook_grads(model, loss, x, y, loss.draw(3, g))
    # the torch.func path still serves it
    per_example_grads(model, loss, x, y, loss.draw(3, g), engine="vmap")


def test_hook_gradients_under_no_grad_raise_rather_than_return_zeros():
    model, loss = _Stack(4, 3, 1, 1, 1, True, 2, None), _RowLoss(2)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 2, 7, 7, generator=g), torch.randint(0, 4, (2,), generator=g)
    with torch.no_grad(), pytest.raises(RuntimeError):
        hook_grads(model, loss, x, y, loss.draw(2, g))


@settings(max_examples=25, deadline=None)
@example(
    b=3, k=3, c=6, kernel=1, stride=1, padding=0, dilation=1, bias=True, padding_idx=None, seed=1, clip_q=0.5
)
@example(
    b=4, k=2, c=1, kernel=3, stride=1, padding=1, dilation=1, bias=True, padding_idx=0, seed=2, clip_q=0.5
)
@given(
    b=st.integers(1, 5),
    k=st.integers(1, 3),
    c=st.sampled_from([1, 2, 4, 6]),
    kernel=st.integers(1, 3),
    stride=st.integers(1, 2),
    padding=st.integers(0, 1),
    dilation=st.integers(1, 2),
    bias=st.booleans(),
    padding_idx=st.sampled_from([None, 0]),
    seed=st.integers(0, 2**16),
    clip_q=st.floats(0.1, 0.9),
)
def test_hook_gradients_equal_torch_func_on_random_layers(
    b, k, c, kernel, stride, padding, dilation, bias, padding_idx, seed, clip_q
):
    torch.manual_seed(seed)
    model = _Stack(c, kernel, stride, padding, dilation, bias, 2 if c % 2 == 0 else 1, padding_idx)
    loss = _RowLoss(k)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(b, 2, 7, 7, generator=g), torch.randint(0, 4, (b,), generator=g)
    rand = loss.draw(b, g)
    assert not unsupported(model) and select_engine(model, loss) == "hooks"
    hooks, lh = hook_grads(model, loss, x, y, rand)
    ref, lr = per_example_grads(model, loss, x, y, rand, engine="vmap")
    _assert_same(hooks, ref)
    assert torch.allclose(lh, lr, rtol=1e-5, atol=1e-5)
    norms = torch.stack([v.flatten(1).pow(2).sum(1) for v in ref.values()]).sum(0).sqrt()
    clip = float(torch.quantile(norms, clip_q)) + 1e-6
    _assert_same(clip_and_sum(hooks, clip)[0], clip_and_sum(ref, clip)[0])
