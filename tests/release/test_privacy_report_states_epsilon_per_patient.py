"""A job directory's privacy report (and `train`'s closing line) at a PATIENT-level site states the figure the
site's caps bound and its statement signs, ε PER PATIENT, as the site's total. It stated "unit of privacy:
one image of one site, total ε = 2.717" for a run that spent 10.0 per patient of at most 4 images: the
events composed as if each protected one image, which understates what one patient can lose."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from feta_release.accounting import PrivacyEvent, epsilon
from feta_release.privacy_unit import PrivacyUnit
from feta_release.release.jobdir import privacy_report
from tests.support.release import report_job_dir

DELTA, CAP = 1e-5, 4
EVENTS = [PrivacyEvent("central", 2.9844, 1.0, 1), PrivacyEvent("dpsgd", 8.7109375, 1.0, 20, unit="patient")]


def _job_dir(tmp_path: Path, unit: PrivacyUnit | None) -> Path:
    return report_job_dir(tmp_path, EVENTS, DELTA, unit)


def test_a_patient_level_sites_report_states_its_epsilon_per_patient(tmp_path: Path) -> None:
    unit = PrivacyUnit("patient", CAP)
    per = unit.statement(0.0, DELTA, EVENTS)["epsilon_per_patient"]
    assert per > 3 * epsilon(EVENTS, DELTA)  # the figure at stake: per patient, over the cap
    report = privacy_report(_job_dir(tmp_path, unit))
    assert report["sites"]["site"]["per_patient"]["epsilon_per_patient"] == pytest.approx(per)
    assert "PATIENT" in report["unit_of_privacy"]
    text = (tmp_path / "privacy_report.txt").read_text("utf-8")
    assert f"total ε per patient = {per:.3f} at δ = {DELTA:g} (at most {CAP} image(s) each" in text, text


def test_an_image_level_sites_report_states_its_epsilon_per_image(tmp_path: Path) -> None:
    report = privacy_report(_job_dir(tmp_path, None))
    assert (
        report["unit_of_privacy"] == "one image of one site" and "per_patient" not in report["sites"]["site"]
    )
    text = (tmp_path / "privacy_report.txt").read_text("utf-8")
    assert f"site site: total ε per image = {epsilon(EVENTS, DELTA):.3f} at δ = {DELTA:g}" in text


def test_a_patient_level_sites_lifetime_line_states_its_spend_per_patient(tmp_path: Path) -> None:
    """The lifetime line beside the per-patient total: the site's ledger caps its lifetime PER PATIENT, and
    the statement's ``lifetime.epsilon`` composes the events as if each protected one image. Printed as it
    was, a site with two such jobs read "total ε per patient = 9.999" above "lifetime ... ε = 4.016", a
    lifetime smaller than one of its jobs and a quarter of what one patient can lose (15.6)."""
    unit = PrivacyUnit("patient", CAP)
    life = EVENTS + EVENTS  # two jobs on the same patients
    job_dir = _job_dir(tmp_path, unit)
    atts = json.loads((job_dir / "attestations.json").read_text())
    atts["site"]["statement"]["lifetime"] = {
        "events": [e.to_dict() for e in life],
        "epsilon": epsilon(life, DELTA),
        "delta": DELTA,
    }
    (job_dir / "attestations.json").write_text(json.dumps(atts))
    per_life = unit.statement(0.0, DELTA, life)["epsilon_per_patient"]
    assert per_life > unit.statement(0.0, DELTA, EVENTS)["epsilon_per_patient"] > 2 * epsilon(life, DELTA)
    report = privacy_report(job_dir)
    assert report["sites"]["site"]["lifetime"]["epsilon"] == pytest.approx(per_life)
    text = (tmp_path / "privacy_report.txt").read_text("utf-8")
    assert f"lifetime on the same images (all jobs): ε per patient = {per_life:.3f} at δ = {DELTA:g}" in text
    assert f"{epsilon(life, DELTA):.3f}" not in text, text


def test_a_patient_level_sites_worst_case_line_states_its_spend_per_patient(tmp_path: Path) -> None:
    """The secure-aggregation line ("if every other site colluded ...: ε = ") beside the per-patient total
    states the worst case per patient too, as the site's ledger caps it, not the statement's image-level
    ``worst_case_epsilon``."""
    from feta_release.accounting import Event, SkellamEvent, worst_case_epsilon

    unit = PrivacyUnit("patient", CAP)
    events: list[Event] = [
        SkellamEvent("central", 1.0, 1, l2=40.0, l1=1600.0, mu=4e5, mu_worst=1e5),
        EVENTS[1],
    ]
    image_worst = worst_case_epsilon(events, DELTA)
    st = {
        "epsilon": epsilon(events, DELTA),
        "delta": DELTA,
        "accountant": "rdp",
        "events": [e.to_dict() for e in events],
        "policy_sha256": "ab" * 32,
        "privacy_unit": unit.statement(0.0, DELTA, events),
        "secure_aggregation": {"max_colluders": 0, "worst_case_epsilon": image_worst},
    }
    (tmp_path / "attestations.json").write_text(
        json.dumps({"site": {"statement": st, "signature": {"signer": "cd" * 8}}})
    )
    (tmp_path / "job_summary.json").write_text(
        json.dumps({"job_id": "j", "rounds": 1, "skipped": {}, "timings": {}})
    )
    report = privacy_report(tmp_path)
    worst = report["sites"]["site"]["secure_aggregation"]["worst_case_epsilon"]
    assert worst > image_worst
    text = (tmp_path / "privacy_report.txt").read_text("utf-8")
    assert f"only this site's own noise share protecting it): ε per patient = {worst:.3f}" in text, text
