"""The derived job at a PATIENT-level site (public patients P, at most k images each): the rules fit every
stage's noise so that the job's total epsilon PER PATIENT, as the planner and the ledger count it
(``accounting.unit_epsilon``: the image-level releases by group privacy over k, patient-level DP-SGD as it
is), meets the target. A split per image spends about k times it per patient and the site refuses the job."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from feta_release.accounting import unit_epsilon
from feta_release.config import JobConfig
from feta_release.errors import ConfigError
from feta_release.job_rules import DataFacts, PatientFacts, derive
from feta_release.planning import PrivacyPlan, plan


def _site_plan(facts: DataFacts, cfg: JobConfig) -> PrivacyPlan:
    """The job's plan as a patient-level site plans it: its public size, patient-level DP-SGD over its public
    patients, the total per patient over its cap."""
    p = facts.patients
    assert p is not None
    return plan(
        cfg,
        facts.size,
        image_shape=facts.shape,
        n_classes=facts.n_classes,
        dpsgd_unit="patient",
        dpsgd_size=p.patients,
        patient_cap=p.cap,
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(
    cap=st.integers(1, 8),
    size=st.sampled_from([4000, 12_000, 30_000, 60_000]),
    per_patient=st.sampled_from([1.5, 2.5, 4.0]),
    eps=st.floats(0.5, 20.0),
    budget=st.sampled_from([600.0, 3600.0]),
    dpsgd=st.sampled_from(["auto", "on"]),
)
def test_the_derived_job_meets_epsilon_per_patient_at_a_patient_level_site(
    cap: int, size: int, per_patient: float, eps: float, budget: float, dpsgd: str
) -> None:
    facts = DataFacts(
        size=size,
        height=28,
        width=28,
        channels=1,
        n_classes=10,
        epsilon=eps,
        time_budget=budget,
        dpsgd=dpsgd,  # type: ignore[arg-type]
        patients=PatientFacts(max(1, round(size / per_patient)), cap),
    )
    try:
        d = derive(facts)
    except ConfigError as exc:  # too little data, or an epsilon below group privacy's floor: refused so
        assert "below the floor" in str(exc) or "lower the patient cap" in str(exc)
        assume(False)
    p = _site_plan(facts, d.cfg)
    total = unit_epsilon(p.history, p.delta, patient_cap=cap)
    assert total == pytest.approx(p.epsilon)
    assert 0.97 * eps <= total <= eps
    if d.cfg.dpsgd_steps(size):
        assert d.cfg.for_size(size).dpsgd.batch <= facts.patients.patients  # type: ignore[union-attr]


def test_a_cap_of_four_at_eight_thousand_patients_plans_within_epsilon_ten() -> None:
    """20,000 images of 8,000 patients, at most 4 each, epsilon 10: a warm-up fitted for 10 per image would
    spend 97.1 per patient (refused); the plan spends at most 10 per patient, and the header says so."""
    facts = DataFacts(20_000, 28, 28, 1, 10, 10.0, patients=PatientFacts(8000, 4))
    d = derive(facts)
    total = _site_plan(facts, d.cfg).epsilon
    assert 9.7 <= total <= 10.0
    assert any("per patient of at most 4 images" in n for n in d.notes if n.startswith("central:"))
    assert any(n.startswith("dpsgd: off (") and "asked for" not in n for n in d.notes)


@pytest.mark.parametrize("size", [4000, 30_000])
def test_a_cap_one_site_gets_the_image_level_job(size: int) -> None:
    """With at most one image per patient, epsilon per patient is epsilon per image: the same job."""
    image = derive(DataFacts(size, 28, 28, 1, 10, 4.0, time_budget=3600.0))
    patient = derive(DataFacts(size, 28, 28, 1, 10, 4.0, time_budget=3600.0, patients=PatientFacts(size, 1)))
    a, b = image.cfg.to_dict(), patient.cfg.to_dict()
    assert a["dpsgd"].pop("rate") == pytest.approx(b["dpsgd"].pop("rate"), abs=1e-6)
    assert a == b
