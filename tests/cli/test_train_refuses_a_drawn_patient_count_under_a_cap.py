"""`train --patient-cap K` (K >= 2) of a derived job whose patient count is not public: the derived job fits
its noise per patient over the cap and samples patients at q = batch / P, so P must be public before the job
is derived. Drawing it (a noisy count charged in the site ledger) and refusing afterwards would spend the
site's budget on a job that cannot run; the run is refused in one line before anything is drawn or charged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.cli import run_cli


class Started(Exception):
    """The run was handed to the trainer: the job was accepted."""


def _two_scans_per_patient(root: Path) -> Path:
    """30 patients with two scans each, as a CSV ``path,label,patient_id``."""
    from PIL import Image

    rng = np.random.default_rng(0)
    rows = ["path,label,patient_id"]
    for p in range(30):
        for j in range(2):
            Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)).save(root / f"p{p}_{j}.png")
            rows.append(f"p{p}_{j}.png,{'ab'[p % 2]},pat{p}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    return root / "labels.csv"


def _train(data: Path, out: Path) -> list[str]:
    return ["train", "--data", str(data), "--patient-cap", "2", "--epsilon", "10", "--out", str(out)]


def test_train_refuses_a_derived_patient_cap_without_a_public_patient_count_before_any_charge(
    tmp_path: Path, capsys: Any
) -> None:
    data = _two_scans_per_patient(tmp_path)
    out = tmp_path / "run"
    code, stdout, err = run_cli([*_train(data, out), "--no-progress"], capsys)
    assert code == 2, (code, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "--patient-cap 2" in err and "--public-patients P" in err, err
    assert "Traceback" not in err
    ledger = out / "site" / "ledger.sqlite"
    assert not ledger.exists() or ledger.stat().st_size == 0, "a noisy count was charged before the refusal"


def test_train_takes_a_derived_patient_cap_with_the_public_patient_count(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    reached: list[Any] = []

    def run_train(cfg: Any, data: Any, out_dir: Any, opts: Any) -> None:
        reached.append(opts.patients)
        raise Started

    monkeypatch.setattr("coordinator.local_run.run_train", run_train)
    data = _two_scans_per_patient(tmp_path)
    with pytest.raises(Started):
        run_cli([*_train(data, tmp_path / "run"), "--public-patients", "30", "--no-progress"], capsys)
    assert len(reached) == 1 and reached[0].cap == 2
