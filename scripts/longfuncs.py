"""List functions and methods longer than a limit, in lines of CODE.

A line of code is a logical line of the function's source (its `def` line to its end, decorators not counted):
one statement, or a compound statement's header, however many physical lines a formatter spreads it over (a
call with one argument a line is one line of code, a signature too); comments, blank lines and the docstring
do not count. The project standard, "functions <= ~60 lines of code", counts what a reader has to follow, not
prose and not layout, so reformatting the tree never changes a count. A nested function counts in its own
right and in the function that contains it (its lines are that function's lines too).

    python scripts/longfuncs.py feta_release edge coordinator          # threshold 60
    python scripts/longfuncs.py --max 40 feta_release/stages

Prints `path:line qualified.name N` for each function above the limit, longest first; exit status 1 when any
is. AST and tokenize only: nothing is imported, so it runs without the project's dependencies.
"""

from __future__ import annotations

import argparse
import ast
import io
import sys
import tokenize
from collections.abc import Iterator
from pathlib import Path

FuncNode = ast.FunctionDef | ast.AsyncFunctionDef


def code_lines(source: str) -> set[int]:
    """Line numbers (1-based) that hold a token other than a comment, a newline or indentation."""
    skip = {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
    }
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            # a multi-line token (a string) occupies every line it spans
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines


def statement_lines(source: str) -> set[int]:
    """Line numbers (1-based) where a logical line starts (a statement or a compound statement's header)."""
    trivia = {tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    starts: set[int] = set()
    fresh = True
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NEWLINE:
            fresh = True
        elif tok.type not in trivia and fresh:
            starts.add(tok.start[0])
            fresh = False
    return starts


def _docstring_lines(fn: FuncNode) -> set[int]:
    body = fn.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        return set(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    return set()


def functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, FuncNode]]:
    """Every function and method with its qualified name (Class.method, outer.<locals>.inner)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + node.name
            yield name, node
            yield from functions(node, name + ".<locals>.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, prefix + node.name + ".")
        else:
            yield from functions(node, prefix)


def function_lengths(path: Path) -> list[tuple[int, str, int]]:
    """(line, qualified name, lines of code) of each function in one file, from its `def` line to its end.

    Decorators do not count: they declare the function's interface (a click command's options), they are not
    code a reader follows through it.
    """
    source = path.read_text("utf-8")
    code = statement_lines(source)
    out = []
    for name, fn in functions(ast.parse(source, str(path))):
        span = set(range(fn.lineno, (fn.end_lineno or fn.lineno) + 1))
        out.append((fn.lineno, name, len((span & code) - _docstring_lines(fn))))
    return out


def python_files(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(f for f in p.rglob("*.py") if ".venv" not in f.parts) if p.is_dir() else [p]
    return files


def long_functions(paths: list[str], limit: int = 60) -> list[tuple[str, str, int]]:
    """(path:line, name, lines of code) of every function above `limit`, longest first."""
    found = [
        (f"{f}:{line}", name, n)
        for f in python_files(paths)
        for line, name, n in function_lengths(f)
        if n > limit
    ]
    return sorted(found, key=lambda row: (-row[2], row[0]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="files or directories (searched for *.py)")
    ap.add_argument("--max", type=int, default=60, help="lines of code allowed per function (default 60)")
    args = ap.parse_args(argv)
    rows = long_functions(args.paths, args.max)
    for where, name, n in rows:
        print(f"{where} {name} {n}")
    return 1 if rows else 0


if __name__ == "__main__":
    sys.exit(main())
