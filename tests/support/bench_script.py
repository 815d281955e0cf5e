"""Import a script of ``bench/`` (not a package) as a module, for the tests that check its logic."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(script: str, name: str) -> ModuleType:
    """``bench/<script>`` imported as module ``name``. It is registered in ``sys.modules`` before it runs:
    a script's dataclasses look their module up by name."""
    spec = importlib.util.spec_from_file_location(name, BENCH / script)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
