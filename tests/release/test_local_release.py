"""``feta-release train`` writes the job directory a federated coordinator writes (one-site job, the site's
attestation from its ledger, privacy report, signed release), with the same code; its privacy accounting is
the run's: the same events and epsilon as the plan, the ledger's DP-SGD requests the planner's round sizes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from feta_release.accounting import epsilon, events_from_list
from feta_release.config import load_job
from feta_release.data import load_embedded, save_npz
from feta_release.data.commitment import create_secret, dataset_commitment, load_secret
from feta_release.data.declared import DataDeclaration
from feta_release.ledger import Ledger
from feta_release.planning import merged, plan, stage_events
from feta_release.policy import make_policy, sign_policy
from feta_release.release import jobdir
from feta_release.signing import generate_keypair, load_private_key
from tests.support.cli import run_cli as _run

ROOT = Path(__file__).resolve().parents[2]


# What coordinator/finalize.py (now feta_release.release.jobdir) leaves in a federated job's --out, besides
# the coordinator's own state (state/, plan.json, progress.jsonl).
def job_layout(sites: list[str]) -> set[str]:
    return {
        "signed_job.json",
        "job_summary.json",
        "attestations.json",
        "model.pt",
        "privacy_report.json",
        "privacy_report.txt",
        "budget.svg",
        "samples.png",
        "release/manifest.json",
        "release/generator.onnx",
        *(f"policies/{s}.signed.json" for s in sites),
        *(f"release/policies/{s}.signed.json" for s in sites),
    }


SUMMARY_KEYS = {
    "job_id",
    "sites",
    "class_names",
    "image_shape",
    "rounds",
    "skipped",
    "site_epsilon",
    "site_unit",
    "site_epsilon_per_image",
    "delta",
    "histories",
    "timings",
}


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("kit")
    full = load_embedded()
    rng = np.random.default_rng(3)
    idx = np.concatenate([rng.choice(np.flatnonzero(full.labels == c), 20, replace=False) for c in range(10)])
    data = full.subset(np.sort(idx))
    save_npz(data, tmp / "small.npz")
    keys = {n: generate_keypair(tmp / "keys", n) for n in ("coordinator", "site", "admin")}
    secret = create_secret(tmp / "keys" / "data.secret")
    doc = make_policy(
        "hosp-a",
        dataset_commitment(data, load_secret(secret)),
        200,
        [load_private_key(keys["coordinator"][0]).public_key()],
        per_job=(5.0, 1e-5),
        lifetime=(20.0, 1e-5),
        site_key=load_private_key(keys["site"][0]).public_key(),
        declared=DataDeclaration.draft_from(data),
    )
    (tmp / "policy.signed.json").write_text(json.dumps(sign_policy(doc, load_private_key(keys["admin"][0]))))
    job = (
        (ROOT / "feta_release" / "presets" / "tiny.toml")
        .read_text("utf-8")
        .replace("epsilon = 10.0", "epsilon = 4.0")
    )
    (tmp / "job.toml").write_text(job)
    return {
        "tmp": tmp,
        "data": tmp / "small.npz",
        "policy": tmp / "policy.signed.json",
        "job": tmp / "job.toml",
        "coordinator": keys["coordinator"][0],
        "site": keys["site"][0],
        "admin_pub": keys["admin"][1],
        "secret": secret,
    }


@pytest.mark.slow
def test_train_writes_the_federated_job_layout_and_a_verifiable_release(
    kit: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out = kit["tmp"] / "run"
    train = [
        "train",
        str(kit["job"]),
        "--data",
        str(kit["data"]),
        "--out",
        str(out),
        "--synthetic",
        "10",
        "--quiet",
        "--json",
        "--site-key",
        str(kit["site"]),
        "--policy",
        str(kit["policy"]),
        "--trusted",
        str(kit["admin_pub"]),
        "--data-secret",
        str(kit["secret"]),
        "--coordinator-key",
        str(kit["coordinator"]),
    ]
    code, stdout, err = _run([*train, "--checkpoint-every", "3"], capsys)
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["release"] == str(out / "release")
    assert _files(out) >= job_layout(["hosp-a"])

    # privacy accounting unchanged: the attested events are the run's, which are the plan's
    cfg = load_job(kit["job"])
    n = json.loads((out / "plan.json").read_text())["hosp-a"]["size"]
    assert n == 200  # the policy's declared size
    planned = plan(cfg, n)
    att = json.loads((out / jobdir.ATTESTATIONS).read_text())["hosp-a"]["statement"]
    run_events = events_from_list(summary["events"])
    assert events_from_list(att["events"]) == run_events == planned.events
    assert att["epsilon"] == pytest.approx(summary["epsilon"], rel=1e-12)
    assert summary["epsilon"] == pytest.approx(epsilon(planned.events, 1e-5), rel=1e-12)
    # ... and the ledger's requests are the planner's: DP-SGD one round of all its steps, whatever the
    # checkpoints
    job_id = json.loads((out / jobdir.SIGNED_JOB).read_text())["job"]["job_id"]
    with Ledger(out / "site" / "ledger.sqlite") as led:
        rows = led.requests(job_id)
    steps = planned.event("dpsgd").steps  # type: ignore[union-attr]
    charged = [e for r in rows for e in events_from_list(r["events"])]
    assert charged == stage_events(cfg, n, rounds=[steps]) == stage_events(cfg, n)
    assert merged(charged) == planned.events
    summary_doc = json.loads((out / jobdir.SUMMARY).read_text())
    assert summary_doc["rounds"] == 1 and set(summary_doc) == SUMMARY_KEYS

    # the release verifies, synthesizes and reports exactly as a federated one
    trusted = ["--trusted", f"hosp-a={kit['admin_pub']}"]
    code, stdout, err = _run(["verify", str(out / "release"), "--json", *trusted], capsys)
    assert code == 0 and json.loads(stdout)["ok"] is True, (stdout, err)
    code, _, err = _run(
        [
            "synthesize",
            "--release",
            str(out / "release"),
            "--num",
            "3",
            "--out",
            str(kit["tmp"] / "syn"),
            "--no-progress",
            *trusted,
        ],
        capsys,
    )
    assert code == 0, err
    code, _, err = _run(
        ["report", str(out / "release"), "--out", str(kit["tmp"] / "r.html"), *trusted], capsys
    )
    assert code == 0, err
    # the same command again: already complete and already released, nothing re-spent or re-signed
    before = (out / "release" / "manifest.json").read_bytes()
    code, stdout, _ = _run(train, capsys)
    assert code == 0 and json.loads(stdout)["already_complete"] is True
    assert (out / "release" / "manifest.json").read_bytes() == before


@pytest.mark.slow  # a whole federated job and its ONNX release: minutes on a loaded machine
def test_a_federated_job_directory_has_the_same_layout(tmp_path: Path) -> None:
    """The coordinator's side of the same code: a job over the in-process Grid, then coordinator/finalize."""
    from coordinator.finalize import build_release, privacy_report, sample_grid
    from coordinator.setup import sign_job_file
    from feta_release.federation.job import run_job
    from tests.support.federation import harness, make_federation, tiny_job

    fed = make_federation(tmp_path / "fed")
    signed, _ = sign_job_file(fed, tiny_job(), "job-layout")
    out = tmp_path / "out"
    run_job(
        harness(fed),
        signed,
        out,
        coordinator_key=load_private_key(fed.coordinator_key),
        wait_timeout=2,
        poll_interval=0.05,
    )
    privacy_report(out)
    sample_grid(out)
    build_release(out, fed.coordinator_key)
    sites = [s.site_id for s in fed.sites]
    assert _files(out) >= job_layout(sites)
    # beyond the shared layout only the coordinator's own state and logs
    assert {f.split("/")[0] for f in _files(out) - job_layout(sites)} <= {
        "state",
        "plan.json",
        "progress.jsonl",
    }
    summary = json.loads((out / jobdir.SUMMARY).read_text())
    assert set(summary) == SUMMARY_KEYS
