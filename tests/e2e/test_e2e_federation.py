"""End to end with REAL Flower processes on loopback (SuperLink + 3 SuperNodes). Slow: minutes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.federation import make_federation, node_settings, tiny_job

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "feta_release"]


def _pids_of_group_alive(pgids: list[int]) -> list[int]:
    from feta_release.federation.procs import group_alive

    return [g for g in pgids if group_alive(g)]


def test_real_processes_run_a_job_and_an_untrusted_node_refuses(tmp_path, loopback):
    from coordinator.runner import run_signed_job, sign_or_resume
    from feta_release import job_rules
    from feta_release.ledger import Ledger

    # site-c's policy does not allow this app bundle: its node must refuse before running any of it.
    fed = make_federation(tmp_path / "fed", policy_overrides={"site-c": {"app_bundles": ["0" * 64]}})
    cfg = tiny_job(federation={"rounds": 1, "local_steps": 1, "min_sites": 2, "round_timeout": 600.0})
    job_toml = tmp_path / "job.toml"
    job_toml.write_text(job_rules.job_toml(cfg))
    out = tmp_path / "out"
    signed = sign_or_resume(job_toml, ["site-a", "site-b"], fed.coordinator_key, out, "job-e2e")
    try:
        summary = run_signed_job(signed, fed.coordinator_key, out, loopback.start(fed), insecure=True)
    finally:
        pgids = loopback.stop()
    assert _pids_of_group_alive(pgids) == []
    assert summary["rounds"] == 1 and set(summary["site_epsilon"]) == {"site-a", "site-b"}
    for sid in ("site-a", "site-b"):
        with Ledger(fed.site(sid).ledger) as led:
            assert [r["request_id"] for r in led.requests()] == ["job-e2e:train:0"]
    # The untrusted-bundle refusal: logged at the site, reported to the coordinator, nothing charged.
    trust_log = fed.site("site-c").ledger.parent / "work" / "trust.log"
    assert "refused app bundle" in trust_log.read_text()
    events = [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines()]
    assert any("refused" in e["message"] and "allow-list" in e["message"] for e in events)
    with Ledger(fed.site("site-c").ledger) as led:
        assert led.requests() == []


def test_demo_quick_end_to_end_and_release_verifies(tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run(
        [
            *CLI,
            "demo",
            "--out",
            str(out),
            "--quick",
            "--rounds",
            "1",
            "--local-steps",
            "1",
            "--per-site",
            "40",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for f in (
        "samples.png",
        "privacy_report.txt",
        "privacy_report.json",
        "demo_summary.json",
        "budget.svg",
        "report.html",
    ):
        assert (out / f).exists(), f
    page = (out / "report.html").read_text("utf-8")
    assert "Release VERIFIED" in page  # the DPO's page, against the demo's role-bound keys
    assert "ε lifetime (all jobs)" in page and "site site-a administrator" in page
    report = json.loads((out / "privacy_report.json").read_text())
    assert all(s["epsilon_total"] <= 1.0 + 1e-9 for s in report["sites"].values())
    fed = out / "federation"
    trusted = ["--coordinator", str(fed / "coordinator" / "coordinator.pub")]
    for s in ("site-a", "site-b", "site-c"):  # role-bound: each site's administrator (policy) key for its id
        trusted += ["--trusted", f"{s}={fed / 'sites' / s / 'keys' / 'policy-admin.pub'}"]
    v = subprocess.run(
        [*CLI, "verify", str(out / "release"), *trusted], capture_output=True, text=True, timeout=300
    )
    assert v.returncode == 0, v.stdout[-2000:] + v.stderr[-2000:]


def test_demo_cleans_up_its_processes_on_ctrl_c(tmp_path):
    out = tmp_path / "demo"
    # As from a terminal: SIGINT at its default in the child, also when this suite itself was started in the
    # background (`cmd &` from a script ignores SIGINT, children inherit that, and the demo then rightly
    # ignores it).
    p = subprocess.Popen(
        [*CLI, "demo", "--out", str(out), "--quick", "--rounds", "3", "--per-site", "40"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 300
    try:
        # Wait until the nodes run and the job has started, then interrupt like a terminal Ctrl-C.
        while time.monotonic() < deadline and not (out / "job" / "progress.jsonl").exists():
            time.sleep(1)
        assert (out / "job" / "progress.jsonl").exists(), "the demo never started its job"
        children = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
        assert children, "no processes found for the demo"
        p.send_signal(signal.SIGINT)
        p.wait(120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    time.sleep(2)
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes left behind: {left}"
    assert p.returncode == 130


def test_tls_and_node_authentication_real_processes(tmp_path):
    from coordinator.runner import run_signed_job, sign_or_resume
    from coordinator.superlink import SuperLinkSettings, register_node, start_superlink
    from coordinator.tls import make_certificates
    from edge.launch import start_node
    from feta_release import job_rules
    from feta_release.federation.procs import free_port
    from feta_release.signing import make_node_auth_key

    fed = make_federation(tmp_path / "fed")
    certs = make_certificates(tmp_path / "certs")
    keys = {s.site_id: make_node_auth_key(tmp_path / "certs" / "nodes", s.site_id) for s in fed.sites}
    cfg = tiny_job(federation={"rounds": 1, "local_steps": 1, "min_sites": 2, "round_timeout": 600.0})
    job_toml = tmp_path / "job.toml"
    job_toml.write_text(job_rules.job_toml(cfg))
    out = tmp_path / "out"
    signed = sign_or_resume(job_toml, ["site-a", "site-b"], fed.coordinator_key, out, "job-tls")
    port = free_port()
    addr = f"127.0.0.1:{port}"
    procs = []
    try:
        procs.append(
            start_superlink(
                SuperLinkSettings(
                    port=port,
                    database=tmp_path / "coord" / "state.db",
                    home=tmp_path / "coord",
                    ssl_certfile=certs["server_cert"],
                    ssl_keyfile=certs["server_key"],
                    ssl_ca_certfile=certs["ca_cert"],
                    enable_supernode_auth=True,
                )
            )
        )
        for sid in ("site-a", "site-b"):  # site-c's key is NOT registered
            register_node(
                keys[sid][1], sid, tmp_path / "coord" / "cli", addr, root_certificates=certs["ca_cert"]
            )
        for s in fed.sites:
            procs.append(
                start_node(
                    node_settings(
                        s,
                        superlink=addr,
                        port=free_port(),
                        root_certificates=certs["ca_cert"],
                        auth_key=keys[s.site_id][0],
                    )
                )
            )
        time.sleep(3)
        summary = run_signed_job(
            signed, fed.coordinator_key, out, addr, insecure=False, root_certificates=certs["ca_cert"]
        )
        unregistered = procs[-1]
        deadline = time.monotonic() + 60
        while unregistered.alive() and time.monotonic() < deadline:
            time.sleep(1)
        assert not unregistered.alive(), "an unregistered node key was not refused"
    finally:
        for p in procs:
            p.stop()
    assert set(summary["site_epsilon"]) == {"site-a", "site-b"}
