"""Progress events of a job's long stages: one line each in the job directory's ``progress.jsonl`` and on the
console (``train``'s lines, ``coordinator run``'s streamed log).

Every stage that can run for more than a few seconds on a CPU reports through this module, one way: a stage
counted in units (optimiser steps, images, classes) through a :class:`Meter` (an event at its start, at
each tenth of its units with the units done, the rate and the estimated seconds left, and at its end), a stage
that is one call (the ONNX export, the signing) through :func:`timed` (an event at its start and at its end
with its seconds). The stage functions (``stages``, ``release.jobdir``) take a :data:`Sink` and build their
meters themselves, so every caller (``train``, ``coordinator run``, the ServerApp, the demo) shows the same
lines.

The stage names below are the names of the cost model's terms (``job_rules.estimate``): an event's ``stage``
is a term of the estimate, so the estimate can be checked to cost every stage a job reports.

Torch-free and light (the release commands import it). What an event carries is public: step counts, image
counts, seconds and the loss of a post-processing stage on released statistics.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# an event without its time: a driver's sink adds the time and its phase where the event has none
Sink = Callable[[dict[str, Any]], None]

LOG_FILE = "progress.jsonl"

# the stages a job runs, as its events and the cost model's terms name them
CENTRAL = "central"
FREQUENCY = "frequency"
AUX_FIT = "aux generator"
PROTOTYPES = "cell prototypes"
AUX_IMAGES = "aux images"
SPATIAL = "spatial warm-up"
FREQUENCY_WARMUP = "frequency warm-up"
POLISH = "polish"
PRETRAINING = "pretraining"
DPSGD = "dpsgd"
GRIDS = "grids"
SAMPLING = "sampling"
EXPORT = "export"
SIGNING = "signing"
REPORT = "privacy report"
SAMPLE_GRID = "sample grid"
# the stages after the driver's job: the privacy report, the sample grid, the synthetic set and the release
# (left out of a job's time budget, which is the training's)
FINISHING = (REPORT, SAMPLE_GRID, SAMPLING, EXPORT, SIGNING)


def append_event(path: Path, ev: dict[str, Any]) -> None:
    """One line of ``progress.jsonl``. A coordinator killed mid-line left a torn last line: it is ended first,
    so that this event (and every later one) stays a line of its own that a reader can parse."""
    line = (json.dumps(ev) + "\n").encode("utf-8")
    with open(path, "a+b") as fh:
        if fh.seek(0, os.SEEK_END) and (fh.seek(-1, os.SEEK_END), fh.read(1))[1] != b"\n":
            line = b"\n" + line
        fh.write(line)


def job_log(out_dir: Path, phase: str, echo: Callable[[dict[str, Any]], None] | None = None) -> Sink:
    """A sink that appends each event, timed and in ``phase``, to ``out_dir/progress.jsonl`` and hands it to
    ``echo`` (a console line): how the stages after a driver's job (the synthetic set, the release) report in
    the same log as the job."""

    def sink(ev: dict[str, Any]) -> None:
        full = {"t": time.time(), "phase": phase, **ev}
        append_event(Path(out_dir) / LOG_FILE, full)
        if echo is not None:
            echo(full)

    return sink


def say(sink: Sink | None, message: str, **fields: Any) -> None:
    """One event with ``message`` (nothing without a sink)."""
    if sink is not None:
        sink({"message": message, **fields})


def duration(seconds: float) -> str:
    """``seconds`` in the words of a progress line: "40 s", "3.5 min", "1.2 h"."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


class Meter:
    """The progress of a stage of ``total`` units: call it with (units done[, total, loss]) after each unit
    (it is the warm-up loops' and the sampler's progress callback). It reports its start, each tenth of the
    units (units done, rate, estimated seconds left) and, through :meth:`end`, its end with its seconds."""

    def __init__(self, sink: Sink | None, stage: str, unit: str, total: int, what: str = "") -> None:
        self.sink, self.stage, self.unit, self.total = sink, stage, unit, int(total)
        self.t0 = time.monotonic()
        self.tenths = 0
        say(
            sink,
            f"{stage} {what or f'of {self.total} {unit}'}",
            stage=stage,
            done=0,
            total=self.total,
            unit=unit,
        )

    def __call__(self, done: int, total: int | None = None, loss: float | None = None) -> None:
        """``done`` of the stage's units (``total``: the caller's count of its own part, not used: a stage of
        several parts, as the frequency warm-up set, counts over all of them)."""
        tenth = 10 * done // max(1, self.total)
        if tenth <= self.tenths or self.sink is None:
            return
        self.tenths = tenth
        seconds = time.monotonic() - self.t0
        rate = done / seconds if seconds > 0 else 0.0
        left = (self.total - done) / rate if rate > 0 else 0.0
        words = f"{self.stage} {done}/{self.total} {self.unit} ({rate:.3g} {self.unit}/s"
        words += f", ~{duration(left)} left)" if done < self.total else ")"
        fields: dict[str, Any] = {"loss": float(loss)} if loss is not None else {}
        say(
            self.sink,
            words + (f" loss {loss:.4f}" if loss is not None else ""),
            stage=self.stage,
            done=int(done),
            total=self.total,
            unit=self.unit,
            rate=rate,
            eta_s=left,
            seconds=seconds,
            **fields,
        )

    def end(self, note: str = "") -> float:
        """Report the stage's end (``note``: e.g. its final loss); returns its seconds."""
        seconds = time.monotonic() - self.t0
        say(
            self.sink,
            f"{self.stage} done in {seconds:.1f} s{f' ({note})' if note else ''}",
            stage=self.stage,
            done=self.total,
            total=self.total,
            unit=self.unit,
            seconds=seconds,
        )
        return seconds


# While timed stages are open in this context: how many, and the exception that ended the innermost one with
# that stage's name and nesting level, so that each enclosing stage it goes on to end names that stage instead
# of being logged as a failure of its own. Cleared when the outermost stage ends (it holds a traceback).
_open_stages: contextvars.ContextVar[int] = contextvars.ContextVar("open_stages", default=0)
_raised_in: contextvars.ContextVar[tuple[BaseException, str, int] | None] = contextvars.ContextVar(
    "raised_in", default=None
)


@contextlib.contextmanager
def timed(sink: Sink | None, stage: str, what: str) -> Iterator[None]:
    """A stage that is one call: an event naming ``what`` it does at its start, one with its seconds at its
    end; the exception of a stage that raises goes on to the caller. The end event says how the stage ended:

    - ``"{stage} done in N s"``;
    - ``"{stage} failed after N s (Type)"``, ``failed`` = the exception's type: the stage raised it (a
      ``SystemExit`` with a failing code included);
    - ``"{stage} stopped after N s: its stage INNER failed (Type)"``, ``failed`` = the type and ``failed_in``
      = INNER: a timed stage inside it raised, so the log says once which stage stopped the job and after
      how long, and every stage around it still reads as not finished (``failed``, as before);
    - ``"{stage} ended after N s: the program exited (code 0)"``, ``stopped = "exit"``: a clean
      ``SystemExit``, no failure;
    - ``"{stage} interrupted after N s"``, ``stopped = "interrupted"``: Ctrl-C (``KeyboardInterrupt``).
    """
    t0 = time.monotonic()
    say(sink, f"{stage}: {what}", stage=stage)
    depth = _open_stages.set(_open_stages.get() + 1)
    try:
        yield
    except BaseException as exc:
        seconds = time.monotonic() - t0
        words, fields = _ending(stage, _open_stages.get(), exc, f"{seconds:.1f} s")
        say(
            sink,
            f"{stage} {words}",
            stage=stage,
            seconds=seconds,
            **fields,
        )
        raise
    finally:
        _open_stages.reset(depth)
        if _open_stages.get() == 0:  # the outermost stage: no enclosing stage left to name the failure to
            _raised_in.set(None)
    seconds = time.monotonic() - t0
    say(sink, f"{stage} done in {seconds:.1f} s", stage=stage, seconds=seconds)


def _ending(stage: str, level: int, exc: BaseException, took: str) -> tuple[str, dict[str, Any]]:
    """(the end's words after the stage's name, the end event's fields) for a stage at nesting ``level``
    (1: outermost) that ``exc`` ended after ``took``."""
    if isinstance(exc, KeyboardInterrupt):
        return f"interrupted after {took}", {"stopped": "interrupted"}
    if isinstance(exc, SystemExit) and exc.code in (0, None):
        return f"ended after {took}: the program exited (code 0)", {"stopped": "exit"}
    error = type(exc).__name__
    if isinstance(exc, SystemExit):  # sys.exit("message") prints it and exits with 1
        error += f": exit code {exc.code if isinstance(exc.code, int) else 1}"
    raised = _raised_in.get()
    if raised is not None and raised[0] is exc and raised[2] > level:
        inner = raised[1]
        return f"stopped after {took}: its stage {inner} failed ({error})", {
            "failed": type(exc).__name__,
            "failed_in": inner,
        }
    _raised_in.set((exc, stage, level))
    return f"failed after {took} ({error})", {"failed": type(exc).__name__}
