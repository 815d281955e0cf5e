"""`train --policy` at a PATIENT-level site applies the policy's unit of privacy as the site's node does
(``data.loading.policy_data``): the images capped at its ``dataset.patient_cap``, DP-SGD sampling its
``dataset.patients``. The job is then derived, planned and trained over the counts the node charges. Without
``--patient-cap`` such a run was refused with a message about a --public-patients nobody gave; with a
``--public-patients`` or ``--patient-cap`` other than the policy's, the job was derived and the trainer
divided over one count while the node charged q over the other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from feta_release.data.declared import DataDeclaration
from tests.support.cli import run_cli
from tests.support.patients import noise_patient_csv

PATIENTS, CAP, SCANS = 30, 2, 3  # the policy's public patients and cap; scans each patient has


class Started(Exception):
    """The run was handed to the trainer."""


@pytest.fixture
def reached(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    got: list[Any] = []

    def run_train(cfg: Any, data: Any, out_dir: Any, opts: Any) -> None:
        got.append((data, opts))
        raise Started

    monkeypatch.setattr("coordinator.local_run.run_train", run_train)
    return got


def _site(tmp_path: Path) -> list[str]:
    """A CSV of PATIENTS patients with SCANS scans each and `train`'s --policy options for a patient-level
    policy (PATIENTS public patients, at most CAP images each) signed by the site's administrator."""
    from feta_release.policy import make_policy, sign_policy, write_signed_policy
    from feta_release.signing import generate_keypair, load_private_key

    noise_patient_csv(tmp_path, PATIENTS, SCANS)
    admin, admin_pub = generate_keypair(tmp_path / "k", "admin")
    coord, _ = generate_keypair(tmp_path / "k", "coordinator")
    (tmp_path / "k" / "data.secret").write_bytes(b"s" * 32)
    doc = make_policy(
        "hosp",
        "1" * 64,
        PATIENTS * CAP,
        [load_private_key(coord).public_key()],
        per_job=(10.0, 1e-5),
        lifetime=(20.0, 1e-5),
        patient_level=(PATIENTS, CAP),
        declared=DataDeclaration(("a", "b"), (1, 28, 28)),
    )
    pol = write_signed_policy(tmp_path / "site.signed.json", sign_policy(doc, load_private_key(admin)))
    return [
        "train",
        "--data",
        str(tmp_path / "labels.csv"),
        "--epsilon",
        "10",
        "--out",
        str(tmp_path / "run"),
        "--policy",
        str(pol),
        "--trusted",
        str(admin_pub),
        "--data-secret",
        str(tmp_path / "k" / "data.secret"),
        "--no-progress",
    ]


def test_train_samples_the_policys_patients_at_its_cap_without_a_cap_flag(
    tmp_path: Path, reached: list[Any], capsys: Any
) -> None:
    with pytest.raises(Started):
        run_cli(_site(tmp_path), capsys)
    data, opts = reached[0]
    assert opts.patients is not None and (opts.patients.n_public, opts.patients.cap) == (PATIENTS, CAP)
    assert data.n == PATIENTS * CAP and not opts.draw_patients  # capped as the node caps, nothing drawn


@pytest.mark.parametrize(
    ("flag", "said"),
    [
        (["--public-patients", "40"], f"dataset.patients = {PATIENTS}"),
        (["--patient-cap", "3"], f"dataset.patient_cap = {CAP}"),
    ],
)
def test_train_refuses_a_patient_count_or_cap_other_than_its_policys(
    tmp_path: Path, reached: list[Any], capsys: Any, flag: list[str], said: str
) -> None:
    code, _, err = run_cli([*_site(tmp_path), *flag], capsys)
    assert code != 0 and reached == [], err
    assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()
