"""`feta-release export RUN_DIR` -> verify -> synthesize, through the CLI, on the job directory a
`train --no-release` run leaves (signed job, the site's signed attestation, its signed policy, model.pt): the
one release builder (``release.jobdir.build_release``) makes RUN_DIR/release from it, as a coordinator's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from feta_release.accounting import epsilon, events_from_list  # noqa: E402
from feta_release.cli import cli  # noqa: E402
from feta_release.config import load_preset  # noqa: E402
from feta_release.errors import ReleaseError  # noqa: E402
from feta_release.policy import sign_policy  # noqa: E402
from feta_release.signing import load_private_key  # noqa: E402
from feta_release.training.checkpoint import save_torch  # noqa: E402
from tests.support.training import embedded_subset, train_run  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # fixtures: tests/conftest.py


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny `train` run without its release (the job directory `export` reads)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    cfg = load_preset("tiny").replace(dpsgd={"steps": 2}, warmup={"spatial_iterations": 1})
    train_run(cfg, embedded_subset(), out, public_size=240, release=False)
    assert not (out / "release").exists()
    return out


@pytest.fixture
def rd(finished: Path, tmp_path: Path) -> Path:
    """A copy of the finished run for one test to alter."""
    return Path(shutil.copytree(finished, tmp_path / "run"))


def _export(rd: Path, *extra: str):  # noqa: ANN202
    return CliRunner().invoke(cli, ["export", str(rd), *extra])


def _trusted(rd: Path) -> list[str]:
    """Role-bound trust: the run's site's administrator key (the run's own, which signed its policy)."""
    return ["--trusted", f"site={rd / 'keys' / 'policy-admin.pub'}"]


def _nothing_released(rd: Path) -> bool:
    return not (rd / "release").exists() and not [p for p in rd.iterdir() if p.name.startswith(".release")]


def test_export_verify_synthesize_cli(rd: Path, tmp_path: Path) -> None:
    r = _export(rd, "--steps", "4")
    assert r.exit_code == 0, (r.output, r.exception)
    man = json.loads((rd / "release" / "manifest.json").read_text())["manifest"]
    (site,) = man["sites"]
    report = json.loads((rd / "privacy_report.json").read_text())["sites"]["site"]
    assert site["site_id"] == "site" and site["events"] == report["events"]  # the site's signed statement
    assert man["generator"]["classes"] == [str(c) for c in range(10)]
    assert man["generator"]["sampler"]["steps"] == 4
    assert (rd / "release" / "policies" / "site.signed.json").is_file()

    r = CliRunner().invoke(cli, ["verify", str(rd / "release"), "--json", *_trusted(rd)])
    assert r.exit_code == 0 and json.loads(r.output)["ok"] is True, r.output

    out = tmp_path / "synthetic"
    r = CliRunner().invoke(
        cli,
        ["synthesize", "--release", str(rd / "release"), "--num", "4", "--out", str(out), "--no-progress"]
        + _trusted(rd),
    )
    assert r.exit_code == 0, (r.output, r.exception)
    assert len(json.loads((out / "certificate.json").read_text())["files"]) == 4


def test_export_refuses_a_spend_outside_the_sites_policy_and_writes_nothing(rd: Path) -> None:
    """The site's policy in the job directory caps the job at ε 0.5; the run's attested spend is above it."""
    pol = rd / "policies" / "site.signed.json"
    doc = json.loads(pol.read_text())["policy"]
    doc["budget"]["per_job"]["epsilon"] = 0.5
    pol.write_text(json.dumps(sign_policy(doc, load_private_key(rd / "keys" / "policy-admin.key"))))
    r = _export(rd)
    assert isinstance(r.exception, ReleaseError) and "outside its signed policy" in str(r.exception)
    assert _nothing_released(rd)


def test_export_refuses_an_unfinished_run(rd: Path) -> None:
    (rd / "attestations.json").unlink()  # the site never signed its statement: the job did not finish
    r = _export(rd)
    assert isinstance(r.exception, ReleaseError) and "not a finished job directory" in str(r.exception)
    assert _nothing_released(rd)


class _Payload:
    """Pickles to a call of ``Path.touch(marker)``: code a full unpickle would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: D105
        return (Path.touch, (self.marker,))


def test_export_does_not_unpickle_code_from_model_pt(rd: Path, tmp_path: Path) -> None:
    """Attack: whoever can write the run directory plants code in model.pt; `export` must load weights only.
    Fails on 473f707 (torch.load weights_only=False runs it)."""
    marker = tmp_path / "pwned"
    ckpt = torch.load(rd / "model.pt", weights_only=True)
    save_torch(rd / "model.pt", {**ckpt, "extra": _Payload(marker)})
    r = _export(rd)
    assert not marker.exists(), "export ran code from model.pt"
    assert isinstance(r.exception, ReleaseError) and "weights-only" in str(r.exception)
    assert _nothing_released(rd)


def test_an_edited_attestation_in_the_run_directory_is_not_released(rd: Path) -> None:
    """Attack: whoever can write the run directory edits the site's spend statement (attestations.json). A
    lowered spend is refused by export; any other edit is released by the coordinator's key as given, and
    verify refuses it: the statement is the site's, signed with its key."""
    path = rd / "attestations.json"
    signed = path.read_text()
    atts = json.loads(signed)
    st = atts["site"]["statement"]
    st["events"] = st["events"][:1]
    st["epsilon"] = epsilon(events_from_list(st["events"]), st["delta"], st["accountant"])
    path.write_text(json.dumps(atts))
    r = _export(rd)
    assert isinstance(r.exception, ReleaseError) and "refusing to release" in str(r.exception)
    assert _nothing_released(rd)

    atts = json.loads(signed)
    atts["site"]["statement"]["note"] = "edited"
    path.write_text(json.dumps(atts))
    assert _export(rd).exit_code == 0
    r = CliRunner().invoke(cli, ["verify", str(rd / "release"), "--json", *_trusted(rd)])
    failed = [c["detail"] for c in json.loads(r.output)["checks"] if c["status"] == "fail"]
    assert r.exit_code != 0 and any("site site attestation: bad signature" in d for d in failed), r.output
