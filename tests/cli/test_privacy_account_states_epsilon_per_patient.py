"""`privacy account` of a PATIENT-level site's history states ε per patient, the figure its caps bound: from
its signed statement (its ``privacy_unit`` gives the cap) or with --patient-cap K. It composed the events as
if each protected one image (0.668 where one patient can lose 3.43); where no cap is known it now says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from feta_release.accounting import PrivacyEvent, epsilon, patient_epsilon
from feta_release.cli import cli
from feta_release.privacy_unit import PrivacyUnit
from tests.support.cli import run_cli_merged
from tests.support.release import new_keys, patient_attestation

DELTA, CAP = 1e-5, 4
EVENTS = [PrivacyEvent("central", 6.0, 1.0, 1), PrivacyEvent("dpsgd", 20.0, 0.05, 200, unit="patient")]
PER_PATIENT, PER_IMAGE = patient_epsilon(EVENTS, DELTA, CAP), epsilon(EVENTS, DELTA)


def _account(*args: str) -> str:
    res = CliRunner().invoke(cli, ["privacy", "account", *args])
    assert res.exit_code == 0, res.output
    return res.output


def test_a_site_statement_is_accounted_per_patient(tmp_path: Path) -> None:
    st = {
        "epsilon": PER_IMAGE,
        "delta": DELTA,
        "accountant": "rdp",
        "events": [e.to_dict() for e in EVENTS],
        "privacy_unit": PrivacyUnit("patient", CAP).statement(PER_IMAGE, DELTA, EVENTS),
    }
    (path := tmp_path / "statement.json").write_text(json.dumps(st))
    data = json.loads(_account(str(path), "--json"))
    assert PER_PATIENT > 4 * PER_IMAGE
    assert data["epsilon"] == pytest.approx(PER_PATIENT) and data["unit"] == "patient"
    assert f"total epsilon per PATIENT {PER_PATIENT:.3f}" in _account(str(path))


def test_a_bare_history_with_patient_events_says_its_figure_is_per_image(tmp_path: Path) -> None:
    (path := tmp_path / "events.json").write_text(json.dumps([e.to_dict() for e in EVENTS]))
    out = _account(str(path), "--delta", str(DELTA))
    assert f"total epsilon {PER_IMAGE:.3f}" in out and "less than one patient can lose" in out, out
    out = _account(str(path), "--delta", str(DELTA), "--patient-cap", str(CAP))
    assert f"total epsilon per PATIENT {PER_PATIENT:.3f}" in out, out


def _signed_statement(tmp_path: Path) -> Path:
    """A patient-level site's signed statement as its node writes it ("history" is a word)."""
    att, _, _ = patient_attestation(new_keys(), EVENTS, EVENTS)
    assert att["statement"]["history"] == "site-ledger"
    (path := tmp_path / "statement.json").write_text(json.dumps(att))
    return path


@pytest.mark.parametrize("signed", [True, False])
def test_a_node_signed_statement_is_accounted_per_patient(tmp_path: Path, signed: bool) -> None:
    path = _signed_statement(tmp_path)
    if not signed:
        path.write_text(json.dumps(json.loads(path.read_text())["statement"]))
    data = json.loads(_account(str(path), "--json"))
    assert data["epsilon"] == pytest.approx(PER_PATIENT) and data["images_per_patient_cap"] == CAP


def test_a_patient_cap_other_than_the_statements_signed_cap_is_refused(tmp_path: Path) -> None:
    path = _signed_statement(tmp_path)
    code, out = run_cli_merged(["privacy", "account", str(path), "--patient-cap", "1"])
    assert code == 4 and f"signed cap of {CAP}" in out and "drop --patient-cap" in out, out
    assert len(out.strip().splitlines()) == 1 and "Traceback" not in out
    assert f"{PER_PATIENT:.3f}" in _account(str(path), "--patient-cap", str(CAP))
