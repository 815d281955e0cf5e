"""At a PATIENT-level site a job's DP-SGD ``rate`` is sized over the public PATIENTS by one rule
(``JobConfig.for_size``): `privacy plan JOB.toml -n N --patient-cap k --patients P`, `train JOB.toml` and
`train --preset` of the same job plan and charge one history. A preset file planned or trained as a job
file sampled q = rate x N / P (0.125 for cpu-eps10 at two images a patient) while `train --preset` sampled
the preset's q = rate (0.0625)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from feta_release.cli import main
from feta_release.config import load_preset
from tests.support.cli import run_cli

PATIENTS, IMAGES = 2000, 4000  # declared public counts: two images a patient
PRESETS = Path(__file__).resolve().parents[2] / "feta_release" / "presets"


class Started(Exception):
    """The run was handed to the trainer."""


def _plan_json(job: Path) -> dict[str, Any]:
    out = io.StringIO()
    argv = [str(job), "-n", str(IMAGES), "--declared-size", "--patient-cap", "2", "--patients", str(PATIENTS)]
    argv.append("--json")
    with contextlib.redirect_stdout(out):
        main(["privacy", "plan", *argv])
    return dict(json.loads(out.getvalue()))


def _csv(root: Path) -> Path:
    """Ten patients with three scans each (the cap keeps two), as a CSV ``path,label,patient_id``."""
    from PIL import Image

    rng, rows = np.random.default_rng(0), ["path,label,patient_id"]
    for p in range(10):
        for j in range(3):
            Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)).save(root / f"p{p}_{j}.png")
            rows.append(f"p{p}_{j}.png,{'ab'[p % 2]},pat{p}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    return root / "labels.csv"


def _charged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any, *job: str) -> list[dict]:
    """The history `train JOB --patient-cap 2 --public-patients P --public-size N` charges: the job handed to
    the trainer, sized and planned as the run sizes and plans it."""
    from coordinator.local_run import _plan, sized_job

    got: list[Any] = []

    def run_train(cfg: Any, data: Any, out_dir: Any, opts: Any) -> None:
        got.append((cfg, data, opts))
        raise Started

    monkeypatch.setattr("coordinator.local_run.run_train", run_train)
    data = _csv(tmp_path)
    args = ["train", *job, "--data", str(data), "--patient-cap", "2", "--out", str(tmp_path / "r")]
    with pytest.raises(Started):
        run_cli(
            [*args, "--public-patients", str(PATIENTS), "--public-size", str(IMAGES), "--no-progress"], capsys
        )
    cfg, data, opts = got[0]
    plan = _plan(sized_job(cfg, IMAGES, opts.patients), data, IMAGES, opts.patients, [], declared=False)
    return [e.to_dict() for e in plan.history]


@pytest.mark.parametrize("preset", ["cpu-eps10", "paper-mnist"])
def test_plan_train_of_the_job_file_and_train_preset_charge_one_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any, preset: str
) -> None:
    job = PRESETS / f"{preset}.toml"
    shown = _plan_json(job)["history"]
    sgd = next(e for e in shown if e["stage"] == "dpsgd")
    assert sgd["unit"] == "patient"
    assert sgd["q"] == pytest.approx(float(load_preset(preset).dpsgd.rate), abs=1 / PATIENTS)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    assert _charged(tmp_path / "a", monkeypatch, capsys, str(job)) == shown
    assert _charged(tmp_path / "b", monkeypatch, capsys, "--preset", preset) == shown
