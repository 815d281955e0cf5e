"""Who may import whom, enforced: imports sit at module top except at the documented lazy boundaries.

Boundaries (each a reason a heavy import must wait until a function runs):
  - fast CLI start: the command groups load neither torch nor Flower, so ``--help`` and the light
    commands answer at once (``feta_release/cli/__init__.py`` loads each group lazily);
  - light install: ``verify``, ``report`` and ``synthesize`` run where torch, Flower and opacus are absent
    (tests/release/test_light_install.py runs them; here their modules are checked at import);
  - site administration: ``policy check`` / ``job verify --policy`` (``edge.admission``) and ``site init``
    (``edge.kit``) run on an administrator's machine without the training stack;
  - layering: the core package ``feta_release`` (its CLI aside) never imports the drivers ``edge`` and
    ``coordinator``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "flwr", "opacus", "onnx")

BOUNDARIES = {
    "fast CLI start": [
        "feta_release.cli",
        "edge.cli",
        "edge.site_cli",
        "coordinator.cli",
        "coordinator.demo",
    ],
    "light install": [
        "feta_release.release.verify",
        "feta_release.release.report",
        "feta_release.release.synthesize",
        "feta_release.cli.release_cmd",
    ],
    "site administration": ["edge.admission", "edge.kit"],
}

# Function-level imports allowed in the driver packages: module -> the modules it may import lazily (and why).
LAZY = {
    "edge/cli.py": {".launch"},  # Flower, for `node start` only
    "edge/forward.py": {
        ".clientapp"
    },  # torch: the per-message ClientApp loads it only when no worker answers
    "edge/launch.py": {"feta_release.training.device"},  # torch, for `node start --device auto|cuda` only
    "coordinator/cli.py": {".setup", ".runner", ".finalize"},  # Flower / torch, per command
    "coordinator/demo.py": {
        ".setup",
        ".runner",
        ".finalize",
        "edge.launch",
    },  # Flower / torch, once the demo runs
    # Flower's secure-aggregation primitives (via secure_collect), for `policy check --data` of a secure job
    # only
    "edge/admission.py": {"feta_release.federation.plan", "feta_release.federation.secure_collect"},
    # Flower's SuperNode and SuperExec programs (uvicorn, FastAPI), each in its own process only: every
    # per-message ClientApp imports this module for its client side
    "edge/runtime_api.py": {
        "uvicorn",
        "flwr.supernode.main",
        "flwr.supernode.cli.flower_supernode",
        "flwr.supercore.cli.flower_superexec",
        "flwr.supercore.superexec.executor.subprocess_executor",
    },
}


def _loaded(modules: list[str]) -> list[str]:
    code = (
        f"import sys\nfor m in {modules!r}:\n    __import__(m)\n"
        f"print(sorted({{n.split('.')[0] for n in sys.modules}} & {set(HEAVY)!r}))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("boundary", sorted(BOUNDARIES))
def test_boundary_modules_import_no_heavy_package(boundary):
    assert _loaded(BOUNDARIES[boundary]) == [], f"{boundary}: {BOUNDARIES[boundary]}"


def _function_imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text("utf-8"))
    out = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    out += [(node.lineno, a.name) for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    out.append((node.lineno, "." * node.level + (node.module or "")))
    return out


def _driver_files() -> list[Path]:
    files = [
        *(REPO / "edge").glob("*.py"),
        *(REPO / "coordinator").glob("*.py"),
        *(REPO / "feta_release" / "federation").glob("*.py"),
    ]
    return sorted(files)


def test_driver_packages_import_at_module_top_except_at_documented_boundaries():
    bad = []
    for p in _driver_files():
        rel = str(p.relative_to(REPO))
        allowed = LAZY.get(rel, set())
        bad += [
            f"{rel}:{line} imports {mod} inside a function"
            for line, mod in _function_imports(p)
            if mod not in allowed
        ]
    assert bad == [], "\n".join(bad)


def test_the_core_package_does_not_import_the_drivers():
    bad = []
    for p in sorted((REPO / "feta_release").rglob("*.py")):
        if "cli" in p.relative_to(REPO / "feta_release").parts[:1]:
            continue  # the CLI is the top layer: it registers the drivers' command groups
        for node in ast.walk(ast.parse(p.read_text("utf-8"))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            bad += [
                f"{p.relative_to(REPO)}:{node.lineno} imports {n}"
                for n in names
                if n.split(".")[0] in ("edge", "coordinator")
            ]
    assert bad == [], "\n".join(bad)


# The stage layer and everything the local driver runs (engines, models, data, figures, the job directory):
# imports at module top as well. The one boundary: pydicom (seconds to import), which
# `feta_release.data.loading` (imported by the CLI's data options at start) needs only once a DICOM file is
# read.
STAGE_LAYER = [
    "feta_release/stages",
    "feta_release/training",
    "feta_release/models",
    "feta_release/data",
    "feta_release/evaluation.py",
    "feta_release/viz.py",
    "feta_release/release/jobdir.py",
    "feta_release/release/jobfiles.py",
    "feta_release/release/export_run.py",
]
STAGE_LAYER_LAZY = {"feta_release/data/dicom.py": {"pydicom", "pydicom.errors", "pydicom.pixels"}}


def test_the_stage_layer_imports_at_module_top_except_pydicom():
    files = sorted(
        f
        for entry in STAGE_LAYER
        for f in ([REPO / entry] if entry.endswith(".py") else (REPO / entry).rglob("*.py"))
    )
    assert len(files) > 20
    bad = []
    for p in files:
        rel = str(p.relative_to(REPO))
        allowed = STAGE_LAYER_LAZY.get(rel, set())
        bad += [
            f"{rel}:{line} imports {mod} inside a function"
            for line, mod in _function_imports(p)
            if mod not in allowed
        ]
    assert bad == [], "\n".join(bad)
