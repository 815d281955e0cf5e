"""The time estimate of a job (``job_rules.estimate``) costs every stage the command runs, the synthetic set
and the release's export and signing included, and the job's header names each term with its seconds. The
sampler is costed per call of the denoiser its solver makes. (That every stage a ``train`` run reports is a
term: tests/training/test_stage_progress.py.)"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feta_release.config import load_preset
from feta_release.errors import ConfigError
from feta_release.job_rules import DataFacts, derive, estimate, sampler_calls, sampling_seconds
from feta_release.progress_events import (
    AUX_FIT,
    AUX_IMAGES,
    DPSGD,
    EXPORT,
    FINISHING,
    FREQUENCY_WARMUP,
    GRIDS,
    POLISH,
    PROTOTYPES,
    REPORT,
    SAMPLE_GRID,
    SAMPLING,
    SIGNING,
    SPATIAL,
)

RELEASE = {REPORT, SAMPLE_GRID, SAMPLING, EXPORT, SIGNING}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    side=st.sampled_from([28, 32, 64]),
    channels=st.sampled_from([1, 3]),
    size=st.integers(300, 50_000),
    eps=st.floats(0.5, 20.0),
    device=st.sampled_from(["cpu", "cuda"]),
)
def test_the_derived_jobs_header_names_every_term_of_its_estimate_the_export_included(
    side: int, channels: int, size: int, eps: float, device: str
) -> None:
    facts = DataFacts(size, side, side, channels, 4, eps, device=device)  # type: ignore[arg-type]
    try:
        d = derive(facts)
    except ConfigError:  # below the floor: no job, no header
        return
    terms = d.estimate.seconds
    assert RELEASE | {GRIDS} <= set(terms)
    line = next(n for n in d.notes if n.startswith("estimated "))
    for stage, seconds in terms.items():
        assert f"{stage} {seconds:.0f}" in line, (stage, line)
    assert (
        f"+ {d.estimate.finishing / 60:.1f} min to draw {size} synthetic images and build the release" in line
    )
    assert d.estimate.training == pytest.approx(sum(v for k, v in terms.items() if k not in FINISHING))


def _facts(**kw: object) -> DataFacts:
    return DataFacts(4000, 64, 64, 1, 4, 10.0, **kw)  # type: ignore[arg-type]


def test_the_estimate_costs_the_stages_the_job_runs_and_only_those() -> None:
    both = load_preset("tiny").replace(
        central={"cells": 4, "cell_rule": "aux"}, warmup={"polish_iterations": 10}, dpsgd={"steps": 3}
    )
    assert {AUX_FIT, PROTOTYPES, AUX_IMAGES, FREQUENCY_WARMUP, SPATIAL, POLISH, DPSGD} | RELEASE <= set(
        estimate(both, _facts()).seconds
    )
    central_only = both.replace(frequency={"sigma": None}, central={"cell_rule": "slant"}, dpsgd={"steps": 0})
    terms = set(estimate(central_only, _facts()).seconds)
    assert not terms & {AUX_FIT, PROTOTYPES, AUX_IMAGES, FREQUENCY_WARMUP, DPSGD}
    assert {SPATIAL, POLISH} | RELEASE <= terms


@pytest.mark.parametrize(
    ("sampler", "calls"),
    [
        ({"solver": "heun", "steps": 8}, 15),  # the last Heun step is an Euler step
        ({"solver": "euler", "steps": 8}, 8),
        ({"solver": "heun", "steps": 8, "guidance": 1.5}, 30),  # each call runs the batch twice
    ],
)
def test_the_sampler_is_costed_per_call_of_the_denoiser(sampler: dict[str, object], calls: int) -> None:
    cfg = load_preset("tiny").replace(sampler=sampler)
    assert sampler_calls(cfg) == calls
    one = sampling_seconds(cfg, _facts(), 1)
    assert sampling_seconds(cfg, _facts(), 4100) == pytest.approx(4100 * one)
    euler = sampling_seconds(
        cfg.replace(sampler={"solver": "euler", "steps": 1, "guidance": 0.0}), _facts(), 1
    )
    assert one == pytest.approx(calls * euler)
    assert estimate(cfg, _facts(), 4100).seconds[SAMPLING] == pytest.approx(4100 * one, abs=0.05)


def test_the_aux_fit_costs_the_pixels_batch_and_width_not_the_channels() -> None:
    # a step's convolutions run at the generator's width: the output channels add ~1 % (bench/release_cost.py)
    cfg = load_preset("tiny").replace(
        auxgen={"width": 32, "batch": 100, "restarts": 1, "epochs": 10, "iterations_per_epoch": 40}
    )

    def aux(cfg_: object = cfg, **facts: object) -> float:
        kw = {
            "size": 4000,
            "height": 64,
            "width": 64,
            "channels": 1,
            "n_classes": 4,
            "epsilon": 10.0,
            **facts,
        }
        return estimate(cfg_, DataFacts(**kw)).seconds[AUX_FIT]  # type: ignore[arg-type]

    assert aux(channels=3) == pytest.approx(aux(channels=1), rel=0.01)
    assert aux(height=28, width=28) == pytest.approx(aux() * 784 / 4096, rel=0.01)
    assert aux(cfg.replace(auxgen={"batch": 200})) == pytest.approx(2 * aux(), rel=0.01)
    # measured 3.06x from width 32 to 64 (1 thread, 28 px): between linear and square in the width
    wide = aux(cfg.replace(auxgen={"width": 64})) / aux()
    assert 2.5 < wide < 3.5, wide
