"""`train` at a patient-level site (declared public patients P, at most k images each) derives, plans and
charges the job `privacy plan --patients P --patient-cap k` shows: its DP-SGD batch is a fraction of the
public PATIENTS (at most the rules' batch for P, never above P), sampled at q = batch / P, and its events are
the plan's. A local run that sized the batch over the images would sample up to k times as many patients per
step as the plan (or be refused by its own planner)."""

from __future__ import annotations

import contextlib
import io
import json
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
