"""bench/finding_sweep.py: every route's row runs the job `train --epsilon [--public] [--dpsgd on]` derives
(with the row's seed), the plan holds the ceiling once per seed and every route x epsilon x seed, and the
table puts the finding class beside its real-data ceiling."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from feta_release.cli.derive_options import DeriveRequest, derived_jobs
from feta_release.config import load_job
from feta_release.data.procedural import generate_dataset
from tests.support.bench_script import load_bench

ROOT = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    return load_bench("finding_sweep.py", "finding_sweep")


def test_each_route_runs_the_job_the_command_line_derives_with_the_rows_seed(tmp_path: Path) -> None:
    bench = _bench()
    train, public = (
        generate_dataset("medical", 300, size=28, seed=1),
        generate_dataset("medical", 200, size=28, seed=7, population="B"),
    )
    for route, dpsgd, pub in (
        ("scratch", None, None),
        ("public", None, public),
        ("public-dpsgd", "on", public),
    ):
        task = {"route": route, "eps": 10.0, "seed": 3, "time_budget": "900", "device": "cpu", "set": {}}
        bench.derived_job_file(task, train, public, tmp_path / f"{route}.toml")
        got = load_job(tmp_path / f"{route}.toml")
        want, _ = derived_jobs(
            DeriveRequest(10.0, None, "900", None, dpsgd),
            train,
            "cpu",
            train.n,
            None,
            None,
            lambda _: None,
            public=pub,
        )
        assert got == want.replace(job={"seed": 3})
    assert load_job(tmp_path / "public-dpsgd.toml").dpsgd_steps(train.n) > 0
    assert load_job(tmp_path / "public.toml").dpsgd_steps(train.n) == 0
    assert (
        load_job(tmp_path / "scratch.toml").public.pretrain_iterations == 2000
    )  # the [public] default: unused


def test_the_plan_has_one_ceiling_per_seed_and_every_route_epsilon_and_seed(tmp_path: Path) -> None:
    bench = _bench()
    args = bench.parse_args(["--seeds", "0,1", "--eps", "1,10", "--out", str(tmp_path / "r.jsonl")])
    tasks = bench.plan_tasks(args, {"train": "t", "eval": "e", "public": "p"}, 3200)
    assert [t["route"] for t in tasks[:2]] == ["ceiling", "ceiling"]
    rows = {(t["route"], t["eps"], t["seed"]) for t in tasks[2:]}
    assert rows == {(r, e, s) for r in bench.ROUTES for e in (1.0, 10.0) for s in (0, 1)}
    assert len({t["name"] for t in tasks}) == len(tasks)


def test_the_table_divides_the_finding_accuracy_by_the_same_seeds_ceiling() -> None:
    bench = _bench()
    pc = {"normal": 0.5, "finding": 0.4, "effusion": 0.9, "opacity": 0.8}
    rows = [
        {"route": "ceiling", "eps": None, "seed": 0, "accuracy": 0.7, "per_class": {**pc, "finding": 0.8}},
        {
            "route": "public",
            "eps": 10.0,
            "seed": 0,
            "accuracy": 0.6,
            "per_class": pc,
            "recall": 0.3,
            "coverage": 0.2,
            "precision": 0.5,
            "train_s": 10.0,
            "peak_rss_mib": 100,
            "gpu_peak_mib": 0,
        },
        {"route": "public", "eps": 10.0, "seed": 1, "error": "stopped"},
    ]
    text = bench.table(rows)
    line = next(ln for ln in text.splitlines() if ln.startswith("| public |"))
    assert "| 0.400 | 0.500 |" in line and "| 1 |" in line  # finding 0.4, 0.4 / 0.8 of its ceiling, one seed


def test_a_noise_start_route_is_its_route_with_the_sampler_from_pure_noise(tmp_path: Path) -> None:
    bench = _bench()
    train, public = (
        generate_dataset("medical", 300, size=28, seed=1),
        generate_dataset("medical", 200, size=28, seed=7, population="B"),
    )
    jobs = {}
    for route in ("public", "public-noise-start"):
        task = {"route": route, "eps": 10.0, "seed": 0, "time_budget": "900", "device": "cpu", "set": {}}
        bench.derived_job_file(task, train, public, tmp_path / f"{route}.toml")
        jobs[route] = load_job(tmp_path / f"{route}.toml")
    assert (
        jobs["public"].sampler.start_sigma is not None
        and jobs["public-noise-start"].sampler.start_sigma is None
    )
    assert (
        jobs["public"].replace(sampler={"start_sigma": None, "start_source": "central"})
        == jobs["public-noise-start"]
    )


def test_the_nocentral_routes_drop_only_the_training_on_central_images(tmp_path: Path) -> None:
    bench = _bench()
    train, public = (
        generate_dataset("medical", 300, size=28, seed=1),
        generate_dataset("medical", 200, size=28, seed=7, population="B"),
    )
    for route in ("public-dpsgd", "public-dpsgd-nocentral"):
        task = {"route": route, "eps": 10.0, "seed": 0, "time_budget": "900", "device": "cpu", "set": {}}
        bench.derived_job_file(task, train, public, tmp_path / f"{route}.toml")
    base, edit = (load_job(tmp_path / f"{r}.toml") for r in ("public-dpsgd", "public-dpsgd-nocentral"))
    assert edit.dpsgd_steps(train.n) > 0 and edit.public.pretrain_iterations > 0
    assert edit == base.replace(
        warmup={"spatial_iterations": 0, "polish_iterations": 0, "frequency_mix_central": False}
    )


def test_rows_run_with_this_tree_first_and_the_callers_path_kept(monkeypatch) -> None:  # noqa: ANN001
    """A row's child process finds this checkout first and then the caller's path (wheels installed beside a
    machine's own packages): replacing the path left every row of a GPU machine without its carried wheels."""
    bench = _bench()
    seen: dict = {}

    class _Proc:
        def __init__(self, *args, env=None, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
            seen.update(env)

        def wait(self, timeout=None) -> int:  # noqa: ANN001
            return 1

    monkeypatch.setenv("PYTHONPATH", "/opt/wheels")
    monkeypatch.setattr(bench.subprocess, "Popen", _Proc)
    task = {k: "x" for k in ("route", "eps", "seed", "mode", "device", "settings", "name")}
    bench.spawn(task, deadline=float("inf"))
    assert seen["PYTHONPATH"].split(":") == [str(ROOT), "/opt/wheels"]
