"""The ML engineer's path of docs/tutorials/own-images.md, run as written: every command of its bash blocks,
in order, from an empty folder (generate a small set, inspect, train with a derived job, verify, synthesize,
evaluate). Nothing is substituted: the commands use relative paths. Slow: a whole training run on the CPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# A whole derived-job run (about 2 minutes of training on an idle 2-core CPU) and its evaluation; a shared,
# oversubscribed machine takes many times that.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def tutorial_commands() -> list[str]:
    """Every command of the tutorial's bash blocks, in order (continuations joined, comments dropped)."""
    text = (REPO / "docs" / "tutorials" / "own-images.md").read_text("utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    joined = [re.sub(r"\\\n\s*", " ", b) for b in blocks]
    return [
        ln.strip() for b in joined for ln in b.splitlines() if ln.strip() and not ln.strip().startswith("#")
    ]


def _env() -> dict[str, str]:
    path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def test_the_tutorial_commands_run_as_written_and_end_in_a_verified_measured_release(tmp_path: Path) -> None:
    cmds = tutorial_commands()
    assert [c.split()[1] for c in cmds] == [
        "data",
        "data",
        "data",
        "train",
        "verify",
        "synthesize",
        "evaluate",
    ], cmds
    outputs = {}
    for cmd in cmds:
        proc = subprocess.run(
            ["bash", "-c", cmd], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=1500
        )
        assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        outputs[cmd.split()[1]] = proc.stdout + proc.stderr
    # train printed the very verify command the tutorial runs
    verify = next(c for c in cmds if c.split()[1] == "verify")
    assert verify.replace("feta-release ", "") in outputs["train"].replace(str(tmp_path) + "/", "")
    assert outputs["verify"].startswith("VERIFIED")  # the verdict comes first
    ev = (
        json.loads((tmp_path / "synthetic" / "evaluation" / "evaluation.json").read_text())
        if (tmp_path / "synthetic" / "evaluation" / "evaluation.json").is_file()
        else None
    )
    assert "downstream accuracy" in outputs["evaluate"] or ev is not None
