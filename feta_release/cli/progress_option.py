"""One name for the progress option across the CLI: ``--progress/--no-progress`` (click's on/off flag pair, on
by default), on every command that draws progress bars, spinners or streamed progress lines. Results, warnings
and errors are printed either way; ``--no-progress`` is for logs and scripts.

Spellings used before (``train --quiet``) stay accepted as hidden, deprecated aliases that print one warning
and mean ``--no-progress``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

OPTION = "--progress/--no-progress"


def progress_option(
    what: str, *, old_quiet: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add ``--progress/--no-progress`` (the function gets ``progress: bool``); ``what`` says what it shows.
    ``old_quiet``: also accept the hidden, deprecated ``--quiet`` (= ``--no-progress``)."""

    def deco(f: Callable[..., Any]) -> Callable[..., Any]:
        wrapped = f
        if old_quiet:

            @functools.wraps(f)
            def wrapped(*args: Any, quiet_deprecated: bool = False, **kw: Any) -> Any:
                if quiet_deprecated:
                    kw["progress"] = False
                return f(*args, **kw)

            wrapped = click.option(
                "--quiet",
                "quiet_deprecated",
                is_flag=True,
                hidden=True,
                callback=_warn_quiet,
                help="Deprecated spelling of --no-progress.",
            )(wrapped)
        return click.option(
            OPTION,
            "progress",
            default=True,
            show_default=True,
            help=f"Show {what}; --no-progress shows none (results and warnings are still printed).",
        )(wrapped)

    return deco


def _warn_quiet(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    if value:
        click.echo("warning: --quiet is deprecated; use --no-progress (same meaning)", err=True)
    return value
