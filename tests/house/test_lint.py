"""Static checks as tests, so CI (which runs the README's test command) enforces them: ruff on the whole tree
with the rules in pyproject.toml, mypy on what [tool.mypy] files lists: the whole library and both drivers
(feta_release, edge, coordinator). No cache, so a stale one can never hide an error (about 5 s of CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_ruff_finds_nothing():
    r = _run("ruff", "check", "--no-cache", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_passes_on_the_library_and_both_drivers():
    r = _run("mypy", "--no-incremental", "--cache-dir", "/dev/null")
    assert r.returncode == 0, r.stdout + r.stderr
