"""The hook engine (training.ghost_clip) is used only where its layer rules compute the torch.func vectors.

Its rules see a parameter only through its own module's forward, with the library's forward and default
options. A parameter used elsewhere (weight tying through ``F.linear(h, emb.weight)``), one registered in two
modules, a module option no rule implements (``Embedding(scale_grad_by_freq=True)``), a subclass with its own
forward, a forward hook, an extra parameter (the old ``weight_norm``) or a layer applied to rows that are not
the batch's (positions folded into the row axis: one example's gradient then sums other examples' rows, so the
clip no longer bounds one example's contribution) made the former engine return other vectors than torch.func,
silently. Now the static check refuses what it can see, and the trainer cross-checks the hooks against
torch.func ONCE, on a 2-example dummy batch drawn from a fixed public generator: ``auto`` then falls back to
torch.func, an explicit ``hooks`` is refused."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from feta_release.config import load_preset
from feta_release.errors import ConfigError
from feta_release.models.edm import EDMLoss, build_denoiser
from feta_release.training import dpsgd
from feta_release.training.dpsgd import DPSGDTrainer, per_example_grads, select_engine
from feta_release.training.ghost_clip import cross_check, hook_grads, unsupported
from tests.support.dpsgd import LayerStack as _Stack
from tests.support.dpsgd import RowLoss as _RowLoss
from tests.support.dpsgd import assert_same_gradients as _assert_same
from tests.support.dpsgd import dpsgd_job as _cfg

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # tiny models: see conftest

D = 2 * 7 * 7  # _RowLoss's rows are (2, 7, 7) images with 4 labels


class _Loss(_RowLoss):
    """``_RowLoss`` with the public dummy example the trainer's cross-check draws (labels in [0, 4))."""

    def example(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        return torch.randn(n, 2, 7, 7, generator=generator), torch.randint(0, 4, (n,), generator=generator)


class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, 3)

    def features(self, x: Tensor, sigma: Tensor) -> Tensor:
        return torch.tanh(self.lin(x.flatten(1) * sigma[:, None]))


class _TiedFunctional(_Base):
    """GPT-style tying: the embedding's weight is also the output projection, used through ``F.linear``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 3)

    def forward(self, x: Tensor, sigma: Tensor, labels: Tensor) -> Tensor:
        return F.linear(self.features(x, sigma) + self.emb(labels), self.emb.weight)


class _TwoModulesOneParameter(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.b.weight = self.a.weight

    def forward(self, x: Tensor, sigma: Tensor, labels: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(self.features(x, sigma))))


class _EmbeddingOption(_Base):
    def __init__(self, **options: object) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 3, **options)

    def forward(self, x: Tensor, sigma: Tensor, labels: Tensor) -> Tensor:
        return self.features(x, sigma) * self.emb(labels)


class _Out(_Base):
    """lin -> out; subclasses change how ``out`` computes (see the tests below)."""

    def __init__(self, out: nn.Module | None = None) -> None:
        super().__init__()
        self.out = out if out is not None else nn.Linear(3, 3)

    def forward(self, x: Tensor, sigma: Tensor, labels: Tensor) -> Tensor:
        return self.out(self.features(x, sigma))


class _Doubled(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, 2 * self.weight, self.bias)


class _FoldedRows(_Out):
    """The output layer over (rows x 2 positions) folded into ONE leading axis: a row of it is not a batch
    row."""

    def forward(self, x: Tensor, sigma: Tensor, labels: Tensor) -> Tensor:
        h = self.features(x, sigma)
        seq = torch.stack([h, -0.5 * h], 1).reshape(-1, 3)  # (2R, 3): row 2r + t is position t of batch row r
        return self.out(seq).reshape(-1, 2, 3).sum(1)


def _weight_norm() -> nn.Module:
    with warnings.catch_warnings():
        # torch deprecates it for the parametrization (which is refused anyway)
        warnings.simplefilter("ignore")
        return _Out(nn.utils.weight_norm(nn.Linear(3, 3)))


def _hooked() -> nn.Module:
    model = _Out()
    model.out.register_forward_hook(lambda m, i, o: 2 * o)
    return model


class _ExtraParameter(_Out):
    def __init__(self) -> None:
        super().__init__()
        self.out.gain = nn.Parameter(torch.ones(3))  # in no rule: the former hooks returned zeros for it

    def forward(self, x: Tensor, sigma: Tensor, labels: Tensor) -> Tensor:
        return super().forward(x, sigma, labels) * self.out.gain


class _SameModuleTwice(_Out):
    def __init__(self) -> None:
        super().__init__()
        self.again = self.out  # one module under two names: one owner, its two calls add up

    def forward(self, x: Tensor, sigma: Tensor, labels: Tensor) -> Tensor:
        return self.again(torch.tanh(super().forward(x, sigma, labels)))


def _batch(n: int = 4, k: int = 3, seed: int = 1) -> tuple[_Loss, Tensor, Tensor, dict[str, Tensor]]:
    loss, g = _Loss(k), torch.Generator().manual_seed(seed)
    # a repeated label (frequencies)
    x, y = torch.randn(n, 2, 7, 7, generator=g), torch.tensor([1, 1, 2, 1][:n])
    return loss, x, y, loss.draw(n, g)


def _trainer(model: nn.Module, loss: _Loss, engine: str = "auto") -> DPSGDTrainer:
    return DPSGDTrainer(
        model, _cfg(per_example=engine), 1.0, 0.5, torch.Generator().manual_seed(0), loss=loss
    )


def _the_trainers_vectors_are_torch_funcs(model: nn.Module) -> None:
    """The engine the trainer resolves ("auto") computes the torch.func per-example gradients, and an explicit
    "hooks" is refused with an error naming the option."""
    torch.manual_seed(0)
    loss, x, y, rand = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the cross-check's fall-back notice
        tr = _trainer(model, loss)
    got, _ = per_example_grads(model, loss, x, y, rand, engine=tr.engine)
    ref, _ = per_example_grads(model, loss, x, y, rand, engine="vmap")
    _assert_same(got, ref)
    assert tr.engine == "vmap"
    with pytest.raises(ConfigError, match="per_example"):
        _trainer(model, loss, "hooks")


def test_weight_tying_through_f_linear_is_caught_before_any_step():
    model = _TiedFunctional()
    loss, x, y, rand = _batch()
    hooks, _ = hook_grads(model, loss, x, y, rand)  # what the former engine used: the F.linear use is lost
    ref, _ = per_example_grads(model, loss, x, y, rand, engine="vmap")
    assert float((hooks["emb.weight"] - ref["emb.weight"]).norm()) > 0.1 * float(ref["emb.weight"].norm())
    assert "emb.weight" in (cross_check(model, loss) or "")
    _the_trainers_vectors_are_torch_funcs(model)


class _TiedTable(_Base):
    """``_TiedFunctional`` under another name: its fall-back message is its own (warned once per process)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(4, 3)

    def forward(self, x: Tensor, sigma: Tensor, labels: Tensor) -> Tensor:
        return F.linear(self.features(x, sigma) + self.table(labels), self.table.weight)


def test_the_fall_back_is_warned_once_and_an_explicit_hooks_refusal_is_one_line_naming_the_parameter(
    monkeypatch,
):
    monkeypatch.setattr(dpsgd, "_WARNED", set())  # once per process: this test's own process-wide record
    loss = _Loss(2)
    with pytest.warns(RuntimeWarning, match=r"torch\.func.*table\.weight is used 2 time"):
        assert _trainer(_TiedTable(), loss).engine == "vmap"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same fall-back again: silent
        assert _trainer(_TiedTable(), loss).engine == "vmap"
    with pytest.raises(ConfigError) as err:
        _trainer(_TiedTable(), loss, "hooks")
    assert (
        "\n" not in str(err.value)
        and "table.weight" in str(err.value)
        and str(err.value).endswith('or "vmap"')
    )


def test_a_parameter_registered_in_two_modules_is_refused_statically():
    # the former hooks happened to add the two modules' uses correctly (measured: 1e-7 off torch.func), but
    # which uses reach a shared parameter is not something the rules can see: refused, torch.func serves it
    model = _TwoModulesOneParameter()
    assert any("a.weight" in p and "b.weight" in p for p in unsupported(model)), unsupported(model)
    _the_trainers_vectors_are_torch_funcs(model)


def test_one_module_registered_under_two_names_keeps_the_hooks():
    model = _SameModuleTwice()
    loss, x, y, rand = _batch()
    assert unsupported(model) == [] and _trainer(model, loss).engine == "hooks"
    _assert_same(
        hook_grads(model, loss, x, y, rand)[0], per_example_grads(model, loss, x, y, rand, engine="vmap")[0]
    )


@pytest.mark.parametrize("option", ["scale_grad_by_freq", "max_norm", "sparse"])
def test_embedding_options_no_rule_implements_are_refused(option):
    value = 1.0 if option == "max_norm" else True
    model = _EmbeddingOption(**{option: value})
    assert any(option in p for p in unsupported(model)), unsupported(model)
    # the former rule ignored the frequency: a per-example gradient 3x too big
    if option == "scale_grad_by_freq":
        _the_trainers_vectors_are_torch_funcs(model)


@pytest.mark.parametrize(
    "model_fn, words",
    [
        (lambda: _Out(_Doubled(3, 3)), "forward"),
        (_hooked, "forward hook"),
        (_weight_norm, "weight_g"),
        (_ExtraParameter, "gain"),
    ],
)
def test_modules_whose_computation_the_rule_does_not_see_are_refused(model_fn, words):
    model = model_fn()
    assert any(words in p for p in unsupported(model)), unsupported(model)
    # the numbers see it too (belt and braces), except where the model cannot even be copied (the old
    # weight_norm)
    assert cross_check(model, _Loss(2)) is not None
    _the_trainers_vectors_are_torch_funcs(model)


def test_a_global_forward_hook_is_refused_while_it_is_registered():
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: o)
    try:
        assert any("global forward hook" in p for p in unsupported(_Out()))
    finally:
        handle.remove()
    assert unsupported(_Out()) == []


def test_a_model_the_hooks_cannot_run_falls_back_at_build_not_at_the_first_step():
    # F.silu(lin(x), inplace=True): the tap refuses it (loud)
    from tests.support.dpsgd import InPlaceAfterLinear as _InPlaceAfterLinear

    model = _InPlaceAfterLinear()
    assert "modified inplace" in (cross_check(model, _Loss(2)) or "")
    _the_trainers_vectors_are_torch_funcs(model)


@settings(max_examples=15, deadline=None)
@given(
    k=st.integers(1, 3),
    c=st.sampled_from([1, 2, 4, 6]),
    kernel=st.integers(1, 3),
    stride=st.integers(1, 2),
    padding=st.integers(0, 1),
    dilation=st.integers(1, 2),
    bias=st.booleans(),
    padding_idx=st.sampled_from([None, 0]),
)
def test_the_cross_check_accepts_every_supported_layer_configuration(
    k, c, kernel, stride, padding, dilation, bias, padding_idx
):
    # no false alarm (the fall-back would cost speed; an explicit "hooks" would be refused): every rule, its
    # options
    model = _Stack(c, kernel, stride, padding, dilation, bias, 2 if c % 2 == 0 else 1, padding_idx)
    assert unsupported(model) == [] and cross_check(model, _Loss(k)) is None


def test_a_layer_over_folded_rows_fails_the_cross_check():
    # no static check sees it (every module is supported); only the numbers do: one example's gradient summed
    # other examples' rows, the one case where the clip no longer bounded one example's contribution
    model = _FoldedRows()
    assert unsupported(model) == []
    assert "out." in (cross_check(model, _Loss(2)) or "")
    _the_trainers_vectors_are_torch_funcs(model)


def test_the_cross_check_passes_on_the_real_denoiser_and_leaves_everything_as_it_was():
    torch.manual_seed(0)
    model = build_denoiser(load_preset("cpu-eps1").model, (1, 28, 28), 10)
    model.eval()
    loss = EDMLoss((1, 28, 28), 10, 4)
    state = {n: v.clone() for n, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    assert cross_check(model, loss) is None
    assert select_engine(model, loss, "hooks", check=True) == "hooks"
    assert not model.training  # its mode is the caller's
    # no global draw (the dummy batch has its own generator)
    assert torch.equal(torch.random.get_rng_state(), rng)
    for n, v in model.state_dict().items():
        assert torch.equal(v, state[n]), n


def test_the_trainer_keeps_the_hooks_and_its_generator_where_the_check_passes():
    from tests.support.dpsgd import SHAPE, TinyDenoiser

    gen = torch.Generator().manual_seed(7)
    before = gen.get_state()
    tr = DPSGDTrainer(TinyDenoiser(), _cfg(), 1.0, 0.5, gen, image_shape=SHAPE, n_classes=3)
    assert tr.engine == "hooks"
    assert torch.equal(gen.get_state(), before)  # the check never draws from the private stream


def test_a_loss_without_a_dummy_example_cannot_be_cross_checked():
    model = _Out()
    assert select_engine(model, _RowLoss(2), "auto") == "hooks"  # the static selection alone
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert select_engine(model, _RowLoss(2), "auto", check=True) == "vmap"
    with pytest.raises(ConfigError, match="example"):
        select_engine(model, _RowLoss(2), "hooks", check=True)
    assert select_engine(model, _Loss(2), "hooks", check=True) == "hooks"
