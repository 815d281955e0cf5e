"""`privacy plan --preset NAME -n N --patient-cap k --patients P` plans the job `train --preset NAME
--patient-cap k --public-patients P` charges: at a patient-level site the preset's DP-SGD rate samples the
public PATIENTS (``job_rules.fit_dpsgd_to_patients``, the one function both apply). The only plan of a
preset was its file's, whose rate is a fraction of the images: q = rate x N / P (0.125 for cpu-eps10 at two
images a patient) where `train --preset` ran q = rate (0.0625)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from feta_release.cli import main
from feta_release.config import load_preset
from tests.support.cli import run_cli
from tests.support.patients import noise_patient_csv

PATIENTS, IMAGES = 2000, 4000  # declared public counts: two images a patient


class Started(Exception):
    """The run was handed to the trainer."""


def _plan_json(preset: str) -> dict[str, Any]:
    out = io.StringIO()
    facts = ["-n", str(IMAGES), "--declared-size", "--patient-cap", "2", "--patients", str(PATIENTS)]
    with contextlib.redirect_stdout(out):
        main(["privacy", "plan", "--preset", preset, *facts, "--json"])
    return dict(json.loads(out.getvalue()))


def _csv(root: Path) -> Path:
    """Ten patients with three scans each (the cap keeps two), as a CSV ``path,label,patient_id``."""
    return noise_patient_csv(root, 10, 3)


@pytest.mark.parametrize("preset", ["cpu-eps10", "paper-mnist"])
def test_plan_preset_is_the_history_train_preset_charges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any, preset: str
) -> None:
    from coordinator.local_run import _plan

    got: list[Any] = []

    def run_train(cfg: Any, data: Any, out_dir: Any, opts: Any) -> None:
        got.append((cfg, data, opts))
        raise Started

    monkeypatch.setattr("coordinator.local_run.run_train", run_train)
    args = ["train", "--preset", preset, "--data", str(_csv(tmp_path)), "--patient-cap", "2"]
    args += ["--public-patients", str(PATIENTS), "--public-size", str(IMAGES), "--out", str(tmp_path / "r")]
    with pytest.raises(Started):
        run_cli([*args, "--no-progress"], capsys)
    cfg, data, opts = got[0]
    charged = _plan(cfg.for_size(IMAGES), data, IMAGES, opts.patients, [], declared=False)  # as the run
    shown = _plan_json(preset)
    assert [e.to_dict() for e in charged.history] == shown["history"]
    sgd = next(e for e in shown["history"] if e["stage"] == "dpsgd")
    assert sgd["unit"] == "patient"
    assert sgd["q"] == pytest.approx(float(load_preset(preset).dpsgd.rate), abs=1 / PATIENTS)


def test_plan_refuses_a_preset_beside_a_job_file(capsys: Any) -> None:
    code, _, err = run_cli(["privacy", "plan", "job.toml", "--preset", "cpu-eps10"], capsys)
    assert code == 2 and "drop JOB_FILE" in err and "Traceback" not in err, err
