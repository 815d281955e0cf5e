"""The command reference in docs/ is generated from the CLI: a changed option or help text without a
regenerated reference fails here (run ``python scripts/cli_reference.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_cli_reference_is_current():
    out = subprocess.run(
        [sys.executable, "scripts/cli_reference.py", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_command_has_a_section():
    text = (REPO / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    from feta_release.cli import COMMANDS

    for name in COMMANDS:
        assert f"## `feta-release {name}`" in text, name
