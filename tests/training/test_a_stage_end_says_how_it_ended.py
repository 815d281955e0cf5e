"""A one-call stage's end event (``progress_events.timed``) says how it ended. An inner stage that raised was
logged "failed" once per nesting level, as if every enclosing stage had failed on its own, and a clean exit
(``SystemExit(0)``) or Ctrl-C was logged as a failure. Now the stage that raised is the one "failed (Type)",
each enclosing stage "stopped" naming it, and an exit or an interrupt is recorded as such. The end event
keeps ``stage`` and ``seconds``; ``failed`` (the exception's type) marks every stage a failure stopped, as
before, ``failed_in`` the stage where it was raised, ``stopped`` an exit or an interrupt."""

from __future__ import annotations

import json
from typing import Any

import pytest

from feta_release.progress_events import EXPORT, REPORT, SIGNING, timed


def _ends(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each stage's end event (the one with its seconds), by stage; every event is a JSON line."""
    for e in events:
        json.dumps(e)
    ends = [e for e in events if "seconds" in e]
    assert len(ends) == len({e["stage"] for e in ends}), ends
    return {e["stage"]: e for e in ends}


def test_only_the_stage_that_raised_is_logged_failed_and_each_enclosing_one_names_it() -> None:
    events: list[dict[str, Any]] = []
    with pytest.raises(ValueError), timed(events.append, REPORT, "outer"):
        with timed(events.append, EXPORT, "middle"), timed(events.append, SIGNING, "inner"):
            raise ValueError("the manifest is torn")
    ends = _ends(events)
    assert [e["stage"] for e in events if "seconds" in e] == [SIGNING, EXPORT, REPORT]
    inner = ends[SIGNING]
    assert inner["message"].startswith(f"{SIGNING} failed after") and inner["message"].endswith(
        "(ValueError)"
    )
    assert inner["failed"] == "ValueError" and "failed_in" not in inner and "stopped" not in inner
    for stage in (EXPORT, REPORT):
        end = ends[stage]
        assert " failed after" not in end["message"], end
        assert end["message"].startswith(f"{stage} stopped after"), end
        assert f"its stage {SIGNING} failed (ValueError)" in end["message"], end
        assert end["failed"] == "ValueError" and end["failed_in"] == SIGNING
    assert sum(" failed after" in e["message"] for e in events) == 1


@pytest.mark.parametrize("code", [0, None])
def test_a_clean_exit_inside_a_stage_is_not_a_failure(code: int | None) -> None:
    events: list[dict[str, Any]] = []
    with (
        pytest.raises(SystemExit),
        timed(events.append, REPORT, "outer"),
        timed(events.append, EXPORT, "inner"),
    ):
        raise SystemExit(code)
    for stage, end in _ends(events).items():
        assert "failed" not in end and end["stopped"] == "exit", end
        assert "failed" not in end["message"] and end["message"].startswith(f"{stage} ended after"), end
        assert "the program exited (code 0)" in end["message"], end


def test_a_failing_exit_code_inside_a_stage_is_a_failure() -> None:
    events: list[dict[str, Any]] = []
    with pytest.raises(SystemExit), timed(events.append, EXPORT, "inner"):
        raise SystemExit(2)
    end = _ends(events)[EXPORT]
    assert end["failed"] == "SystemExit" and "exit code 2" in end["message"] and "stopped" not in end


def test_an_interrupt_inside_a_stage_is_recorded_as_an_interrupt() -> None:
    events: list[dict[str, Any]] = []
    with pytest.raises(KeyboardInterrupt):
        with timed(events.append, REPORT, "outer"), timed(events.append, EXPORT, "inner"):
            raise KeyboardInterrupt
    for stage, end in _ends(events).items():
        assert "failed" not in end and end["stopped"] == "interrupted", end
        assert end["message"].startswith(f"{stage} interrupted after"), end


def test_an_enclosing_stage_that_raises_its_own_error_is_the_one_that_failed() -> None:
    """An inner failure the enclosing stage handled is not its end's cause: another error it raises is."""
    events: list[dict[str, Any]] = []
    with pytest.raises(KeyError), timed(events.append, REPORT, "outer"):
        try:
            with timed(events.append, EXPORT, "inner"):
                raise ValueError("handled")
        except ValueError:
            pass
        raise KeyError("its own")
    ends = _ends(events)
    assert ends[EXPORT]["failed"] == "ValueError" and ends[REPORT]["failed"] == "KeyError"
    assert "failed_in" not in ends[REPORT] and ends[REPORT]["message"].startswith(f"{REPORT} failed after")


def test_a_stage_after_a_handled_failure_ends_as_what_it_did() -> None:
    events: list[dict[str, Any]] = []
    error = ValueError("once")
    with pytest.raises(ValueError), timed(events.append, EXPORT, "first"):
        raise error
    # the same exception object raised again in a later, unrelated stage: that stage failed on its own
    with pytest.raises(ValueError), timed(events.append, SIGNING, "second"):
        raise error
    with timed(events.append, REPORT, "third"):
        pass
    ends = _ends(events)
    assert ends[SIGNING]["message"].startswith(f"{SIGNING} failed after") and "failed_in" not in ends[SIGNING]
    assert ends[REPORT]["message"].startswith(f"{REPORT} done in") and "failed" not in ends[REPORT]


def test_a_stage_inside_one_of_the_same_name_is_the_one_that_failed() -> None:
    events: list[dict[str, Any]] = []
    with (
        pytest.raises(ValueError),
        timed(events.append, EXPORT, "outer"),
        timed(events.append, EXPORT, "inner"),
    ):
        raise ValueError("once")
    first, second = [e for e in events if "seconds" in e]
    assert first["message"].startswith(f"{EXPORT} failed after") and "failed_in" not in first
    assert second["message"].startswith(f"{EXPORT} stopped after") and second["failed_in"] == EXPORT


def test_an_exit_with_a_message_is_a_failure_logged_without_reading_the_message() -> None:
    events: list[dict[str, Any]] = []
    with pytest.raises(SystemExit), timed(events.append, EXPORT, "inner"):
        raise SystemExit("refused: {braces} in the text")
    end = _ends(events)[EXPORT]
    assert end["failed"] == "SystemExit" and end["message"].endswith("(SystemExit: exit code 1)")
