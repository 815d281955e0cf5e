"""bench/bench_federated_vs_pooled.py: the federated arm runs the preset's job (rates, cells, no DP-SGD), and
the script's --quick mode runs both arms end to end and writes its table."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from feta_release.config import load_preset
from tests.support.bench_script import load_bench


def _bench() -> ModuleType:
    return load_bench("bench_federated_vs_pooled.py", "bench_fedpool")


def test_the_federated_arm_runs_the_same_job_as_the_pooled_arm() -> None:
    bench = _bench()
    preset = load_preset("cpu-eps1-nodpsgd")
    fed = bench.federated_config(preset, 1300, 2, True, 3)
    assert fed.federation.secure_aggregation and fed.federated_rounds == 0 and fed.job.seed == 2
    assert fed.central.batch == 1300 and fed.central.cells == 2  # q = 1 at every site, as the pooled run's
    same = ("privacy", "frequency", "model", "warmup", "auxgen", "sampler")
    assert {k: v for k, v in fed.to_dict().items() if k in same} == {
        k: v for k, v in preset.to_dict().items() if k in same
    }
    assert not bench.federated_config(preset, 1300, 0, False, 3).federation.secure_aggregation


def test_quick_mode_runs_both_arms_with_both_samplers_and_writes_the_table(tmp_path: Path) -> None:
    out = tmp_path / "fedpool-quick.json"
    doc = _bench().main(["--quick", "--out", str(out), "--runs", str(tmp_path / "runs"), "--threads", "1"])
    saved = json.loads(out.read_text())
    assert saved["table"] == doc["table"] and "pooled (1 site)" in doc["table"]
    for arm, rows in saved["rows"].items():
        assert [r["seed"] for r in rows] == [0], arm
        assert 0 < rows[0]["epsilon"] <= 1.0
        assert all(0 <= rows[0][k] <= 1 for k in ("acc_noise", "acc_sdedit", "release_only")), arm
    fed = saved["rows"]["federated (3 sites, secure aggregation)"][0]
    # secure: both figures attested
    assert all(w > fed["epsilon"] for w in fed["worst_case_epsilon"].values())
    # both arms' SDEdit sets: their job directory's synthetic.npz (train's own for the pooled arm), drawn by
    # the one code (release.jobdir.synthetic_set) from the arm's released central images
    for job in (tmp_path / "runs" / "pooled" / "seed0", tmp_path / "runs" / "federated" / "seed0" / "job"):
        with np.load(job / "synthetic.npz") as z:
            assert len(z["labels"]) == 200 and np.isfinite(z["images"]).all(), job


# one seed's row of a stream's table (its fields as the bench writes them)
ROW = {
    "seed": 0,
    "acc_noise": 0.5,
    "fd_noise": 10.0,
    "acc_sdedit": 0.6,
    "fd_sdedit": 9.0,
    "release_only": 0.4,
    "epsilon": 0.99,
    "seconds": 60.0,
    "load": {"start": 1.0, "end": 2.0},
}


def test_parallel_streams_merge_into_one_table(tmp_path: Path) -> None:
    bench = _bench()
    row = dict(ROW)
    base = {"preset": "p", "protocol": {"seeds": [0, 1]}}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(
        json.dumps({**base, "rows": {"pooled (1 site)": [row, {**row, "seed": 1, "acc_sdedit": 0.8}]}})
    )
    fed = {**row, "worst_case_epsilon": {"site-a": 1.8}}
    b.write_text(json.dumps({**base, "rows": {"federated": [fed]}}))
    doc = bench.merge([str(a), str(b)], tmp_path / "m.json")
    assert [r["seed"] for r in doc["rows"]["pooled (1 site)"]] == [0, 1] and len(
        doc["rows"]["federated"]
    ) == 1
    assert "0.700 ± 0.141" in doc["table"] and "0.990 (1.800)" in doc["table"]
    b.write_text(json.dumps({**base, "preset": "q", "rows": {}}))
    with pytest.raises(SystemExit):
        bench.merge([str(a), str(b)], tmp_path / "m.json")


def test_a_stream_that_ran_another_seed_merges_into_the_earlier_table(tmp_path: Path) -> None:
    """A later stream (``--seeds 2``) of the same protocol adds its rows: seeds are the union, rows in seed
    order; a different protocol (other than its seed list) is still refused."""
    bench = _bench()
    row = dict(ROW)
    proto = {"n_synthetic": 10, "seeds": [0, 1, 2]}
    early, late = tmp_path / "early.json", tmp_path / "late.json"
    early.write_text(
        json.dumps({"preset": "p", "protocol": proto, "rows": {"pooled": [{**row, "seed": 1}, row]}})
    )
    late.write_text(
        json.dumps(
            {
                "preset": "p",
                "protocol": {**proto, "seeds": [2]},
                "rows": {"pooled": [{**row, "seed": 2, "acc_sdedit": 0.9}]},
            }
        )
    )
    doc = bench.merge([str(late), str(early)], tmp_path / "m.json")
    assert [r["seed"] for r in doc["rows"]["pooled"]] == [0, 1, 2] and doc["protocol"]["seeds"] == [0, 1, 2]
    assert "| **pooled, mean ± std** | 0,1,2 |" in doc["table"] and "0.700 ± 0.173" in doc["table"]
    late.write_text(json.dumps({"preset": "p", "protocol": {**proto, "n_synthetic": 20}, "rows": {}}))
    with pytest.raises(SystemExit):
        bench.merge([str(late), str(early)], tmp_path / "m.json")
