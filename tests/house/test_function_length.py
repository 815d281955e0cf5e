"""The project standard "functions <= ~60 lines of code", enforced on the library and both drivers with
scripts/longfuncs.py (AST + tokenize only, no import of the code it measures: a fraction of a second).
A line of code is a logical line: a statement the formatter spreads over several lines counts once."""

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


def test_the_count_skips_blank_lines_comments_the_docstring_decorators_and_continuations(tmp_path: Path):
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
    # f: def, y = (x + 1), s = """a b""", return  -> 4; m: def, def inner, return 1, return inner() -> 4
    assert got == {"f": 4, "C.m": 4, "C.m.<locals>.inner": 2}
    assert longfuncs.long_functions([str(src)], 3) == [(f"{src}:17", "C.m", 4), (f"{src}:4", "f", 4)]


def test_the_count_does_not_change_when_a_formatter_wraps_the_code(tmp_path: Path) -> None:
    one, wrapped = tmp_path / "one.py", tmp_path / "wrapped.py"
    one.write_text("def f(a, b):\n    x = g(a, b, key=1)\n    if x: return [a, b]\n    return x\n")
    wrapped.write_text(
        "def f(\n    a,\n    b,\n):\n    x = g(\n        a,\n        b,\n        key=1,\n    )\n"
        "    if x: return [\n        a,\n        b,\n    ]\n    return x\n"
    )
    assert longfuncs.function_lengths(one) == [(1, "f", 4)]
    assert longfuncs.function_lengths(wrapped) == [(1, "f", 4)]
