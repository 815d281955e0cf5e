"""Faults with REAL processes on loopback: SuperNodes, a node's worker and the coordinator killed mid-job.

One secure-aggregation job between three sites (central images summed by secure aggregation, a spatial warm-up
at the coordinator, two per-site DP-SGD rounds), run by the real ``feta-release coordinator run`` against a
real SuperLink and three real ``node start`` processes, with these faults, each at a point read off the
processes' own records (a worker's log, a ledger row, the job's progress log), never off a clock:

1. site-c's whole node is SIGKILLed during the secure sum, right after its worker computed its masked vector
   (charged): the sum is decoded without it (its pairwise masks rebuilt from the others' shares, threshold 2
   of 3), or with it when its vector left before the kill;
2. the coordinator (SuperLink, ServerApp and ``coordinator run``) is SIGKILLed during the warm-up; it is
   started again, site-c's node too, and ``coordinator run`` with the same ``--out`` resumes;
3. site-b's worker is SIGKILLed mid-request, after its ledger charged DP-SGD round 1 and before the answer was
   recorded: that round goes on without site-b (the site refuses to run a charged request twice);
4. site-c's node is SIGKILLed during DP-SGD round 2 (charged, computing): the round goes on without it.

The job completes without site-c's attestation (it was down); site-c's node comes back and the same command
again resumes: nothing is trained or charged again, and site-c attests. Every site's ledger holds each release
once (no request charged twice, no release charged under a second request id), every file of the job directory
reads back whole, and each site's attested epsilon is at most what the plan said. Slow (real processes,
minutes), bounded by timeouts at every wait."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from feta_release.federation.procs import kill_tree
from tests.support.federation import make_federation, node_file_options, tiny_job

pytestmark = pytest.mark.slow

# Longer than a healthy site ever needs on a loaded machine; a killed node is not waited for this long: its
# SuperLink stops waiting for it when its heartbeat lapses (Flower: 2 x 30 s) and answers its messages with an
# error.
ROUND_TIMEOUT = 300.0


def _wait(what: str, ok: Callable[[], bool], timeout: float, poll: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def _status(ledger: Path, request_id: str) -> str | None:
    if not ledger.exists():
        return None
    try:
        con = sqlite3.connect(f"file:{ledger}?mode=ro", uri=True, timeout=1.0)
        try:
            row = con.execute("SELECT status FROM requests WHERE request_id=?", (request_id,)).fetchone()
        finally:
            con.close()
    except sqlite3.Error:
        return None
    return None if row is None else str(row[0])


def _answers(work: Path, kind: str) -> int:
    log = work / "worker.log"
    return log.read_text("utf-8", errors="replace").count(f"answered {kind}") if log.exists() else 0


def _events(out: Path) -> list[dict[str, Any]]:
    p = out / "progress.jsonl"
    return (
        [json.loads(line) for line in p.read_text("utf-8").splitlines() if line.strip()] if p.exists() else []
    )


class Coordinator:
    """``coordinator run`` against a SuperLink, both real processes, killable together."""

    def __init__(self, tmp: Path, fed: Any, job_toml: Path, out: Path, port: int) -> None:
        self.tmp, self.fed, self.job_toml, self.out, self.port = tmp, fed, job_toml, out, port
        self.superlink: Any = None
        self.run: subprocess.Popen[str] | None = None

    def start_superlink(self) -> None:
        from coordinator.superlink import SuperLinkSettings, start_superlink

        self.superlink = start_superlink(
            SuperLinkSettings(
                port=self.port,
                database=self.tmp / "coord" / "state.db",
                insecure=True,
                home=self.tmp / "coord",
            )
        )

    def submit(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "feta_release",
            "coordinator",
            "run",
            str(self.job_toml),
            "--sites",
            "site-a,site-b,site-c",
            "--key",
            str(self.fed.coordinator_key),
            "--out",
            str(self.out),
            "--superlink",
            f"127.0.0.1:{self.port}",
            "--insecure",
            "--job-id",
            "job-f",
            "--no-release",
        ]
        self.log = open(self.tmp / f"coordinator-run-{time.monotonic_ns()}.log", "w")  # noqa: SIM115 - closed in wait
        self.run = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )

    def wait(self, timeout: float) -> tuple[int, str]:
        assert self.run is not None
        try:
            code = self.run.wait(timeout)
        finally:
            self.log.close()
        return code, Path(self.log.name).read_text("utf-8")

    def kill(self) -> None:
        """The whole coordinator dies at once: SuperLink (with its ServerApp) and ``coordinator run``."""
        for pid in ([self.run.pid] if self.run else []) + ([self.superlink.pid] if self.superlink else []):
            kill_tree(pid)
        if self.run is not None:
            self.run.wait(10)
            self.log.close()
        if self.superlink is not None:
            self.superlink.stop()


class Node:
    """``feta-release node start`` as the site runs it (its SuperNode and warm worker as children; the worker
    is restarted by the node when it dies)."""

    def __init__(self, s: Any, port: int, log: Path) -> None:
        from feta_release.federation.procs import free_port

        cmd = [
            sys.executable,
            "-m",
            "feta_release",
            "node",
            "start",
            *node_file_options(s),
            "--trusted",
            str(s.policy_pub),
            "--superlink",
            f"127.0.0.1:{port}",
            "--port",
            str(free_port()),
            "--insecure",
        ]
        self.log = open(log, "a")  # noqa: SIM115 - closed in stop
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )

    def worker_pid(self) -> int | None:
        try:
            family = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return None
        return next((p.pid for p in family if "edge.worker" in " ".join(_cmdline(p))), None)

    def kill(self) -> None:
        kill_tree(self.proc.pid)
        self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the node stops its SuperNode and worker itself
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                kill_tree(self.proc.pid)
        self.proc.wait(10)
        self.log.close()


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _job(tmp: Path) -> Path:
    from feta_release import job_rules

    cfg = tiny_job(
        central={"rounds": 1, "batch": 10, "sigma": 5.0},
        warmup={"spatial_iterations": 30, "spatial_batch": 8},
        federation={
            "secure_aggregation": True,
            "secagg_threshold": 2,
            "rounds": 2,
            "local_steps": 4,
            "min_sites": 2,
            "round_timeout": ROUND_TIMEOUT,
        },
    )
    p = tmp / "job.toml"
    p.write_text(job_rules.job_toml(cfg))
    return p


def test_nodes_a_worker_and_the_coordinator_killed_mid_job_complete_it_without_a_double_charge(tmp_path):
    from feta_release.federation.procs import free_port

    fed = make_federation(tmp_path / "fed")
    work = {s.site_id: s.ledger.parent / "work" for s in fed.sites}
    ledgers = {s.site_id: s.ledger for s in fed.sites}
    out, port = tmp_path / "out", free_port()
    co = Coordinator(tmp_path, fed, _job(tmp_path), out, port)
    nodes: dict[str, Any] = {}
    try:
        co.start_superlink()
        nodes = {s.site_id: Node(s, port, tmp_path / f"{s.site_id}.log") for s in fed.sites}
        co.submit()
        # 1. site-c dies right after handing over its masked vector (setup, share_keys,
        #    collect_masked_vectors)
        _wait("site-c's masked vector", lambda: _answers(work["site-c"], "query.secagg") >= 3, 600)
        nodes.pop("site-c").kill()
        # 2. the coordinator dies during the warm-up, after the secure sum was decoded and kept
        _wait(
            "the warm-up",
            lambda: any(e["message"].startswith("spatial warm-up on") for e in _events(out)),
            600,
        )
        co.kill()
        decoded = [e for e in _events(out) if "decoded" in e["message"]]
        # decoded: with site-c's vector when it arrived before the kill, else without it (its masks recovered
        # from the others' shares either way)
        assert decoded and {"site-a", "site-b"} <= set(decoded[0]["sites"])
        _check_files(out)
        # ... and is started again, site-c's node too; the same command resumes the job
        co.start_superlink()
        nodes["site-c"] = Node(fed.site("site-c"), port, tmp_path / "site-c.log")
        co.submit()
        # 3. site-b's worker dies mid-request: round 1 charged at site-b, its answer not yet recorded
        _wait(
            "site-b's charge of round 1",
            lambda: _status(ledgers["site-b"], "job-f:train:0") == "charged",
            900,
            poll=0.005,
        )
        worker = nodes["site-b"].worker_pid()
        assert worker is not None, "site-b's node runs no worker"
        os.kill(worker, signal.SIGKILL)
        # 4. site-c's node dies during round 2 (charged, computing)
        _wait(
            "site-c's charge of round 2",
            lambda: _status(ledgers["site-c"], "job-f:train:1") == "charged",
            900,
            poll=0.005,
        )
        nodes.pop("site-c").kill()
        code, text = co.wait(900)
        assert code == 0, text[-3000:]
        first = json.loads((out / "job_summary.json").read_text())
        # the job is done, but site-c was down when the sites attested: no statement of its spend yet
        # site-b finished its charged round 0 after its worker died (once, from the start or its checkpoint);
        # site-c was down for round 1
        assert first["rounds"] == 2 and first["skipped"] == {"1": ["site-c"]}
        assert set(first["site_epsilon"]) == {"site-a", "site-b"}
        assert any(e.get("site") == "site-c" and e["phase"] == "attest" for e in _events(out))
        # site-c comes back; the same command again: nothing is trained or charged again, site-c attests
        nodes["site-c"] = Node(fed.site("site-c"), port, tmp_path / "site-c.log")
        rows = _rows(fed)
        co.submit()
        code, text = co.wait(900)
    finally:
        co.kill()
        for n in nodes.values():
            n.stop()
    assert code == 0, text[-3000:]
    summary = json.loads((out / "job_summary.json").read_text())
    assert summary["rounds"] == 2 and summary["skipped"] == first["skipped"]
    assert set(summary["site_epsilon"]) == {"site-a", "site-b", "site-c"} and _rows(fed) == rows
    _check_files(out)
    _check_no_double_charge(fed, out, summary)


def _rows(fed: Any) -> dict[str, int]:
    from feta_release.ledger import Ledger

    out = {}
    for s in fed.sites:
        with Ledger(s.ledger) as led:
            out[s.site_id] = len(led.requests())
    return out


def _check_files(out: Path) -> None:
    """Nothing half-written: every JSON document and every array file of the job directory reads back
    whole."""
    for p in out.rglob("*.json"):
        json.loads(p.read_text("utf-8"))
    for p in out.rglob("*.npz"):
        with np.load(p) as z:
            [z[k] for k in z.files]
    assert not list(out.rglob("*.tmp")), "a temporary file of an interrupted write was left behind"


def _check_no_double_charge(fed: Any, out: Path, summary: dict[str, Any]) -> None:
    from feta_release.ledger import Ledger

    plan = json.loads((out / "plan.json").read_text())
    for s in fed.sites:
        with Ledger(s.ledger) as led:
            reqs = led.requests("job-f")
        slots = [
            (r["mechanism"], r["request_id"].rsplit(":", 1)[-1] if r["mechanism"] == "dpsgd" else "")
            for r in reqs
        ]
        assert len(slots) == len(set(slots)), f"{s.site_id} charged one release twice: {slots}"
        assert sorted(m for m, _ in slots) == ["central", "dpsgd", "dpsgd"], (s.site_id, slots)
        assert summary["site_epsilon"][s.site_id] <= plan[s.site_id]["planned_epsilon"] + 1e-9
