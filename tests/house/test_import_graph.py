"""The import graph of the library and both drivers, built from the source with ``ast``: no import circle, and
the layers of docs/architecture.md ("Who may import whom") hold through every path, lazy imports included.

An edge is any import a module can execute: at module top or inside a function (a lazy import still runs, and
a circle through it breaks as soon as the two modules load in the other order). Importing ``a.b.c`` from
outside ``a.b`` runs the package ``a.b`` (its ``__init__``) too, so that is an edge as well. Imports under
``if TYPE_CHECKING:`` never run: they count for the layers (they are still a dependency of the design) but not
for circles.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("feta_release", "edge", "coordinator")
# Import circles allowed, each with its reason. None today: keep it that way.
CIRCLES_ALLOWED: dict[frozenset[str], str] = {}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module that importing ``name`` runs (``a.b.f`` of a function ``f`` is module ``a.b``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
    return [
        f"{base}.{a.name}" if _resolve(f"{base}.{a.name}") == f"{base}.{a.name}" else base for a in node.names
    ]


def _guarded(tree: ast.Module) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (never executed)."""
    return {
        id(n)
        for top in ast.walk(tree)
        if isinstance(top, ast.If) and "TYPE_CHECKING" in ast.unparse(top.test)
        for n in ast.walk(top)
    }


def import_graph(*, type_checking: bool) -> dict[str, set[str]]:
    """module -> the project modules it may import (each package whose ``__init__`` that runs included)."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text("utf-8"))
        skip = set() if type_checking else _guarded(tree)
        out: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip:
                for name in _imported_names(node, module, path.name == "__init__.py"):
                    target = _resolve(name)
                    if target is None or target == module:
                        continue
                    parts = target.split(".")
                    out |= {
                        ".".join(parts[:i])
                        for i in range(1, len(parts) + 1)
                        if ".".join(parts[:i]) in MODULES and not module.startswith(".".join(parts[:i]) + ".")
                    }
        graph[module] = out - {module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.add(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(frozenset(comp))
    return found


def _reachable(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module ``start`` reaches -> the module that imports it on one path (to name the path in a
    failure)."""
    seen: dict[str, str] = {}
    todo = [start]
    while todo:
        v = todo.pop()
        for w in graph[v]:
            if w not in seen and w != start:
                seen[w] = v
                todo.append(w)
    return seen


def _path(seen: dict[str, str], start: str, end: str) -> str:
    hops = [end]
    while hops[-1] != start:
        hops.append(seen[hops[-1]])
    return " -> ".join(reversed(hops))


def test_the_graph_builder_sees_a_circle_and_a_package_init() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [frozenset("abc")]
    assert _circles({"a": {"b"}, "b": set()}) == []
    # the library itself: the stage package's __init__ imports its modules, a driver module reaches it through
    # them
    g = import_graph(type_checking=False)
    assert "feta_release.stages.pretrain" in g["feta_release.stages"]
    assert "feta_release.models" in g["feta_release.stages.context"]  # the package runs before its module


def test_the_library_and_drivers_have_no_import_circle() -> None:
    circles = [sorted(c) for c in _circles(import_graph(type_checking=False)) if c not in CIRCLES_ALLOWED]
    assert circles == [], f"import circles (lazy imports count): {circles}"


# (layer, a layer below it that it must never reach, through any path): why
NEVER_REACHES = {
    # a release is read, checked and sampled where no training stack is installed; the model file it reads is
    # models/model_file.py
    ("feta_release.release", "feta_release.training"): "the release side reads models, never trains",
    # a node reaches the coordinator only over the network: no code of the coordinator runs on a site
    ("edge", "coordinator"): "a site node runs no coordinator code",
    # the planner is arithmetic on public facts (sizes, ε, δ): its noise figures count parameters from the
    # config (feta_release/model_size.py), no model is built or imported
    ("feta_release.planning", "feta_release.models"): "the planner builds no model",
}


def _within(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


def test_no_layer_reaches_a_layer_it_must_never_import() -> None:
    graph = import_graph(type_checking=True)
    bad = []
    for (upper, lower), why in NEVER_REACHES.items():
        for start in (m for m in graph if _within(m, upper)):
            seen = _reachable(graph, start)
            bad += [f"{why}: {_path(seen, start, m)}" for m in seen if _within(m, lower)][:1]
    assert bad == [], "\n".join(bad)
