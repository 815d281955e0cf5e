"""What `verify`, `synthesize` and `verify-synthetic` print for a data-protection officer: the verdict on the
FIRST line, then one line per site (unit, ε this job and lifetime with their caps, worst case with its cap,
the trust assumption), the details only with --explain, and a machine-readable --json. A caveat is a NOTE,
never a PASS."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("torch")  # only to BUILD the test release

from feta_release.cli import cli  # noqa: E402
from feta_release.release.onnx_export import export_denoiser  # noqa: E402
from feta_release.signing import public_key_pem  # noqa: E402
from tests.support.release import IMAGE_SHAPE, secure_release, small_denoiser  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # fixtures: tests/conftest.py


@pytest.fixture(scope="module")
def secure(tmp_path_factory) -> tuple[Path, list[str], Path]:
    root = tmp_path_factory.mktemp("secure")
    keys = secure_release(root / "release", export_denoiser(small_denoiser(), IMAGE_SHAPE))
    trusted = []
    for sid, k in keys.items():
        (root / f"{sid}-admin.pub").write_text(public_key_pem(k.policy))
        trusted += ["--trusted", f"{sid}={root / f'{sid}-admin.pub'}"]
    from feta_release.signing import generate_keypair

    generate_keypair(root, "dpo")
    return root / "release", trusted, root


def _run(args: list[str]) -> tuple[int, list[str]]:
    r = CliRunner().invoke(cli, args)
    return r.exit_code, [ln for ln in r.output.splitlines() if ln.strip()]


SITE_LINE = (
    "site st-mary: per image, δ = 1e-05: ε this job 1.07 (cap 2), lifetime 1.07 (cap 8); worst case (all "
    "other sites collude) 1.46 (cap 3), lifetime 1.46 (cap 24); holds if no other site colludes with the "
    "coordinator"
)


def test_verify_prints_the_verdict_first_then_one_line_per_site_with_caps_and_assumption(secure):
    release, trusted, _ = secure
    code, lines = _run(["verify", str(release), *trusted])
    assert code == 0
    assert lines[0].startswith("VERIFIED: ") and "19 checks passed, 0 warned, 0 failed, 2 note(s)" in lines[0]
    assert lines[1].strip() == SITE_LINE and lines[2].strip().startswith("site st-luke: per image")
    assert not any(ln.startswith(("PASS", "pass")) for ln in lines)  # details only on request
    assert len(" ".join(lines).split()) < 220  # two sites: a screen, not a paragraph per site


def test_explain_shows_every_check_and_the_caveat_as_a_note_not_a_pass(secure):
    release, trusted, _ = secure
    code, lines = _run(["verify", str(release), *trusted, "--explain"])
    assert code == 0 and lines[0].startswith("VERIFIED: ")
    caveat = "holds if no other site colludes with the coordinator (the noise"
    assert sum(ln.startswith("NOTE site ") and caveat in ln for ln in lines) == 2
    assert not any(ln.startswith("PASS") and "holds if" in ln for ln in lines)
    assert sum(ln.startswith("PASS ") for ln in lines) == 19
    assert any("Meaning: whether or not any single image" in ln for ln in lines)


def test_json_gives_verdict_separate_counts_and_per_site_figures_with_caps(secure):
    release, trusted, _ = secure
    code, _ = _run(["verify", str(release), *trusted, "--json"])
    doc = json.loads(CliRunner().invoke(cli, ["verify", str(release), *trusted, "--json"]).output)
    assert code == 0 and doc["verdict"] == "VERIFIED" and doc["ok"] is True
    assert doc["counts"] == {"passed": 19, "warned": 0, "failed": 0, "notes": 2}
    mary = next(s for s in doc["sites"] if s["site_id"] == "st-mary")
    assert mary["unit"] == "image" and mary["assumed_colluders"] == 0
    assert (
        mary["job"]["cap"] == 2.0
        and mary["worst_case"]["cap"] == 3.0
        and mary["lifetime_worst_case"]["cap"] == 24
    )
    assert mary["worst_case"]["epsilon"] > mary["job"]["epsilon"]


def test_refused_release_says_refused_and_why_on_the_first_line(secure, tmp_path):
    release, trusted, _ = secure
    bad = shutil.copytree(release, tmp_path / "release")
    (bad / "generator.onnx").write_bytes((bad / "generator.onnx").read_bytes() + b"x")
    r = CliRunner().invoke(cli, ["verify", str(bad), *trusted])
    first = r.output.splitlines()[0]
    assert r.exit_code != 0 and first.startswith("REFUSED: do not publish; ") and "generator" in first
    assert "1 failed" in first


def test_synthesize_and_verify_synthetic_print_the_verdict_first(secure, tmp_path):
    release, trusted, root = secure
    out = tmp_path / "synthetic"
    code, lines = _run(
        [
            "synthesize",
            "--release",
            str(release),
            "--num",
            "3",
            "--out",
            str(out),
            "--no-progress",
            "--threads",
            "1",
            *trusted,
            "--key",
            str(root / "dpo.key"),
            "--signer",
            "DPO office",
        ]
    )
    assert code == 0, lines
    assert lines[0].startswith("VERIFIED: the release") and lines[1].strip().startswith(
        "site st-mary: per image"
    )
    code, lines = _run(["verify-synthetic", str(out), "--certificate-key", str(root / "dpo.pub"), *trusted])
    assert code == 0, lines
    assert lines[0].startswith("VERIFIED: the synthetic folder") and "failed" in lines[0]
    assert lines[1].strip() == SITE_LINE
    doc = json.loads(
        CliRunner()
        .invoke(
            cli,
            ["verify-synthetic", str(out), "--certificate-key", str(root / "dpo.pub"), *trusted, "--json"],
        )
        .output
    )
    assert doc["verdict"] == "VERIFIED" and doc["counts"]["notes"] == 2 and len(doc["sites"]) == 2


def test_a_patient_level_site_is_summarised_per_patient_against_its_caps() -> None:
    """At a patient-level site the caps bound ε PER PATIENT (the image-level stages by group privacy over the
    patient cap): the line shows that figure beside the caps, never the smaller per-image one."""
    from feta_release.accounting import PrivacyEvent, epsilon, patient_epsilon
    from feta_release.release.summary import site_summary

    events = [PrivacyEvent("central", 5.0, 1.0, 2), PrivacyEvent("dpsgd", 1.5, 0.05, 100, unit="patient")]
    rows = [e.to_dict() for e in events]
    site = {
        "site_id": "st-anne",
        "delta": 1e-5,
        "epsilon": epsilon(events, 1e-5),
        "accountant": "rdp",
        "events": rows,
        "attestation": {
            "statement": {"lifetime": {"events": rows, "delta": 1e-5, "epsilon": epsilon(events, 1e-5)}}
        },
    }
    policy = {
        "budget": {"per_job": {"epsilon": 4.0, "delta": 1e-5}, "lifetime": {"epsilon": 9.0, "delta": 1e-5}},
        "accountant": "rdp",
        "dataset": {"privacy_unit": "patient", "patient_cap": 3, "patients": 100},
    }
    s = site_summary(site, policy)
    per_patient = patient_epsilon(events, 1e-5, 3, "rdp")
    assert s.unit == "patient" and s.job.epsilon == pytest.approx(per_patient) and s.job.cap == 4.0
    assert per_patient > epsilon(events, 1e-5)  # the per-image figure would understate a patient's loss
    assert s.line().startswith(f"site st-anne: per patient, δ = 1e-05: ε this job {per_patient:.3g} (cap 4)")
    assert s.worst is None and "holds whoever colludes" in s.assumption
