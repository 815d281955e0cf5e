"""bench/generality.py: the pipeline cell runs the job asked for at the row's ε (a preset or a job file
rewritten with the row's ε, δ and seed; the derived job by --epsilon), the plan has one cell per method, kind,
size, ε and seed (the ceiling once per ε pair, no digits beyond the 5,000 shipped), and the table shows every
row."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from feta_release.config import load_job, load_preset
from tests.support.bench_script import load_bench

ROOT = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    return load_bench("generality.py", "generality")


@pytest.mark.parametrize("preset", ["tiny", "cpu-eps1", "cpu-eps10", "xray64-eps10"])
def test_a_preset_job_is_written_with_the_rows_epsilon_delta_and_seed(tmp_path: Path, preset: str) -> None:
    bench = _bench()
    (path,) = bench.job_args(f"preset:{preset}", 3.0, 2e-6, 7, tmp_path, derived=False)
    cfg = load_job(path)
    assert (cfg.privacy.epsilon, cfg.privacy.delta, cfg.job.seed) == (3.0, 2e-6, 7)
    want = load_preset(preset).replace(privacy={"epsilon": 3.0, "delta": 2e-6}, job={"seed": 7})
    assert cfg.to_dict() == want.to_dict()  # every other setting of the preset kept


def test_job_choice_derived_preset_template_and_auto(tmp_path: Path) -> None:
    bench = _bench()
    assert bench.job_args("derived", 1.0, 1e-5, 0, tmp_path, derived=False) == ["--epsilon", "1"]
    assert bench.job_args("auto", 10.0, 1e-5, 0, tmp_path, derived=True) == ["--epsilon", "10"]
    (auto1,) = bench.job_args("auto", 1.0, 1e-5, 0, tmp_path, derived=False)
    assert load_job(auto1).job.name == "cpu-eps1"
    (templ,) = bench.job_args("preset:cpu-eps{eps}", 10.0, 1e-5, 0, tmp_path, derived=False)
    assert load_job(templ).job.name == "cpu-eps10" and load_job(templ).privacy.epsilon == 10.0


def test_the_plan_has_every_cell_once_and_no_digits_beyond_the_shipped_set(tmp_path: Path) -> None:
    bench = _bench()
    args = bench.parse_args(
        ["--sizes", "500,20000", "--seeds", "0,1", "--job", "derived", "--work", str(tmp_path)]
    )
    cells = bench.plan_cells(args, derived=False)
    names = [bench._cell_name(c) for c in cells]
    assert len(names) == len(set(names))
    # per (kind, size): ceiling x seeds + (dpsgd + release) x eps x seeds; digits only at 500
    assert len(cells) == 5 * (2 + 2 * 2 * 2)
    assert not any(c["kind"] == "digits" and c["size"] == 20000 for c in cells)
    assert all(c["delta"] == 1e-5 and c["mode"] == "test" for c in cells)
    md = bench.table({}, args)
    assert md.count("\n| ") == 1 + 3 * 2 * 2  # header + kinds x sizes x eps rows
    assert "| digits | 20,000 | 1 | n/a" in md


def test_the_table_aggregates_seeds_and_names_failed_cells() -> None:
    bench = _bench()
    args = bench.parse_args(["--kinds", "medical", "--sizes", "500", "--eps", "1", "--seeds", "0,1"])
    cell = {"seconds": 10.0, "rss_mib": 300}
    results = {
        "ceiling-medical-n500-seed0": {**cell, "result": {"acc": 0.9}},
        "ceiling-medical-n500-seed1": {**cell, "result": {"acc": 0.8}},
        "dpsgd-medical-n500-eps1-seed0": {**cell, "rss_mib": 700, "result": {"acc": 0.5, "epsilon": 0.99}},
        "release-medical-n500-eps1-seed0": {**cell, "result": {"error": "DataError: no images"}},
    }
    md = bench.table(results, args)
    row = next(ln for ln in md.splitlines() if ln.startswith("| medical"))
    assert "0.850 ± 0.071 (2)" in row and "0.500 ± 0.000 (1)" in row
    assert "30 s" in row and "700 MiB" in row
    assert "release-medical-n500-eps1-seed0: DataError: no images" in md


def test_priority_runs_the_listed_rows_first_with_their_ceiling_and_seeds_in_order(tmp_path: Path) -> None:
    bench = _bench()
    args = bench.parse_args(
        [
            "--sizes",
            "4000",
            "--seeds",
            "0,1",
            "--methods",
            "ceiling,release",
            "--job",
            "derived",
            "--work",
            str(tmp_path),
            "--priority",
            "medical:10,digits:1",
        ]
    )
    names = [bench._cell_name(c) for c in bench.plan_cells(args, derived=False)]
    assert names[:8] == [
        "ceiling-medical-n4000-seed0",
        "ceiling-medical-n4000-seed1",
        "release-medical-n4000-eps10-seed0",
        "release-medical-n4000-eps10-seed1",
        "ceiling-digits-n4000-seed0",
        "ceiling-digits-n4000-seed1",
        "release-digits-n4000-eps1-seed0",
        "release-digits-n4000-eps1-seed1",
    ]
    unlisted = bench.parse_args(
        [
            "--sizes",
            "4000",
            "--seeds",
            "0,1",
            "--methods",
            "ceiling,release",
            "--job",
            "derived",
            "--work",
            str(tmp_path),
        ]
    )
    assert sorted(names) == sorted(bench._cell_name(c) for c in bench.plan_cells(unlisted, derived=False))


def test_the_per_class_lines_put_the_release_beside_the_ceiling() -> None:
    bench = _bench()
    args = bench.parse_args(["--kinds", "medical", "--sizes", "500", "--eps", "10", "--seeds", "0,1"])
    cell = {"seconds": 10.0, "rss_mib": 300}
    results = {
        "ceiling-medical-n500-seed0": {
            **cell,
            "result": {"acc": 0.9, "per_class": {"normal": 0.9, "finding": 0.8}},
        },
        "release-medical-n500-eps10-seed0": {
            **cell,
            "result": {"acc": 0.6, "per_class": {"normal": 0.9, "finding": 0.2}},
        },
        "release-medical-n500-eps10-seed1": {
            **cell,
            "result": {"acc": 0.6, "per_class": {"normal": 0.7, "finding": 0.4}},
        },
    }
    assert "- medical, 500, ε = 10: normal 0.80 (0.90), finding 0.30 (0.80)" in bench.table(results, args)


def test_cells_keep_the_callers_python_path_after_the_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _bench()
    monkeypatch.setenv("PYTHONPATH", "/opt/wheels")
    assert bench.child_env()["PYTHONPATH"].split(":") == [str(ROOT), "/opt/wheels"]


def test_a_route_names_its_cells_apart_and_the_table_shows_only_its_own(tmp_path: Path) -> None:
    bench = _bench()
    argv = ["--kinds", "digits", "--sizes", "500", "--eps", "1", "--seeds", "0", "--methods", "release"]
    plain = bench.parse_args([*argv, "--job", "derived", "--work", str(tmp_path)])
    routed = bench.parse_args(
        [*argv, "--job", "derived", "--work", str(tmp_path), "--public", "strokes:50", "--dpsgd", "on"]
    )
    (p,) = bench.plan_cells(plain, derived=False)
    (r,) = bench.plan_cells(routed, derived=False)
    assert bench._cell_name(p) == "release-digits-n500-eps1-seed0"
    assert bench._cell_name(r) == "release-digits-n500-eps1-public-strokes50-dpsgd-on-seed0"
    cell = {"seconds": 10.0, "rss_mib": 300}
    results = {
        bench._cell_name(p): {**cell, "result": {"acc": 0.25, "epsilon": 1.0}},
        bench._cell_name(r): {**cell, "result": {"acc": 0.75, "epsilon": 1.0}},
    }
    plain_row = next(ln for ln in bench.table(results, plain).splitlines() if ln.startswith("| digits"))
    routed_md = bench.table(results, routed)
    routed_row = next(ln for ln in routed_md.splitlines() if ln.startswith("| digits"))
    assert "0.250 ± 0.000 (1)" in plain_row and "0.750" not in plain_row
    assert "0.750 ± 0.000 (1)" in routed_row and "0.250" not in routed_row
    assert "public pretraining on strokes:50" in routed_md and "train --dpsgd on" in routed_md


def test_a_routes_public_set_is_generated_once_at_the_datas_side_and_named(tmp_path: Path) -> None:
    import numpy as np

    from feta_release.data import ImageDataset, load_dataset

    bench = _bench()
    train = ImageDataset(np.zeros((4, 1, 28, 28), np.float32), np.arange(4) % 2, ("a", "b"), source="t")
    cell = {"work": str(tmp_path), "public": "strokes:40", "dpsgd": "on"}
    args = bench._route_args(cell, train)
    assert args[:2] == ["--dpsgd", "on"] and args[2] == "--public"
    public, _ = load_dataset(args[3])
    assert public.n == 40 and public.image_shape == (1, 28, 28)
    stamp = Path(args[3]).stat().st_mtime_ns
    assert bench._route_args(cell, train)[3] == args[3] and Path(args[3]).stat().st_mtime_ns == stamp
    assert bench._route_args({"work": str(tmp_path)}, train) == []


def _resample() -> ModuleType:
    return load_bench("resample.py", "resample")


def test_resample_reads_each_sampler_setting_as_json_or_a_word() -> None:
    parse_setting = _resample().parse_setting

    assert parse_setting("guidance=1.5") == {"guidance": 1.5}
    assert parse_setting("start_sigma=null") == {"start_sigma": None}
    assert parse_setting("start_source=mix") == {"start_source": "mix"}
    assert parse_setting("start_source=mix,start_sigma=0.7") == {"start_source": "mix", "start_sigma": 0.7}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        parse_setting("guidance")


def test_resample_builds_a_missing_aux_pool_without_writing_into_the_release(tmp_path: Path) -> None:
    """A run that shipped no aux pool, redrawn from one: the pool is rebuilt from the run's one frequency
    release and handed over, and ``released/`` (which a later release build reads) is left as it was; two
    frequency releases are refused in one line naming them."""
    import numpy as np

    from feta_release.release.jobdir import synthetic_set
    from tests.support.training import embedded_subset, train_run

    resample = _resample()
    run = tmp_path / "r"
    cfg = load_preset("tiny").replace(sampler={"start_sigma": 0.5}, dpsgd={"steps": 0})
    train_run(cfg, embedded_subset(), run, n_synthetic=10, public_size=240, release=False)
    before = {p: p.read_bytes() for p in (run / "released").rglob("*") if p.is_file()}
    setting = {"start_sigma": 0.5, "start_source": "aux"}
    assert resample.aux_pool_for(run, {"guidance": 2.0}) is None  # no pool needed
    images, labels = resample.aux_pool_for(run, setting)
    assert images.dtype == np.float32 and len(images) == len(labels) and images.shape[1:] == (1, 28, 28)
    assert 0 <= images.min() and images.max() <= 1 and set(labels.tolist()) == set(range(10))
    with np.load(synthetic_set(run, 10, 0, sampler=setting, name="aux.npz", aux=(images, labels))) as z:
        assert z["images"].shape == (10, 1, 28, 28)
    assert {p: p.read_bytes() for p in (run / "released").rglob("*") if p.is_file()} == before
    (run / "state" / "frequency_site.npz").rename(run / "state" / "frequency_other.npz")
    assert resample.aux_pool_for(run, setting)[0].shape == images.shape  # found by its pattern, any site
    (run / "state" / "frequency_b.npz").write_bytes((run / "state" / "frequency_other.npz").read_bytes())
    with pytest.raises(SystemExit, match="2 frequency releases"):
        resample.aux_pool_for(run, setting)
