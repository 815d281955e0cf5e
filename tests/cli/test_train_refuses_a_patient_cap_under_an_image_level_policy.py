"""`train --patient-cap K` under an IMAGE-level --policy (its ``dataset`` declares no ``privacy_unit =
"patient"``): the cap dropped every patient's images past the first K while the run stayed image-level
(DP-SGD sampling images, every ε per image), silently: not the patient-level run the cap asks for. It is
refused in one line naming the policy file, the mismatch and the fix, before any image is read or any ε
charged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from feta_release.data.declared import DataDeclaration
from tests.support.cli import run_cli


def _image_level_site(tmp_path: Path) -> tuple[list[str], Path]:
    """`train`'s options for a CSV with patient ids under an image-level policy its administrator signed."""
    from feta_release.policy import make_policy, sign_policy, write_signed_policy
    from feta_release.signing import generate_keypair, load_private_key

    (tmp_path / "labels.csv").write_text("path,label,patient_id\nx0.png,a,p0\nx1.png,b,p0\n")
    admin, admin_pub = generate_keypair(tmp_path / "k", "admin")
    coord, _ = generate_keypair(tmp_path / "k", "coordinator")
    (tmp_path / "k" / "data.secret").write_bytes(b"s" * 32)
    doc = make_policy(
        "hosp",
        "1" * 64,
        200,
        [load_private_key(coord).public_key()],
        per_job=(10.0, 1e-5),
        lifetime=(20.0, 1e-5),
        declared=DataDeclaration(("a", "b"), (1, 28, 28)),
    )
    pol = write_signed_policy(tmp_path / "site.signed.json", sign_policy(doc, load_private_key(admin)))
    args = [
        "train",
        "--data",
        str(tmp_path / "labels.csv"),
        "--epsilon",
        "10",
        "--out",
        str(tmp_path / "run"),
    ]
    args += [
        "--policy",
        str(pol),
        "--trusted",
        str(admin_pub),
        "--data-secret",
        str(tmp_path / "k" / "data.secret"),
    ]
    return [*args, "--no-progress"], pol


@pytest.mark.parametrize(("how", "cap"), [(["--epsilon", "10"], 1), (["--preset", "tiny"], 2)])
def test_train_refuses_a_patient_cap_the_image_level_policy_does_not_declare(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch, how: list[str], cap: int
) -> None:
    read: list[Any] = []
    monkeypatch.setattr("feta_release.data.load_dataset", lambda *a, **k: read.append(a) or 1 / 0)
    monkeypatch.setattr("coordinator.local_run.run_train", lambda *a, **k: read.append(a) or 1 / 0)
    args, pol = _image_level_site(tmp_path)
    if how[0] == "--preset":
        args = [a for a in args if a not in ("--epsilon", "10")] + how
    code, _, err = run_cli([*args, "--patient-cap", str(cap)], capsys)
    assert code != 0 and read == [], err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"{pol}: the policy makes the IMAGE the unit of privacy" in err and f"--patient-cap {cap}" in err
    assert f'dataset.privacy_unit = "patient", patient_cap = {cap}' in err and "drop the patient cap" in err
    assert not (tmp_path / "run").exists()
