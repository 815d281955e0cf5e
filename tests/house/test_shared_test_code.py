"""Code that several test modules use lives in tests/support/ (or a conftest.py fixture), never in a test
module: a test module imported by another is collected once but executed twice, its module-level state
(fixtures, seeds, thread settings) leaks into the importer, and moving or deleting it breaks tests
elsewhere."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


def _package(path: Path) -> list[str]:
    """The dotted package of a file under tests/ (``tests.house`` for this one)."""
    return ["tests", *path.relative_to(TESTS).parent.parts]


def _imported(tree: ast.AST, package: list[str]) -> list[tuple[int, str]]:
    """Every module an import statement (at any depth) or an ``__import__`` / ``import_module`` call names."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            # `from tests.x import test_y` names the module tests.x.test_y as well
            out += [(node.lineno, module)] + [(node.lineno, f"{module}.{a.name}") for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) in {"__import__", "import_module"}
        ):
            out.append((node.lineno, node.args[0].value))
    return out


def imported_test_modules(source: str, package: list[str]) -> list[str]:
    """The test modules (``test_*``) that ``source`` imports."""
    return [
        f"line {n}: {m}"
        for n, m in _imported(ast.parse(source), package)
        if m.split(".")[-1].startswith("test_")
    ]


def test_no_file_under_tests_imports_a_test_module() -> None:
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        found += [
            f"{path.relative_to(TESTS.parent)} {hit}"
            for hit in imported_test_modules(path.read_text("utf-8"), _package(path))
        ]
    assert not found, "move what these share into tests/support/ (or a conftest.py fixture):\n" + "\n".join(
        found
    )


@pytest.mark.parametrize(
    "source",
    [
        "from tests.training.test_models import TINY",
        "from .test_worker import _ctx",
        "from ..training.test_dpsgd_engine import SHAPE",
        "from tests.training import test_models",
        "from . import test_worker",
        "import tests.node.test_worker",
        "def f():\n    from tests.release.test_synthesize import REPO\n    return REPO",
        "X = __import__('tests.release.test_synthesize', fromlist=['REPO']).REPO",
        "import importlib\nX = importlib.import_module('tests.node.test_worker')",
    ],
)
def test_every_import_form_of_a_test_module_is_found(source: str) -> None:
    assert imported_test_modules(source, ["tests", "node"])


@pytest.mark.parametrize(
    "source",
    [
        "from tests.support.training import TINY",
        "from tests.support import federation",
        "import feta_release.testing_tools",
        "from feta_release.release.verify import verify_release",
    ],
)
def test_imports_of_shared_test_code_and_the_library_pass(source: str) -> None:
    assert imported_test_modules(source, ["tests", "node"]) == []
