"""`train` at a patient-level site (declared public patients P, at most k images each) derives, plans and
charges the job `privacy plan --patients P --patient-cap k` shows: its DP-SGD batch is a fraction of the
public PATIENTS (at most the rules' batch for P, never above P), sampled at q = batch / P, and its events are
the plan's. A local run that sized the batch over the images would sample up to k times as many patients per
step as the plan (or be refused by its own planner)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from coordinator.local_run import _plan as train_plan
from feta_release.cli import main
from feta_release.cli.derive_options import DeriveRequest, derived_jobs
from feta_release.data import ImageDataset
from feta_release.errors import ConfigError
from feta_release.job_rules import PatientFacts
from feta_release.privacy_unit import PatientIndex


def _privacy_plan(argv: list[str]) -> dict[str, Any] | None:
    """`feta-release privacy plan ARGV --json` as one JSON object; None where it refuses the facts."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(["privacy", "plan", *argv, "--json"])
        except SystemExit as exc:
            if exc.code:
                return None
    return json.loads(out.getvalue())


def _digits(per_class: int = 2) -> ImageDataset:
    """A stand-in for the site's images: the classes and shape the facts declare (the plan reads no pixel)."""
    labels = np.repeat(np.arange(10), per_class)
    return ImageDataset(np.zeros((len(labels), 1, 28, 28), np.float32), labels, tuple(map(str, range(10))))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    size=st.sampled_from([4_000, 20_000, 100_000]),
    per_patient=st.sampled_from([1.0, 1.5, 3.0]),
    cap=st.integers(1, 4),
    eps=st.sampled_from([4.0, 10.0, 20.0]),
    minutes=st.sampled_from([15, 50]),
)
def test_train_derives_plans_and_charges_the_job_privacy_plan_shows(
    size: int, per_patient: float, cap: int, eps: float, minutes: int
) -> None:
    patients = max(1, round(size / per_patient))
    facts = ["--size", str(size), "--shape", "28x28x1", "--classes", "10", "--epsilon", str(eps)]
    argv = [*facts, "--time-budget", f"{minutes}m", "--declared-size"]
    shown = _privacy_plan([*argv, "--patients", str(patients), "--patient-cap", str(cap)])
    data = _digits()
    req = DeriveRequest(eps, None, f"{minutes}m", None)
    try:
        cfg, _ = derived_jobs(
            req, data, "cpu", size, None, None, lambda _: None, patients=PatientFacts(patients, cap)
        )
    except ConfigError:  # below the floor: refused alike
        assert shown is None
        event("refused below the floor")
        return
    assert shown is not None and cfg.to_dict() == shown["derived_job"]
    sized = cfg.for_size(size)  # what the run signs at its public size
    index = PatientIndex(np.arange(data.n) % max(1, data.n // cap), patients, cap)
    charged = train_plan(sized, data, size, index, [], declared=True)
    assert [e.to_dict() for e in charged.history] == shown["history"]
    sgd = charged.event("dpsgd")
    event("DP-SGD on" if sgd is not None else "DP-SGD off")
    if sgd is not None:
        assert sized.dpsgd.batch <= patients
        assert getattr(sgd, "unit", None) == "patient" and sgd.q == pytest.approx(
            sized.dpsgd.batch / patients
        )
        note = next(n for n in shown["notes"] if n.startswith("dpsgd:"))
        assert f" at q = {sgd.q} " in note, note


@pytest.mark.parametrize("size", [4_000, 100_000])
def test_at_a_patient_cap_of_one_train_derives_the_plans_job_over_its_size_as_patients(size: int) -> None:
    """`train --patient-cap 1` without --public-patients: the cap leaves one image per patient, so the public
    size is the public patient count; the job `train` derives is the one `privacy plan --patient-cap 1` shows
    (both sample the size's patients), not an image-level one whose rate rounds apart."""
    argv = ["--size", str(size), "--shape", "28x28x1", "--classes", "10", "--epsilon", "10"]
    shown = _privacy_plan([*argv, "--time-budget", "50m", "--declared-size", "--patient-cap", "1"])
    req = DeriveRequest(10.0, None, "50m", None)
    cfg, _ = derived_jobs(req, _digits(), "cpu", size, None, None, lambda _: None, one_each=True)
    assert shown is not None and cfg.to_dict() == shown["derived_job"]


PRESETS = Path(__file__).resolve().parents[2] / "feta_release" / "presets"


@pytest.mark.parametrize("declared", [True, False])
@pytest.mark.parametrize(("preset", "size"), [("cpu-eps10", 4_000), ("cpu-eps1", 9_000)])
def test_a_job_files_plan_at_a_patient_cap_of_one_is_what_train_charges(
    preset: str, size: int, declared: bool
) -> None:
    """`privacy plan JOB -n N --patient-cap 1` planned image-level DP-SGD (images sampled, events of unit
    "image") while `train JOB --patient-cap 1` samples its patients, the N images the cap leaves one each: the
    plan's history and σ were not what the site's ledger holds."""
    from coordinator.local_run import TrainOptions, _public_counts
    from feta_release.config import load_job
    from feta_release.mechanisms.count import size_event

    job = PRESETS / f"{preset}.toml"
    shown = _privacy_plan(
        [str(job), "-n", str(size), "--patient-cap", "1", *(["--declared-size"] * declared)]
    )
    data, cfg = _digits(), load_job(job)
    index = PatientIndex(np.arange(data.n), 1, 1)  # one image each; 1: the placeholder `train` starts with
    if declared:  # as `train --public-size N --patient-cap 1` counts its patients
        opts = TrainOptions(public_size=size, patients=index, draw_patients=True)
        _, n_pub, index, counted = _public_counts(cfg, data, None, opts, None)  # type: ignore[arg-type]
    else:  # the drawn size is the patient count too (here: drawn at N)
        n_pub, counted = size, [size_event()]
        index = PatientIndex(index.ids, size, 1)
    charged = train_plan(cfg.for_size(n_pub), data, n_pub, index, counted, declared=False)
    assert shown is not None and [e.to_dict() for e in charged.history] == shown["history"]
    assert shown["history"][-1]["unit"] == "patient" and shown["epsilon"] == pytest.approx(charged.epsilon)


def test_a_job_files_plan_at_a_patient_cap_of_two_names_the_missing_patient_count(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without --patients `train` draws the patient count and samples patients over the draw, which no plan
    knows: refused in one line naming --patients (it planned image-level DP-SGD, a job no site runs)."""
    from feta_release.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["privacy", "plan", str(PRESETS / "cpu-eps10.toml"), "-n", "9000", "--patient-cap", "2"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--patient-cap 2 without --patients" in err, err
    assert "give --patients P" in err and "Traceback" not in err
