"""A job fits the data it is given: over 300-100,000 images, 28-128 px, 1 or 3 channels, 2-100 classes and
epsilon 0.5-20 the derived job runs (valid, within the policy's default resource caps and memory limit,
planned within its epsilon with no release mostly noise, batches and rates consistent with the public size)
or is refused in one line naming the figure; a shipped preset on data of another shape is adapted by the
same rules or refused naming the derived job."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feta_release.accounting import epsilon
from feta_release.config import JobConfig, load_preset
from feta_release.data import save_npz
from feta_release.data.dataset import ImageDataset, site_memory_bytes
from feta_release.errors import ConfigError
from feta_release.job_rules import DPSGD_MIN_STEPS, DataFacts, _dpsgd_batch, derive, fit_preset, preset_shape
from feta_release.mechanisms.count import size_event
from feta_release.mechanisms.feature_map import check_feature_map
from feta_release.model_size import denoiser_parameters
from feta_release.planning import plan, stage_events
from feta_release.policy.enforce import DEFAULT_RESOURCES
from tests.support.cli import run_cli

PRESETS = (
    "tiny",
    "cpu-eps1",
    "cpu-eps1-nodpsgd",
    "cpu-eps10",
    "cpu-eps10-nodpsgd",
    "paper-mnist",
    "xray64-eps10",
)
MEMORY_MB = DEFAULT_RESOURCES["max_worker_memory_mb"]

facts = st.builds(
    lambda n, side, c, k, eps, fed, drawn: DataFacts(
        n, side, side, c, k, eps, federated=fed, size_drawn=drawn, memory_mb=MEMORY_MB
    ),
    st.integers(300, 100_000),
    st.integers(28, 128),
    st.sampled_from([1, 3]),
    st.integers(2, 100),
    st.floats(0.5, 20.0),
    st.booleans(),
    st.booleans(),
)


def _within_default_resources(cfg: JobConfig, f: DataFacts) -> None:
    params = denoiser_parameters(cfg.model, f.shape, f.n_classes)
    assert params <= DEFAULT_RESOURCES["max_model_parameters"]
    assert cfg.dpsgd.physical_batch <= DEFAULT_RESOURCES["max_physical_batch"]
    assert cfg.dpsgd.physical_batch * cfg.dpsgd.noise_multiplicity <= DEFAULT_RESOURCES["max_pass_rows"]
    assert site_memory_bytes(f.size, f.values) <= MEMORY_MB * 2**20


def _batches_follow_the_size(cfg: JobConfig, f: DataFacts) -> None:
    sized = cfg.for_size(f.size)
    assert sized.central.batch == f.size and cfg.central.rate == 1.0  # one pass over every image
    assert sized.dpsgd.batch == _dpsgd_batch(f.size) <= f.size
    steps = cfg.dpsgd_steps(f.size)
    if steps:
        # at most 20 epochs: a federated job's whole rounds are rounded down, never past the cap
        assert DPSGD_MIN_STEPS <= steps <= math.ceil(20 * f.size / sized.dpsgd.batch)
        if f.federated:
            assert steps == cfg.federation.rounds * cfg.federation.local_steps
    assert not f.federated or cfg.central.cells == 1


def _refusal_names_its_figure(f: DataFacts, msg: str) -> None:
    assert "\n" not in msg and msg.startswith("derived job")
    if "draw the public size" in msg:
        assert f.size_drawn and epsilon([size_event()], f.job_delta) >= 0.5 * f.epsilon
    elif "max_worker_memory_mb" in msg:
        assert site_memory_bytes(f.size, f.values) > MEMORY_MB * 2**20
        assert f"{f.size:,} images of {f.channels}x{f.height}x{f.width} need" in msg
    else:
        assert (
            "below the floor" in msg and "noise std" in msg and "needs about" in msg and "epsilon >=" in msg
        )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(f=facts)
def test_derived_job_runs_on_the_data_or_is_refused_naming_the_figure(f: DataFacts) -> None:
    try:
        d = derive(f)
    except ConfigError as exc:
        _refusal_names_its_figure(f, str(exc))
        return
    cfg = d.cfg
    assert JobConfig.from_dict(cfg.to_dict()) == cfg
    _within_default_resources(cfg, f)
    _batches_follow_the_size(cfg, f)
    check_feature_map(cfg.frequency, f.shape)
    size = size_event() if f.size_drawn else None
    p = plan(cfg, f.size, size=size, image_shape=f.shape, n_classes=f.n_classes)
    assert p.epsilon <= f.epsilon + 1e-9 and not p.warnings
    assert epsilon(stage_events(cfg, f.size, size=size), f.job_delta) <= f.epsilon + 1e-9


def test_three_channel_128px_site_of_100000_images_is_refused_over_the_worker_memory() -> None:
    f = DataFacts(100_000, 128, 128, 3, 10, 10.0, memory_mb=MEMORY_MB)
    with pytest.raises(ConfigError) as exc:
        derive(f)
    msg = str(exc.value)
    assert (
        "100,000 images of 3x128x128 need 19.31 GiB" in msg
        and "resources.max_worker_memory_mb 16,384 MiB" in msg
    )
    assert "--image-size" in msg
    derive(DataFacts(40_000, 128, 128, 3, 10, 10.0, memory_mb=MEMORY_MB))  # 40,000 fit


preset_facts = st.builds(
    lambda name, n, side, c, k: (
        name,
        DataFacts(n, side, side, c, k, load_preset(name).privacy.epsilon, memory_mb=MEMORY_MB),
    ),
    st.sampled_from(PRESETS),
    st.integers(300, 100_000),
    st.integers(28, 128),
    st.sampled_from([1, 3]),
    st.integers(2, 100),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=preset_facts)
def test_preset_on_any_shape_is_adapted_by_the_rules_or_refused_naming_the_derived_job(case) -> None:
    name, f = case
    preset = load_preset(name)
    try:
        cfg = fit_preset(preset, name, f)
    except ConfigError as exc:
        msg = str(exc)
        assert "\n" not in msg and f"preset {name}" in msg and "drop --preset and give --epsilon" in msg
        assert (
            "exceeds the dataset size" in msg and f.size < max(preset.central.batch, preset.dpsgd.batch)
        ) or "max_worker_memory_mb" in msg, msg
        return
    check_feature_map(cfg.frequency, f.shape)
    _within_default_resources(cfg, f)
    assert (
        plan(cfg, f.size, image_shape=f.shape, n_classes=f.n_classes).epsilon <= preset.privacy.epsilon + 1e-9
    )
    # the privacy of the preset is never what adapts: the same noise, rates and steps
    assert (cfg.central.sigma, cfg.central.rate, cfg.central.rounds) == (
        preset.central.sigma,
        preset.central.rate,
        preset.central.rounds,
    )
    assert (cfg.frequency.sigma, cfg.frequency.features, cfg.dpsgd) == (
        preset.frequency.sigma,
        preset.frequency.features,
        cfg.dpsgd.__class__(**{**preset.dpsgd.__dict__, "physical_batch": cfg.dpsgd.physical_batch}),
    )
    if f.shape == preset_shape(preset):
        assert cfg == preset


def test_preset_on_its_own_data_is_unchanged_and_on_rgb_64px_keeps_its_query_and_clip_per_value() -> None:
    p = load_preset("cpu-eps10-nodpsgd")
    assert fit_preset(p, "cpu-eps10-nodpsgd", DataFacts(4000, 28, 28, 1, 10, 10.0)) == p
    cfg = fit_preset(p, "cpu-eps10-nodpsgd", DataFacts(4000, 64, 64, 3, 10, 10.0))
    assert int(64 * cfg.central.downsample) == 16  # the 14x14 query's nearest power-of-two side
    assert cfg.central.clip == pytest.approx(2.0 * math.sqrt(3 * 16 * 16 / (14 * 14)), abs=1e-3)
    assert (cfg.frequency.patch, cfg.frequency.stride) == (16, 7)
    assert len(cfg.model.channel_mult) == 3


def _rgb_npz(path, n: int, side: int = 32) -> None:
    rng = np.random.default_rng(0)
    images = rng.random((n, 3, side, side), dtype=np.float32)
    save_npz(ImageDataset(images, np.arange(n, dtype=np.int64) % 4, ("a", "b", "c", "d")), path)


def test_train_preset_whose_batch_exceeds_the_declared_size_is_refused_in_one_line(tmp_path, capsys) -> None:
    _rgb_npz(tmp_path / "rgb.npz", 300, side=64)
    code, _, out = run_cli(
        [
            "train",
            "--preset",
            "xray64-eps10",
            "--data",
            str(tmp_path / "rgb.npz"),
            "--public-size",
            "300",
            "--out",
            str(tmp_path / "run"),
            "--no-progress",
        ],
        capsys,
    )
    assert code == 2, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and "preset xray64-eps10" in lines[0] and "[central] batch 1000" in lines[0], out
    assert "drop --preset and give --epsilon 10" in lines[0] and "Traceback" not in out
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_train_tiny_preset_on_rgb_images_runs_adapted(tmp_path, capsys) -> None:
    _rgb_npz(tmp_path / "rgb.npz", 400)
    code, _, out = run_cli(
        [
            "train",
            "--preset",
            "tiny",
            "--data",
            str(tmp_path / "rgb.npz"),
            "--public-size",
            "400",
            "--out",
            str(tmp_path / "run"),
            "--synthetic",
            "8",
            "--no-progress",
            "--no-release",
        ],
        capsys,
    )
    assert code == 0, out
    assert "note: preset tiny was tuned on 1x28x28 images; adapted to 3x32x32" in out, out
    assert (tmp_path / "run" / "COMPLETE").exists()
