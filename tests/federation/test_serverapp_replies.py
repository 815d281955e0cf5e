"""The ServerApp pulls the sites' replies every half second (``coordinator.serverapp.PromptGrid``), not every
3 s as flwr's own loop: every reply that came is returned, one still missing at the timeout is left out (the
driver reports that site as down or too slow), and the rest of the Grid is the SuperLink's own. Checked on a
fake clock: no test waits on a real one."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from coordinator import serverapp


class Clock:
    """``time`` as the module sees it: ``sleep`` advances ``monotonic`` and is recorded."""

    def __init__(self) -> None:
        self.now, self.slept = 1000.0, []  # type: ignore[var-annotated]

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


class SlowGrid:
    """A SuperLink whose reply to message ``i`` can first be pulled at pull number ``ready[i]`` (never when
    None)."""

    def __init__(self, ready: list[int | None]) -> None:
        self.ready, self.pulls = ready, 0

    def push_messages(self, messages: list[Any]) -> list[str]:
        return [f"m{i}" for i, _ in enumerate(messages)]

    def pull_messages(self, ids: set[str]) -> list[Any]:
        self.pulls += 1
        due = [i for i, r in enumerate(self.ready) if r is not None and r <= self.pulls and f"m{i}" in ids]
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=f"m{i}")) for i in due]

    def get_node_ids(self) -> list[int]:
        return [7, 8]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(serverapp, "time", c)
    return c


def test_every_reply_is_collected_pulling_every_half_second(clock: Clock) -> None:
    grid = SlowGrid([1, 4, 2])
    replies = serverapp.PromptGrid(grid).send_and_receive(["a", "b", "c"], timeout=300)  # type: ignore[arg-type]
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["m0", "m1", "m2"]
    assert grid.pulls == 4 and clock.slept == [serverapp.REPLY_POLL] * 3 and serverapp.REPLY_POLL <= 0.5


def test_a_reply_missing_at_the_timeout_is_left_out(clock: Clock) -> None:
    grid = SlowGrid([2, None])
    replies = serverapp.PromptGrid(grid).send_and_receive(["a", "b"], timeout=10)  # type: ignore[arg-type]
    assert [r.metadata.reply_to_message_id for r in replies] == ["m0"]
    assert sum(clock.slept) == pytest.approx(10) and grid.pulls == 20  # no pull past the timeout


def test_the_rest_of_the_grid_is_the_superlinks(clock: Clock) -> None:
    assert serverapp.PromptGrid(SlowGrid([])).get_node_ids() == [7, 8]  # type: ignore[arg-type]


def test_the_serverapp_runs_the_job_over_the_prompt_grid(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, clock: Clock
) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(serverapp, "run_job", lambda grid, *a, **k: seen.append(grid))
    (tmp_path / "job.json").write_text("{}")
    context = SimpleNamespace(run_config={"job-file": str(tmp_path / "job.json"), "out-dir": str(tmp_path)})
    grid = SlowGrid([1])
    serverapp.main(grid, context)  # type: ignore[arg-type]
    assert isinstance(seen[0], serverapp.PromptGrid) and seen[0]._grid is grid
