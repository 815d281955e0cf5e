"""Privacy planning (stage_events / plan) and the ``privacy plan`` / ``privacy account`` commands."""

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
from feta_release.planning import Target, plan, stage_events, target

JOBS = Path(__file__).parents[1] / "support" / "jobs"


def test_plan_valid_job_composes_whole_history() -> None:
    cfg = load_job(JOBS / "valid_feta_pro.toml")
    p = plan(cfg, 4000)
    assert [s.stage for s in p.stages] == ["central", "frequency", "dpsgd"]
    central, freq, sgd = p.stages
    assert (central.sigma, central.q, central.steps) == (5.0, 0.1, 5)
    assert (freq.sigma, freq.q, freq.steps) == (26.6, 1.0, 1)
    assert sgd.q == 256 / 4000 and sgd.steps == cfg.dpsgd_steps(4000) == 157
    assert p.calibrated and sgd.sigma == p.noise_multiplier
    # The total is recomputed over all events and meets the budget within the calibration tolerance.
    assert p.epsilon == pytest.approx(epsilon(list(p.history), 1e-5))
    assert 0.95 < p.epsilon <= 1.0
    over = epsilon([*p.history[:2], PrivacyEvent("dpsgd", p.noise_multiplier - 0.01, sgd.q, sgd.steps)], 1e-5)
    assert over > 1.0
    assert sum(s.share for s in p.stages) == pytest.approx(1.0)
    assert all(s.epsilon < p.epsilon for s in p.stages)
    d = p.to_dict()
    for key in ("noise_multiplier", "epsilon", "delta", "accountant", "stages", "dataset_size", "history"):
        assert key in d
    assert json.loads(json.dumps(d)) == d


def test_warmup_costs_dpsgd_noise() -> None:
    cfg = load_job(JOBS / "valid_feta_pro.toml")
    with_warm = plan(cfg, 4000).noise_multiplier
    no_warm = plan(cfg.replace(central={"rounds": 0}, frequency={"sigma": None}), 4000).noise_multiplier
    assert no_warm < with_warm
    assert [s.enabled for s in plan(cfg.replace(central={"rounds": 0}), 4000).stages] == [False, True, True]


def test_fixed_noise_is_checked_not_calibrated() -> None:
    p = plan(load_job(JOBS / "valid_fixed_noise.toml"), 4000)
    assert p.noise_multiplier == 2.0 and not p.calibrated and p.epsilon <= 10.0
    with pytest.raises(PrivacyError, match=r"noise_multiplier 0.5 .* above the budget"):
        plan(load_job(JOBS / "invalid_fixed_noise_over_budget.toml"), 4000)


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
        plan(load_job(JOBS / job), 4000)


def test_invalid_job_file_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="epsilonn"):
        load_job(JOBS / "invalid_unknown_key.toml")


def test_central_batch_larger_than_dataset() -> None:
    with pytest.raises(PrivacyError, match=r"\[central\] batch"):
        plan(JobConfig().replace(dpsgd={"batch": 10, "steps": 10}), 100)  # default central batch 6000


def test_federated_plan_and_prior_events() -> None:
    cfg = load_job(JOBS / "valid_feta_pro.toml").replace(federation={"rounds": 4, "local_steps": 10})
    small, large = plan(cfg, 1000, federated=True), plan(cfg, 4000, federated=True)
    assert small.stage("dpsgd").steps == 40 == large.stage("dpsgd").steps
    assert small.stage("dpsgd").q == 256 / 1000
    assert small.noise_multiplier > large.noise_multiplier  # a smaller site samples at a higher rate
    prior = [PrivacyEvent("dpsgd", 2.0, 0.05, 50)]
    with_prior = plan(cfg, 4000, federated=True, prior=prior, budget=Target(2.0, 1e-5, "rdp"))
    assert with_prior.history[0] == prior[0] and with_prior.stages[0].stage == "prior"
    assert with_prior.epsilon <= 2.0
    assert with_prior.epsilon == pytest.approx(epsilon(list(with_prior.history), 1e-5))


def test_dataset_size_must_be_positive() -> None:
    with pytest.raises(PrivacyError):
        plan(JobConfig(), 0)


# -- CLI
# ------------------------------------------------------------------------------------------------------


def test_cli_plan_json() -> None:
    res = CliRunner().invoke(
        cli, ["privacy", "plan", str(JOBS / "valid_feta_pro.toml"), "--dataset-size", "4000", "--json"]
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["dataset_size"] == 4000 and data["dataset_size_assumed"] is False
    assert data["delta"] == 1e-5 and data["accountant"] == "rdp"
    from feta_release.mechanisms.count import size_event

    # train without --public-size draws its size from a noisy count: the plan holds that event first
    drawn = plan(load_job(JOBS / "valid_feta_pro.toml"), 4000, size=size_event())
    assert data["noise_multiplier"] == pytest.approx(drawn.noise_multiplier)
    assert [s["stage"] for s in data["stages"]] == ["size", "central", "frequency", "dpsgd"]
    assert data["epsilon"] <= 1.0


def test_cli_plan_table_and_default_size() -> None:
    res = CliRunner().invoke(cli, ["privacy", "plan", str(JOBS / "valid_dpdm_no_warmup.toml")])
    assert res.exit_code == 0, res.output
    assert "assumed N = 4000" in res.output
    assert "total epsilon" in res.output and "dpsgd" in res.output and "disabled" in res.output
    res = CliRunner().invoke(
        cli, ["privacy", "plan", str(JOBS / "valid_dpdm_no_warmup.toml"), "-n", "2000", "--json"]
    )
    data = json.loads(res.stdout)
    assert data["dataset_size"] == 2000 and data["stages"][3]["q"] == 256 / 2000  # after the size row
    res = CliRunner().invoke(
        cli,
        [
            "privacy",
            "plan",
            str(JOBS / "valid_dpdm_no_warmup.toml"),
            "-n",
            "2000",
            "--json",
            "--declared-size",
        ],
    )
    data = json.loads(res.stdout)
    assert [s["stage"] for s in data["stages"]] == ["central", "frequency", "dpsgd"]
    assert data["noise_multiplier"] == pytest.approx(
        plan(load_job(JOBS / "valid_dpdm_no_warmup.toml"), 2000).noise_multiplier
    )


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
    p = plan(load_job(JOBS / "valid_feta_pro.toml"), 4000)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(p.to_dict()))
    res = CliRunner().invoke(cli, ["privacy", "account", str(path), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["epsilon"] == pytest.approx(p.epsilon) and data["events"] == 3
    bare = tmp_path / "events.json"
    bare.write_text(json.dumps([e.to_dict() for e in p.history]))
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

    for name in ("cpu-eps1", "cpu-eps10", "cpu-eps10-nodpsgd"):
        cfg = load_preset(name)
        plans = {n: plan(cfg, n) for n in (500, 1400, 4000, 60_000)}
        for p in plans.values():
            assert p.epsilon <= cfg.privacy.epsilon + 1e-9
            assert p.stage("central").q == pytest.approx(cfg.central.rate, rel=0.01)
        # Same rates -> the same warm-up spend whatever the size; only the noise per pixel changes.
        assert plans[500].stage("central").epsilon == pytest.approx(
            plans[60_000].stage("central").epsilon, rel=0.02
        )
        nts = [plans[n].stage("central").noise_to_signal for n in (500, 1400, 4000, 60_000)]
        assert nts == sorted(nts, reverse=True)


def test_plan_warns_when_a_release_is_mostly_noise() -> None:
    cfg = JobConfig().replace(
        central={"rate": 0.5, "sigma": 8.0, "clip": 3.0, "rounds": 2},
        frequency={"sigma": 10.0, "features": 200},
        dpsgd={"rate": 0.05, "steps": 5},
    )
    small, big = plan(cfg, 500), plan(cfg, 4000)
    # central: 8 * 3 / (250 / 10) = 0.96 per pixel at N = 500; 0.12 at N = 4000
    assert small.stage("central").noise_to_signal == pytest.approx(0.96)
    assert big.stage("central").noise_to_signal == pytest.approx(0.12)
    assert any("[central]" in w and "mostly noise" in w for w in small.warnings)
    assert not any("[central]" in w for w in big.warnings)
    # frequency: 10 * sqrt(200) / N * 10 -> 2.83 at N = 500 (warned), 0.35 at N = 4000
    assert small.stage("frequency").noise_to_signal == pytest.approx(10 * 200**0.5 / 500 * 10)
    assert any("[frequency]" in w for w in small.warnings)
    assert json.loads(json.dumps(small.to_dict()))["warnings"] == list(small.warnings)


def test_privacy_plan_cli_prints_noise_warning(tmp_path: Path) -> None:
    job = tmp_path / "j.toml"
    job.write_text(
        "[central]\nrate = 0.5\nsigma = 8.0\nclip = 3.0\nrounds = 2\n[dpsgd]\nrate = 0.05\nsteps = 5\n"
    )
    res = CliRunner().invoke(cli, ["privacy", "plan", str(job), "-n", "500"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())  # rich wraps at the terminal width
    assert "warning: [central] at N = 500" in text and "mostly noise" in text
    assert "noise/signal [central]: noise std 0.960 per pixel" in text


def test_dpsgd_noise_figure_falls_with_the_batch_at_fixed_epsilon() -> None:
    from feta_release.models.edm import build_denoiser

    cfg = JobConfig().replace(central={"rounds": 0}, dpsgd={"steps": 50, "rate": 0.01})
    p_small, p_big = plan(cfg, 20_000), plan(cfg.replace(dpsgd={"rate": 0.1}), 20_000)
    params = sum(t.numel() for t in build_denoiser(cfg.model, (1, 28, 28), 10).parameters())
    for p, batch in ((p_small, 200), (p_big, 2000)):
        assert p.stage("dpsgd").noise_to_signal == pytest.approx(p.noise_multiplier * params**0.5 / batch)
    assert p_big.stage("dpsgd").noise_to_signal < p_small.stage("dpsgd").noise_to_signal
    assert not any("[dpsgd]" in w for w in p_small.warnings)  # reported, never warned: steps average it down


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(500, 60_000),
    n_classes=st.integers(2, 20),
    preset=st.sampled_from(["cpu-eps1", "cpu-eps10", "cpu-eps10-nodpsgd", "paper-mnist"]),
)
def test_rate_presets_accept_any_dataset_size(n: int, n_classes: int, preset: str) -> None:
    """`train --preset cpu-eps1 --data` on 1,400 images refused ("fewer than [central] batch")."""
    import numpy as np

    from feta_release.config import load_preset
    from feta_release.data import ImageDataset
    from feta_release.training.data_checks import check_data

    cfg = load_preset(preset).for_size(n)
    ds = ImageDataset(
        np.zeros((n, 1, 2, 2), np.float32),
        np.arange(n) % n_classes,
        tuple(str(c) for c in range(n_classes)),
        source="toy",
    )
    check_data(cfg, ds)  # no batch above the data
    assert cfg.central.batch <= n and cfg.dpsgd.batch <= n


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(500, 60_000),
    preset=st.sampled_from(["cpu-eps1", "cpu-eps10", "cpu-eps10-nodpsgd", "paper-mnist"]),
)
def test_presets_accept_the_suggested_public_size_when_it_rounds_the_count_up(n: int, preset: str) -> None:
    """Review: cpu-eps1's central rate 1 makes batch = public size; 3,251 images -> public size 3,300 was
    refused ("fewer than [central] batch") although q = batch / public size = 1."""
    import numpy as np

    from feta_release.config import load_preset
    from feta_release.data import ImageDataset
    from feta_release.data.commitment import suggest_public_size
    from feta_release.training.data_checks import check_data

    n_pub = suggest_public_size(n)
    cfg = load_preset(preset).for_size(n_pub)
    ds = ImageDataset(
        np.zeros((n, 1, 2, 2), np.float32), np.arange(n) % 10, tuple(map(str, range(10))), source="toy"
    )
    check_data(cfg, ds, n_pub)
    assert cfg.central.batch <= n_pub and cfg.dpsgd.batch <= n_pub


# -- one planner for both drivers
# ---------------------------------------------------------------------------------


@settings(max_examples=6, deadline=None)
@given(
    n=st.integers(800, 20_000),
    rounds=st.integers(1, 5),
    local=st.integers(1, 30),
    central=st.booleans(),
    frequency=st.booleans(),
)
def test_single_site_and_federated_planning_give_identical_events(
    n: int, rounds: int, local: int, central: bool, frequency: bool
) -> None:
    """A local run of rounds x local_steps DP-SGD steps and a federated site of the same public size plan the
    same events: the same warm-up, the same calibrated sigma and q, the same steps (split into rounds) and
    epsilon."""
    from feta_release.planning import merged

    cfg = JobConfig().replace(
        central={"rounds": 3 if central else 0, "batch": 200, "sigma": 5.0},
        frequency={"sigma": 30.0 if frequency else None},
        dpsgd={"batch": 100, "steps": rounds * local},
        federation={"rounds": rounds, "local_steps": local},
    )
    local_events = stage_events(cfg, n)
    fed_events = stage_events(cfg, n, federated=True)
    assert merged(fed_events) == local_events
    assert [e for e in fed_events if e.stage == "dpsgd"] == [
        PrivacyEvent("dpsgd", local_events[-1].sigma, 100 / n, local)
    ] * rounds
    single, site = plan(cfg, n), plan(cfg, n, federated=True)
    assert single.events == site.events == local_events
    assert single.epsilon == pytest.approx(site.epsilon, rel=1e-9)
    assert single.noise_multiplier == site.noise_multiplier


def test_federated_sigma_is_calibrated_for_the_sites_capped_budget() -> None:
    from types import SimpleNamespace

    from feta_release.accounting import calibrate_noise_multiplier

    cfg = load_job(JOBS / "valid_feta_pro.toml").replace(federation={"rounds": 4, "local_steps": 10})
    policy = SimpleNamespace(job_epsilon=0.8, job_delta=1e-6, accountant="rdp")
    budget = target(cfg, policy)
    assert budget == Target(0.8, 1e-6, "rdp")
    events = stage_events(cfg, 4000, federated=True, budget=budget)
    warm = events[:2]
    expected = calibrate_noise_multiplier(warm, 256 / 4000, 40, 0.8, 1e-6, "rdp")
    assert [e.stage for e in events] == ["central", "frequency"] + ["dpsgd"] * 4
    assert events[-1].sigma == expected > stage_events(cfg, 4000, federated=True)[-1].sigma
    assert epsilon(events, 1e-6) <= 0.8 + 1e-9


def test_calibrations_are_cached_on_disk_exactly(tmp_path: Path) -> None:
    cfg = load_job(JOBS / "valid_feta_pro.toml").replace(federation={"rounds": 2, "local_steps": 5})
    first = stage_events(cfg, 3000, federated=True, cache_dir=tmp_path)
    assert len(list((tmp_path / "calibrations").glob("*.json"))) == 1
    assert (
        stage_events(cfg, 3000, federated=True, cache_dir=tmp_path)
        == first
        == stage_events(cfg, 3000, federated=True)
    )


# -- DP-SGD round sizes: one schedule, one list of events, whichever driver
# ---------------------------------------


@settings(max_examples=25, deadline=None)
@given(total=st.integers(0, 400), chunk=st.integers(1, 60))
def test_round_sizes_split_every_step_once(total: int, chunk: int) -> None:
    from feta_release.planning import round_sizes

    sizes = round_sizes(total, chunk)
    assert sum(sizes) == total and all(1 <= k <= chunk for k in sizes)
    assert all(k == chunk for k in sizes[:-1])  # only the last round may be short
    assert len(sizes) == -(-total // chunk)


@settings(max_examples=8, deadline=None)
@given(
    n=st.integers(800, 20_000),
    total=st.integers(1, 120),
    chunk=st.integers(1, 50),
    central=st.booleans(),
    frequency=st.booleans(),
)
def test_local_and_federated_events_are_identical_for_the_same_round_sizes(
    n: int, total: int, chunk: int, central: bool, frequency: bool
) -> None:
    """The same schedule (rounds of ``chunk`` steps, the last shorter) gives the same events in a local run
    and at a federated site, and splitting never changes sigma, q or epsilon: only the one round of a local
    run is cut."""
    from feta_release.planning import merged, round_sizes

    cfg = JobConfig().replace(
        central={"rounds": 3 if central else 0, "batch": 200, "sigma": 5.0},
        frequency={"sigma": 30.0 if frequency else None},
        dpsgd={"batch": 100, "steps": total},
    )
    sizes = round_sizes(total, chunk)
    local = stage_events(cfg, n, rounds=sizes)
    fed = stage_events(cfg, n, federated=True, rounds=sizes)
    assert local == fed
    assert [e.steps for e in local if e.stage == "dpsgd"] == sizes
    whole = stage_events(cfg, n)
    assert merged(local) == whole  # one round of `total` steps: the same sigma and q, steps summed
    assert epsilon(local, 1e-5) == pytest.approx(epsilon(whole, 1e-5), rel=1e-9)
    assert plan(cfg, n, rounds=sizes).events == plan(cfg, n).events


def test_round_sizes_must_be_positive_integers() -> None:
    cfg = JobConfig().replace(
        central={"rounds": 3, "batch": 200, "sigma": 5.0}, dpsgd={"batch": 100, "steps": 10}
    )
    for bad in ([5, 0, 5], [5, -1], [2.5], [True]):
        with pytest.raises(PrivacyError, match="round sizes"):
            stage_events(cfg, 10_000, rounds=bad)
    assert [e.stage for e in stage_events(cfg, 10_000, rounds=[])] == [
        e.stage for e in stage_events(cfg, 10_000)
    ][:-1]
