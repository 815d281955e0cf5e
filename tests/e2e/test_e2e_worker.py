"""End to end with REAL Flower processes: a job's messages answered by the sites' warm workers. Slow:
minutes."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from tests.support.federation import make_federation, node_settings, tiny_job

pytestmark = pytest.mark.slow


def test_a_job_runs_through_the_workers_and_a_dead_worker_falls_back(tmp_path):
    from coordinator.runner import run_signed_job, sign_or_resume
    from coordinator.superlink import SuperLinkSettings, start_superlink
    from edge.launch import start_node
    from feta_release import job_rules
    from feta_release.federation.procs import free_port
    from feta_release.ledger import Ledger

    fed = make_federation(tmp_path / "fed")
    cfg = tiny_job(federation={"rounds": 2, "local_steps": 1, "min_sites": 2, "round_timeout": 600.0})
    job_toml = tmp_path / "job.toml"
    job_toml.write_text(job_rules.job_toml(cfg))
    out = tmp_path / "out"
    signed = sign_or_resume(job_toml, ["site-a", "site-b"], fed.coordinator_key, out, "job-w")
    procs, workers = [], {}
    port = free_port()
    try:
        procs.append(
            start_superlink(
                SuperLinkSettings(
                    port=port,
                    database=tmp_path / "coord" / "state.db",
                    insecure=True,
                    home=tmp_path / "coord",
                )
            )
        )
        for s in fed.sites[:2]:
            node = start_node(
                node_settings(
                    s,
                    superlink=f"127.0.0.1:{port}",
                    port=free_port(),
                    insecure=True,
                )
            )
            procs.append(node)
            workers[s.site_id] = node.companions[0]
        # site-b's worker dies before the job: its node answers in a fresh process per message instead
        os.kill(workers["site-b"].pid, signal.SIGKILL)
        workers["site-b"].proc.wait(10)
        time.sleep(3)
        watch = CommandLines(str(tmp_path))
        try:
            summary = run_signed_job(signed, fed.coordinator_key, out, f"127.0.0.1:{port}", insecure=True)
        finally:
            watch.stop()
    finally:
        for p in procs:
            p.stop()
    # every local account reads /proc/PID/cmdline: no ClientApp was started with its task token there
    assert watch.clientapps and not [c for c in watch.clientapps if "--token" in c]
    assert summary["rounds"] == 2
    for sid in ("site-a", "site-b"):
        with Ledger(fed.site(sid).ledger) as led:
            assert [r["request_id"] for r in led.requests()] == ["job-w:train:0", "job-w:train:1"]
    work_a, work_b = (fed.site(s).ledger.parent / "work" for s in ("site-a", "site-b"))
    worker_log = (work_a / "worker.log").read_text()
    assert worker_log.count("answered train") == 2 and "answered query.hello" in worker_log
    assert "memory limit 16384 MiB" in worker_log  # the policy's default resources.max_worker_memory_mb
    assert "in this process instead" not in (work_a / "supernode.log").read_text()
    assert "in this process instead" in (work_b / "supernode.log").read_text()
    # stopping the node stopped its worker; the socket is gone with it
    assert (
        not psutil.pid_exists(workers["site-a"].pid)
        or psutil.Process(workers["site-a"].pid).status() == psutil.STATUS_ZOMBIE
    )
    assert not (work_a / "worker" / "worker.sock").exists()


class CommandLines:
    """The command lines of every ``flwr-clientapp`` process of this test's nodes (their shim lies under
    ``root``) seen while it runs (polled: each lives for seconds)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.clientapps: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            for proc in psutil.process_iter(["cmdline"]):
                line = " ".join(proc.info["cmdline"] or [])
                if "flwr-clientapp" in line and self.root in line and line not in self.clientapps:
                    self.clientapps.append(line)
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
