"""When the derived job turns DP-SGD on: a stated rule from public facts. Its noise-to-signal over the job
(sigma sqrt(P) / (B sqrt(T)), the planner's per-step figure averaged over the steps) must be at most a fifth
of the figure at the one point where a DP-SGD stage was measured to tie the releases alone (4,000 digits,
eps 10)."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feta_release.config import JobConfig
from feta_release.errors import ConfigError, PrivacyError
from feta_release.job_rules import (
    DPSGD_MARGIN,
    DPSGD_MAX_NOISE,
    DPSGD_MIN_STEPS,
    DPSGD_TIE_NOISE,
    DataFacts,
    PublicFacts,
    _dpsgd_seconds,
    _dpsgd_steps,
    _fit_budget,
    _split,
    _with_steps,
    derive,
    dpsgd_noise,
    job_dpsgd_noise,
    plan_of,
)
from feta_release.model_size import denoiser_parameters
from feta_release.planning import plan


def _forced(f: DataFacts) -> dict:
    """The rules' job for ``f`` with DP-SGD on (the releases at 75 %, the warm-up leaving DP-SGD's minimum
    steps their time, its steps from the time budget)."""
    d, est = _fit_budget(f, _split(f, True), reserve=_dpsgd_seconds(f, DPSGD_MIN_STEPS + 1))
    return _with_steps(d, _dpsgd_steps(f, d, est), f.federated)


def test_the_tie_figure_is_the_rules_dpsgd_on_4000_digits_at_eps_10() -> None:
    f = DataFacts(4000, 28, 28, 1, 10, 10.0)
    assert job_dpsgd_noise(f, _forced(f)) == pytest.approx(DPSGD_TIE_NOISE, rel=0.01)
    assert DPSGD_MAX_NOISE == pytest.approx(DPSGD_TIE_NOISE / DPSGD_MARGIN)


def test_dpsgd_figure_is_the_planners_per_step_figure_averaged_over_the_steps() -> None:
    f = DataFacts(100_000, 64, 64, 1, 10, 10.0)
    sections = _forced(f)
    cfg = JobConfig.from_dict(sections)
    p = plan(cfg, f.size, image_shape=f.shape, n_classes=f.n_classes)
    steps = cfg.dpsgd_steps(f.size)
    per_step = p.stage("dpsgd").noise_to_signal
    assert per_step is not None
    assert job_dpsgd_noise(f, sections) == pytest.approx(per_step / math.sqrt(steps))
    params = denoiser_parameters(cfg.model, f.shape, f.n_classes)
    assert dpsgd_noise(2.0, params, 400, 100) == pytest.approx(2.0 * math.sqrt(params) / 400 / 10)


def _trained_on_the_built_model(f: DataFacts, cfg: JobConfig) -> int:
    """The scalars DP-SGD trains, counted as training counts them: set_trainable on the model it builds."""
    from feta_release.models import build_denoiser
    from feta_release.models.trainable import set_trainable

    model = build_denoiser(cfg.model, f.shape, f.n_classes)
    return set_trainable(model, cfg.dpsgd.trainable, cfg.dpsgd.lora_rank)


def _with_public(f: DataFacts) -> DataFacts:
    return DataFacts(**{**f.__dict__, "public": PublicFacts(2000, f.shape)})


@pytest.mark.parametrize("trainable", ["norm_attention", "lora"])
def test_dpsgd_figure_weighs_the_noise_in_the_parameters_dpsgd_trains(trainable: str) -> None:
    f = _with_public(DataFacts(100_000, 28, 28, 1, 10, 10.0))
    forced = _forced(f)
    sections = {**forced, "dpsgd": {**forced["dpsgd"], "trainable": trainable, "lora_rank": 3}}
    cfg = JobConfig.from_dict(sections)
    sigma = plan_of(f, cfg).noise_multiplier
    batch, steps = cfg.for_size(f.size).dpsgd.batch, cfg.dpsgd_steps(f.size)
    d = _trained_on_the_built_model(f, cfg)
    assert d < denoiser_parameters(cfg.model, f.shape, f.n_classes) / 4  # far from the whole model's count
    assert job_dpsgd_noise(f, sections) == pytest.approx(sigma * math.sqrt(d) / (batch * math.sqrt(steps)))
    per_step = plan(cfg, f.size, image_shape=f.shape, n_classes=f.n_classes).stage("dpsgd")
    assert per_step.noise_to_signal == pytest.approx(sigma * math.sqrt(d) / batch)
    assert f"{d:,} parameters trained, {trainable}" in per_step.noise_note


def test_dpsgd_off_line_names_the_parameters_it_trains_and_their_figure() -> None:
    f = _with_public(DataFacts(4000, 28, 28, 1, 10, 1.0))  # digits at eps 1 with a public set: DP-SGD off
    job = derive(f)
    assert job.cfg.dpsgd_steps(f.size) == 0 and job.cfg.dpsgd.trainable == "norm_attention"
    line = next(n for n in job.notes if n.startswith("dpsgd: off"))
    said = re.search(r"over the ([\d,]+) parameters it trains \(norm_attention\) is ([\d.]+)", line)
    assert said is not None, line
    assert int(said[1].replace(",", "")) == _trained_on_the_built_model(f, job.cfg)
    assert float(said[2]) == pytest.approx(job_dpsgd_noise(f, _forced(f)), abs=5e-5)


def test_dpsgd_stays_off_where_it_was_measured_not_to_help() -> None:
    for eps in (1.0, 10.0):  # 4,000 digits: it lowered accuracy at eps 1 and tied at eps 10
        assert derive(DataFacts(4000, 28, 28, 1, 10, eps)).cfg.dpsgd_steps(4000) == 0


def test_dpsgd_runs_where_its_figure_is_a_fifth_of_the_tie() -> None:
    f = DataFacts(100_000, 28, 28, 1, 10, 10.0)
    cfg = derive(f).cfg
    assert cfg.dpsgd_steps(f.size) >= DPSGD_MIN_STEPS
    assert job_dpsgd_noise(f, cfg.to_dict()) <= DPSGD_MAX_NOISE


facts = st.builds(
    lambda n, side, c, k, eps, fed: DataFacts(n, side, side, c, k, eps, federated=fed),
    st.integers(300, 100_000),
    st.integers(28, 128),
    st.sampled_from([1, 3]),
    st.integers(2, 100),
    st.floats(0.5, 20.0),
    st.booleans(),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(f=facts)
def test_derived_job_runs_dpsgd_exactly_where_the_rule_allows(f: DataFacts) -> None:
    try:
        cfg = derive(f).cfg
    except ConfigError:  # refused below the floor: tests/accounting/test_job_fits_data.py
        return
    try:
        forced = _forced(f)
    except PrivacyError:  # the releases' share with DP-SGD fits no noise: DP-SGD off
        assert cfg.dpsgd_steps(f.size) == 0
        return
    steps = JobConfig.from_dict(forced).dpsgd_steps(f.size)
    allowed = steps >= DPSGD_MIN_STEPS and job_dpsgd_noise(f, forced) <= DPSGD_MAX_NOISE
    assert (cfg.dpsgd_steps(f.size) > 0) == allowed
