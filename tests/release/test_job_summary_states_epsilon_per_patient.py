"""`job_summary.json` (what `coordinator run` prints, the federation's closing line and the demo's summary
read) states a PATIENT-level site's ε per patient, the figure its caps bound, with its unit beside it. It gave
the statement's ``epsilon``, the events composed as if each protected one image: 0.668 where one patient of
that site can lose 3.43."""

from __future__ import annotations

from typing import Any

import pytest

from feta_release.accounting import PrivacyEvent, epsilon, patient_epsilon
from feta_release.privacy_unit import PrivacyUnit
from feta_release.release.jobfiles import job_summary

DELTA, CAP = 1e-5, 4
EVENTS = [PrivacyEvent("central", 6.0, 1.0, 1), PrivacyEvent("dpsgd", 20.0, 0.05, 200, unit="patient")]
IMAGE_EVENTS = [PrivacyEvent("central", 6.0, 1.0, 1), PrivacyEvent("dpsgd", 20.0, 0.05, 200)]


def _attestation(events: list[PrivacyEvent], unit: PrivacyUnit | None) -> dict[str, Any]:
    st: dict[str, Any] = {
        "epsilon": epsilon(events, DELTA),
        "delta": DELTA,
        "events": [e.to_dict() for e in events],
    }
    if unit is not None:
        st["privacy_unit"] = unit.statement(st["epsilon"], DELTA, events)
    return {"statement": st}


def test_a_patient_level_sites_summary_figure_is_per_patient() -> None:
    atts = {"p": _attestation(EVENTS, PrivacyUnit("patient", CAP)), "i": _attestation(IMAGE_EVENTS, None)}
    summary = job_summary("j", ["p", "i"], ["a"], [1, 8, 8], 1, {}, atts, {})
    per = patient_epsilon(EVENTS, DELTA, CAP)
    assert per > 4 * epsilon(EVENTS, DELTA)
    assert summary["site_epsilon"]["p"] == pytest.approx(per) and summary["site_unit"]["p"] == "patient"
    assert summary["site_epsilon_per_image"] == {"p": pytest.approx(epsilon(EVENTS, DELTA))}
    # an image-level site's figure is its statement's, as before
    assert (
        summary["site_epsilon"]["i"] == epsilon(IMAGE_EVENTS, DELTA) and summary["site_unit"]["i"] == "image"
    )
