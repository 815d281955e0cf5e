"""Every ε in a patient-level site's part of the privacy report is PER PATIENT, the figure its ledger and
policy cap: ``privacy_report.json``'s ``epsilon_total``, its stage figures, the text's stage lines and
``budget.svg``. Stated per image, ``epsilon_total`` read 2.717 where one patient of at most 4 images can lose
9.999, the stage lines "central alone ε = 1.394" named no unit, and the chart drew the per-image totals
against the policy's per-patient caps, so a site at its cap looked well under it. The image-level figures
stay, named ``*_per_image``; an image-level site's report is unchanged."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from feta_release.accounting import PrivacyEvent, epsilon, epsilon_breakdown, patient_epsilon
from feta_release.privacy_unit import PrivacyUnit
from feta_release.release.jobdir import privacy_report
from tests.support.release import report_job_dir

DELTA, CAP = 1e-5, 4
EVENTS = [PrivacyEvent("central", 2.9844, 1.0, 1), PrivacyEvent("dpsgd", 8.7109375, 1.0, 20, unit="patient")]
PER_PATIENT = patient_epsilon(EVENTS, DELTA, CAP)
PER_IMAGE = epsilon(EVENTS, DELTA)


def _job_dir(tmp_path: Path, unit: PrivacyUnit | None, per_job_cap: float = 10.0) -> Path:
    return report_job_dir(tmp_path, EVENTS, DELTA, unit, per_job_cap)


def test_a_patient_level_sites_epsilon_total_is_per_patient(tmp_path: Path) -> None:
    assert PER_PATIENT > 3 * PER_IMAGE
    site = privacy_report(_job_dir(tmp_path, PrivacyUnit("patient", CAP)))["sites"]["site"]
    assert site["unit"] == "patient"
    assert site["epsilon_total"] == pytest.approx(PER_PATIENT)
    assert site["epsilon_by_stage_alone"]["total"] == pytest.approx(PER_PATIENT)
    assert site["epsilon_total_per_image"] == pytest.approx(PER_IMAGE)  # the smaller figure names its unit


def test_a_patient_level_sites_stage_lines_state_their_unit(tmp_path: Path) -> None:
    """Each stage alone per patient: the image-level central release by group privacy over the cap."""
    privacy_report(_job_dir(tmp_path, PrivacyUnit("patient", CAP)))
    text = (tmp_path / "privacy_report.txt").read_text("utf-8")
    central = patient_epsilon(EVENTS[:1], DELTA, CAP)
    assert central > 4 * epsilon(EVENTS[:1], DELTA)
    assert f"    central    alone ε per patient = {central:.3f}" in text, text
    assert f"    dpsgd      alone ε per patient = {epsilon(EVENTS[1:], DELTA):.3f}" in text, text
    assert not re.search(r"alone ε = ", text), text


def test_a_patient_level_sites_budget_chart_draws_its_spend_per_patient(tmp_path: Path) -> None:
    """At a per-patient cap of 10 the site spent 9.999 per patient: the chart's total bar reads that, not
    the 2.717 composed as if each event protected one image."""
    privacy_report(_job_dir(tmp_path, PrivacyUnit("patient", CAP)))
    svg = (tmp_path / "budget.svg").read_text("utf-8")
    assert f">{PER_PATIENT:.3g} this job</text>" in svg, svg
    assert f">{PER_IMAGE:.3g} this job</text>" not in svg
    assert "site site (ε per patient)" in svg


def test_an_image_level_sites_report_text_says_per_image_json_and_chart_unchanged(tmp_path: Path) -> None:
    report = privacy_report(_job_dir(tmp_path, None))
    site = report["sites"]["site"]
    assert site.get("unit", "image") == "image" and not [k for k in site if k.endswith("_per_image")]
    assert site["epsilon_total"] == PER_IMAGE
    assert site["epsilon_by_stage_alone"] == epsilon_breakdown(EVENTS, DELTA)
    text = (tmp_path / "privacy_report.txt").read_text("utf-8")
    stages = epsilon_breakdown(EVENTS, DELTA)
    assert (
        f"site site: total ε per image = {PER_IMAGE:.3f} at δ = {DELTA:g} (rdp accountant), signed by the "
        f"site's key {'cd' * 8}\n"
        f"    central    alone ε per image = {stages['central']:.3f}\n"
        f"    dpsgd      alone ε per image = {stages['dpsgd']:.3f}\n"
        "\nStage figures are each stage alone; composition is sub-additive, the total is what counts.\n"
        "Each site's data never left it"
    ) in text, text
    svg = (tmp_path / "budget.svg").read_text("utf-8")
    assert f">{PER_IMAGE:.3g} this job</text>" in svg and "per patient" not in svg
