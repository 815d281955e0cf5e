"""bench/derived_job_table.py: the quality column shows only what is a quality claim - the plain derived job
scored on HELD-OUT images - with its seeds, ceiling, DP-SGD anchor and measured time; a validation score, a
preset's or a public-pretraining route's never fills it, and a file that is not a result is one clear line."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.bench_script import load_bench


def _bench() -> ModuleType:
    return load_bench("derived_job_table.py", "derived_job_table")


def _results(tmp_path: Path, name: str, **args: str) -> Path:
    cells = {
        "ceiling-digits-n500-seed0": {"result": {"acc": 0.99}, "seconds": 1, "rss_mib": 1},
        "dpsgd-digits-n500-eps1-seed0": {"result": {"acc": 0.2}, "seconds": 1, "rss_mib": 1},
        "release-digits-n500-eps1-seed0": {
            "result": {"acc": 0.30, "train_s": 600.0},
            "seconds": 1,
            "rss_mib": 1,
        },
        "release-digits-n500-eps1-seed1": {
            "result": {"acc": 0.40, "train_s": 720.0},
            "seconds": 1,
            "rss_mib": 1,
        },
    }
    base = {"job": "derived", "mode": "test", "public": "None", "dpsgd": "None", "threads": "1"}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"args": {**base, "n_synthetic": "10000", **args}, "cells": cells}))
    return path


def _digits_row(table: str, n: str, eps: str) -> str:
    (line,) = [
        r for r in table.splitlines() if r.startswith(f"| digits 28x28 grey, 10 classes | {n} | {eps} |")
    ]
    return line


def test_held_out_derived_cells_fill_the_quality_column(tmp_path: Path) -> None:
    bench = _bench()
    table = bench.table(bench.load_results([_results(tmp_path, "held-out")]))
    row = _digits_row(table, "500", "1")
    assert "**0.350 ± 0.071** (2 seeds)" in row
    assert "ceiling 0.990" in row and "DP-SGD CNN 0.200" in row
    assert "train + 10,000 samples 11 min at 1 thread(s)" in row
    assert _digits_row(table, "500", "10").endswith(f"| {bench.NOT_MEASURED} |")


@pytest.mark.parametrize(
    "args",
    [{"mode": "validation"}, {"job": "preset:cpu-eps1"}, {"public": "strokes:10000"}, {"dpsgd": "on"}],
    ids=["validation-score", "preset-job", "public-route", "dpsgd-override"],
)
def test_no_tuning_score_or_other_route_is_shown_as_the_derived_jobs_quality(
    tmp_path: Path, args: dict[str, str]
) -> None:
    bench = _bench()
    table = bench.table(bench.load_results([_results(tmp_path, "other", **args)]))
    assert _digits_row(table, "500", "1").endswith(f"| {bench.NOT_MEASURED} |")


def test_a_file_that_is_not_a_result_is_one_line_naming_it(tmp_path: Path) -> None:
    bench = _bench()
    bad = tmp_path / "notes.json"
    bad.write_text("[1, 2]")
    with pytest.raises(SystemExit) as exc:
        bench.load_results([bad])
    assert str(exc.value).startswith(f"error: {bad}: not a bench/generality.py result file")
