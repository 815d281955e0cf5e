"""The node tells its state: connecting / connected / refused (why) / serving job X / stopped, on the
console and in `node status`, from the SuperNode's real output; its log is plain text with timestamps."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge.node_state import STATE_FILE, NodeMonitor, open_job, plain, read_state

E = "\x1b"
# Lines as flower-supernode 1.41 prints them (captured from real runs; colours included).
START = [
    f"{E}[92mINFO {E}[0m:      Starting Flower SuperNode",
    f"{E}[93mWARNING {E}[0m:   Option `--insecure` was set. Starting insecure channel to 127.0.0.1:9092.",
    "INFO:     Uvicorn running on http://127.0.0.1:9101 (Press CTRL+C to quit)",
]
RETRY = [f"{E}[93mWARNING {E}[0m:   Connection attempt failed, retrying in 0.92 seconds"] * 3
CONNECTED = [
    f"{E}[92mINFO {E}[0m:      SuperNode ID: 10777853659587752390",
    f"{E}[92mINFO {E}[0m:      Starting Flower SuperExec",
]
UNREGISTERED = [
    f"{E}[91mERROR {E}[0m:     Exit Code: 305",
    "Failed to initialize the connection to the SuperLink.",
    "[code: 2004] Failed to activate SuperNode.",
    "The SuperNode could not establish a connection to the SuperLink.",
    "",
    "For more information, visit: <https://flower.ai/docs/framework/1.41/en/ref-exit-codes/305.html>",
]


def _round(stage: str) -> list[str]:
    return [
        f"{E}[92mINFO {E}[0m:      [RUN 7273002801530066929, ROUND {stage}]",
        f"{E}[92mINFO {E}[0m:      Receiving: query.{stage} message (ID: aa57)",
        f"{E}[92mINFO {E}[0m:      Sending: query.{stage} message (ID: 9454)",
        f"{E}[92mINFO {E}[0m:      Sent successfully",
    ]


def _monitor(tmp_path: Path, ledger: Path | None = None) -> tuple[NodeMonitor, list[str]]:
    said: list[str] = []
    return NodeMonitor(
        "127.0.0.1:9092", tmp_path / "work", tmp_path / "supernode.log", ledger=ledger, announce=said.append
    ), said


def _states(said: list[str]) -> list[str]:
    return [re.match(r"\S+ node (\w+):", s).group(1) for s in said]  # type: ignore[union-attr]


def test_connecting_then_connected_each_said_once_and_the_log_is_plain_with_timestamps(tmp_path):
    mon, said = _monitor(tmp_path)
    for line in START + RETRY + CONNECTED:
        mon.feed(line + "\n")
    assert _states(said) == ["connecting", "connecting", "connected"]  # the three retries are one message
    assert "cannot reach the coordinator at 127.0.0.1:9092 yet" in said[1]
    assert "registered at 127.0.0.1:9092 as node 10777853659587752390; waiting for a job" in said[2]
    log = (tmp_path / "supernode.log").read_text("utf-8")
    assert E not in log
    lines = log.splitlines()
    assert len(lines) == len(START + RETRY + CONNECTED)
    assert all(re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \S", ln) for ln in lines)
    state = json.loads((tmp_path / "work" / STATE_FILE).read_text())
    assert state["state"] == "connected" and state["node_id"] == "10777853659587752390"


def test_serving_names_the_job_from_the_ledger_and_returns_to_connected_after_the_attestation(tmp_path):
    """The job id comes from the site's own ledger: the job bound after the run began, never a stale open
    one."""
    from feta_release.ledger import Ledger

    key = Ed25519PrivateKey.generate()
    with Ledger(tmp_path / "ledger.db", key=key) as led:
        led.bind_job("job-old", "a" * 64, "b" * 64)
        led.close_job("job-old", "a" * 64)
        led.bind_job("job-crashed", "d" * 64, "b" * 64)  # never attested: still open
    assert open_job(tmp_path / "ledger.db") == "job-crashed"
    mon, said = _monitor(tmp_path, ledger=tmp_path / "ledger.db")
    for line in START + CONNECTED + _round("hello"):
        mon.feed(line)
    assert (
        "job-crashed" not in said[-1]
        and "(Flower run 7273002801530066929; its job id once admitted)" in said[-1]
    )
    with Ledger(tmp_path / "ledger.db", key=key) as led:  # the ClientApp admits the hello: the job is bound
        led.bind_job("job-7", "c" * 64, "b" * 64)
    for line in _round("central") + _round("attest"):
        mon.feed(line)
    assert _states(said) == ["connecting", "connected", "serving", "serving", "serving", "connected"]
    assert said[3].endswith("node serving: job job-7, stage central") and "stage attest" in said[4]
    assert "served job job-7 (final attestation sent); waiting for the next job" in said[-1]
    # A node restarted in the middle of job-7: its first round already names the job (bound before, still
    # open)...
    mon2, said2 = _monitor(tmp_path / "restart", ledger=tmp_path / "ledger.db")
    for line in START + CONNECTED + [ln.replace("7273002801530066929", "99") for ln in _round("round-3")]:
        mon2.feed(line)
    # ...only from its second round (the first might be a new job whose id is not bound yet).
    assert "its job id once admitted" in said2[-1]
    mon2.feed(_round("round-4")[0].replace("7273002801530066929", "99"))
    assert said2[-1].endswith("node serving: job job-7, stage round-4")


def test_a_node_the_coordinator_turns_away_says_refused_and_why(tmp_path):
    mon, said = _monitor(tmp_path)
    for line in START + UNREGISTERED:
        mon.feed(line)
    mon.stopped(305)
    assert _states(said)[-1] == "refused"
    assert "node-auth key is not registered there" in said[-1] and "exit code 305" in said[-1]
    # the reason is kept
    assert json.loads((tmp_path / "work" / STATE_FILE).read_text())["state"] == "refused"


def test_a_job_the_site_refuses_says_refused_with_the_site_s_reason(tmp_path):
    mon, said = _monitor(tmp_path)
    for line in (
        START
        + CONNECTED
        + _round("hello")[:2]
        + [
            "Traceback (most recent call last):",
            '  File "edge/clientapp.py", line 45, in _admit',
            "feta_release.policy.enforce.PolicyBudgetExceeded: budget.per_job.epsilon: job would spend 3.2 > "
            "cap 1",
        ]
    ):
        mon.feed(line)
    assert _states(said)[-1] == "refused"
    assert (
        "this site refused a job's request: budget.per_job.epsilon: job would spend 3.2 > cap 1" in said[-1]
    )
    assert "(PolicyBudgetExceeded)" in said[-1]


def test_read_state_tells_a_dead_process_and_status_shows_the_state(tmp_path):
    from edge.cli import node
    from feta_release.ledger import Ledger

    work = tmp_path / "work"
    mon, _ = _monitor(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mon.set_pid(dead.pid)
    for line in START + CONNECTED:
        mon.feed(line)
    state = read_state(work)
    assert state is not None and state["state"] == "connected" and state["running"] is False
    Ledger(tmp_path / "ledger.db", key=Ed25519PrivateKey.generate()).close()
    res = CliRunner().invoke(node, ["status", "--ledger", str(tmp_path / "ledger.db")])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("node: connected: registered at 127.0.0.1:9092 as node 10777853659587752390")
    assert "its process is no longer running" in res.output
    res = CliRunner().invoke(node, ["status", "--ledger", str(tmp_path / "ledger.db"), "--json"])
    assert json.loads(res.output)["node"]["state"] == "connected"
    assert read_state(tmp_path / "elsewhere") is None


def test_managed_process_hands_real_output_lines_to_the_monitor(tmp_path):
    """A real child process printing Flower's coloured lines: the pipe, the reader thread and the plain
    log."""
    from feta_release.federation.procs import ManagedProcess

    script = "import sys, time\n" + "".join(f"print({ln!r}, flush=True)\n" for ln in START + CONNECTED)
    script += "time.sleep(30)\n"
    mon, said = _monitor(tmp_path)
    proc = ManagedProcess(
        "fake node",
        [sys.executable, "-c", script],
        {"PATH": "/usr/bin:/bin"},
        tmp_path / "supernode.log",
        on_line=mon.feed,
    )
    mon.set_pid(proc.pid)
    try:
        deadline = time.monotonic() + 60
        while "connected" not in _states(said) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert read_state(tmp_path / "work")["running"] is True  # type: ignore[index]
    finally:
        proc.stop()
    mon.stopped(proc.proc.returncode)
    assert _states(said) == ["connecting", "connected", "stopped"]
    log = (tmp_path / "supernode.log").read_text("utf-8")
    assert E not in log and "SuperNode ID: 10777853659587752390" in log


def test_plain_strips_colour_and_cursor_codes():
    assert plain(f"{E}[92mINFO {E}[0m: x{E}[2K  \n") == "INFO : x"


def test_the_nodes_log_state_and_work_dir_are_for_the_site_account_only(tmp_path):
    """Local users are attackers: the log (tracebacks may quote image-dependent values), the state file
    (refusal reasons) and the work directory (compute times track the realised batch sizes) are 0600 /
    0700."""
    import stat

    from edge.site import owner_only_dir
    from feta_release.federation.procs import ManagedProcess

    (tmp_path / "supernode.log").write_text("old line\n")
    os.chmod(tmp_path / "supernode.log", 0o644)
    mon, _ = _monitor(tmp_path)
    mon.feed("INFO :      Starting Flower SuperNode\n")
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(tmp_path / "supernode.log") == 0o600
    assert mode(mon.state_path) == 0o600
    work = owner_only_dir(tmp_path / "work2")
    assert mode(work) == 0o700
    proc = ManagedProcess(
        "touch",
        [sys.executable, "-c", f"open({str(work / 'x.txt')!r}, 'w').close()"],
        dict(os.environ),
        tmp_path / "child.log",
        umask=0o077,
    )
    proc.proc.wait(30)
    assert mode(work / "x.txt") == 0o600 and mode(tmp_path / "child.log") == 0o600
