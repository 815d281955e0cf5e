"""Privacy planning (plan_job / plan_site) and the ``privacy plan`` / ``privacy account`` commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.accounting import PrivacyEvent, epsilon
from feta_release.cli import cli, main
from feta_release.config import JobConfig, load_job
from feta_release.errors import ConfigError, PrivacyError
from feta_release.planning import plan_job, plan_site

JOBS = Path(__file__).parent / "jobs"


def test_plan_valid_job_composes_whole_history() -> None:
    cfg = load_job(JOBS / "valid_feta_pro.toml")
    plan = plan_job(cfg, 4000)
    assert [s.stage for s in plan.stages] == ["central", "frequency", "dpsgd"]
    central, freq, sgd = plan.stages
    assert (central.sigma, central.q, central.steps) == (5.0, 0.1, 5)
    assert (freq.sigma, freq.q, freq.steps) == (26.6, 1.0, 1)
    assert sgd.q == 256 / 4000 and sgd.steps == cfg.dpsgd_steps(4000) == 157
    assert plan.calibrated and sgd.sigma == plan.noise_multiplier
    # The total is recomputed over all events and meets the budget within the calibration tolerance.
    assert plan.epsilon == pytest.approx(epsilon(list(plan.history), 1e-5))
    assert 0.95 < plan.epsilon <= 1.0
    over = epsilon([*plan.history[:2], PrivacyEvent("dpsgd", plan.noise_multiplier - 0.01, sgd.q, sgd.steps)], 1e-5)
    assert over > 1.0
    assert sum(s.share for s in plan.stages) == pytest.approx(1.0)
    assert all(s.epsilon < plan.epsilon for s in plan.stages)
    d = plan.to_dict()
    for key in ("noise_multiplier", "epsilon", "delta", "accountant", "stages", "dataset_size", "history"):
        assert key in d
    assert json.loads(json.dumps(d)) == d


def test_warmup_costs_dpsgd_noise() -> None:
    cfg = load_job(JOBS / "valid_feta_pro.toml")
    with_warm = plan_job(cfg, 4000).noise_multiplier
    no_warm = plan_job(cfg.replace(central={"rounds": 0}, frequency={"sigma": None}), 4000).noise_multiplier
    assert no_warm < with_warm
    assert [s.enabled for s in plan_job(cfg.replace(central={"rounds": 0}), 4000).stages] == [False, True, True]


def test_fixed_noise_is_checked_not_calibrated() -> None:
    plan = plan_job(load_job(JOBS / "valid_fixed_noise.toml"), 4000)
    assert plan.noise_multiplier == 2.0 and not plan.calibrated and plan.epsilon <= 10.0
    with pytest.raises(PrivacyError, match=r"noise_multiplier 0.5 .* above the budget"):
        plan_job(load_job(JOBS / "invalid_fixed_noise_over_budget.toml"), 4000)


@pytest.mark.parametrize(
    ("job", "message"),
    [
        ("invalid_warmup_exceeds_budget.toml", r"warm-up alone .* shrink \[central\]"),
        ("invalid_batch_too_large.toml", r"\[dpsgd\] batch 10000 exceeds the dataset size 4000"),
        ("invalid_sigma_unbounded.toml", r"\[dpsgd\] cannot meet epsilon .* noise multiplier 1000"),
        ("invalid_fixed_noise_over_budget.toml", r"\[dpsgd\] noise_multiplier"),
    ],
)
def test_infeasible_plans_name_the_stage(job: str, message: str) -> None:
    with pytest.raises(PrivacyError, match=message):
        plan_job(load_job(JOBS / job), 4000)


def test_invalid_job_file_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="epsilonn"):
        load_job(JOBS / "invalid_unknown_key.toml")


def test_central_batch_larger_than_dataset() -> None:
    with pytest.raises(PrivacyError, match=r"\[central\] batch"):
        plan_job(JobConfig().replace(dpsgd={"batch": 10, "steps": 10}), 100)  # default central batch 6000


def test_plan_site_and_prior_events() -> None:
    cfg = load_job(JOBS / "valid_feta_pro.toml").replace(federation={"rounds": 4, "local_steps": 10})
    small, large = plan_site(cfg, 1000), plan_site(cfg, 4000)
    assert small.stage("dpsgd").steps == 40 == large.stage("dpsgd").steps
    assert small.stage("dpsgd").q == 256 / 1000
    assert small.noise_multiplier > large.noise_multiplier  # a smaller site samples at a higher rate
    prior = [PrivacyEvent("dpsgd", 2.0, 0.05, 50)]
    with_prior = plan_site(cfg, 4000, prior_events=prior, target_epsilon=2.0)
    assert with_prior.history[0] == prior[0] and with_prior.stages[0].stage == "prior"
    assert with_prior.epsilon <= 2.0
    assert with_prior.epsilon == pytest.approx(epsilon(list(with_prior.history), 1e-5))


def test_dataset_size_must_be_positive() -> None:
    with pytest.raises(PrivacyError):
        plan_job(JobConfig(), 0)


# -- CLI ------------------------------------------------------------------------------------------------------


def test_cli_plan_json() -> None:
    res = CliRunner().invoke(cli, ["privacy", "plan", str(JOBS / "valid_feta_pro.toml"), "--dataset-size", "4000",
                                   "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["dataset_size"] == 4000 and data["dataset_size_assumed"] is False
    assert data["delta"] == 1e-5 and data["accountant"] == "rdp"
    assert data["noise_multiplier"] == pytest.approx(plan_job(load_job(JOBS / "valid_feta_pro.toml"), 4000).noise_multiplier)
    assert [s["stage"] for s in data["stages"]] == ["central", "frequency", "dpsgd"]
    assert data["epsilon"] <= 1.0


def test_cli_plan_table_and_default_size() -> None:
    res = CliRunner().invoke(cli, ["privacy", "plan", str(JOBS / "valid_dpdm_no_warmup.toml")])
    assert res.exit_code == 0, res.output
    assert "assumed N = 4000" in res.output
    assert "total epsilon" in res.output and "dpsgd" in res.output and "disabled" in res.output
    res = CliRunner().invoke(cli, ["privacy", "plan", str(JOBS / "valid_dpdm_no_warmup.toml"), "-n", "2000", "--json"])
    data = json.loads(res.stdout)
    assert data["dataset_size"] == 2000 and data["stages"][2]["q"] == 256 / 2000


def test_cli_errors_exit_with_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["privacy", "plan", str(JOBS / "invalid_warmup_exceeds_budget.toml")])
    assert exc.value.code == PrivacyError.exit_code
    assert "shrink [central]" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["privacy", "plan", str(JOBS / "invalid_unknown_key.toml")])
    assert exc.value.code == ConfigError.exit_code
    with pytest.raises(SystemExit) as exc:
        main(["privacy", "plan", str(JOBS / "no_such_job.toml")])
    assert exc.value.code == ConfigError.exit_code
    assert "not found" in capsys.readouterr().err


def test_cli_account(tmp_path: Path) -> None:
    plan = plan_job(load_job(JOBS / "valid_feta_pro.toml"), 4000)
    path = tmp_path / "privacy.json"
    path.write_text(json.dumps(plan.to_dict()))
    res = CliRunner().invoke(cli, ["privacy", "account", str(path), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["epsilon"] == pytest.approx(plan.epsilon) and data["events"] == 3
    bare = tmp_path / "events.json"
    bare.write_text(json.dumps([e.to_dict() for e in plan.history]))
    res = CliRunner().invoke(cli, ["privacy", "account", str(bare), "--delta", "1e-6"])
    assert res.exit_code == 0 and "total epsilon" in res.output
    assert CliRunner().invoke(cli, ["privacy", "account", str(bare)]).exit_code != 0  # no delta anywhere
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps([{"stage": "dpsgd", "sigma": -1, "q": 0.1, "steps": 1}]))
    res = CliRunner().invoke(cli, ["privacy", "account", str(broken), "--delta", "1e-5"])
    assert isinstance(res.exception, PrivacyError) and "sigma" in str(res.exception)


# -- sampling rates and noise-to-signal figures -------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 200_000), rate=st.floats(1e-4, 1.0))
def test_for_size_turns_a_rate_into_a_batch_within_the_data(n: int, rate: float) -> None:
    cfg = JobConfig().replace(central={"rate": rate}, dpsgd={"rate": rate, "steps": 3})
    sized = cfg.for_size(n)
    for sec in (sized.central, sized.dpsgd):
        assert 1 <= sec.batch <= n or (n == 1 and sec.batch == 1)
        assert sec.batch == max(1, round(rate * n))
    assert sized.for_size(n) == sized  # idempotent for the same size


def test_rate_presets_plan_on_any_size_and_keep_epsilon() -> None:
    from feta_release.config import load_preset

    for name in ("cpu-eps1", "cpu-eps10"):
        cfg = load_preset(name)
        plans = {n: plan_job(cfg, n) for n in (500, 1400, 4000, 60_000)}
        for n, p in plans.items():
            assert p.epsilon <= cfg.privacy.epsilon + 1e-9
            assert p.stage("central").q == pytest.approx(cfg.central.rate, rel=0.01)
        # Same rates -> the same warm-up spend whatever the size; only the noise per pixel changes.
        assert plans[500].stage("central").epsilon == pytest.approx(plans[60_000].stage("central").epsilon, rel=0.02)
        nts = [plans[n].stage("central").noise_to_signal for n in (500, 1400, 4000, 60_000)]
        assert nts == sorted(nts, reverse=True)


def test_plan_warns_when_a_release_is_mostly_noise() -> None:
    cfg = JobConfig().replace(central={"rate": 0.5, "sigma": 8.0, "clip": 3.0, "rounds": 2},
                              frequency={"sigma": 10.0, "features": 200}, dpsgd={"rate": 0.05, "steps": 5})
    small, big = plan_job(cfg, 500), plan_job(cfg, 4000)
    # central: 8 * 3 / (250 / 10) = 0.96 per pixel at N = 500; 0.12 at N = 4000
    assert small.stage("central").noise_to_signal == pytest.approx(0.96)
    assert big.stage("central").noise_to_signal == pytest.approx(0.12)
    assert any("[central]" in w and "mostly noise" in w for w in small.warnings)
    assert not any("[central]" in w for w in big.warnings)
    # frequency: 10 * sqrt(200) / N * 10 -> 2.83 at N = 500 (warned), 0.35 at N = 4000
    assert small.stage("frequency").noise_to_signal == pytest.approx(10 * 200 ** 0.5 / 500 * 10)
    assert any("[frequency]" in w for w in small.warnings)
    assert json.loads(json.dumps(small.to_dict()))["warnings"] == list(small.warnings)


def test_privacy_plan_cli_prints_noise_warning(tmp_path: Path) -> None:
    job = tmp_path / "j.toml"
    job.write_text("[central]\nrate = 0.5\nsigma = 8.0\nclip = 3.0\nrounds = 2\n[dpsgd]\nrate = 0.05\nsteps = 5\n")
    res = CliRunner().invoke(cli, ["privacy", "plan", str(job), "-n", "500"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())  # rich wraps at the terminal width
    assert "warning: [central] at N = 500" in text and "mostly noise" in text
    assert "noise/signal [central]: noise std 0.960 per pixel" in text


def test_dpsgd_noise_figure_falls_with_the_batch_at_fixed_epsilon() -> None:
    from feta_release.models.edm import build_denoiser

    cfg = JobConfig().replace(central={"rounds": 0}, dpsgd={"steps": 50, "rate": 0.01})
    p_small, p_big = plan_job(cfg, 20_000), plan_job(cfg.replace(dpsgd={"rate": 0.1}), 20_000)
    params = sum(t.numel() for t in build_denoiser(cfg.model, (1, 28, 28), 10).parameters())
    for p, batch in ((p_small, 200), (p_big, 2000)):
        assert p.stage("dpsgd").noise_to_signal == pytest.approx(p.noise_multiplier * params ** 0.5 / batch)
    assert p_big.stage("dpsgd").noise_to_signal < p_small.stage("dpsgd").noise_to_signal
    assert not any("[dpsgd]" in w for w in p_small.warnings)  # reported, never warned: steps average it down


@settings(max_examples=25, deadline=None)
@given(n=st.integers(500, 60_000), n_classes=st.integers(2, 20),
       preset=st.sampled_from(["cpu-eps1", "cpu-eps10", "paper-mnist"]))
def test_rate_presets_accept_any_dataset_size(n: int, n_classes: int, preset: str) -> None:
    """issue 15: `train --preset cpu-eps1 --data` on 1,400 images refused ("fewer than [central] batch")."""
    import numpy as np

    from feta_release.config import load_preset
    from feta_release.data import ImageDataset
    from feta_release.training.pipeline import check_data

    cfg = load_preset(preset).for_size(n)
    ds = ImageDataset(np.zeros((n, 1, 2, 2), np.float32), np.arange(n) % n_classes,
                      tuple(str(c) for c in range(n_classes)), source="toy")
    check_data(cfg, ds)  # no batch above the data
    assert cfg.central.batch <= n and cfg.dpsgd.batch <= n
