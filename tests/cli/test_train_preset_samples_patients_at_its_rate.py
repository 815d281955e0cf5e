"""`train --preset` at a PATIENT-level site samples DP-SGD at the preset's rate over the site's public
PATIENTS. The preset's ``[dpsgd] rate`` is the q it was tuned at; the site samples whole patients at q =
batch / P, and the batch was sized over the images (rate x N): at two images a patient, q was twice the
preset's and each step twice its patients (the charge consistent, the job another than the one asked for).
Where P is not public (a cap of 2 or more without --public-patients) the run is refused before anything is
read or charged, as the derived job is."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from feta_release.config import load_preset
from feta_release.job_rules import PatientFacts, fit_dpsgd_to_patients
from tests.support.cli import run_cli
from tests.support.patients import noise_patient_csv

PATIENTS, IMAGES = 1000, 2000  # declared public counts: two images a patient


class Started(Exception):
    """The run was handed to the trainer."""


@pytest.fixture
def reached(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    got: list[Any] = []

    def run_train(cfg: Any, data: Any, out_dir: Any, opts: Any) -> None:
        got.append((cfg, data, opts))
        raise Started

    monkeypatch.setattr("coordinator.local_run.run_train", run_train)
    return got


def _csv(root: Path) -> Path:
    """Ten patients with three scans each (the cap keeps two), as a CSV ``path,label,patient_id``."""
    return noise_patient_csv(root, 10, 3)


def _train(tmp_path: Path, preset: str, *more: str) -> list[str]:
    data = _csv(tmp_path)
    return [
        "train",
        "--preset",
        preset,
        "--data",
        str(data),
        "--patient-cap",
        "2",
        "--out",
        str(tmp_path / "r"),
    ]


@pytest.mark.parametrize("preset", ["cpu-eps10", "paper-mnist"])
def test_a_presets_dpsgd_samples_the_public_patients_at_its_rate(
    tmp_path: Path, reached: list[Any], capsys: Any, preset: str
) -> None:
    from coordinator.local_run import _plan

    args = [*_train(tmp_path, preset), "--public-patients", str(PATIENTS), "--public-size", str(IMAGES)]
    with pytest.raises(Started):
        run_cli([*args, "--no-progress"], capsys)
    cfg, data, opts = reached[0]
    rate = float(load_preset(preset).dpsgd.rate)
    sized = cfg.for_size(IMAGES)  # as the run sizes it at its public size
    assert sized.dpsgd.batch == round(rate * PATIENTS)  # it was round(rate x images): twice as many
    sgd = _plan(sized, data, IMAGES, opts.patients, [], declared=False).event("dpsgd")
    assert sgd.unit == "patient" and sgd.q == pytest.approx(rate, abs=1 / PATIENTS)
    assert f"q x the {PATIENTS} public patients = {sized.dpsgd.batch} patients" in capsys.readouterr().err


def test_a_preset_at_a_cap_of_two_without_a_public_patient_count_is_refused_before_reading(
    tmp_path: Path, reached: list[Any], capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    read: list[Any] = []
    monkeypatch.setattr("feta_release.data.load_dataset", lambda *a, **k: read.append(a) or 1 / 0)
    code, _, err = run_cli([*_train(tmp_path, "cpu-eps10"), "--no-progress"], capsys)
    assert code == 2 and reached == [] and read == [], err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "--preset cpu-eps10 at --patient-cap 2" in err and "--public-patients P" in err, err


def test_a_preset_without_dpsgd_runs_at_a_drawn_patient_count(
    tmp_path: Path, reached: list[Any], capsys: Any
) -> None:
    """No DP-SGD, nothing sized over the patients: the count is drawn as before."""
    with pytest.raises(Started):
        run_cli([*_train(tmp_path, "cpu-eps10-nodpsgd"), "--no-progress"], capsys)
    assert reached[0][2].draw_patients


@given(
    rate=st.floats(1e-4, 1.0),
    patients=st.integers(1, 10**6),
    epochs=st.one_of(st.none(), st.floats(0.1, 200.0)),
)
def test_the_fitted_batch_samples_patients_at_the_presets_rate(
    rate: float, patients: int, epochs: float | None
) -> None:
    cfg = load_preset("paper-mnist").replace(
        dpsgd={"rate": rate, "epochs": epochs, "steps": None if epochs else 60}
    )
    fit = fit_dpsgd_to_patients(cfg, PatientFacts(patients, 4))
    out = cfg.replace(dpsgd=fit)
    assert out.dpsgd.rate is None and out.for_size(7 * patients).dpsgd == out.dpsgd  # images size nothing
    batch = out.dpsgd.batch
    assert batch == 1 or abs(batch - rate * patients) <= 0.5 + 1e-9
    assert out.dpsgd.steps == (60 if epochs is None else max(1, math.ceil(epochs * patients / batch)))
    assert fit_dpsgd_to_patients(cfg, None) == {}
