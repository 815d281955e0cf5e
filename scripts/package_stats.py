"""Size and structure of the project's packages in one tree: lines, code lines, function-level imports, long
functions.

    python scripts/package_stats.py .                  # this checkout
    python scripts/package_stats.py ../old-tree        # another tree (a `git worktree add --detach` of an old commit)

Per package (feta_release, edge, coordinator, tests): files, raw lines (as `wc -l` counts them), code lines
(lines holding a token other than a comment or whitespace, by `scripts/longfuncs.code_lines` over the whole
file, so docstrings count), import statements inside a function (each `import` / `from ... import` node once,
however deeply nested; AST only) and functions above 60 code lines (`scripts/longfuncs.function_lengths`).
Nothing is imported from the tree measured, so an old commit needs no environment of its own.
"""  # noqa: E501

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from longfuncs import code_lines, function_lengths, python_files  # noqa: E402  (a sibling script, not a package)

PACKAGES = ("feta_release", "edge", "coordinator", "tests")


def function_imports(source: str) -> int:
    """Import statements that sit inside a function body (each counted once, also inside a nested
    function)."""
    inside: set[int] = set()
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside |= {id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return len(inside)


def package_row(root: Path, package: str, limit: int = 60) -> tuple[int, int, int, int, int]:
    """(files, raw lines, code lines, function-level imports, functions above `limit`) of one package."""
    files = python_files([str(root / package)])
    raw = code = imports = long = 0
    for f in files:
        text = f.read_text("utf-8")
        raw += text.count("\n")
        code += len(code_lines(text))
        imports += function_imports(text)
        long += sum(1 for _, _, n in function_lengths(f) if n > limit)
    return len(files), raw, code, imports, long


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", help="the tree to measure (its repository root)")
    ap.add_argument("--max", type=int, default=60, help="code lines allowed per function (default 60)")
    args = ap.parse_args(argv)
    root = Path(args.root)
    print(
        f"| package | files | raw lines | code lines | imports inside functions | functions > {args.max} "
        "code lines |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    total = [0, 0, 0, 0, 0]
    for pkg in PACKAGES:
        row = package_row(root, pkg, args.max)
        total = [a + b for a, b in zip(total, row)]
        print(f"| {pkg} | " + " | ".join(f"{v:,}" for v in row) + " |")
    print("| all four | " + " | ".join(f"{v:,}" for v in total) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
