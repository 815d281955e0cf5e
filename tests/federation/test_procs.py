"""Stopping a Flower process stops everything it started, also what left its process group."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import psutil

from feta_release.federation.procs import ManagedProcess

# A parent that starts a child in a NEW session (as flower-superlink's flower-superexec does), reports the
# child's pid, and waits; the child ignores nothing and just sleeps.
_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


def test_stop_kills_a_descendant_in_another_session(tmp_path: Path) -> None:
    pids: list[int] = []
    proc = ManagedProcess(
        "parent",
        [sys.executable, "-c", _PARENT],
        dict(os.environ),
        tmp_path / "p.log",
        on_line=lambda line: pids.append(int(line)),
    )
    deadline = time.monotonic() + 60
    while not pids and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pids, "the parent never reported its child"
    child = psutil.Process(pids[0])
    assert os.getsid(child.pid) != os.getsid(proc.pid)  # really outside the group
    proc.stop(timeout=5)
    try:
        child.wait(10)
    except psutil.TimeoutExpired:
        child.kill()
        raise AssertionError("the child in another session outlived stop()") from None
    assert not child.is_running()
    assert not proc.alive()
