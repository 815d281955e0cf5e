"""Write docs/reference/cli.md from the click commands themselves, so the reference cannot drift from the CLI.

python scripts/cli_reference.py            # rewrite docs/reference/cli.md
python scripts/cli_reference.py --check    # exit 1 if the file differs from what the CLI says (the test's
check)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "docs" / "reference" / "cli.md"
HEADER = """# Command reference

Generated from the commands' own help by `python scripts/cli_reference.py`; do not edit by hand
(`tests/house/test_cli_reference.py` fails when this file and the CLI disagree). Exit codes: docs/reference/exit-codes.md.
"""  # noqa: E501


def _walk(
    cmd: click.Command, path: list[str], ctx: click.Context | None
) -> list[tuple[str, click.Command, click.Context]]:
    here = click.Context(cmd, info_name=path[-1], parent=ctx, terminal_width=100, max_content_width=100)
    found = [(" ".join(path), cmd, here)]
    if isinstance(cmd, click.Group):
        for name in cmd.list_commands(here):
            sub = cmd.get_command(here, name)
            if sub is not None and not sub.hidden:
                found += _walk(sub, [*path, name], here)
    return found


def render() -> str:
    from feta_release.cli import cli

    parts = [HEADER]
    for name, cmd, ctx in _walk(cli, ["feta-release"], None):
        if name == "feta-release":
            continue
        parts.append(f"\n## `{name}`\n\n```text\n{cmd.get_help(ctx).rstrip()}\n```\n")
    return "".join(parts)


EXIT_DOC = ROOT / "docs" / "reference" / "exit-codes.md"


def render_exit_codes() -> str:
    """One row per error type the CLI turns into an exit code (feta_release/errors.py), in code order."""
    import inspect

    from feta_release import errors

    kinds = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.FetaError)]
    rows = sorted(
        ((c.exit_code, c.__name__, inspect.getdoc(c) or "") for c in kinds), key=lambda r: (r[0], r[1])
    )
    lines = [
        "# Exit codes",
        "",
        "Generated from `feta_release/errors.py` by `python scripts/cli_reference.py`.",
        "Every refusal prints one line naming what is wrong and the fix, then exits with its code.",
        "",
        "| code | error | meaning |",
        "|---|---|---|",
        "| 0 | – | success |",
    ]
    lines += [f"| {code} | `{name}` | {doc.splitlines()[0]} |" for code, name, doc in rows]
    lines += [
        "| 8 | – | a partial check: what could be checked passed, the rest needs more input (e.g. `policy "
        "check` of a secure-aggregation job without `--data`) |",
        "| 130 | – | interrupted (Ctrl-C) |",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    files = {OUT: render(), EXIT_DOC: render_exit_codes()}
    if ap.parse_args().check:
        stale = [p for p, text in files.items() if not p.is_file() or p.read_text(encoding="utf-8") != text]
        for p in stale:
            print(f"{p.relative_to(ROOT)} is STALE: run python scripts/cli_reference.py")
        return 1 if stale else 0
    for p, text in files.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
