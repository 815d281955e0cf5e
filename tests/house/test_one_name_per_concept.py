"""One name per concept: a public top-level class or function name is defined in one module of the library and
the drivers, so a reader who meets the name knows which thing it is and where it lives.

Not counted: a click command's function (its name is the command's, the user's word: ``verify`` the command
and ``ledger_chain.verify`` the chain check are told apart by where they are called) and ``typing.overload``
stubs.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("feta_release", "edge", "coordinator")

# Names defined in more than one module on purpose, each with the reason the things are different.
ALLOWED = {
    "main": "each process's entry point (python -m, console script, Flower's SuperExec shim): the usual name",
    "rand_augmen"
    "t": "the warm-up's (torch, on the training device) and the release's (numpy, no torch installed)",
}


def _decorator_names(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> set[str]:
    out = set()
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute):
            out.add(target.attr)
        elif isinstance(target, ast.Name):
            out.add(target.id)
    return out


def public_definitions(source: str) -> list[str]:
    """The public class and function names a module defines at top level (click commands and overloads
    aside)."""
    names = []
    for node in ast.parse(source).body:
        if not isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        ) or node.name.startswith("_"):
            continue
        if _decorator_names(node) & {"command", "group", "overload"}:
            continue
        names.append(node.name)
    return names


def _definitions() -> dict[str, list[str]]:
    where: dict[str, list[str]] = defaultdict(list)
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for name in dict.fromkeys(public_definitions(path.read_text("utf-8"))):
                where[name].append(str(path.relative_to(ROOT)))
    return where


def test_the_counter_sees_functions_and_classes_but_not_commands_or_overloads() -> None:
    src = (
        "import click\nfrom typing import overload\n@click.command()\ndef verify(): ...\n@overload\ndef f(x: "
        "int): ...\ndef f(x): ...\nclass Release: ...\ndef _private(): ...\nasync def fetch(): ...\n"
    )
    assert public_definitions(src) == ["f", "Release", "fetch"]


def test_no_public_name_is_defined_in_two_library_modules() -> None:
    twice = {name: files for name, files in _definitions().items() if len(files) > 1 and name not in ALLOWED}
    assert twice == {}, "\n".join(f"{name}: {', '.join(files)}" for name, files in sorted(twice.items()))


def test_every_allowed_name_is_still_defined_twice() -> None:
    where = _definitions()
    assert [name for name in ALLOWED if len(where.get(name, [])) < 2] == []
