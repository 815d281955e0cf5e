"""Rich progress bars for long stages, with a silent mode for tests and library callers.

``Reporter.task(description, total)`` is a context manager yielding ``advance(n=1, **fields)``; ``log(msg)``
prints a line above the bars. With ``enabled=False`` nothing is printed (same calls, no output).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class Reporter:
    def __init__(self, enabled: bool = True, console: Console | None = None) -> None:
        self.enabled = enabled
        self.console = console or Console(stderr=True)

    def log(self, message: str) -> None:
        """``message`` is rich markup: escape text that is not (see :meth:`warn`)."""
        if self.enabled:
            self.console.print(message, highlight=False)

    def warn(self, message: str) -> None:
        """A warning in plain text: its "[sampler]", "[central]" (job sections) are printed, not read as
        markup."""
        self.log(f"[yellow]warning[/]: {escape(message)}")

    @contextlib.contextmanager
    def task(self, description: str, total: int | None) -> Iterator[Callable[..., None]]:
        if not self.enabled:
            yield lambda n=1, **fields: None
            return
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        with progress:
            tid = progress.add_task(description, total=total, info="")

            def advance(n: int = 1, info: str | None = None) -> None:
                if info is None:
                    progress.advance(tid, n)
                else:
                    progress.update(tid, advance=n, info=info)

            yield advance
