"""mypy, as the lint test runs it, over one small source file: what it reports for a caller written to be
wrong or right (the house tests that pin a typed signature)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def mypy_report(tmp_path: Path, name: str, text: str) -> str:
    """mypy's output for ``text`` written to ``tmp_path/name.py``, run from the project root (its config)."""
    src = tmp_path / f"{name}.py"
    src.write_text(text)
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir", "/dev/null", str(src)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return r.stdout + r.stderr
