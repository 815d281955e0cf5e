"""Patient-level DP-SGD: patients Poisson-sampled, each patient's summed gradient clipped to C, noise sigma*C
on the sum, divided by q x the PUBLIC number of patients; the event's unit is the patient (no group
conversion) and image-level runs are unchanged."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.accounting import PrivacyEvent, epsilon, events_from_list, group_epsilon
from feta_release.config import JobConfig, load_preset
from feta_release.errors import ConfigError, PrivacyError
from feta_release.planning import plan, stage_events
from feta_release.privacy_unit import PatientIndex, PrivacyUnit, group_patient_rows
from feta_release.training.dpsgd import DPSGDTrainer, patient_batch
from tests.support.dpsgd import DotLoss, Weights


class ZeroGradLoss(DotLoss):
    def __call__(self, model, x, y, rand):  # noqa: ANN001, ANN204
        return (model(x) * 0.0).sum()


def _cfg(clip: float = 1.0, physical_batch: int = 4) -> JobConfig:
    return JobConfig().replace(dpsgd={"batch": 4, "steps": 3, "physical_batch": physical_batch, "clip": clip})


def _trainer(
    d: int,
    sigma: float,
    q: float,
    ids: np.ndarray,
    n_public: int,
    cap: int,
    seed: int = 0,
    loss: object | None = None,
    clip: float = 1.0,
) -> DPSGDTrainer:
    return DPSGDTrainer(
        Weights(d),
        _cfg(clip),
        sigma,
        q,
        torch.Generator().manual_seed(seed),
        loss=loss or DotLoss(),
        n_public=n_public,
        patient_rows=group_patient_rows(ids),
        images_per_patient=cap,
    )


def test_noise_std_on_the_patient_sum_is_sigma_c_over_public_expected_batch() -> None:
    d, sigma, clip, q = 20_000, 2.5, 0.7, 0.3
    ids = np.repeat(np.arange(40), 3)  # 40 patients x 3 images; the public count says 50
    tr = _trainer(d, sigma, q, ids, n_public=50, cap=3, seed=4, loss=ZeroGradLoss(), clip=clip)
    noisy, stats = tr.noisy_gradient(torch.randn(len(ids), d), torch.zeros(len(ids), dtype=torch.int64))
    v = noisy["w"]
    want = sigma * clip / (q * 50)  # q x PUBLIC patients (15), never q x 40 nor q x 120 images
    # 20,000 iid normal draws: relative s.e. of the sample std ~0.5 %; 3 % is > 5 s.e.
    assert float(v.std()) == pytest.approx(want, rel=0.03)
    assert abs(float(v.mean())) < 5 * want / math.sqrt(d)
    assert stats.expected_batch == pytest.approx(15.0)


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=8),
    many=st.integers(1, 40),
    scale=st.floats(0.5, 50.0),
    seed=st.integers(0, 10_000),
)
def test_adding_a_patient_with_many_images_moves_the_sum_by_at_most_c(
    sizes: list[int], many: int, scale: float, seed: int
) -> None:
    """q = 1 and (almost) no noise: the released sum x expected batch is the clipped sum itself."""
    d, clip = 12, 1.0
    rng = np.random.default_rng(seed)
    ids = np.repeat(np.arange(len(sizes)), sizes)
    x = torch.from_numpy(rng.normal(size=(len(ids), d)) * scale).float()
    # the added patient: ``many`` images all pointing the same way, each far beyond the clip
    extra = torch.from_numpy(np.tile(rng.normal(size=d) * 10 * scale, (many, 1))).float()
    ids2 = np.concatenate([ids, np.full(many, len(sizes))])
    x2 = torch.cat([x, extra])
    cap = max(max(sizes), many)  # every image used, so the cap does not hide anything
    outs = []
    for ii, xx in ((ids, x), (ids2, x2)):
        tr = _trainer(d, 1e-9, 1.0, ii, n_public=1, cap=cap)
        g, _ = tr.noisy_gradient(xx, torch.zeros(len(ii), dtype=torch.int64))
        outs.append(g["w"].double())  # divided by q x n_public = 1
    assert float((outs[1] - outs[0]).norm()) <= clip * (1 + 1e-5)
    # and an image-level trainer on the same data moves by up to ``many`` x C: why the unit matters
    if many > 1:
        img = [
            DPSGDTrainer(
                Weights(d),
                _cfg(clip),
                1e-9,
                1.0,
                torch.Generator().manual_seed(0),
                loss=DotLoss(),
                n_public=1,
            ).noisy_gradient(xx, torch.zeros(len(xx), dtype=torch.int64))[0]["w"]
            for xx in (x, x2)
        ]
        assert float((img[1] - img[0]).norm()) == pytest.approx(many * clip, rel=1e-4)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=30),
    cap=st.integers(1, 5),
    q=st.floats(0.05, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_patient_sampler_takes_whole_capped_patients(sizes: list[int], cap: int, q: float, seed: int) -> None:
    ids = np.repeat(np.arange(len(sizes)), sizes)
    rows_of = [torch.from_numpy(np.flatnonzero(ids == p)) for p in range(len(sizes))]
    rows, owner = patient_batch(rows_of, q, cap, torch.Generator().manual_seed(seed))
    assert rows.numel() == owner.numel()
    if owner.numel():
        assert owner.tolist() == sorted(owner.tolist()) and set(owner.tolist()) == set(
            range(int(owner.max()) + 1)
        )
    for j in owner.unique().tolist():
        mine = rows[owner == j].numpy()
        patient = set(ids[mine].tolist())
        assert len(patient) == 1  # one sampled patient's images are all that patient's
        p = patient.pop()
        assert len(mine) == min(cap, sizes[p]) and len(set(mine.tolist())) == len(mine)  # capped, no repeats


def test_patient_sampling_rate_is_q() -> None:
    n, q, draws = 200, 0.15, 300
    rows_of = [torch.tensor([i]) for i in range(n)]
    gen = torch.Generator().manual_seed(1)
    counts = [int(patient_batch(rows_of, q, 1, gen)[1].numel()) for _ in range(draws)]
    mean = float(np.mean(counts))
    se = math.sqrt(n * q * (1 - q) / draws)  # binomial: each patient independently with probability q
    assert abs(mean - n * q) < 5 * se
    # Poisson, not a fixed size
    assert float(np.std(counts)) == pytest.approx(math.sqrt(n * q * (1 - q)), rel=0.2)


@settings(max_examples=20, deadline=None)
@given(exact=st.integers(1, 60), public=st.integers(1, 500), q=st.floats(0.01, 1.0))
def test_only_public_counts_leave(exact: int, public: int, q: float) -> None:
    """The divisor is q x the PUBLIC patient count whatever the exact count; no public count: refused."""
    ids = np.arange(exact)
    tr = _trainer(3, 1.0, q, ids, n_public=public, cap=2, loss=ZeroGradLoss())
    _, stats = tr.noisy_gradient(torch.zeros(exact, 3), torch.zeros(exact, dtype=torch.int64))
    assert stats.expected_batch == pytest.approx(q * public)
    with pytest.raises(ConfigError, match="PUBLIC number of patients"):
        DPSGDTrainer(
            Weights(3),
            _cfg(),
            1.0,
            q,
            torch.Generator(),
            loss=DotLoss(),
            patient_rows=group_patient_rows(ids),
        )
    with pytest.raises(PrivacyError):
        PatientIndex(ids, 0, 2)


def test_physical_chunks_never_split_a_patient() -> None:
    """A patient's images straddling a physical chunk would be clipped in two halves (sensitivity 2C)."""
    d = 5
    ids = np.repeat(np.arange(3), [3, 3, 3])
    x = torch.zeros(9, d)
    # each image 1 along e_0: a patient's sum is 3, clipped to 1; halves would give 2 (e.g. 2 + 1)
    x[:, 0] = 1.0
    tr = DPSGDTrainer(
        Weights(d),
        _cfg(1.0, physical_batch=2),
        1e-9,
        1.0,
        torch.Generator().manual_seed(0),
        loss=DotLoss(),
        n_public=1,
        patient_rows=group_patient_rows(ids),
        images_per_patient=3,
    )
    g, stats = tr.noisy_gradient(x, torch.zeros(9, dtype=torch.int64))
    assert float(g["w"][0]) == pytest.approx(3.0, rel=1e-6) and stats.batch_size == 3
    assert stats.clipped_fraction == 1.0


def test_image_level_events_and_epsilon_are_unchanged() -> None:
    """Image-level events serialise without a unit (as before) and the patient plan has the same sigma, q,
    steps and epsilon, only the unit differs."""
    cfg = load_preset("cpu-eps1")  # central + frequency warm-up, calibrated DP-SGD
    img = stage_events(cfg, 2000)
    pat = stage_events(cfg, 2000, dpsgd_unit="patient")
    assert all(set(e.to_dict()) == {"stage", "sigma", "q", "steps"} for e in img)
    assert [(e.stage, e.sigma, e.q, e.steps) for e in img] == [(e.stage, e.sigma, e.q, e.steps) for e in pat]
    assert [e.unit for e in pat if e.stage == "dpsgd"] == ["patient"] and img[-1].unit == "image"
    assert events_from_list([e.to_dict() for e in pat]) == pat  # the unit round-trips
    old_style = [PrivacyEvent(e.stage, e.sigma, e.q, e.steps) for e in img]  # what an earlier version wrote
    assert epsilon(img, 1e-5) == epsilon(old_style, 1e-5) == epsilon(pat, 1e-5)
    p_img, p_pat = plan(cfg, 2000), plan(cfg, 2000, dpsgd_unit="patient")
    assert p_img.epsilon == p_pat.epsilon and "PATIENT" in p_pat.stage("dpsgd").note
    assert "unit" not in str(p_img.to_dict()["history"])


def test_patient_statement_does_not_group_convert_dpsgd() -> None:
    p = plan(load_preset("cpu-eps1"), 2000, dpsgd_unit="patient")
    only_sgd = [e for e in p.events if e.stage == "dpsgd"]
    st1 = PrivacyUnit("patient", 5).statement(epsilon(only_sgd, 1e-5), 1e-5, only_sgd)
    assert st1["epsilon_per_patient"] == pytest.approx(epsilon(only_sgd, 1e-5))  # no 5 x
    mixed = PrivacyUnit("patient", 5).statement(p.epsilon, p.delta, p.events)
    warm = [e for e in p.events if e.unit == "image"]
    assert warm  # the preset has a warm-up: group 5 for it, DP-SGD direct, basic composition
    # the warm-up's group figure at δ/2 (per-record δ chosen so the patient's δ is δ/2), DP-SGD's at δ/2
    if warm:
        want = group_epsilon(warm, p.delta / 2, 5) + epsilon(only_sgd, p.delta / 2)
        assert mixed["epsilon_per_patient"] == pytest.approx(want) and mixed["delta_per_patient"] == p.delta
        assert (
            mixed["epsilon_per_patient"]
            < PrivacyUnit("patient", 5).statement(p.epsilon, p.delta)["epsilon_per_patient"]
        )


def test_release_statements_name_the_unit() -> None:
    """The certificate's PNG text and the report's paragraph say "patient" only for patient-level DP-SGD
    events."""
    from feta_release.release.certificate import epsilon_line
    from feta_release.release.report import _unit_paragraph

    img = [
        {"stage": "central", "sigma": 8.0, "q": 0.1, "steps": 1},
        {"stage": "dpsgd", "sigma": 2.0, "q": 0.01, "steps": 100},
    ]
    pat = [img[0], {**img[1], "unit": "patient"}]
    site = {"site_id": "a", "epsilon": 1.0, "delta": 1e-5, "accountant": "rdp"}
    line_img, line_pat = epsilon_line([{**site, "events": img}]), epsilon_line([{**site, "events": pat}])
    assert "unit = one image of that site" in line_img and "patient" not in line_img
    assert "one patient of that site for DP-SGD" in line_pat and line_pat.isascii()
    assert "PATIENT" in _unit_paragraph([{"events": pat}]) and "PATIENT" not in _unit_paragraph(
        [{"events": img}]
    )


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=8),
    physical=st.integers(1, 7),
    seed=st.integers(0, 2**16),
)
def test_a_patient_straddling_physical_calls_is_clipped_once_whole(
    sizes: list[int], physical: int, seed: int
) -> None:
    """The real images go through calls of exactly ``physical_batch`` rows, so a patient may straddle
    calls (one, two or many); its partial sums are carried and the clip applies to the WHOLE patient's sum:
    the step equals the sum over patients of clip(sum of their gradients), whatever the layout and call
    size."""
    d, clip = 3, 1.0
    ids = np.repeat(np.arange(len(sizes)), sizes)
    x = torch.randn(len(ids), d, generator=torch.Generator().manual_seed(seed)) * 0.8
    tr = DPSGDTrainer(
        Weights(d),
        _cfg(clip, physical_batch=physical),
        1e-9,
        1.0,
        torch.Generator().manual_seed(0),
        loss=DotLoss(),
        n_public=len(sizes),
        patient_rows=group_patient_rows(ids),
        images_per_patient=6,
    )
    g, stats = tr.noisy_gradient(x, torch.zeros(len(ids), dtype=torch.int64))
    want = torch.zeros(d)
    for p in range(len(sizes)):
        s = x[torch.from_numpy(ids == p)].sum(0)
        want += s * min(1.0, clip / (float(s.norm()) + 1e-12))
    assert torch.allclose(g["w"] * len(sizes), want, atol=1e-5), (g["w"] * len(sizes), want)
    assert stats.batch_size == len(sizes)


def _carry_ops(continues: bool, carry: bool) -> list[str]:
    from torch.utils._python_dispatch import TorchDispatchMode

    from feta_release.training.dpsgd import _carry_patients

    ops: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    sums = {"w": torch.randn(4, 3, 2), "b": torch.randn(4, 5)}
    prev = {"w": torch.randn(3, 2), "b": torch.randn(5)} if carry else None
    with Record():
        _carry_patients(sums, prev, 2, continues)
    return ops


def test_the_carry_does_the_same_work_whatever_the_patient_layout() -> None:
    """A torch.cat and a clone ran only where a sampled patient straddled two calls, so the work per
    step counted the sampled patients' (private) image counts. Now the same operations run for every chunk."""
    assert _carry_ops(True, True) == _carry_ops(False, True)


def test_a_non_finite_patient_that_ends_in_a_chunk_does_not_reach_the_next_patient() -> None:
    """A patient whose partial sum is NaN is dropped at its own clip; its NaN must not be carried (0 * NaN)
    into the next chunk's first patient, which would then be dropped too: one patient moving the sum by 2C."""
    from feta_release.training.dpsgd import _carry_patients

    sums = {"w": torch.ones(4, 3)}
    sums["w"][2] = float("nan")
    out, held = _carry_patients(sums, None, 2, False)
    assert torch.equal(held["w"], torch.zeros(3)) and torch.isnan(out["w"][2]).all()
    out, held = _carry_patients({"w": torch.ones(4, 3)}, held, 2, False)
    assert torch.equal(out["w"][0], torch.ones(3))
