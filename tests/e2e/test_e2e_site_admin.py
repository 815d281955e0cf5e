"""The site administrator's path of docs/how-to/onboard-a-site.md, run as written, with real processes.

From an empty folder, the commands of that how-to's first block (at most six) bring up a node that a
real coordinator (Flower SuperLink with TLS and node authentication, on loopback) admits and whose job it
serves; before the coordinator registers the node's key, the same node says it is refused and why.  Only what
the environment dictates is substituted: the data path, the coordinator's address, the node's local port.
Slow: real Flower processes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def readme_commands() -> list[str]:
    """The first bash block of the site administrator's how-to: one string per command (continuations
    joined)."""
    text = (REPO / "docs" / "how-to" / "onboard-a-site.md").read_text("utf-8")
    section = text[text.index("## The five commands") :]
    block = section[section.index("```bash") + len("```bash") :]
    block = block[: block.index("```")]
    joined = re.sub(r"\\\n\s*", " ", block)
    return [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def _env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1"}


def _run(cmd: str, cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc.stdout


def _hospital_data(root: Path) -> Path:
    """70x70 greyscale scans of 16 patients (2 images each), labelled by a path,label,patient_id CSV."""
    rng = np.random.default_rng(0)
    (root / "img").mkdir(parents=True)
    rows = ["path,label,patient_id"]
    for i in range(32):
        label = "effusion" if i % 2 else "normal"
        arr = (rng.random((70, 70)) * 80 + (120 if i % 2 else 40)).astype(np.uint8)
        Image.fromarray(arr, "L").save(root / "img" / f"scan{i:02d}.png")
        rows.append(f"img/scan{i:02d}.png,{label},P{i // 2:03d}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    return root / "labels.csv"


def _coordinator_material(d: Path, env: dict[str, str]) -> str:
    """What the coordinator sends a site: its public key, its CA certificate, a signed job, its app bundle's
    hash."""
    from feta_release import job_rules
    from tests.support.federation import tiny_job

    _run(
        "feta-release keys generate --out coord-keys --name coordinator && cp coord-keys/coordinator.pub . "
        "&& feta-release coordinator certs --out certs && cp certs/ca.crt .",
        d,
        env,
    )
    job = tiny_job(federation={"rounds": 1, "local_steps": 1, "min_sites": 1, "round_timeout": 60.0})
    (d / "job.toml").write_text(job_rules.job_toml(job))
    _run(
        "feta-release job sign job.toml --key coord-keys/coordinator.key --job-id job-1 --sites st-mary "
        "--out job.signed.json",
        d,
        env,
    )
    return _run("feta-release coordinator fab-hash", d, env).strip()


def _status(site: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(
        ["feta-release", "node", "status", "--config", str(site / "node.toml")],
        cwd=site.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.stdout.splitlines()[0] if proc.stdout else proc.stderr


def _wait_state(site: Path, want: str, node: subprocess.Popen, timeout: float = 240.0) -> dict:
    path = site / "work" / "node-state.json"
    deadline = time.monotonic() + timeout
    state: dict = {}
    while time.monotonic() < deadline:
        if path.exists():
            state = json.loads(path.read_text())
            if state["state"] == want:
                return state
        if node.poll() is not None and state.get("state") != want:
            break
        time.sleep(0.5)
    out = node.stdout.read() if node.poll() is not None and node.stdout else ""
    raise AssertionError(f"node never {want}; last state {state}; node exit {node.poll()}\n{out[-3000:]}")


def _start(cmd: str, cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    # SIGINT at its default, as from a terminal, also when the suite runs in the background (`cmd &` ignores
    # it)
    return subprocess.Popen(
        ["bash", "-c", f"exec {cmd}"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.stdout.read() if proc.stdout else ""


def test_readme_site_admin_path_brings_up_a_node_the_coordinator_admits(tmp_path):
    from feta_release.federation.procs import free_port, wait_for_port

    commands = readme_commands()
    assert len(commands) <= 6, commands
    assert commands[-1].startswith("feta-release node start")
    env = _env()
    here = tmp_path / "site-admin"  # the administrator's empty folder
    here.mkdir()
    env["APP_SHA256"] = _coordinator_material(here, env)
    labels = _hospital_data(tmp_path / "data")
    port, node_port = free_port(), free_port()
    subst = {"/data/labels.csv": str(labels), "coordinator.example.org:9092": f"127.0.0.1:{port}"}

    def adapt(cmd: str) -> str:
        for a, b in subst.items():
            cmd = cmd.replace(a, b)
        return cmd + (f" --port {node_port}" if cmd.startswith("feta-release node start") else "")

    coord = _start(
        f"feta-release coordinator start --host 127.0.0.1 --port {port} --database coord/state.db "
        "--ssl-certfile certs/server.pem --ssl-keyfile certs/server.key --ssl-ca-certfile certs/ca.crt "
        "--enable-supernode-auth --home coord",
        here,
        env,
    )
    node = None
    try:
        wait_for_port("127.0.0.1", port, 120)
        for cmd in commands[:-1]:
            out = _run(adapt(cmd), here, env)
            if " policy check " in f" {cmd} ":
                assert "accept" in out.lower(), out
        site = here / "st-mary"
        # Not registered yet: the coordinator turns the node away, and the node says so and why.
        node = _start(adapt(commands[-1]), here, env)
        refused = _wait_state(site, "refused", node)
        assert "node-auth key is not registered" in refused["detail"]
        first = _stop(node)
        assert "node refused: the coordinator refused this node" in first
        _run(
            f"feta-release coordinator register st-mary/keys/node-auth.pub --name st-mary "
            f"--superlink 127.0.0.1:{port} --root-certificates certs/ca.crt --home coord",
            here,
            env,
        )
        node = _start(adapt(commands[-1]), here, env)
        state = _wait_state(site, "connected", node)
        assert state["node_id"] and "waiting for a job" in state["detail"]
        assert _status(site, env).startswith(f"node: connected: registered at 127.0.0.1:{port} as node")
        # The coordinator runs its job: the node serves it, says which, and is back to waiting afterwards.
        _run(
            f"feta-release coordinator run job.toml --sites st-mary --key coord-keys/coordinator.key --out "
            f"run1 --superlink 127.0.0.1:{port} --root-certificates certs/ca.crt --job-id job-1 --no-release",
            here,
            env,
        )
        served = _wait_state(site, "connected", node, timeout=60)
        assert served["detail"].startswith("served job job-1 (final attestation sent)"), served
    finally:
        out = _stop(node) if node is not None else ""
        _stop(coord)
    assert "node connected: registered" in out and "node stopped" in out
    assert "node serving: job job-1, stage" in out
    log = (site / "work" / "supernode.log").read_text("utf-8")
    assert "\x1b" not in log and re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ", log)
