"""The derived job is timed at the CPU threads it runs with: its CPU cost model was measured on 2 threads,
and a run on 1 thread (`train --threads 1`) takes about 1.8x as long, so a job derived as if on 2 threads
ran past its time budget. Fewer threads buy fewer steps; 2 threads (or more: not credited) give the job as
it was."""

from __future__ import annotations

from dataclasses import replace

import pytest

from feta_release.errors import ConfigError
from feta_release.job_rules import (
    AUX_FIT,
    DPSGD,
    KMEANS_SECONDS_PER_CLASS,
    REFERENCE_THREADS,
    SPATIAL,
    DataFacts,
    PublicFacts,
    derive,
    estimate,
    thread_factor,
)

# jobs with every kind of term: the releases alone at eps 1 and 10, a warm-up cut to the budget, DP-SGD
FACTS = [
    DataFacts(4000, 28, 28, 1, 10, 1.0),
    DataFacts(500, 28, 28, 1, 10, 10.0),
    DataFacts(4000, 64, 64, 1, 4, 10.0),
    DataFacts(3200, 64, 64, 1, 2, 10.0, dpsgd="on"),
    DataFacts(20_000, 32, 32, 3, 10, 8.0, dpsgd="on", time_budget=3000.0),
]


@pytest.mark.parametrize("facts", FACTS)
def test_two_threads_or_more_derive_the_job_the_rules_derived_before(facts: DataFacts) -> None:
    """The constants were measured on 2 threads: there the job, its estimate and its steps are the ones
    every pinned derivation states; more threads are never credited (not measured)."""
    assert facts.threads == REFERENCE_THREADS
    base = derive(facts)
    for threads in (2, 3, 16):
        d = derive(replace(facts, threads=threads))
        assert d.cfg == base.cfg and d.estimate == base.estimate, threads


def test_one_thread_costs_each_cpu_stage_the_measured_factor() -> None:
    """The same job on 1 thread: every stage timed at a 2-thread CPU rate (training passes, DP-SGD, the aux
    fit, the sampler) costs 2 ** THREAD_EXPONENT as much; k-means (measured on 1 thread) and the fixed costs
    do not move."""
    f2 = DataFacts(3200, 64, 64, 1, 2, 10.0, dpsgd="on")
    f1 = replace(f2, threads=1)
    cfg = derive(f2).cfg
    one, two = estimate(cfg, f1).seconds, estimate(cfg, f2).seconds
    assert thread_factor(f1) == pytest.approx(1.80, abs=0.01) and thread_factor(f2) == 1.0
    for stage in (SPATIAL, AUX_FIT, DPSGD, "sampling"):
        assert one[stage] == pytest.approx(two[stage] * thread_factor(f1), abs=0.1), stage
    for stage in ("export", "signing", "privacy report"):
        assert one[stage] == two[stage], stage
    draw = two["cell prototypes"] / f2.n_classes - KMEANS_SECONDS_PER_CLASS  # the aux draw per class
    want = (draw * thread_factor(f1) + KMEANS_SECONDS_PER_CLASS) * f2.n_classes
    assert one["cell prototypes"] == pytest.approx(want, abs=0.1)


def test_fewer_threads_buy_fewer_dpsgd_steps_and_a_shorter_warm_up() -> None:
    """The budget is seconds of the user's time: on 1 thread it buys fewer DP-SGD steps (52 -> 23 at 4,000
    64 px images) and cuts the warm-up (1,000 -> 428 spatial steps), and the 1-thread estimate stays within
    the budget it was sized to (the 2-thread job, run on 1 thread, would take 1.8x its estimate)."""
    f2 = DataFacts(4000, 64, 64, 1, 2, 10.0, dpsgd="on")
    f1 = replace(f2, threads=1)
    d2, d1 = derive(f2), derive(f1)
    assert d1.cfg.dpsgd_steps(f1.size) < d2.cfg.dpsgd_steps(f2.size)
    assert d1.cfg.warmup.spatial_iterations < d2.cfg.warmup.spatial_iterations
    assert d1.estimate.training <= f1.budget * 1.01
    assert estimate(d2.cfg, f1).training > f1.budget  # the 2-thread job, timed on 1 thread, overruns


def test_public_pretraining_gets_fewer_steps_from_its_share_on_one_thread() -> None:
    """Pretraining takes at most a third of the budget: on 1 thread that third holds fewer steps."""
    public = PublicFacts(50_000, (1, 64, 64), ("a", "b"))
    f2 = DataFacts(4000, 64, 64, 1, 2, 10.0, public=public)
    p2 = derive(f2).cfg.public.pretrain_iterations
    p1 = derive(replace(f2, threads=1)).cfg.public.pretrain_iterations
    assert p1 < p2


def test_a_gpu_job_does_not_follow_the_cpu_threads() -> None:
    """A GPU's time is the GPU's: its job is the same whatever the CPU threads."""
    f = DataFacts(3200, 64, 64, 1, 2, 10.0, dpsgd="on", device="cuda")
    assert derive(replace(f, threads=1)).cfg == derive(f).cfg


def test_the_job_header_states_the_threads_it_was_derived_for() -> None:
    f = DataFacts(4000, 28, 28, 1, 10, 1.0)
    assert ", cpu, 2 threads, time budget" in derive(f).notes[0]
    one = derive(replace(f, threads=1)).notes[0]
    assert ", cpu, 1 thread (CPU stages estimated 1.80x their 2-thread time), time budget" in one


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_bad_thread_count_is_refused_in_one_line(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"^derived job: threads must be an integer >= 1, got") as exc:
        derive(replace(DataFacts(4000, 28, 28, 1, 10, 1.0), threads=bad))  # type: ignore[arg-type]
    assert "\n" not in str(exc.value)
