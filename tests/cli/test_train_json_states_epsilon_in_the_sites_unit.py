"""`train --json`'s ``epsilon`` is in the site's unit, as ``privacy_report.json``'s ``epsilon_total``: per
patient at a patient-level site. It read the events composed as if each protected one image (2.717 where one
patient of at most 4 images can lose 9.999), with the per-patient figure only beside it; a script reading
``epsilon`` got the smaller number without a unit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coordinator.local_run import TrainResult
from feta_release.accounting import PrivacyEvent, epsilon, patient_epsilon
from feta_release.cli.train_cmd import _print_summary

DELTA, CAP = 1e-5, 4
EVENTS = [PrivacyEvent("central", 2.9844, 1.0, 1), PrivacyEvent("dpsgd", 8.7109375, 1.0, 20, unit="patient")]


def _summary(tmp_path: Path, per_patient: float | None, capsys: Any) -> dict[str, Any]:
    res = TrainResult(
        run_dir=tmp_path,
        epsilon=epsilon(EVENTS, DELTA),
        delta=DELTA,
        events=EVENTS,
        dpsgd_sigma=8.7109375,
        dpsgd_steps_trained=20,
        seconds=1.0,
        epsilon_per_patient=per_patient,
    )
    _print_summary(res, "rdp", None, True)
    return json.loads(capsys.readouterr().out)


def test_a_patient_level_runs_json_epsilon_is_per_patient(tmp_path: Path, capsys: Any) -> None:
    per = patient_epsilon(EVENTS, DELTA, CAP)
    assert per > 3 * epsilon(EVENTS, DELTA)
    summary = _summary(tmp_path, per, capsys)
    assert summary["unit"] == "patient"
    assert summary["epsilon"] == per == summary["epsilon_per_patient"]
    assert summary["epsilon_per_image"] == epsilon(EVENTS, DELTA)


def test_an_image_level_runs_json_epsilon_is_unchanged(tmp_path: Path, capsys: Any) -> None:
    summary = _summary(tmp_path, None, capsys)
    assert summary["epsilon"] == epsilon(EVENTS, DELTA) and summary["epsilon_per_patient"] is None
    assert summary.get("unit", "image") == "image" and "epsilon_per_image" not in summary
