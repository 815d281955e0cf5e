"""A release whose site's policy did not verify still gets its figures (the officer must see why it failed):
verify's, synthesize's and the HTML report's site line. At a site whose statement makes the PATIENT its unit
the line now states the statement's ε per patient; it stated "per image" and the events composed as if each
protected one image, a figure several times smaller than one patient can lose."""

from __future__ import annotations

import pytest

from feta_release.accounting import PrivacyEvent, SkellamEvent, epsilon, patient_epsilon
from feta_release.privacy_unit import PrivacyUnit
from feta_release.release.summary import site_summary

DELTA, CAP = 1e-5, 4
EVENTS = [
    SkellamEvent("central", 1.0, 1, l2=40.0, l1=1600.0, mu=4e5, mu_worst=1e5),
    PrivacyEvent("dpsgd", 20.0, 0.05, 200, unit="patient"),
]
LIFE = EVENTS + EVENTS


def _site(unit: PrivacyUnit | None) -> dict:
    rows, life = [e.to_dict() for e in EVENTS], [e.to_dict() for e in LIFE]
    st: dict = {
        "epsilon": epsilon(EVENTS, DELTA),
        "delta": DELTA,
        "lifetime": {"events": life, "delta": DELTA, "epsilon": epsilon(LIFE, DELTA)},
        "secure_aggregation": {
            "max_colluders": 0,
            "worst_case_epsilon": 1.0,
            "lifetime_worst_case_epsilon": 2.0,
        },
    }
    if unit is not None:
        st["privacy_unit"] = unit.statement(0.0, DELTA, EVENTS)
    return {
        "site_id": "st-anne",
        "delta": DELTA,
        "epsilon": epsilon(EVENTS, DELTA),
        "accountant": "rdp",
        "events": rows,
        "attestation": {"statement": st},
    }


def test_without_a_verified_policy_a_patient_level_statement_is_summarised_per_patient() -> None:
    s = site_summary(_site(PrivacyUnit("patient", CAP)), None)
    per, life = patient_epsilon(EVENTS, DELTA, CAP), patient_epsilon(LIFE, DELTA, CAP)
    assert per > 2 * epsilon(EVENTS, DELTA)
    assert s.unit == "patient" and s.job.epsilon == pytest.approx(per) and s.job.cap is None
    assert s.lifetime.epsilon == pytest.approx(life)
    assert s.worst is not None and s.worst.epsilon == pytest.approx(
        patient_epsilon(EVENTS, DELTA, CAP, view="worst_case")
    )
    assert s.lifetime_worst is not None and s.lifetime_worst.epsilon == pytest.approx(
        patient_epsilon(LIFE, DELTA, CAP, view="worst_case")
    )
    assert s.line().startswith(f"site st-anne: per patient, δ = 1e-05: ε this job {per:.3g} (cap ?)")


def test_without_a_verified_policy_an_image_level_statement_keeps_its_signed_figures() -> None:
    s = site_summary(_site(None), None)
    assert s.unit == "image" and s.job.epsilon == epsilon(EVENTS, DELTA)
    assert s.lifetime.epsilon == epsilon(LIFE, DELTA)
    assert s.worst is not None and s.worst.epsilon == 1.0
    assert s.lifetime_worst is not None and s.lifetime_worst.epsilon == 2.0
