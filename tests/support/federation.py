"""Shared set-up for the federation tests: tiny sites, keys, signed policies, an in-process federation."""

from __future__ import annotations

import json
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from feta_release.config import JobConfig

TINY_MODEL = {"channels": 8, "channel_mult": [1], "num_res_blocks": 1, "attn_resolutions": []}


def tiny_sites(n_sites: int = 3, per_site: int = 40, seed: int = 0) -> dict[str, Any]:
    """Disjoint small sites from the embedded digits, every class present at every site."""
    from feta_release.data import load_embedded
    from feta_release.data.splits import split_sites

    ds = load_embedded()
    rng = np.random.default_rng(seed)
    idx = np.concatenate(
        [
            rng.choice(np.flatnonzero(ds.labels == c), per_site * n_sites // 10, replace=False)
            for c in range(10)
        ]
    )
    small = ds.subset(np.sort(idx), source="embedded subset")
    parts = split_sites(small, n_sites, seed=seed)
    return {f"site-{chr(ord('a') + i)}": p for i, p in enumerate(parts)}


def tiny_job(**sections: dict[str, Any]) -> JobConfig:
    base: dict[str, Any] = {
        "job": {"name": "tiny", "seed": 0},
        "privacy": {"epsilon": 1.0, "delta": 1e-5},
        "central": {"rounds": 0},
        "frequency": {"sigma": None},
        "model": TINY_MODEL,
        "warmup": {"spatial_iterations": 0, "frequency_epochs": 0},
        "dpsgd": {"batch": 8, "steps": 1, "noise_multiplicity": 1, "physical_batch": 16},
        # per-site noise, explicitly: these jobs test that mode (secure aggregation, the default for >= 2
        # sites, is asked for with secure_aggregation = True; tests/federation/test_secure_default.py checks
        # the default itself)
        "federation": {
            "min_sites": 2,
            "rounds": 2,
            "local_steps": 2,
            "round_timeout": 30.0,
            "secure_aggregation": False,
        },
    }
    for name, over in sections.items():
        base[name] = {**base.get(name, {}), **over}
    return JobConfig.from_dict(base)


def full_job(**sections: dict[str, Any]) -> JobConfig:
    """All three stages, tiny: central images, frequency statistics, DP-SGD rounds."""
    over: dict[str, Any] = {
        "central": {"rounds": 1, "batch": 10, "sigma": 5.0},
        "frequency": {"sigma": 26.6, "features": 200, "chunk": 64},
        "warmup": {
            "spatial_iterations": 4,
            "spatial_batch": 8,
            "frequency_epochs": 1,
            "frequency_images": 40,
            "frequency_batch": 20,
        },
        "auxgen": {"epochs": 1, "iterations_per_epoch": 2, "batch": 20, "width": 8},
    }
    for name, more in sections.items():
        over[name] = {**over.get(name, {}), **more}
    return tiny_job(**over)


def fedsgd_job(**fed: Any) -> JobConfig:
    return full_job(federation={"secure_aggregation": True, "fedsgd": True, "rounds": 2, **fed})


def site_and_job(fed: Any, job_id: str, cfg: Any, site_id: str = "site-a") -> tuple[Any, Any, dict[str, Any]]:
    """A site as its node opens it, and a job signed for ``fed`` as that site verifies it (with the signed
    job)."""
    from coordinator.setup import sign_job_file
    from edge.site import site_for
    from feta_release.policy.jobs import verify_job

    signed, _ = sign_job_file(fed, cfg, job_id)
    site = site_for(fed.site(site_id).node_config())
    return site, verify_job(signed, site.policy, source="test"), signed


def harness(
    fed: Any,
    down: set[str] | frozenset[str] = frozenset(),
    fail_on: dict[str, Any] | None = None,
    devices: dict[str, str] | None = None,
):
    """``devices``: {site: its node config's device (``node start --device``)}; a site not named has none
    (cpu)."""
    from edge.clientapp import app
    from edge.site import CFG_DEVICE
    from feta_release.federation.harness import HarnessNode, InProcessGrid

    nodes, devices = {}, devices or {}
    for i, s in enumerate(fed.sites):
        cfg = {
            **s.node_config(),
            **({CFG_DEVICE: devices[s.site_id]} if s.site_id in devices else {}),
        }
        nodes[100 + i] = HarnessNode(app, cfg, down=s.site_id in down, fail_on=(fail_on or {}).get(s.site_id))
    return InProcessGrid(nodes)


def make_federation(tmp: Path, **kw: Any):
    from coordinator.setup import prepare_federation

    return prepare_federation(tmp, tiny_sites(), **kw)


def node_settings(site: Any, **more: Any) -> Any:
    """``edge.launch.NodeSettings`` of a federation site's node (``fed.site(...)``: its data, signed policy,
    trusted policy key, ledger, site key and data secret) with ``more`` settings."""
    from edge.launch import NodeSettings

    return NodeSettings(
        data=site.data,
        policy=site.policy,
        trusted_policy_key=site.policy_pub,
        ledger=site.ledger,
        site_key=site.site_key,
        data_secret=site.data_secret,
        **more,
    )


def node_file_options(site: Any) -> list[str]:
    """``node start``'s options naming a federation site's files (data, signed policy, ledger, site key, data
    secret); the trusted policy key is left to the caller."""
    return [
        "--data",
        str(site.data),
        "--policy",
        str(site.policy),
        "--ledger",
        str(site.ledger),
        "--site-key",
        str(site.site_key),
        "--data-secret",
        str(site.data_secret),
    ]


def run_harness_job(fed: Any, grid: Any, signed: dict[str, Any], out: Path, **kw: Any) -> Any:
    """Run a signed job over an in-process grid with the federation's coordinator key and short test
    timeouts."""
    from feta_release.federation.job import run_job
    from feta_release.signing import load_private_key

    return run_job(
        grid,
        signed,
        out,
        coordinator_key=load_private_key(fed.coordinator_key),
        wait_timeout=2,
        poll_interval=0.05,
        **kw,
    )


def ledger_requests(fed: Any, site_id: str, job_id: str) -> list[dict[str, Any]]:
    """The requests a site's ledger recorded for a job (none when the site's node never started: no ledger
    yet)."""
    from feta_release.ledger import Ledger

    if not Path(fed.site(site_id).ledger).exists():
        return []
    with Ledger(fed.site(site_id).ledger) as led:
        return led.requests(job_id)


def stop_serving(stop: Any, sock: Any, thread: Any, listener: Any) -> None:
    """End a test's in-thread ``edge.worker.serve`` loop: ask it to stop, wake its ``accept()`` with a bare
    connection that never waits for an answer, join, close.

    Not a channel call: when the loop saw the stop between two requests it has already left ``accept()``, the
    connection lands in the listener's backlog, and a call would wait for a challenge nobody sends (a
    hang)."""
    stop.requested = True
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(sock))
        except OSError:
            pass
    thread.join(5)
    listener.close()


def spy_warm_up(mp: pytest.MonkeyPatch) -> dict[str, Any]:
    """Record the coordinator's warm-up (``federation.job.warm_up``) as ``mp`` wraps it: its last call's
    arguments by name (``central``, ``sizes``...) and the aux generator it returned (``"fitted"``)."""
    import inspect

    from feta_release.federation import job as fjob

    real, seen = fjob.warm_up, {}

    def spy(*args: Any, **kw: Any) -> Any:
        seen.update(inspect.signature(real).bind(*args, **kw).arguments)
        seen["fitted"] = real(*args, **kw)
        return seen["fitted"]

    mp.setattr(fjob, "warm_up", spy)
    return seen


@dataclass(frozen=True)
class FederatedRun:
    """A job run over the in-process federation of :func:`make_federation`: its job directory ``out`` and
    what its warm-up was called with (:func:`spy_warm_up`)."""

    fed: Any
    cfg: JobConfig
    out: Path
    warm_up: dict[str, Any]

    def copy(self, to: Path) -> Path:
        """A copy of the job directory at ``to``, for a test that writes into it."""
        shutil.copytree(self.out, to)
        return to

    def trust(self) -> dict[str, Any]:
        from feta_release.signing import load_public_key

        return {s.site_id: load_public_key(s.policy_pub) for s in self.fed.sites}


def federated_run(tmp: Path, cfg: JobConfig, job_id: str) -> FederatedRun:
    """``cfg`` signed as ``job_id`` for a fresh three-site federation under ``tmp`` and run over an in-process
    grid, its warm-up recorded."""
    from coordinator.setup import sign_job_file

    with pytest.MonkeyPatch.context() as mp:
        seen = spy_warm_up(mp)
        fed = make_federation(tmp / "fed")
        signed, _ = sign_job_file(fed, cfg, job_id)
        run_harness_job(fed, harness(fed), signed, tmp / "out")
    return FederatedRun(fed, cfg, tmp / "out", seen)


def released_by_another_job(out: Path, name: str) -> None:
    """Stamp the release ``out/released/name`` of a job directory as job ``job-other``'s (a stale file of
    another job left in the directory) and remove the release built from it, so that it is built again."""
    with np.load(out / "released" / name) as z:
        arrays = dict(z)
    np.savez(out / "released" / name, **{**arrays, "job_id": np.array("job-other")})
    shutil.rmtree(out / "release")


class SignedTrain:
    """A `train --policy` run of the tiny preset on 200 embedded digits, as a site would run it: coordinator,
    site and policy-admin keys, a signed one-site policy, and ``sampler_lines`` added to the preset's
    [sampler]."""

    def __init__(self, tmp: Path, sampler_lines: str) -> None:
        from feta_release.data import load_dataset, load_embedded, save_npz
        from feta_release.data.commitment import create_secret, dataset_commitment, load_secret
        from feta_release.data.declared import DataDeclaration
        from feta_release.policy import make_policy, sign_policy
        from feta_release.signing import generate_keypair, load_private_key

        self.tmp, self.run = tmp, tmp / "run"
        full = load_embedded()
        rng = np.random.default_rng(3)
        idx = np.concatenate(
            [rng.choice(np.flatnonzero(full.labels == c), 20, replace=False) for c in range(10)]
        )
        save_npz(full.subset(np.sort(idx)), tmp / "small.npz")
        self.keys = {n: generate_keypair(tmp / "keys", n) for n in ("coordinator", "site", "admin")}
        self.secret = create_secret(tmp / "keys" / "data.secret")
        data, _ = load_dataset(tmp / "small.npz")
        declared = DataDeclaration.draft_from(data)
        data, _ = load_dataset(tmp / "small.npz", declared=declared)  # as train maps it under the policy
        doc = make_policy(
            "hosp-a",
            dataset_commitment(data, load_secret(self.secret)),
            200,
            [load_private_key(self.keys["coordinator"][0]).public_key()],
            per_job=(10.0, 1e-5),
            lifetime=(20.0, 1e-5),
            site_key=load_private_key(self.keys["site"][0]).public_key(),
            declared=declared,
        )
        (tmp / "policy.json").write_text(
            json.dumps(sign_policy(doc, load_private_key(self.keys["admin"][0])))
        )
        job = (Path(__file__).resolve().parents[2] / "feta_release" / "presets" / "tiny.toml").read_text(
            "utf-8"
        )
        (tmp / "job.toml").write_text(job.replace("[sampler]\n", "[sampler]\n" + sampler_lines))

    def train(self) -> None:
        from feta_release.cli import main

        k, t = self.keys, self.tmp
        try:
            main(
                [
                    "train",
                    str(t / "job.toml"),
                    "--data",
                    str(t / "small.npz"),
                    "--out",
                    str(self.run),
                    "--synthetic",
                    "10",
                    "--no-progress",
                    "--site-key",
                    str(k["site"][0]),
                    "--policy",
                    str(t / "policy.json"),
                    "--trusted",
                    str(k["admin"][1]),
                    "--data-secret",
                    str(self.secret),
                    "--coordinator-key",
                    str(k["coordinator"][0]),
                ]
            )
        except SystemExit as exc:
            assert not exc.code

    def trust(self) -> dict[str, Any]:
        from feta_release.signing import load_public_key

        return {"hosp-a": load_public_key(self.keys["admin"][1])}

    def signed_config(self) -> JobConfig:
        """The config of the job the run signed."""
        return JobConfig.from_dict(json.loads((self.run / "signed_job.json").read_text())["job"]["config"])

    def export_again(self, out: Path) -> Any:
        """The release built again from a copy of the run's job directory at ``out`` (``export``'s
        builder); returns ``out/release``."""
        from feta_release.release.jobdir import build_release

        shutil.copytree(self.run, out, ignore=shutil.ignore_patterns("release"))
        return build_release(out, self.keys["coordinator"][0])
