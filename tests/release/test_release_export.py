"""`feta-release export RUN_DIR` -> verify -> synthesize, through the CLI, on a run directory laid out as
feta_release/training/pipeline.py writes it (model.pt, job.json, run.json naming the site ledger, the ledger,
privacy.json as an unsigned copy, COMPLETE)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from feta_release.accounting import epsilon, events_to_list  # noqa: E402
from feta_release.cli import cli  # noqa: E402
from feta_release.config import JobConfig, config_hash  # noqa: E402
from feta_release.errors import ReleaseError  # noqa: E402
from feta_release.files import atomic_write_json  # noqa: E402
from feta_release.ledger import Budget, Ledger  # noqa: E402
from feta_release.models.edm import denoiser_spec  # noqa: E402
from feta_release.policy import make_policy, sign_policy  # noqa: E402
from feta_release.signing import (  # noqa: E402
    generate_keypair,
    load_private_key,
    sha256_file,  # noqa: E402
)
from feta_release.training.checkpoint import save_torch  # noqa: E402
from tests.support.release import CLASSES, EVENTS, IMAGE_SHAPE, small_denoiser  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # fixtures: tests/conftest.py


def _run_dir(root: Path, site_key: Path, events=EVENTS, complete: bool = True) -> Path:
    """A finished run: its events charged in a site ledger signed by ``site_key`` (as `train` charges
    them)."""
    cfg = JobConfig.from_dict(
        {
            "model": {"channels": 8, "channel_mult": [1, 2], "num_res_blocks": 1, "attn_resolutions": [4]},
            "sampler": {"solver": "heun", "steps": 5},
            "dpsgd": {"steps": 200},
        }
    )
    den = small_denoiser()
    rd = root / "run"
    rd.mkdir()
    save_torch(
        rd / "model.pt",
        {
            "spec": denoiser_spec(cfg.model, IMAGE_SHAPE, len(CLASSES)),
            "state_dict": den.state_dict(),
            "class_names": CLASSES,
            "job_hash": config_hash(cfg.to_dict()),
            "sampler": cfg.to_dict()["sampler"],
        },
    )
    atomic_write_json(rd / "job.json", cfg.to_dict())
    budget = Budget(job_epsilon=100.0, lifetime_epsilon=100.0, delta=1e-5)
    with Ledger(rd / "ledger.sqlite", key=load_private_key(site_key)) as led:
        for i, e in enumerate(events):
            led.charge("local-run", f"local-run/{e.stage}/{i}", e.stage, [e], budget, response=b"released")
        if complete:  # as the run closes its job: the signed record names job.json's hash, model.pt, delta
            led.close_job(
                "local-run",
                config_hash(cfg.to_dict()),
                {"model_sha256": sha256_file(rd / "model.pt"), "delta": 1e-5, "accountant": "rdp"},
            )
        # Another site job in the same ledger, closed, spending far less (a cheaper statement to point at).
        cheap = EVENTS[0]
        led.charge("cheap-run", "cheap-run/0", cheap.stage, [cheap], budget, response=b"released")
        led.close_job(
            "cheap-run",
            config_hash(cfg.to_dict()),
            {"model_sha256": "c" * 64, "delta": 1e-5, "accountant": "rdp"},
        )
    atomic_write_json(
        rd / "privacy.json",
        {
            "accountant": "rdp",
            "delta": 1e-5,
            "events": events_to_list(events),
            "epsilon": epsilon(events, 1e-5),
        },
    )
    atomic_write_json(
        rd / "run.json",
        {
            "status": "complete",
            "finished": "2026-11-22T01:00:00Z",
            "ledger": {"path": "ledger.sqlite", "job_id": "local-run"},
        },
    )
    if complete:
        (rd / "COMPLETE").write_text("")
    return rd


@pytest.fixture
def setup(tmp_path):
    kd = tmp_path / "keys"
    coord, coord_pub = generate_keypair(kd, "coordinator")
    site, site_pub = generate_keypair(kd, "site")
    pol_key, pol_pub = generate_keypair(kd, "policy")
    return tmp_path, {
        "coord": coord,
        "site": site,
        "policy_key": pol_key,
        "pubs": [str(coord_pub), str(site_pub), str(pol_pub)],
    }


def _policy_file(tmp: Path, k: dict, per_job_eps: float) -> Path:
    doc = make_policy(
        "hosp-a",
        "1" * 64,
        5000,
        [load_private_key(k["coord"]).public_key()],
        per_job=(per_job_eps, 1e-5),
        lifetime=(20.0, 1e-5),
        site_key=load_private_key(k["site"]).public_key(),
    )
    p = tmp / f"policy-{per_job_eps}.signed.json"
    p.write_text(json.dumps(sign_policy(doc, load_private_key(k["policy_key"]))))
    return p


def _trusted(k: dict) -> list[str]:
    """Role-bound trust: site hosp-a's administrator key (the coordinator and site keys follow from its
    policy)."""
    return ["--trusted", f"hosp-a={k['pubs'][2]}"]


def test_export_verify_synthesize_cli(setup):
    tmp, k = setup
    rd = _run_dir(tmp, k["site"])
    pol = _policy_file(tmp, k, 5.0)
    rel = tmp / "release"
    r = CliRunner().invoke(
        cli,
        [
            "export",
            str(rd),
            "--out",
            str(rel),
            "--coordinator-key",
            str(k["coord"]),
            "--site-key",
            str(k["site"]),
            "--policy",
            str(pol),
            "--steps",
            "4",
        ],
    )
    assert r.exit_code == 0, (r.output, r.exception)
    man = json.loads((rel / "manifest.json").read_text())["manifest"]
    (site,) = man["sites"]
    assert site["site_id"] == "hosp-a" and site["events"] == events_to_list(EVENTS)
    assert man["generator"]["classes"] == CLASSES and man["generator"]["sampler"]["steps"] == 4
    assert man["timestamps"]["trained"] == "2026-11-22T01:00:00Z"
    assert (rel / "policies" / "hosp-a.signed.json").is_file()

    r = CliRunner().invoke(cli, ["verify", str(rel), "--json", *_trusted(k)])
    assert r.exit_code == 0, r.output
    out_json = json.loads(r.output)
    assert out_json["ok"] is True
    # The figures come from the site's ledger (signed chain), not from the unsigned run directory: no warning.
    assert not [c for c in out_json["checks"] if c["name"] == "site hosp-a history"]
    assert man["sites"][0]["attestation"]["statement"]["history"] == "site-ledger"

    out = tmp / "synthetic"
    r = CliRunner().invoke(
        cli,
        ["synthesize", "--release", str(rel), "--num", "4", "--out", str(out), "--no-progress", *_trusted(k)],
    )
    assert r.exit_code == 0, (r.output, r.exception)
    assert len(json.loads((out / "certificate.json").read_text())["files"]) == 4


def test_export_refuses_over_policy_run_and_writes_nothing(setup):
    tmp, k = setup
    rd = _run_dir(tmp, k["site"])
    pol = _policy_file(tmp, k, 0.5)  # the run spends more than this
    rel = tmp / "release"
    r = CliRunner().invoke(
        cli,
        [
            "export",
            str(rd),
            "--out",
            str(rel),
            "--coordinator-key",
            str(k["coord"]),
            "--site-key",
            str(k["site"]),
            "--policy",
            str(pol),
        ],
    )
    assert isinstance(r.exception, ReleaseError) and "outside site hosp-a's policy" in str(r.exception)
    assert not rel.exists()
    assert not [p for p in tmp.iterdir() if p.name.startswith(".release")]


def test_export_refuses_unfinished_run(setup):
    tmp, k = setup
    rd = _run_dir(tmp, k["site"], complete=False)
    r = CliRunner().invoke(
        cli,
        [
            "export",
            str(rd),
            "--out",
            str(tmp / "rel"),
            "--coordinator-key",
            str(k["coord"]),
            "--site-key",
            str(k["site"]),
        ],
    )
    assert isinstance(r.exception, ReleaseError) and "not complete" in str(r.exception)
    assert not (tmp / "rel").exists()


class _Payload:
    """Pickles to a call of ``Path.touch(marker)``: code a full unpickle would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: D105
        return (Path.touch, (self.marker,))


def test_export_does_not_unpickle_code_from_model_pt(setup):
    """Attack: whoever can write the run directory plants code in model.pt; `export` (run by the
    site, with the site key) must load weights only. Fails on 473f707 (torch.load weights_only=False runs
    it)."""
    tmp, k = setup
    rd = _run_dir(tmp, k["site"])
    marker = tmp / "pwned"
    ckpt = torch.load(rd / "model.pt", weights_only=True)
    save_torch(rd / "model.pt", {**ckpt, "extra": _Payload(marker)})
    r = CliRunner().invoke(
        cli,
        [
            "export",
            str(rd),
            "--out",
            str(tmp / "rel"),
            "--coordinator-key",
            str(k["coord"]),
            "--site-key",
            str(k["site"]),
            "--policy",
            str(_policy_file(tmp, k, 5.0)),
        ],
    )
    assert not marker.exists(), "export ran code from model.pt"
    assert isinstance(r.exception, ReleaseError) and "weights-only" in str(r.exception)
    assert not (tmp / "rel").exists()


def test_editing_privacy_json_does_not_change_what_export_attests(setup):
    """Attack: whoever can write the run directory lowers the spend in privacy.json; export
    attested from that unsigned file. Now the statement is the ledger's history (fails on the old export)."""
    tmp, k = setup
    rd = _run_dir(tmp, k["site"])
    doc = json.loads((rd / "privacy.json").read_text())
    doc["events"] = [{**e, "sigma": e["sigma"] * 100} for e in doc["events"]]  # "spent almost nothing"
    (rd / "privacy.json").write_text(json.dumps(doc))
    rel = tmp / "release"
    r = CliRunner().invoke(
        cli,
        [
            "export",
            str(rd),
            "--out",
            str(rel),
            "--coordinator-key",
            str(k["coord"]),
            "--site-key",
            str(k["site"]),
            "--policy",
            str(_policy_file(tmp, k, 5.0)),
        ],
    )
    assert r.exit_code == 0, (r.output, r.exception)
    (site,) = json.loads((rel / "manifest.json").read_text())["manifest"]["sites"]
    assert site["events"] == events_to_list(EVENTS) and site["epsilon"] == pytest.approx(
        epsilon(EVENTS, 1e-5)
    )


def test_export_refuses_a_ledger_signed_by_another_key_or_edited(setup):
    import sqlite3

    tmp, k = setup
    rd = _run_dir(tmp, k["site"])
    args = ["export", str(rd), "--coordinator-key", str(k["coord"])]
    r = CliRunner().invoke(cli, [*args, "--out", str(tmp / "r1"), "--site-key", str(k["coord"])])
    assert (
        isinstance(r.exception, ReleaseError)
        and "another key" in str(r.exception)
        and "--site-key" in str(r.exception)
    )
    db = sqlite3.connect(rd / "ledger.sqlite")
    db.execute("UPDATE requests SET events = replace(events, '1.5', '150.0') WHERE mechanism = 'dpsgd'")
    db.commit()
    db.close()
    r = CliRunner().invoke(cli, [*args, "--out", str(tmp / "r2"), "--site-key", str(k["site"])])
    assert isinstance(r.exception, ReleaseError) and "tampered" in str(r.exception)
    assert not (tmp / "r1").exists() and not (tmp / "r2").exists()


def _export(tmp: Path, k: dict, rd: Path, out: str = "rel"):
    return CliRunner().invoke(
        cli,
        [
            "export",
            str(rd),
            "--out",
            str(tmp / out),
            "--coordinator-key",
            str(k["coord"]),
            "--site-key",
            str(k["site"]),
        ],
    )


def test_export_refuses_run_json_pointing_at_another_closed_job(setup):
    """Attack: run.json is unsigned; pointing its job id at a cheaper closed job of the same site ledger
    attested that job's spend for this model. The signed record of that job names another model: refused."""
    tmp, k = setup
    rd = _run_dir(tmp, k["site"])
    run = json.loads((rd / "run.json").read_text())
    run["ledger"]["job_id"] = "cheap-run"
    (rd / "run.json").write_text(json.dumps(run))
    r = _export(tmp, k, rd)
    assert isinstance(r.exception, ReleaseError) and "does not match its site ledger" in str(r.exception)
    assert "model.pt" in str(r.exception) and not (tmp / "rel").exists()


def test_export_refuses_an_edited_delta_and_attests_the_ledgers(setup):
    """Attack: delta came from the unsigned job.json; a larger delta gives a smaller epsilon. Editing it
    is refused (job.json no longer hashes to the signed record); the attested delta is the ledger's."""
    tmp, k = setup
    rd = _run_dir(tmp, k["site"])
    r = _export(tmp, k, rd, "ok")
    assert r.exit_code == 0, (r.output, r.exception)
    (site,) = json.loads((tmp / "ok" / "manifest.json").read_text())["manifest"]["sites"]
    assert site["attestation"]["statement"]["delta"] == 1e-5
    job = json.loads((rd / "job.json").read_text())
    job["privacy"]["delta"] = 1e-2
    (rd / "job.json").write_text(json.dumps(job))
    r = _export(tmp, k, rd)
    assert isinstance(r.exception, ReleaseError) and "job.json hashes to" in str(r.exception)
    assert not (tmp / "rel").exists()


def test_export_refuses_a_swapped_model(setup):
    """Attack: model.pt is unsigned; another model (same job hash, other weights) swapped in after the
    run closed was released under this run's statement. Its sha256 is not the ledger's: refused."""
    tmp, k = setup
    rd = _run_dir(tmp, k["site"])
    ckpt = torch.load(rd / "model.pt", weights_only=True)
    ckpt["state_dict"] = {n: t + 0.01 if t.is_floating_point() else t for n, t in ckpt["state_dict"].items()}
    save_torch(rd / "model.pt", ckpt)
    r = _export(tmp, k, rd)
    assert isinstance(r.exception, ReleaseError) and "model.pt hashes to" in str(r.exception)
    assert not (tmp / "rel").exists()
