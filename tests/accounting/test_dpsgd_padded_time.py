"""The derived job's time model charges each DP-SGD step the rows a site's node really processes.

Every DP-SGD step is padded to the PUBLIC bound on its Poisson batch (``training.padding``: constant work, so
the step's time does not count the sample), so a step costs the padded row count, not the expected batch
q·N (the ``tiny`` preset: 40 rows against 16). A cost model charging q·N printed an optimistic estimate and
derived more steps than the time budget holds. Here the padded count is recomputed from the node's own
bound (``step_bound`` over ``public_rows``, as ``edge.releases`` pads a round)."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import feta_release.training.dpsgd as dp
from feta_release.accounting import PrivacyEvent
from feta_release.config import JobConfig
from feta_release.errors import ConfigError
from feta_release.job_rules import (
    CUDA_CALL_SECONDS,
    CUDA_DPSGD_SECONDS_PER_VALUE,
    DPSGD_OVERHEAD,
    GRID_PER_CLASS,
    SECONDS_PER_PIXEL_PASS,
    DataFacts,
    Derivation,
    PatientFacts,
    _dpsgd_batch,
    derive,
    dpsgd_step_rows,
    estimate,
    sampling_seconds,
    seconds_per_pass,
)
from feta_release.planning import stage_sampling_rate
from feta_release.privacy_unit import PatientIndex
from feta_release.training.padding import public_rows, site_step_rows, step_bound
from tests.support.dpsgd import random_site
from tests.support.federation import tiny_job

# an Estimate keeps each stage to 0.1 s: half of it, plus float error (418.05 rounds to 418.1)
ROUNDING = 0.05 + 1e-9


def padded_rows(cfg: JobConfig, n: int) -> int:
    """The rows the node pads every step to on a site of public size ``n`` (``edge.releases``'s bound)."""
    sized = cfg.for_size(n)
    q = stage_sampling_rate(sized.dpsgd.batch, n, "dpsgd")
    return step_bound(public_rows(n, n), q, sized.dpsgd.physical_batch)


def step_seconds(cfg: JobConfig, f: DataFacts, rows: int) -> float:
    """A DP-SGD step of ``rows`` padded rows: a per-example pass of each on the CPU; on a GPU a per-row cost
    (the H100's, per image value and model width) and a fixed cost per call of ``physical_batch`` rows."""
    if f.device != "cuda":
        return seconds_per_pass(cfg, f) * DPSGD_OVERHEAD * rows
    values_width = seconds_per_pass(cfg, replace(f, device="cpu")) / SECONDS_PER_PIXEL_PASS
    calls = -(-rows // cfg.dpsgd.physical_batch)
    return calls * CUDA_CALL_SECONDS + rows * CUDA_DPSGD_SECONDS_PER_VALUE * values_width


def padded_step_seconds(cfg: JobConfig, f: DataFacts) -> float:
    return step_seconds(cfg, f, padded_rows(cfg, f.size))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(50, 200_000),
    batch_share=st.floats(0.001, 1.0),
    physical=st.integers(1, 64),
    steps=st.integers(1, 5000),
    side=st.sampled_from([28, 32, 64]),
    channels=st.sampled_from([1, 3]),
    device=st.sampled_from(["cpu", "cuda"]),
)
def test_a_dpsgd_job_is_estimated_at_its_padded_rows_per_step(
    n: int, batch_share: float, physical: int, steps: int, side: int, channels: int, device: Any
) -> None:
    """The estimate of a DP-SGD job = the same job without DP-SGD + the padded step's cost x steps (per row;
    on a GPU also per call of ``physical_batch`` rows) + the sample grid ``train`` draws after the rounds."""
    batch = max(1, round(batch_share * n))
    cfg = JobConfig().replace(dpsgd={"batch": batch, "steps": steps, "physical_batch": physical})
    f = DataFacts(
        size=n, height=side, width=side, channels=channels, n_classes=10, epsilon=1.0, device=device
    )
    rows = padded_rows(cfg, n)
    assert rows >= batch  # the bound covers the expected batch, and more
    assert dpsgd_step_rows(cfg, f) == rows
    est, rest = estimate(cfg, f), estimate(cfg.replace(dpsgd={"steps": 0}), f)
    want = step_seconds(cfg, f, rows) * steps
    assert est.seconds["dpsgd"] == pytest.approx(want, abs=ROUNDING)
    grid = sampling_seconds(cfg, f, GRID_PER_CLASS * f.n_classes)
    assert est.total == pytest.approx(rest.total + want + grid, abs=ROUNDING * len(est.seconds))


derived_facts = st.builds(
    lambda n, side, channels, classes, eps, budget, device: DataFacts(
        n, side, side, channels, classes, eps, device=device, time_budget=budget, dpsgd="on"
    ),
    n=st.integers(300, 100_000),
    side=st.sampled_from([28, 32]),
    channels=st.sampled_from([1, 3]),
    classes=st.integers(2, 10),
    eps=st.floats(2.0, 20.0),
    budget=st.floats(300.0, 8000.0),
    device=st.sampled_from(["cpu", "cpu", "cuda"]),
)


def _derived_dpsgd(f: DataFacts) -> tuple[Derivation, int, float] | None:
    """(the derived job, its DP-SGD steps, the seconds of the rest of its training: the job without DP-SGD
    and the sample grid ``train`` draws after the rounds), or None where no job is derived (below the floor:
    nothing to time) or it runs no DP-SGD."""
    try:
        d = derive(f)
    except ConfigError:
        return None
    steps = d.cfg.dpsgd_steps(f.size)
    if steps == 0:
        return None
    grid = sampling_seconds(d.cfg, f, GRID_PER_CLASS * f.n_classes)
    return d, steps, estimate(d.cfg.replace(dpsgd={"steps": 0}), f).training + grid


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(f=derived_facts)
@example(f=DataFacts(100_000, 28, 28, 1, 10, 10.0, time_budget=3000.0))  # the budget binds, not 20 epochs
@example(f=DataFacts(4000, 28, 28, 1, 10, 10.0, time_budget=560.0, dpsgd="on"))
@example(f=DataFacts(20_000, 32, 32, 3, 10, 8.0, device="cuda", time_budget=60.0, dpsgd="on"))
def test_dpsgd_steps_from_the_time_budget_fit_it_padded(f: DataFacts) -> None:
    """The derived steps x the padded step cost + the rest of the job fit the budget, and one step more
    would not (unless 20 epochs cap the steps first); the printed estimate is that padded time."""
    derived = _derived_dpsgd(f)
    if derived is None:
        return
    d, steps, rest = derived
    cost = padded_step_seconds(d.cfg, f)
    assert rest + steps * cost <= f.budget
    epochs_cap = -(-20 * f.size // _dpsgd_batch(f.size))  # the rule's at most 20 epochs
    assert steps == epochs_cap or rest + (steps + 1) * cost > f.budget
    assert d.estimate.seconds["dpsgd"] == pytest.approx(steps * cost, abs=ROUNDING)
    assert d.estimate.training <= f.budget + ROUNDING * len(d.estimate.seconds)


def _rows_a_node_round_processes(
    monkeypatch: pytest.MonkeyPatch,
    cfg: JobConfig,
    n: int,
    n_public: int,
    patients: PatientIndex | None = None,
) -> int:
    """Rows through the per-example clip (real and padding alike) in ``edge.releases.dpsgd_round``; with
    ``patients`` (the index a patient-level site's node builds from its policy) a patient-level round, at
    q = batch / the public patients, as the planner's event for that site."""
    from edge.releases import dpsgd_round

    rows = 0
    clip_and_sum = dp.clip_and_sum

    def counted(grads: Any, clip: float, **kw: Any) -> Any:
        nonlocal rows
        summed, norms = clip_and_sum(grads, clip, **kw)
        rows += int(norms.shape[0])
        return summed, norms

    monkeypatch.setattr(dp, "clip_and_sum", counted)
    ds, weights = random_site(n, 0, cfg)
    unit, population = ("image", n_public) if patients is None else ("patient", patients.n_public)
    q = stage_sampling_rate(cfg.dpsgd.batch, population, "dpsgd")
    event = PrivacyEvent("dpsgd", 1.5, q, cfg.dpsgd_steps(n_public), unit=unit)
    gen = torch.Generator().manual_seed(0)
    dpsgd_round(ds, cfg, copy.deepcopy(weights), event, gen, n_public, patients)
    return rows


def test_the_cost_model_charges_the_rows_a_node_round_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """13 images of public size 20: each of the round's 3 steps runs its public bound of rows through the
    per-example clip, whatever its sample, and the job rules charge exactly that count per step."""
    cfg = tiny_job(dpsgd={"batch": 4, "physical_batch": 4, "steps": 3})
    f = DataFacts(size=20, height=16, width=16, channels=1, n_classes=10, epsilon=1.0)
    rows = _rows_a_node_round_processes(monkeypatch, cfg, 13, 20)
    assert rows == 3 * dpsgd_step_rows(cfg, f) == 3 * padded_rows(cfg, 20)
    assert dpsgd_step_rows(cfg, f) > cfg.dpsgd.batch  # 16 rows a step against the expected 4


def _patient_ids(sizes: list[int]) -> np.ndarray:
    """Per-image patient ids (0..P-1) of patients holding ``sizes`` images each, interleaved (a patient's
    images need not be adjacent in the site's files)."""
    ids = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
    return np.random.default_rng(len(sizes)).permutation(ids)


@st.composite
def _site_rounds(draw: st.DrawFn) -> tuple[JobConfig, DataFacts, int, PatientIndex | None]:
    """(a job of 1-2 DP-SGD steps, the PUBLIC facts the rules read, the site's real image count, the
    ``PatientIndex`` its node builds from its policy or None): a site at or below its public size, image- or
    patient-level (at most ``cap`` images a patient, as the loader caps them), alone or a federation of
    one."""
    n_public = draw(st.integers(2, 48))
    n_rows = n_public - draw(st.integers(0, min(3, n_public - 1)))
    chunk, steps, share = draw(st.integers(1, 8)), draw(st.integers(1, 2)), draw(st.floats(0.05, 1.0))
    patients, pf, population = None, None, n_public
    if draw(st.booleans()):
        cap, sizes = draw(st.integers(1, 4)), list[int]()
        while sum(sizes) < n_rows:
            sizes.append(min(draw(st.integers(1, cap)), n_rows - sum(sizes)))
        population = draw(st.integers(1, n_public))  # the policy's nominal patients, not the exact count
        patients = PatientIndex(_patient_ids(sizes), population, cap)
        pf = PatientFacts(population, cap)
    batch = max(1, min(population, round(share * population)))
    cfg = tiny_job(dpsgd={"batch": batch, "physical_batch": chunk, "steps": steps})
    facts = DataFacts(n_public, 16, 16, 1, 10, 1.0, patients=pf)
    if draw(st.booleans()):  # a federation of one: the rules read the site's policy facts per site
        facts = replace(facts, patients=None, federated=True, site_sizes=(n_public,), site_patients=(pf,))
    return cfg, facts, n_rows, patients


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_site_rounds())
@example(
    case=(
        tiny_job(dpsgd={"batch": 5, "physical_batch": 4, "steps": 2}),
        DataFacts(24, 16, 16, 1, 10, 1.0, patients=PatientFacts(8, 3)),
        24,
        PatientIndex(_patient_ids([3] * 8), 8, 3),
    )
)
def test_the_rules_charge_each_step_the_rows_a_node_round_pushes_through_the_clip(
    case: tuple[JobConfig, DataFacts, int, PatientIndex | None],
) -> None:
    """Image- or patient-level, the rules' padded rows per step (``dpsgd_step_rows``, from public facts only)
    are the rows every step of the site's real node round runs through the per-example clip. A patient-level
    site charged as an image-level one (q = batch / images, no cap in the variance, chunk units) would be
    charged 16 rows a step where its node runs 28 (24 images of 8 patients, 3 each; 5 patients sampled a
    step)."""
    cfg, facts, n_rows, patients = case
    with pytest.MonkeyPatch.context() as mp:
        rows = _rows_a_node_round_processes(mp, cfg, n_rows, facts.size, patients)
    assert rows == cfg.dpsgd_steps(facts.size) * dpsgd_step_rows(cfg, facts)


def _tail(rows: int, q: float, var: float, unit: int) -> int:
    """Whole ``unit``s covering q·rows + 5 sd (``var``: the sample's variance bound): the bound before any
    cap."""
    return max(unit, -(-math.ceil(q * rows + 5 * math.sqrt(max(var, 0.0))) // unit) * unit)


@settings(max_examples=300, deadline=None)
@given(
    n_rows=st.integers(1, 5000),
    n_public=st.integers(1, 5000),
    q=st.floats(1e-4, 1.0),
    chunk=st.integers(1, 64),
    cap=st.one_of(st.none(), st.integers(1, 8)),
)
@example(n_rows=300, n_public=300, q=0.97, chunk=4, cap=None)  # 308 rows for a site of 300
@example(n_rows=12, n_public=12, q=1 / 3, chunk=3, cap=3)  # 21 images for a site of 12
@example(n_rows=386, n_public=1, q=0.5, chunk=2, cap=5)  # patient units of whole chunks: 6, not 5
@example(n_rows=1, n_public=135, q=0.5, chunk=2, cap=5)
@example(n_rows=1, n_public=1, q=1.0, chunk=2, cap=3)
def test_a_step_is_never_padded_beyond_whole_chunks_of_the_sites_public_rows(
    n_rows: int, n_public: int, q: float, chunk: int, cap: int | None
) -> None:
    """A step's sample is a subset of the site's rows (of its sampled patients' images, a subset of its
    images), so it never holds more than the site's ``public_rows`` (its public size, or the bucket of a site
    above it): padding beyond whole chunks of that count is time spent, and charged, for no sample. The bound
    still covers every sample the cap could cut: wherever it is below the 5 sd tail, it is above all the
    site's rows, and no sample fills it (a sample that did would leave no padding call, a step one call
    shorter than the others)."""
    rows = public_rows(n_rows, n_public)
    patients = None if cap is None else SimpleNamespace(cap=cap)
    unit = chunk if cap is None else -(-max(chunk, cap) // chunk) * chunk  # whole chunks covering the cap
    var = rows * q * (1 - q) if cap is None else q * (1 - q) * cap * rows
    bound = site_step_rows(n_rows, n_public, q, chunk, patients)
    assert bound <= -(-(rows + 1) // unit) * unit
    assert bound > n_rows or bound == _tail(rows, q, var, unit)  # above every sample the site can draw
    assert bound % unit == 0 and bound >= q * rows


def test_a_node_round_near_q_one_pushes_whole_chunks_of_the_public_size_through_the_clip(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """19 of 20 public rows a step (q = 0.95): the 5 sd tail is 24 rows, above the 20 a sample of the site
    can ever hold; each of the round's 3 steps runs whole chunks covering 21 rows, 24, through the per-example
    clip (a site of 13 images, or one of exactly 20 that may draw them all), and the job rules charge those
    24."""
    cfg = tiny_job(dpsgd={"batch": 19, "physical_batch": 4, "steps": 3})
    f = DataFacts(size=20, height=16, width=16, channels=1, n_classes=10, epsilon=1.0)
    assert dpsgd_step_rows(cfg, f) == 24
    for n in (13, 20):
        assert _rows_a_node_round_processes(monkeypatch, cfg, n, 20) == 3 * 24


def federated_step_seconds(cfg: JobConfig, f: DataFacts) -> float:
    """A federated step's time: the slowest site's padded rows, each site sampling the one signed batch
    (the rate at the smallest site, as ``coordinator.derive.federated_job`` signs it) over its own size;
    sites unknown: one site of the summed size."""
    if not f.site_sizes:
        return padded_step_seconds(cfg, f)
    batch = max(1, round(cfg.dpsgd.rate * min(f.site_sizes))) if cfg.dpsgd.rate else cfg.dpsgd.batch
    rows = max(
        step_bound(public_rows(n, n), stage_sampling_rate(batch, n, "dpsgd"), cfg.dpsgd.physical_batch)
        for n in f.site_sizes
    )
    return step_seconds(cfg, f, rows)


federated_facts = st.builds(
    lambda sites, known, side, eps, budget, device: DataFacts(
        len(sites) * min(sites),
        side,
        side,
        1,
        10,
        eps,
        device=device,
        time_budget=budget,
        dpsgd="on",
        federated=True,
        site_sizes=tuple(sites) if known else (),
    ),
    sites=st.lists(st.integers(300, 30_000), min_size=1, max_size=5),
    known=st.booleans(),
    side=st.sampled_from([28, 32]),
    eps=st.floats(2.0, 20.0),
    budget=st.floats(300.0, 8000.0),
    device=st.sampled_from(["cpu", "cpu", "cuda"]),
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(f=federated_facts)
@example(f=DataFacts(20_000, 28, 28, 1, 10, 10.0, time_budget=700.0, dpsgd="on", federated=True))
@example(
    f=DataFacts(
        12_000,
        28,
        28,
        1,
        10,
        10.0,
        time_budget=600.0,
        dpsgd="on",
        federated=True,
        site_sizes=(4000, 6000, 10_000),
    )
)
def test_federated_dpsgd_steps_are_the_whole_rounds_that_fit_the_budget(f: DataFacts) -> None:
    """A federated job runs whole rounds of 5 local steps: the derived steps are whole rounds whose padded
    time (the slowest site's) + the rest of the job fit the budget, and one round more would not (unless 20
    epochs cap the steps first). Rounding the steps UP to whole rounds ran up to 4 steps past the budget."""
    derived = _derived_dpsgd(f)
    if derived is None:
        return
    d, steps, rest = derived
    assert steps % 5 == 0 and d.cfg.federation.rounds * d.cfg.federation.local_steps == steps
    assert steps >= 20  # the rules' minimum: 4 whole rounds (below it DP-SGD is off, and the note says so)
    cost = federated_step_seconds(d.cfg, f)
    assert rest + steps * cost <= f.budget
    epochs_cap = -(-20 * f.size // _dpsgd_batch(f.size))
    assert steps + 5 > epochs_cap or rest + (steps + 5) * cost > f.budget
    assert d.estimate.seconds["dpsgd"] == pytest.approx(steps * cost, abs=ROUNDING)
    assert d.estimate.training <= f.budget + ROUNDING * len(d.estimate.seconds)
