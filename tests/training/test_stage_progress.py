"""Every long stage of a ``train`` run reports its progress in ``progress.jsonl`` (units done of all, the
rate, the seconds left, its end with its seconds), the synthetic set and the release included; and the time
estimate has a term for every stage the run reports."""

from __future__ import annotations

import json
from typing import Any

import pytest

from feta_release.config import JobConfig, load_preset
from feta_release.job_rules import DataFacts, estimate
from feta_release.progress_events import (
    AUX_FIT,
    AUX_IMAGES,
    EXPORT,
    FINISHING,
    FREQUENCY_WARMUP,
    POLISH,
    PROTOTYPES,
    REPORT,
    SAMPLE_GRID,
    SAMPLING,
    SIGNING,
    SPATIAL,
    timed,
)
from tests.support.training import embedded_subset, train_run

N, SYNTHETIC = 240, 12


@pytest.fixture(scope="module")
def run(tmp_path_factory: Any) -> tuple[JobConfig, list[dict[str, Any]]]:
    # aux cells: the aux fit runs before the central request and the cell prototypes after it
    cfg = load_preset("tiny").replace(
        central={"cells": 2, "cell_rule": "aux"}, warmup={"polish_iterations": 2}
    )
    out = tmp_path_factory.mktemp("run") / "r"
    train_run(cfg, embedded_subset(N), out, n_synthetic=SYNTHETIC, public_size=N)
    lines = (out / "progress.jsonl").read_text("utf-8").splitlines()
    return cfg, [json.loads(line) for line in lines]


def _stage(events: list[dict[str, Any]], stage: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("stage") == stage]


def _counted(events: list[dict[str, Any]], stage: str, total: int) -> None:
    """``stage`` reported its start (0 of ``total``), its units as they were done, with a rate and the seconds
    left, and its end with its seconds."""
    got = _stage(events, stage)
    assert got, f"no {stage} event"
    assert (got[0]["done"], got[0]["total"]) == (0, total)
    ticks = got[1:-1]
    assert ticks and [e["done"] for e in ticks] == sorted(e["done"] for e in ticks)
    assert ticks[-1]["done"] == total and all(e["rate"] > 0 and e["eta_s"] >= 0 for e in ticks)
    assert got[-1]["seconds"] >= 0 and "done in" in got[-1]["message"]
    assert all(e["phase"] and e["t"] for e in got)


def test_a_train_run_logs_the_aux_generator_fit_step_by_step(run: Any) -> None:
    cfg, events = run
    a = cfg.auxgen
    _counted(events, AUX_FIT, a.restarts * a.epochs * a.iterations_per_epoch)


def test_a_train_run_logs_the_synthetic_set_image_by_image(run: Any) -> None:
    _, events = run
    _counted(events, SAMPLING, SYNTHETIC)
    assert _stage(events, SAMPLING)[0]["phase"] == "release"


def test_a_train_run_logs_the_prototypes_the_warm_ups_and_the_release(run: Any) -> None:
    cfg, events = run
    _counted(events, PROTOTYPES, 10)
    _counted(events, SPATIAL, cfg.warmup.spatial_iterations)
    _counted(events, POLISH, 2)
    assert _stage(events, AUX_IMAGES) and _stage(events, FREQUENCY_WARMUP)
    for stage in (
        REPORT,
        SAMPLE_GRID,
        EXPORT,
        SIGNING,
    ):  # one call each: its start and its end with its seconds
        got = _stage(events, stage)
        assert got and got[-1]["seconds"] >= 0 and got[-1]["phase"] == "release", stage


def test_the_estimate_has_a_term_for_every_stage_the_run_reports(run: Any) -> None:
    cfg, events = run
    reported = {e["stage"] for e in events if "stage" in e}
    facts = DataFacts(size=N, height=28, width=28, channels=1, n_classes=10, epsilon=10.0)
    terms = estimate(cfg, facts, SYNTHETIC).seconds
    assert reported >= {AUX_FIT, PROTOTYPES, SAMPLING, EXPORT, SIGNING, REPORT, SAMPLE_GRID}
    assert reported <= set(terms), reported - set(terms)


def test_each_release_stage_ends_under_its_own_name(run: Any) -> None:
    # the console and progress.jsonl say which stage finished: no two stages end with the same words
    _, events = run
    ends = [
        e["message"]
        for e in events
        if e.get("stage") in FINISHING and "seconds" in e and "done in" in e["message"]
    ]
    assert len(ends) == len(set(m.split(" done in")[0] for m in ends)), ends
    assert any(m.startswith(f"{REPORT} done in") for m in ends) and any(
        m.startswith(f"{SAMPLE_GRID} done in") for m in ends
    ), ends
    assert REPORT != SAMPLE_GRID and len(set(FINISHING)) == len(FINISHING)


class _StageBroke(RuntimeError):
    pass


def test_a_one_call_stage_that_raises_logs_its_end_as_failed_and_raises() -> None:
    events: list[dict[str, Any]] = []
    with pytest.raises(_StageBroke), timed(events.append, EXPORT, "the generator to ONNX"):
        raise _StageBroke("tracer refused the graph")
    start, end = events
    assert start["stage"] == end["stage"] == EXPORT
    assert end["failed"] == "_StageBroke" and end["seconds"] >= 0
    assert end["message"].startswith(f"{EXPORT} failed after") and "_StageBroke" in end["message"]
    assert "done" not in end["message"]


def test_a_one_call_stage_that_returns_logs_its_end_as_done() -> None:
    events: list[dict[str, Any]] = []
    with timed(events.append, SIGNING, "the manifest"):
        pass
    assert [e.get("failed") for e in events] == [None, None]
    assert events[-1]["message"].startswith(f"{SIGNING} done in") and events[-1]["seconds"] >= 0
