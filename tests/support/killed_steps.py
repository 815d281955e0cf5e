"""A DP-SGD run killed (or failing) after a given number of steps: the step counter of the resume-after-kill
tests of ``train`` and of a node's round."""

from __future__ import annotations

from typing import Any

import pytest

from feta_release.training.dpsgd import DPSGDTrainer

# the trainer's own step, taken when this module is imported, before any test wraps it: a second
# count_steps in the same test then wraps the real step, not the first counter
STEP = DPSGDTrainer.step


class Killed(BaseException):
    """The process dies (not an exception a handler catches)."""


def count_steps(monkeypatch: pytest.MonkeyPatch, die_at: int | None = None, error: bool = False) -> list[int]:
    """Count the DP-SGD steps taken (each as the trainer's ``steps_done`` after it) in the returned list; when
    ``die_at`` steps are done the next one kills the process (:class:`Killed`), or with ``error`` raises an
    exception a handler catches (a failure inside the computation)."""
    taken: list[int] = []

    def counted(self: DPSGDTrainer, images: Any, labels: Any) -> Any:
        if die_at is not None and len(taken) == die_at:
            if error:
                raise RuntimeError("a failure inside the computation")
            raise Killed
        out = STEP(self, images, labels)
        taken.append(self.steps_done)
        return out

    monkeypatch.setattr(DPSGDTrainer, "step", counted)
    return taken
