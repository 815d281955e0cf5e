"""The project standard "functions <= ~60 lines of code", enforced on the library and both drivers with
scripts/longfuncs.py (AST + tokenize only, no import of the code it measures: a fraction of a second)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("longfuncs", ROOT / "scripts" / "longfuncs.py")
assert _spec is not None and _spec.loader is not None
longfuncs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(longfuncs)


def test_no_function_in_the_library_or_the_drivers_is_longer_than_60_lines_of_code() -> None:
    rows = longfuncs.long_functions([str(ROOT / p) for p in ("feta_release", "edge", "coordinator")], 60)
    assert rows == [], "split these along a real seam:\n" + "\n".join(f"{w} {n} {k}" for w, n, k in rows)


def test_the_count_skips_blank_lines_comments_the_docstring_and_decorators(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text('''@decorator(
    "option",
)
def f(x):
    """Doc
    string."""

    # a comment
    y = (x +
         1)  # trailing comment
    s = """a
    b"""
    return y


class C:
    def m(self):
        def inner():
            return 1
        return inner()
''')
    got = {name: n for _, name, n in longfuncs.function_lengths(src)}
    # f: def, y = (x +, 1), s = """a, b""", return  -> 6; m: def, def inner, return 1, return inner() -> 4
    assert got == {"f": 6, "C.m": 4, "C.m.<locals>.inner": 2}
    assert longfuncs.long_functions([str(src)], 5) == [(f"{src}:4", "f", 6)]
