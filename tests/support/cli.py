"""Running the ``feta-release`` command line in-process, as a user's shell would see it."""

from __future__ import annotations

from typing import Any


def run_cli(args: list[str], capsys: Any) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``feta-release ARGS`` run in this process (``capsys`` captures the
    output)."""
    from feta_release.cli import main

    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def run_cli_merged(args: list[str]) -> tuple[int, str]:
    """Run the real entry point (its error printing included), capturing what a user would see."""
    import contextlib
    import io

    from feta_release.cli import main

    buf = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            main(args)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, buf.getvalue()
