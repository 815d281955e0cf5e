"""The derived job from the command line: `train --epsilon` without a preset, `privacy plan --shape`, and
`preset list|show|export`."""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.local_run import one_site_job
from feta_release.cli import main
from feta_release.config import JobConfig, load_job, load_preset, preset_names, preset_text
from feta_release.data import ImageDataset, load_embedded, save_npz
from feta_release.job_rules import DataFacts, derive_job, sizing_size
from tests.support.cli import run_cli as _run


def _here() -> int:
    """The torch threads of this process: what `train` and `privacy plan` time a derived job at by default."""
    import torch

    return torch.get_num_threads()


class Stop(Exception):
    """Raised by the stand-in run once it has seen what `train` would run."""


@pytest.fixture(scope="module")
def digits_npz(tmp_path_factory):
    full = load_embedded()
    idx = np.concatenate([np.flatnonzero(full.labels == c)[:60] for c in range(10)])
    path = tmp_path_factory.mktemp("data") / "digits.npz"
    save_npz(full.subset(np.sort(idx)), path)
    return path


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    got: dict[str, Any] = {}

    def fake_run(cfg: JobConfig, data: Any, out_dir: Any, opts: Any) -> None:
        got.update(cfg=cfg, data=data, job_for_size=opts.job_for_size, public_size=opts.public_size)
        raise Stop

    monkeypatch.setattr("coordinator.local_run.run_train", fake_run)
    return got


def test_train_without_a_preset_asks_for_epsilon(tmp_path: Path, capsys: Any) -> None:
    code, _, err = _run(["train", "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "--epsilon" in err and "preset list" in err


def test_derived_job_options_are_refused_beside_a_preset(tmp_path: Path, capsys: Any) -> None:
    code, _, err = _run(["train", "--preset", "tiny", "--epsilon", "1", "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "for the derived job" in err


def test_train_with_a_declared_size_runs_the_job_derived_from_the_data(
    digits_npz: Path, tmp_path: Path, capsys: Any, seen: dict[str, Any]
) -> None:
    saved = tmp_path / "job.toml"
    with pytest.raises(Stop):
        main(
            [
                "train",
                "--data",
                str(digits_npz),
                "--epsilon",
                "10",
                "--public-size",
                "600",
                "--out",
                str(tmp_path / "r"),
                "--save-job",
                str(saved),
            ]
        )
    out = capsys.readouterr().out
    want = derive_job(
        DataFacts(size=600, height=28, width=28, channels=1, n_classes=10, epsilon=10.0, threads=_here())
    )
    assert seen["cfg"] == want and seen["job_for_size"] is None and seen["public_size"] == 600
    assert load_job(saved) == want  # the printed and saved TOML is the job that runs
    assert tomllib.loads(out)["central"]["sigma"] == want.central.sigma
    assert "# facts: public size 600" in out and "not yet measured" in out


def test_train_that_draws_its_size_derives_the_job_at_the_drawn_size(
    digits_npz: Path, tmp_path: Path, capsys: Any, seen: dict[str, Any]
) -> None:
    with pytest.raises(Stop):
        main(["train", "--data", str(digits_npz), "--epsilon", "1", "--out", str(tmp_path / "r")])
    facts = DataFacts(
        size=1, height=28, width=28, channels=1, n_classes=10, epsilon=1.0, size_drawn=True, threads=_here()
    )
    ref = sizing_size(facts)
    # drawn under a job that depends on public facts only (not on the 600 private images)
    assert seen["cfg"] == derive_job(replace(facts, size=ref))
    job_at = seen["job_for_size"]
    assert job_at(700) == derive_job(replace(facts, size=700))
    assert "# facts: public size 700 (noisy count)" in capsys.readouterr().out


def test_privacy_plan_shows_the_derived_job_from_public_facts(capsys: Any) -> None:
    code, out, err = _run(
        [
            "privacy",
            "plan",
            "--size",
            "300",
            "--shape",
            "64x64x3",
            "--classes",
            "10",
            "--epsilon",
            "10",
            "--declared-size",
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    data = json.loads(out)
    want = derive_job(
        DataFacts(size=300, height=64, width=64, channels=3, n_classes=10, epsilon=10.0, threads=_here())
    )
    assert JobConfig.from_dict(data["derived_job"]) == want
    assert data["epsilon"] <= 10.0 and not data["warnings"]
    code, _, err = _run(
        ["privacy", "plan", "--size", "300", "--shape", "28x28", "--classes", "100", "--epsilon", "1"], capsys
    )
    assert code == 2 and "below the floor" in err


def test_privacy_plan_and_train_time_the_derived_job_at_the_threads_given(
    digits_npz: Path, tmp_path: Path, capsys: Any, seen: dict[str, Any]
) -> None:
    """`train --threads 1` runs on one thread, so its job is derived for one (fewer warm-up steps here: the
    2-thread job would overrun the budget ~1.8x), and `privacy plan --threads 1` shows that same job; both
    headers say the thread count."""
    import torch

    facts = DataFacts(size=4000, height=64, width=64, channels=1, n_classes=4, epsilon=10.0, threads=1)
    argv = ["privacy", "plan", "--size", "4000", "--shape", "64x64x1", "--classes", "4", "--epsilon", "10"]
    code, out, err = _run([*argv, "--declared-size", "--threads", "1", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert (
        JobConfig.from_dict(data["derived_job"]) == derive_job(facts) != derive_job(replace(facts, threads=2))
    )
    assert "cpu, 1 thread (CPU stages estimated 1.80x" in data["notes"][0]
    before = torch.get_num_threads()
    try:
        with pytest.raises(Stop):
            main(
                [
                    "train",
                    "--data",
                    str(digits_npz),
                    "--epsilon",
                    "10",
                    "--public-size",
                    "600",
                    "--threads",
                    "1",
                    "--out",
                    str(tmp_path / "r"),
                ]
            )
    finally:
        torch.set_num_threads(before)
    at_600 = replace(facts, size=600, height=28, width=28, n_classes=10)
    assert seen["cfg"] == derive_job(at_600)
    header = capsys.readouterr().out.splitlines()[1]
    assert header.startswith("# facts: public size 600, 28x28x1, 10 classes, epsilon 10"), header
    assert "cpu, 1 thread (CPU stages estimated 1.80x" in header


# the public facts of a site of 100,000 digits at epsilon 10, its size declared
PATIENT_SITE_FACTS = (
    "--size",
    "100000",
    "--shape",
    "28x28x1",
    "--classes",
    "10",
    "--epsilon",
    "10",
    "--declared-size",
)


def test_privacy_plan_plans_the_derived_job_per_patient_as_train_runs_it(capsys: Any) -> None:
    """--patients and --patient-cap beside the public facts: the derived job is planned as `train` runs it at
    a patient-level site (DP-SGD samples whole patients at q = batch / patients, events of unit "patient", the
    budget per patient), not dropped for an image-level plan. Over a cap of 3 the rules fit every stage to the
    budget PER PATIENT, so the plan meets it (a split per image would spend about 3 times it and be
    refused)."""
    facts = [*PATIENT_SITE_FACTS, "--time-budget", "50m", "--json"]
    code, out, err = _run(["privacy", "plan", *facts, "--patient-cap", "1", "--patients", "100000"], capsys)
    assert code == 0, err
    data = json.loads(out)
    sgd = [e for e in data["history"] if e["stage"] == "dpsgd"]
    assert sgd and sgd[0].get("unit") == "patient"
    assert sgd[0]["q"] == pytest.approx(data["derived_job"]["dpsgd"]["batch"] / 100_000)
    code, out, err = _run(["privacy", "plan", *facts, "--patient-cap", "3", "--patients", "40000"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["patient_cap"] == 3 and 9.5 <= data["epsilon"] <= 10.0


def test_privacy_plan_refuses_a_derived_patient_cap_whose_patient_count_train_would_draw(capsys: Any) -> None:
    """`train --patient-cap K` (K >= 2) without --public-patients draws the patient count (event 'patients',
    charged first) and samples patients at q = batch / the drawn count; the derived plan printed image-level
    DP-SGD without that event instead. It is refused in one usage line asking for --patients."""
    facts = PATIENT_SITE_FACTS
    code, out, err = _run(["privacy", "plan", *facts, "--patient-cap", "2", "--json"], capsys)
    assert code == 2 and out == "", out
    assert "draws the patient count" in err and "give --patients P" in err, err
    assert "Traceback" not in err


def test_privacy_plan_at_a_patient_cap_of_one_samples_the_images_as_patients(capsys: Any) -> None:
    """At --patient-cap 1 the cap leaves one image per patient: `train` takes the public size as the public
    patient count (no second count drawn), and the plan samples -n patients as `train` does."""
    facts = [*PATIENT_SITE_FACTS, "--time-budget", "50m", "--json"]
    code, out, err = _run(["privacy", "plan", *facts, "--patient-cap", "1"], capsys)
    assert code == 0, err
    data = json.loads(out)
    sgd = [e for e in data["history"] if e["stage"] == "dpsgd"]
    assert [e["stage"] for e in data["history"]].count("patients") == 0
    assert sgd and sgd[0].get("unit") == "patient"
    assert sgd[0]["q"] == pytest.approx(data["derived_job"]["dpsgd"]["batch"] / 100_000)
    code, same, err = _run(["privacy", "plan", *facts, "--patient-cap", "1", "--patients", "100000"], capsys)
    assert code == 0 and json.loads(same)["derived_job"] == data["derived_job"], err


def test_the_derived_plan_note_states_the_q_its_patient_level_dpsgd_samples_at(capsys: Any) -> None:
    """At a patient-level site DP-SGD samples whole patients at q = batch / patients; the note printed
    batch / images (half of it with 50,000 patients of 100,000 images) beside a table stating the other."""
    facts = PATIENT_SITE_FACTS
    argv = ["privacy", "plan", *facts, "--patient-cap", "1", "--patients", "50000", "--json"]
    code, out, err = _run(argv, capsys)
    assert code == 0, err
    data = json.loads(out)
    sgd = [e for e in data["history"] if e["stage"] == "dpsgd"]
    note = [n for n in data["notes"] if n.startswith("dpsgd:")]
    assert sgd and len(note) == 1, note
    stated = float(re.search(r"at q = ([0-9.e-]+) ", note[0]).group(1))  # type: ignore[union-attr]
    assert (
        stated == pytest.approx(sgd[0]["q"]) == pytest.approx(data["derived_job"]["dpsgd"]["batch"] / 50_000)
    )


def test_privacy_plan_refuses_a_bad_shape(capsys: Any) -> None:
    code, _, err = _run(["privacy", "plan", "--shape", "28by28", "--classes", "10", "--epsilon", "1"], capsys)
    assert code == 2 and "HxWxC" in err


def test_preset_list_names_every_preset_with_its_header_figure(capsys: Any) -> None:
    code, out, _ = _run(["preset", "list"], capsys)
    assert code == 0
    for name in preset_names():
        assert name in out
    assert "0.900 +- 0.015" in out and "0.803 +- 0.019" in out  # the nodpsgd presets' measured figures


def test_preset_show_and_export_give_the_shipped_file(tmp_path: Path, capsys: Any) -> None:
    code, out, _ = _run(["preset", "show", "cpu-eps1-nodpsgd"], capsys)
    assert code == 0 and out == preset_text("cpu-eps1-nodpsgd")
    dest = tmp_path / "mine.toml"
    code, _, _ = _run(["preset", "export", "cpu-eps10-nodpsgd", str(dest)], capsys)
    assert code == 0 and load_job(dest) == load_preset("cpu-eps10-nodpsgd")
    code, _, err = _run(["preset", "export", "cpu-eps10-nodpsgd", str(dest)], capsys)
    assert code == 2 and "--force" in err
    code, _, err = _run(["preset", "show", "../config"], capsys)
    assert code == 2 and "unknown preset" in err


def test_train_help_names_the_derived_job_and_the_best_presets(capsys: Any) -> None:
    code, out, _ = _run(["train", "--help"], capsys)
    assert code == 0
    text = re.sub(r"-\s+", "-", " ".join(out.split()))  # help wraps lines at hyphens
    assert "DERIVED" in text and "--epsilon" in text
    assert "cpu-eps1-nodpsgd" in text and "cpu-eps10-nodpsgd" in text


@pytest.fixture(scope="module")
def two_digits_npz(tmp_path_factory):
    full = load_embedded()
    sub = full.subset(np.sort(np.concatenate([np.flatnonzero(full.labels == c)[:300] for c in (0, 1)])))
    path = tmp_path_factory.mktemp("data") / "two.npz"
    save_npz(ImageDataset(sub.images, sub.labels, ("0", "1"), "two digits"), path)
    return path


@pytest.mark.slow
def test_a_derived_job_trains_end_to_end_within_its_epsilon(
    two_digits_npz: Path, tmp_path: Path, capsys: Any
) -> None:
    # 600 images of 2 classes at epsilon 3: both releases, aux-prototype cells, the shortest warm-up, 3 aux
    # epochs
    out, saved = tmp_path / "run", tmp_path / "job.toml"
    code, stdout, err = _run(
        [
            "train",
            "--data",
            str(two_digits_npz),
            "--epsilon",
            "3",
            "--public-size",
            "600",
            "--time-budget",
            "1s",
            "--save-job",
            str(saved),
            "--out",
            str(out),
            "--synthetic",
            "10",
            "--no-release",
            "--no-progress",
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["epsilon"] <= 3.0
    job = load_job(saved)
    # the generic cells ran, prototypes and all
    assert job.central.cell_rule == "aux" and job.central.cells > 1
    assert job.frequency.sigma is not None and job.auxgen.epochs == 3
    signed = json.loads((out / "signed_job.json").read_text("utf-8"))["job"]["config"]
    assert JobConfig.from_dict(signed) == one_site_job(job.for_size(600), 600).with_secure_default(1)
    assert (out / "COMPLETE").exists()
