"""`flwr run --stream` returns when the SuperLink's log stream breaks, not only when the run ends: the
coordinator must keep following the run (seen in a fresh-machine demo on a loaded 2-core machine, where the
SuperLink's SQLite state was locked and the demo stopped a healthy job in DP-SGD round 2)."""

from __future__ import annotations

import json
from pathlib import Path

from coordinator.superlink import _Lines, follow_run


def _statuses(seq: list[str]):  # noqa: ANN202
    calls = iter(seq)
    return lambda home, run_id: next(calls)


def test_a_run_still_running_after_the_stream_broke_is_followed_to_its_end() -> None:
    got: list[str] = []
    lines = _Lines(got.append)
    for line in ["Successfully started run 42", "[feta] round 1/4", "[feta] round 2/4"]:
        lines(line)
    replayed: list[list[str]] = []

    def reattach(run_id: int, home: Path, on_line) -> int:  # noqa: ANN001
        assert run_id == 42
        replayed.append([])
        # `flwr log --stream` replays the log from the start, then the new lines
        for line in [
            "Successfully started run 42",
            "[feta] round 1/4",
            "[feta] round 2/4",
            "[feta] round 3/4",
            "[feta] round 4/4",
        ]:
            on_line(line)
        return 0

    st = follow_run(
        42, Path("."), lines, poll=0, status=_statuses(["running", "finished:completed"]), reattach=reattach
    )
    assert st == "finished:completed"
    assert len(replayed) == 1
    assert got == [
        "Successfully started run 42",
        "[feta] round 1/4",
        "[feta] round 2/4",
        "[feta] round 3/4",
        "[feta] round 4/4",
    ]  # each line once, nothing lost
    assert lines.run_id == 42


def test_a_finished_run_returns_at_once_without_reattaching() -> None:
    def reattach(*a) -> int:  # noqa: ANN002
        raise AssertionError("must not re-attach to a finished run")

    assert (
        follow_run(
            7, Path("."), _Lines(None), poll=0, status=_statuses(["finished:failed"]), reattach=reattach
        )
        == "finished:failed"
    )


def test_an_unreachable_superlink_is_given_up_on() -> None:
    assert (
        follow_run(7, Path("."), _Lines(None), poll=0, give_up_after=0.0, status=lambda home, rid: "") == ""
    )


def test_the_run_id_is_read_from_flwr_runs_output() -> None:
    lines = _Lines(None)
    lines("Loading project configuration...")
    lines("Successfully started run 13283085410562176071")
    lines("Successfully started run 1")  # a later line never replaces the first
    assert lines.run_id == 13283085410562176071


def test_a_job_that_did_not_finish_says_what_to_do(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    import pytest

    import coordinator.runner as runner
    from feta_release.config import load_preset
    from feta_release.errors import FetaError

    monkeypatch.setattr(runner, "submit", lambda *a, **k: 0)  # exit 0, no job summary: the job did not finish
    signed = tmp_path / "signed_job.json"
    signed.write_text(json.dumps({"job": {"config": load_preset("tiny").to_dict()}}), "utf-8")  # as signed
    with pytest.raises(FetaError, match="run the same command again to resume"):
        runner.run_signed_job(signed, tmp_path / "k", tmp_path, "127.0.0.1:1", insecure=True)
    with pytest.raises(FetaError, match="run the demo again with a new --out"):
        runner.run_signed_job(
            signed,
            tmp_path / "k",
            tmp_path,
            "127.0.0.1:1",
            insecure=True,
            retry_hint="run the demo again with a new --out",
        )
