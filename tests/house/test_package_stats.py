"""scripts/package_stats.py: imports inside functions are counted once each, module-
level and class-level imports not at all, and a package's row adds up its files."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))  # package_stats imports its sibling longfuncs
_spec = importlib.util.spec_from_file_location("package_stats", ROOT / "scripts" / "package_stats.py")
assert _spec is not None and _spec.loader is not None
package_stats = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(package_stats)

SOURCE = '''"""doc"""
import os


class C:
    import json

    def m(self):
        from pathlib import Path  # one

        def inner():
            import re  # two: inside inner AND m, counted once
            return re
        return Path, inner


def f():
    # a comment
    import sys, math  # three: one statement
    return sys, math
'''


def test_imports_inside_functions_are_counted_once_each() -> None:
    assert package_stats.function_imports(SOURCE) == 3


def test_a_package_row_adds_up_its_files(tmp_path: Path) -> None:
    pkg = tmp_path / "feta_release"
    pkg.mkdir()
    (pkg / "a.py").write_text(SOURCE, "utf-8")
    (pkg / "b.py").write_text("x = 1\n\n# only a comment\n", "utf-8")
    files, raw, code, imports, long = package_stats.package_row(tmp_path, "feta_release")
    assert (files, raw, imports, long) == (2, SOURCE.count("\n") + 3, 3, 0)
    assert code == 13 + 1  # a.py: its 13 non-blank lines that are not only a comment; b.py: `x = 1`
