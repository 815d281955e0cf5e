"""The library API (``feta_release.__all__``): its docstring examples run as written, every exported
name resolves, and ``import feta_release`` itself loads nothing heavy (each name imports its module on
first use)."""

from __future__ import annotations

import doctest
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import feta_release

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "feta_release"


def _modules_with_examples() -> list[str]:
    """Every library module whose docstrings hold a ``>>>`` example (read from the source: none is missed)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if re.search(r"^\s*>>> ", path.read_text("utf-8"), re.M):
            parts = path.relative_to(REPO).with_suffix("").parts
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def test_the_examples_are_found_where_the_api_documents_them():
    found = set(_modules_with_examples())
    assert {"feta_release", "feta_release.planning", "feta_release.job_rules"} <= found


@pytest.mark.parametrize("name", _modules_with_examples())
def test_docstring_examples_run_as_written(name: str):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name}: no example ran"
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed (output above)"


def test_every_exported_name_resolves_and_is_listed():
    for name in feta_release.__all__:
        assert getattr(feta_release, name) is not None, name
    assert set(feta_release.__all__) <= set(dir(feta_release))
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        _ = feta_release.not_a_name


def test_the_exports_come_from_the_modules_that_define_them():
    for name, module in feta_release._EXPORTS.items():
        mod = importlib.import_module(f"feta_release.{module}")
        assert getattr(feta_release, name) is getattr(mod, name), name
        assert name in getattr(mod, "__all__", [name]), f"feta_release.{module}.__all__ lacks {name}"
    assert set(feta_release.__all__) == {"__version__", *feta_release._EXPORTS}


def test_importing_the_package_loads_no_module_of_it_and_nothing_heavy():
    code = (
        "import sys, feta_release\n"
        "print(sorted(m for m in sys.modules if m.startswith('feta_release.')"
        " or m.split('.')[0] in ('torch', 'flwr', 'onnx', 'onnxruntime', 'opacus', 'numpy')))\n"
        "feta_release.epsilon\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'flwr', 'onnx', 'opacus')))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[]", "[]"]  # the accountant arrives without the training stack too
