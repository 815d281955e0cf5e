"""A patient-level site's budget bounds the epsilon PER PATIENT: every cap (per job, lifetime, worst case),
the DP-SGD calibration, the statement and verify use the per-patient figure (image-level releases by group
privacy over the patient cap, patient-level DP-SGD as it is); and the lifetime worst case under secure
aggregation is capped.

The attacks: a history that mixes image-level warm-up events with patient-level DP-SGD passed every cap when
they were composed as if they protected one unit, while one patient (at most k images) was protected only at k
times the warm-up's epsilon; and secure jobs each within their caps composed to a lifetime worst case above 3
x the lifetime budget."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.accounting import PrivacyEvent, SkellamEvent, calibrate_noise_multiplier, epsilon
from feta_release.errors import PolicyBudgetExceeded
from feta_release.ledger import Budget, Ledger, check_spend
from feta_release.policy.document import SitePolicy, make_policy

PRESETS = Path(__file__).resolve().parents[2] / "feta_release" / "presets"
DELTA = 1e-5
# cpu-eps1's warm-up at 4,000 images: mean central images (sigma 8, q 0.5, 2 rounds), frequency (sigma 10):
# image-level
WARM = [PrivacyEvent("central", 8.0, 0.5, 2), PrivacyEvent("frequency", 10.0, 1.0, 1)]
CAP = 5


def _patient_policy(**over: Any) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "patient_level": (1000, CAP),
        "per_job": (1.0, DELTA),
        "lifetime": (4.0, DELTA),
        **over,
    }
    return make_policy("site-p", "0" * 64, 4000, ["a" * 64], **kw)


def _dpsgd_calibrated_per_image(warm: list[PrivacyEvent], target: float) -> PrivacyEvent:
    """Patient-level DP-SGD whose sigma makes the MIXED history's per-image epsilon meet ``target``."""
    sigma = calibrate_noise_multiplier(warm, 0.0625, 60, target, DELTA)
    return PrivacyEvent("dpsgd", sigma, 0.0625, 60, unit="patient")


def test_a_patient_level_ledger_refuses_a_charge_whose_epsilon_per_patient_passes_the_per_job_cap(
    tmp_path: Path,
) -> None:
    """The warm-up (image-level, 0.53 per image) then DP-SGD calibrated so the mixed history is 1.0 per image:
    every charge used to pass a per-job cap of 1, while one patient of 5 images was at ~3.7. The ledger
    refuses before it records, naming the per-patient figure."""
    policy = _patient_policy()
    sgd = _dpsgd_calibrated_per_image(WARM, 1.0)
    assert epsilon(WARM + [sgd], DELTA) <= 1.0  # the per-image figure the caps used to see
    with Ledger(tmp_path / "ledger.sqlite", key=Ed25519PrivateKey.generate()) as ledger:
        with pytest.raises(PolicyBudgetExceeded) as exc:
            for i, ev in enumerate([*WARM, sgd]):
                ledger.charge("job-1", f"r{i}", ev.stage, [ev], Budget.from_policy(policy))
        assert exc.value.rule == "budget.per_job.epsilon" and "per patient" in str(exc.value)
        assert exc.value.after > 1.0
        charged = [e for r in ledger.requests("job-1") for e in r["events"]]
    assert len(charged) < 3  # the refused release was never recorded


def test_a_patient_level_site_refuses_lifetime_epsilon_per_patient_over_its_cap() -> None:
    """Per job within the cap even per patient (a small warm-up), but the lifetime history per patient is
    not."""
    small = [PrivacyEvent("central", 20.0, 0.5, 1)]  # 0.12 per image, 0.80 per patient of 5 images
    budget = Budget.from_policy(_patient_policy(per_job=(1.5, DELTA), lifetime=(2.0, DELTA)))
    check_spend(budget, [], small * 2, small)
    with pytest.raises(PolicyBudgetExceeded) as exc:
        check_spend(budget, [], small * 14, small)
    assert exc.value.rule == "budget.lifetime.epsilon" and "per patient" in str(exc.value)
    assert epsilon(small * 15, DELTA) <= 2.0  # the per-image lifetime figure would have passed


def test_the_coordinator_refuses_a_patient_level_job_before_any_release() -> None:
    """A job planned with DP-SGD calibrated per image over the mixed history does not fit the site (per
    patient)."""
    from feta_release.policy.enforce import JobDoesNotFit, check_job_fits

    pol = SitePolicy.from_document(_patient_policy(), None)
    with pytest.raises(JobDoesNotFit) as exc:
        check_job_fits({"site-p": pol}, {"site-p": [*WARM, _dpsgd_calibrated_per_image(WARM, 1.0)]})
    assert "budget.per_job.epsilon" in str(exc.value) and "per patient" in str(exc.value)


def _plan(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any] | None, str]:
    """(exit code, the --json plan or None, stderr) of `feta-release privacy plan ARGS --json`."""
    from feta_release.cli import main

    try:
        main(["privacy", "plan", *args, "--json"])
    except SystemExit as exc:
        return int(exc.code or 0), None, capsys.readouterr().err
    return 0, json.loads(capsys.readouterr().out), ""


@pytest.mark.parametrize("preset,cap", [("cpu-eps1", 5), ("cpu-eps10", 5), ("cpu-eps10", 2)])
def test_privacy_plan_with_a_patient_cap_never_states_more_than_the_budget_per_patient(
    preset: str, cap: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """`privacy plan PRESET --patient-cap K --patients 1000` used to state ε per patient 3.66 at δ 2.4e-4
    under a budget of (1, 1e-5) (cpu-eps10: 17.5 at 8.9e-3). Now the plan meets the budget PER PATIENT (σ
    calibrated for the per-patient total) or refuses, naming the per-patient figure."""
    path = PRESETS / f"{preset}.toml"
    target = 1.0 if preset == "cpu-eps1" else 10.0
    code, data, err = _plan([str(path), "--patient-cap", str(cap), "--patients", "1000"], capsys)
    if code:
        assert "PER PATIENT" in err and "warm-up" in err
        # this one fits: its warm-up per patient leaves room for DP-SGD
        assert (preset, cap) != ("cpu-eps10", 2)
        return
    unit = data["privacy_unit"]  # type: ignore[index]
    assert unit["delta_per_patient"] <= DELTA * (1 + 1e-12)
    assert unit["epsilon_per_patient"] <= target + 1e-9
    # calibrated to the per-patient budget, not far below it
    assert unit["epsilon_per_patient"] > 0.97 * target
    assert data["epsilon"] == pytest.approx(unit["epsilon_per_patient"])  # type: ignore[index]


def test_a_patient_level_sites_calibration_meets_its_budget_per_patient() -> None:
    """The node's and the coordinator's planner (site_dpsgd from the signed policy) calibrate for the
    per-patient total, so the planned events pass the site's own ledger check."""
    from feta_release.config import load_job
    from feta_release.planning import site_dpsgd, stage_events, target
    from feta_release.policy.enforce import check_budget
    from feta_release.privacy_unit import site_unit_statement

    cfg = load_job(PRESETS / "cpu-eps10.toml").for_size(4000)
    cfg = cfg.replace(federation={"rounds": 2, "local_steps": 30})
    pol = SitePolicy.from_document(
        _patient_policy(patient_level=(1000, 2), per_job=(10.0, DELTA), lifetime=(20.0, DELTA)), None
    )
    events = stage_events(cfg, 4000, federated=True, budget=target(cfg, pol), **site_dpsgd(pol))
    job_eps, _ = check_budget(pol, [], [], events)
    statement = site_unit_statement(pol, epsilon(events, DELTA), DELTA, events, "rdp")
    assert statement["epsilon_per_patient"] == pytest.approx(job_eps)
    assert 9.7 < job_eps <= 10.0 + 1e-9 and statement["delta_per_patient"] <= DELTA


def _attested(policy: dict[str, Any], events: list[Any], life: list[Any]) -> dict[str, Any]:
    from feta_release.accounting import events_to_list
    from feta_release.privacy_unit import site_unit_statement

    pol = SitePolicy.from_document(policy, None)
    eps = epsilon(events, DELTA)
    return {
        "site_id": "site-p",
        "epsilon": eps,
        "delta": DELTA,
        "accountant": "rdp",
        "events": events_to_list(events),
        "lifetime": {"epsilon": epsilon(life, DELTA), "delta": DELTA, "events": events_to_list(life)},
        "privacy_unit": site_unit_statement(pol, eps, DELTA, events, "rdp"),
    }


def test_verify_refuses_an_attested_job_whose_epsilon_per_patient_passes_the_signed_cap() -> None:
    from feta_release.release.verify import policy_violations

    policy = _patient_policy()
    events = [*WARM, _dpsgd_calibrated_per_image(WARM, 1.0)]
    problems = policy_violations(policy, _attested(policy, events, events), events)
    assert any("per patient" in p and "budget.per_job.epsilon" in p for p in problems), problems
    fine = [PrivacyEvent("central", 40.0, 0.5, 1)]
    assert policy_violations(policy, _attested(policy, fine, fine), fine) == []


# -- the lifetime worst case under secure aggregation
# ---------------------------------------------------------------

# one secure job: assumed ε 0.50 over 9 noise shares, worst case (own share only) 1.79
SECURE_JOB = SkellamEvent("central", 1.0, 1, 1.0, 1.0, 60.0, 60.0 / 9)


def test_three_secure_jobs_within_their_caps_cannot_pass_the_lifetime_worst_case_cap(tmp_path: Path) -> None:
    """Per job 1 / lifetime 1 / worst case 3 (the default 3 x per job): each job is within its caps (0.50
    assumed, 1.79 worst case) and three of them are within the lifetime cap (0.91), but their lifetime worst
    case is 3.34, above 3 x the lifetime budget. The third is refused before it is recorded."""
    policy = make_policy("site-s", "0" * 64, 4000, ["a" * 64], per_job=(1.0, DELTA), lifetime=(1.0, DELTA))
    with Ledger(tmp_path / "ledger.sqlite", key=Ed25519PrivateKey.generate()) as ledger:
        for job in ("job-1", "job-2"):
            ledger.charge(job, f"{job}/central", "central", [SECURE_JOB], Budget.from_policy(policy))
        with pytest.raises(PolicyBudgetExceeded) as exc:
            ledger.charge("job-3", "job-3/central", "central", [SECURE_JOB], Budget.from_policy(policy))
        assert exc.value.rule == "secure_aggregation.max_lifetime_worst_case_epsilon"
        assert exc.value.after > 3.0 and exc.value.cap == pytest.approx(3.0)
        assert ledger.requests("job-3") == []
    # the assumed lifetime figure passes: only the worst case refuses
    assert epsilon([SECURE_JOB] * 3, DELTA) <= 1.0


def test_a_site_may_set_its_own_lifetime_worst_case_cap() -> None:
    policy = make_policy(
        "site-s",
        "0" * 64,
        4000,
        ["a" * 64],
        per_job=(1.0, DELTA),
        lifetime=(1.0, DELTA),
        secure_aggregation={"max_lifetime_worst_case_epsilon": 2.0},
    )
    assert SitePolicy.from_document(policy, None).lifetime_worst_case_cap == 2.0
    budget = Budget.from_policy(policy)
    check_spend(budget, [], [], [SECURE_JOB])
    with pytest.raises(PolicyBudgetExceeded, match="max_lifetime_worst_case_epsilon"):
        check_spend(budget, [], [SECURE_JOB], [SECURE_JOB])


def test_verify_refuses_a_lifetime_worst_case_over_the_signed_cap() -> None:
    from feta_release.release.verify import policy_violations

    policy = make_policy("site-s", "0" * 64, 4000, ["a" * 64], per_job=(1.0, DELTA), lifetime=(1.0, DELTA))
    policy["site_id"] = "site-p"
    ok = policy_violations(policy, _attested(policy, [SECURE_JOB], [SECURE_JOB] * 2), [SECURE_JOB])
    assert not [p for p in ok if "lifetime" in p], ok
    bad = policy_violations(policy, _attested(policy, [SECURE_JOB], [SECURE_JOB] * 3), [SECURE_JOB])
    assert any("max_lifetime_worst_case_epsilon" in p for p in bad), bad


# -- the per-patient figure itself
# ----------------------------------------------------------------------------------

events_st = st.lists(
    st.builds(
        PrivacyEvent,
        st.sampled_from(["central", "frequency"]),
        st.floats(min_value=0.8, max_value=30.0),
        st.floats(min_value=0.01, max_value=1.0),
        st.integers(1, 200),
    ),
    min_size=1,
    max_size=3,
)


moderate = st.lists(
    st.builds(
        PrivacyEvent,
        st.sampled_from(["central", "frequency"]),
        st.floats(min_value=3.0, max_value=30.0),
        st.floats(min_value=0.01, max_value=1.0),
        st.integers(1, 50),
    ),
    min_size=1,
    max_size=3,
)  # per-record ε a group δ can still pay for


@settings(max_examples=25, deadline=None)
@given(events=moderate, k=st.integers(2, 6), delta=st.sampled_from([1e-5, 1e-6, 1e-3]))
def test_group_epsilon_is_the_best_valid_group_privacy_pair(
    events: list[PrivacyEvent], k: int, delta: float
) -> None:
    """group_epsilon (closed form per RDP order) against a brute-force search over the per-record δ_r: every
    pair (ε(δ_r), δ_r) on the grid whose group δ k·e^{(k-1)ε}·δ_r is within ``delta`` gives a valid k·ε; the
    closed form is never above the best of them (it optimises the same family exactly) and never far below (it
    is one of them)."""
    from feta_release.accounting import epsilon_from_rdp, group_epsilon, history_rdp
    from feta_release.privacy_unit import group_privacy

    got = group_epsilon(events, delta, k)
    curve = history_rdp(events)
    best, best_d = math.inf, None
    for j in range(0, 10000):  # per-record δ from delta down to delta x 1e-100, 100 points a decade
        d_r = delta * 10 ** (-j / 100)
        ge, gd = group_privacy(epsilon_from_rdp(curve, d_r), d_r, k)
        if gd <= delta * (1 + 1e-12) and ge < best:
            best, best_d = ge, d_r
    assert math.isfinite(best) and best_d is not None
    assert epsilon(events, best_d) == pytest.approx(best / k)  # the curve's conversion is the accountant's
    assert got <= best + 1e-9
    assert got >= 0.99 * best - 1e-6


@settings(max_examples=20, deadline=None)
@given(warm=events_st, sgd_sigma=st.floats(min_value=0.6, max_value=5.0), k=st.integers(1, 6))
def test_patient_epsilon_bounds_the_image_figure_and_grows_with_the_cap(
    warm: list[PrivacyEvent], sgd_sigma: float, k: int
) -> None:
    from feta_release.accounting import patient_epsilon

    history = [*warm, PrivacyEvent("dpsgd", sgd_sigma, 0.05, 50, unit="patient")]
    got = patient_epsilon(history, DELTA, k)
    if k == 1:
        assert got == pytest.approx(epsilon(history, DELTA))  # one image per patient: exact, one composition
    else:
        assert got >= epsilon(warm, DELTA / 2)  # at least the warm-up per image
        assert got <= patient_epsilon(history, DELTA, k + 1) + 1e-9
