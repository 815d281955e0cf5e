"""The layering of docs/architecture.md ("who may import whom"), checked on the source: one planner, one
ledger, and no import from the library down into the node or coordinator packages."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "feta_release"


def _imports(path: Path) -> set[str]:
    """Absolute module names a file imports (relative imports resolved against its package), anywhere in
    it."""
    tree = ast.parse(path.read_text("utf-8"))
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def _files(where: Path) -> list[Path]:
    return sorted(p for p in where.rglob("*.py") if ".venv" not in p.parts)


def test_the_library_below_the_cli_never_imports_the_node_or_coordinator() -> None:
    bad = {
        str(p.relative_to(ROOT)): sorted(m for m in _imports(p) if m.split(".")[0] in ("edge", "coordinator"))
        for p in _files(PKG)
        if "cli" not in p.relative_to(PKG).parts
    }
    assert not {k: v for k, v in bad.items() if v}


def test_the_ledger_and_the_planner_sit_below_policy_stages_and_drivers() -> None:
    low = {
        "feta_release.ledger": ("errors", "accounting", "signing", "ledger_chain"),
        "feta_release.ledger_chain": ("errors", "signing"),
        # accountants / mechanisms: the Skellam accounting and parameters of FedSGD rounds (numpy only, below
        # it) model_size: the denoiser's parameter count from its config (torch-free, nothing built); never
        # models
        "feta_release.planning": (
            "errors",
            "accounting",
            "accountants",
            "config",
            "mechanisms",
            "model_size",
        ),
    }
    for mod, allowed in low.items():
        path = ROOT / (mod.replace(".", "/") + ".py")
        own = {m.split(".")[1] for m in _imports(path) if m.startswith("feta_release.") and m.count(".") >= 1}
        assert own <= set(allowed), (mod, own - set(allowed))


def test_one_planner_and_one_ledger_type() -> None:
    """The removed duplicates stay removed: no second event builder, run ledger or budget composition."""
    src = {
        p: p.read_text("utf-8") for p in _files(PKG) + _files(ROOT / "edge") + _files(ROOT / "coordinator")
    }
    for name in (
        "def plan_job(",
        "def plan_site(",
        "def site_plan(",
        "def site_sigma(",
        "def round_event(",
        "def central_event(",
        "def frequency_event(",
        "class RunLedger",
        "class PlannedRun",
        "def plan_run(",
    ):
        assert not [p for p, text in src.items() if name in text], name
    ledgers = [p for p, text in src.items() if "CREATE TABLE IF NOT EXISTS requests" in text]
    assert [p.name for p in ledgers] == ["ledger.py"]
