"""``[auxgen] restarts`` / ``keep``: several fits of the same release, the lowest-loss ones kept
(post-processing)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.config import JobConfig, load_preset
from feta_release.errors import ConfigError
from feta_release.models.auxgen import AuxEnsemble, AuxGenerator, new_aux_model
from feta_release.training.frequency import AUX_DRAW_BATCH, aux_draw, fit_aux_generator, fit_aux_restarts
from tests.support.single_thread import single_thread  # noqa: F401  (autouse fixture)
from tests.support.training import AUX, job
from tests.support.training import frequency_release as _release

SMALL = {**AUX, "epochs": 2, "iterations_per_epoch": 6}


def _fit_inputs():
    rel, _, _ = _release()
    return torch.from_numpy(rel.embedding), rel.omega()


def test_a_single_fit_hashes_as_before_the_option_existed() -> None:
    tiny = load_preset("tiny")
    assert "restarts" not in tiny.to_dict()["auxgen"] and "keep" not in tiny.to_dict()["auxgen"]
    three = tiny.replace(auxgen={"restarts": 3, "keep": 2})
    assert three.to_dict()["auxgen"]["restarts"] == 3 and JobConfig.from_dict(three.to_dict()) == three


@pytest.mark.parametrize("restarts, keep", [(0, 1), (2, 3), (2, 0)])
def test_keep_outside_one_to_restarts_is_refused_in_one_line(restarts: int, keep: int) -> None:
    with pytest.raises(ConfigError, match=f"restarts {restarts}, keep {keep}"):
        job(auxgen={**SMALL, "restarts": restarts, "keep": keep})


def test_one_restart_is_the_plain_fit() -> None:
    emb, omega = _fit_inputs()
    cfg = job(auxgen=SMALL)
    one = fit_aux_restarts(emb, omega, (1, 8, 8), 2, cfg, 6, generator=torch.Generator().manual_seed(3))
    plain = fit_aux_generator(emb, omega, (1, 8, 8), 2, cfg, 6, generator=torch.Generator().manual_seed(3))
    assert isinstance(one, AuxGenerator)
    for a, b in zip(one.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_the_kept_fits_are_the_lowest_final_losses_in_order() -> None:
    """Replays the restarts one by one from the same generator stream and checks the choice independently."""
    emb, omega = _fit_inputs()
    cfg = job(auxgen={**SMALL, "restarts": 3, "keep": 2})
    g = torch.Generator().manual_seed(5)
    fits = [
        fit_aux_generator(emb, omega, (1, 8, 8), 2, cfg, 6, generator=g, return_result=True) for _ in range(3)
    ]
    losses = [float(np.mean(f.losses[-6:])) for f in fits]
    want = [fits[i].generator for i in np.argsort(losses, kind="stable")[:2]]
    steps: list[tuple[int, int]] = []
    got = fit_aux_restarts(
        emb,
        omega,
        (1, 8, 8),
        2,
        cfg,
        6,
        generator=torch.Generator().manual_seed(5),
        progress=lambda i, n, loss: steps.append((i, n)),
    )
    assert isinstance(got, AuxEnsemble) and len(got.members) == 2 and not got.training
    for member, ref in zip(got.members, want, strict=True):
        for a, b in zip(member.state_dict().values(), ref.state_dict().values(), strict=True):
            assert torch.equal(a, b)
    assert steps == [(i, 36) for i in range(1, 37)]  # one count over all three fits


@settings(max_examples=15, deadline=None)
@given(k=st.integers(2, 4), n=st.integers(1, 11), seed=st.integers(0, 2**16))
def test_an_ensemble_draws_the_jth_row_of_a_class_from_member_j_mod_k(k: int, n: int, seed: int) -> None:
    torch.manual_seed(seed)
    members = [AuxGenerator(1, 8, 3, z_dim=4, width=4).eval() for _ in range(k)]
    ens = AuxEnsemble(members).eval()
    z, y = torch.randn(n, 4), torch.randint(0, 3, (n,))
    seen = [0, 0, 0]
    with torch.no_grad():
        out = ens(z, y)
        for i in range(n):
            c = int(y[i])
            assert torch.allclose(out[i], members[seen[c] % k](z[i : i + 1], y[i : i + 1])[0], atol=1e-6)
            seen[c] += 1
    x = aux_draw(ens, y.numpy(), torch.Generator().manual_seed(seed))
    assert x.shape == (n, 1, 8, 8) and 0 <= float(x.min()) and float(x.max()) <= 1


@pytest.mark.parametrize("k", [2, 3, 4])
def test_a_draw_in_passes_gives_each_row_the_member_of_one_call(k: int) -> None:
    """A draw longer than one pass (``AUX_DRAW_BATCH``) keeps counting each label's occurrences across the
    passes: row i goes to the member one call over all the labels would give it, so the pass size changes no
    image (the cell prototypes and the warm-up set are the seed's)."""
    torch.manual_seed(0)
    ens = AuxEnsemble([AuxGenerator(1, 8, 3, z_dim=4, width=4).eval() for _ in range(k)]).eval()
    n = 2 * AUX_DRAW_BATCH + 57
    labels = torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(1))
    drawn = aux_draw(ens, labels.numpy(), torch.Generator().manual_seed(2))
    z = torch.randn((n, 4), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        one_call = ens(z, labels).float().clamp(0, 1)
    assert torch.allclose(drawn, one_call, atol=1e-6)  # the same member per row; float rounding aside


def test_a_class_interleaved_draw_gives_every_member_every_class() -> None:
    """The synthetic set's labels run 0, 1, ..., K-1, 0, 1, ...: a row-index rule would give member 0 only the
    even classes of a 2-member ensemble."""
    members = [AuxGenerator(1, 8, 4, z_dim=4, width=4).eval() for _ in range(2)]
    calls: list[set[int]] = []
    for m in members:
        m.register_forward_hook(lambda _m, args, _out: calls.append(set(args[1].tolist())))
    with torch.no_grad():
        AuxEnsemble(members)(torch.randn(16, 4), torch.arange(16) % 4)
    assert calls == [{0, 1, 2, 3}, {0, 1, 2, 3}]


def test_an_ensemble_of_other_shapes_is_refused() -> None:
    with pytest.raises(ConfigError, match="same shape"):
        AuxEnsemble([AuxGenerator(1, 8, 3, z_dim=4, width=4), AuxGenerator(1, 8, 3, z_dim=4, width=8)])
    with pytest.raises(ConfigError, match=">= 2"):
        AuxEnsemble([AuxGenerator(1, 8, 3, z_dim=4, width=4)])


def test_a_checkpointed_ensemble_loads_into_the_model_the_job_builds() -> None:
    """What ``stages.freq_warmup`` does on resume: the saved state dict into
    ``new_aux_model(members=keep)``."""
    saved = AuxEnsemble([AuxGenerator(1, 8, 3, z_dim=4, width=4) for _ in range(3)]).state_dict()
    fresh = new_aux_model(1, 8, 3, z_dim=4, width=4, members=3)
    fresh.load_state_dict(saved)
    assert isinstance(new_aux_model(1, 8, 3, z_dim=4, width=4), AuxGenerator)
    with pytest.raises(RuntimeError):
        new_aux_model(1, 8, 3, z_dim=4, width=4, members=2).load_state_dict(saved)


def test_a_diverged_fit_is_never_kept_before_a_finite_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN compares false both ways, so a sort by raw loss could keep a diverged start; it sorts last."""
    import feta_release.training.frequency as freq

    finals = iter([float("nan"), 2.0, 1.0])
    made: list[AuxGenerator] = []

    def fake_fit(*_a, **_k):
        made.append(AuxGenerator(1, 8, 2, z_dim=4, width=4))
        return freq.AuxFitResult(generator=made[-1], losses=[next(finals)] * 6, steps=6)

    monkeypatch.setattr(freq, "fit_aux_generator", fake_fit)
    cfg = job(auxgen={**SMALL, "epochs": 1, "restarts": 3, "keep": 2})
    got = fit_aux_restarts(None, None, (1, 8, 8), 2, cfg, 6, generator=torch.Generator())
    assert isinstance(got, AuxEnsemble) and list(got.members) == [made[2], made[1]]
