"""The frequency statistic's patch feature map (``[frequency] patch``, mechanisms/feature_map.py): norm 1 for
every image whatever the public parameters (so the release's sensitivity is unchanged), its kernel, its public
determinism, the release's noise, every path that carries it (files, federation, secure sums, aux fit,
config)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from feta_release.config import load_preset
from feta_release.errors import ConfigError, DataError, PrivacyError
from feta_release.mechanisms.feature_map import FeatureMap
from feta_release.mechanisms.frequency import (
    FrequencyRelease,
    combine_frequency,
    embedding_sum,
    frequency_statistics,
    rff_features,
    rff_frequencies,
)

SHAPE = (1, 12, 12)


def _images(n: int, shape=SHAPE, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, *shape), dtype=np.float32)


@settings(max_examples=60, deadline=None)
@given(
    arrays(np.float32, (3, *SHAPE), elements=st.floats(0, 1, width=32)),
    st.integers(1, 14),
    st.integers(1, 6),
    st.integers(0, 3),
    st.integers(0, 99),
)
def test_every_row_has_norm_one_whatever_the_public_parameters(x, patch, stride, extra, seed) -> None:
    """The sensitivity argument: ||phi(x)|| = 1 for any image, patch (capped at the image), stride and feature
    count (the entries left over after P equal blocks are 0)."""
    fmap = FeatureMap(SHAPE, 10**6, patch=patch, stride=stride)  # only its positions are read
    features = 2 * fmap.positions * (1 + extra) + 2 * extra  # some counts leave padding, some do not
    fmap = FeatureMap(SHAPE, features, 105.0, seed, patch, stride)
    phi = fmap(torch.from_numpy(x))
    assert phi.shape == (3, features) and torch.isfinite(phi).all()
    assert torch.allclose(phi.norm(dim=1), torch.ones(3), atol=1e-5)
    used = fmap.positions * fmap.per_position
    assert used <= features and torch.count_nonzero(phi[:, used:]) == 0


def test_kernel_is_the_mean_over_positions_of_a_gaussian_on_patches() -> None:
    """phi(x).phi(x') -> mean_p exp(-||x_p - x'_p||^2 / (2 b2 k^2 / (H W))). With 10,000 frequencies per patch
    the estimate's std is < 1/sqrt(2 * 10,000) = 0.007; tolerance 0.035 (5 sd)."""
    x = torch.from_numpy(_images(5, seed=3))
    k, s, b2 = 5, 3, 20.0
    fmap = FeatureMap(SHAPE, 2 * 10_000 * 9, b2, 1, patch=k, stride=s)  # (12 - 5) // 3 + 1 = 3 -> 9 positions
    assert fmap.positions == 9 and fmap.per_position == 20_000
    phi = fmap(x)
    cols = torch.nn.functional.unfold(x, k, stride=s).transpose(1, 2)  # (B, P, k k)
    d2 = ((cols[:, None] - cols[None]) ** 2).sum(-1)  # (B, B, P)
    exact = torch.exp(-d2 / (2 * b2 * k * k / 144)).mean(-1)
    assert float((phi @ phi.T - exact).abs().max()) < 0.035


def test_omega_is_public_and_seeded_and_a_whole_image_patch_is_the_pixel_map() -> None:
    a, b = FeatureMap(SHAPE, 64, patch=4, stride=4), FeatureMap(SHAPE, 64, patch=4, stride=4)
    assert torch.equal(a.omega, b.omega) and a.omega.shape == (16, 3)  # 9 positions x 6 features = 54 of 64
    expected = np.random.Generator(np.random.PCG64(1234)).standard_normal((16, 3)) / math.sqrt(
        105.0 * 16 / 144
    )
    assert np.array_equal(a.omega.numpy(), expected.astype(np.float32))
    assert not torch.equal(a.omega, FeatureMap(SHAPE, 64, seed=7, patch=4, stride=4).omega)
    x = torch.from_numpy(_images(4))
    whole = FeatureMap(SHAPE, 40, patch=99)  # capped at 12: one position, the pixel map's kernel and omega
    assert whole.size == 12 and whole.positions == 1
    torch.testing.assert_close(whole(x), rff_features(x.reshape(4, -1), rff_frequencies(144, 40)))


def test_too_few_features_for_the_positions_is_one_line_with_the_fix() -> None:
    with pytest.raises(
        ConfigError, match=r"features 10 are too few for 100 patch positions.*raise features or stride"
    ):
        FeatureMap(SHAPE, 10, patch=3, stride=1)
    with pytest.raises(ConfigError, match="stride >= 1"):
        FeatureMap(SHAPE, 10, patch=3, stride=0)
    # scaled without overflow
    assert FeatureMap(SHAPE, 64, 1e308, patch=4, stride=4).kernel_bandwidth2 < math.inf
    for b2 in (5e-324, math.inf):  # scaled to a patch: 0 or inf; refused before any charge, not in omega
        with pytest.raises(PrivacyError, match="bandwidth2"):
            FeatureMap(SHAPE, 64, b2, patch=4, stride=4)


def test_peak_rows_of_a_node_release_do_not_depend_on_the_count(monkeypatch) -> None:
    """A node maps its N real rows, then P - N dummy rows (edge.padded_releases). With a coordinator's
    huge ``[frequency] chunk`` each pass mapped all its rows at once, so the peak memory was max(N, P - N): an
    out-of-memory threshold on the private count. Steps are now capped at P / 2 (``release_chunk``): the
    largest step, over both passes, is the same for every N; rows in all = P, as before (the timing
    padding)."""
    import feta_release.mechanisms.feature_map as fmod

    seen: list[int] = []
    real_call = fmod.FeatureMap.__call__
    monkeypatch.setattr(
        fmod.FeatureMap, "__call__", lambda self, x: seen.append(len(x)) or real_call(self, x)
    )
    public, peaks = 40, set()
    for n in (1, 7, 20, 33, 39):
        seen.clear()
        for rows in (n, public - n):  # the release, then its padding
            x, y = _images(rows, seed=n), np.arange(rows) % 3
            frequency_statistics(
                x,
                y,
                3,
                features=90,
                sigma=1.0,
                n_public=public,
                rng=np.random.default_rng(0),
                chunk=10**6,
                patch=4,
                stride=4,
            )
        assert sum(seen) == public
        peaks.add(max(seen))
    assert peaks == {20}


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 59), st.integers(0, 10**6))
def test_one_more_image_moves_the_exact_sum_by_at_most_one(which: int, seed: int) -> None:
    """Add/remove one image: the un-noised per-class sum moves by phi(x) in one column, norm <= 1 (sensitivity
    1/N once divided by the public N), through the streamed release path with patches."""
    x = _images(60, seed=seed % 1000)
    y = np.arange(60) % 3
    fmap = FeatureMap(SHAPE, 200, 105.0, 5, patch=5, stride=2)
    full = embedding_sum(x, y, 3, fmap, chunk=16)
    keep = np.arange(60) != which
    less = embedding_sum(x[keep], y[keep], 3, fmap, chunk=16)
    assert np.linalg.norm(full - less) <= 1.0 + 1e-5


def test_release_noise_has_std_sigma_over_n_with_patches() -> None:
    """E + N(0, (sigma/N)^2): the residuals of 200 x 3 entries have std sigma/N; 600 draws give the std within
    ~3 % (1 sd); tolerance 15 %."""
    x, y = _images(50), np.arange(50) % 3
    rel, event = frequency_statistics(
        x, y, 3, features=200, sigma=2.0, n_public=40, rng=np.random.default_rng(7), patch=4, stride=4
    )
    exact = embedding_sum(x, y, 3, FeatureMap(SHAPE, 200, patch=4, stride=4)) / 40
    assert (rel.patch, rel.stride, event.sigma, event.q, event.steps) == (4, 4, 2.0, 1.0, 1)
    assert float(np.std(rel.embedding - exact)) == pytest.approx(2.0 / 40, rel=0.15)


def test_release_arrays_carry_the_map_and_old_files_read_as_the_pixel_map() -> None:
    x, y = _images(30), np.arange(30) % 3
    rel, _ = frequency_statistics(
        x, y, 3, features=64, sigma=1.0, n_public=30, rng=np.random.default_rng(1), patch=6, stride=3
    )
    back = FrequencyRelease.from_arrays(rel.to_arrays())
    assert (back.patch, back.stride) == (6, 3) and back.feature_map() == rel.feature_map()
    pixel, _ = frequency_statistics(
        x, y, 3, features=64, sigma=1.0, n_public=30, rng=np.random.default_rng(1)
    )
    arrays = pixel.to_arrays()
    assert "patch" not in arrays and "stride" not in arrays  # byte-for-byte the files of before the option
    assert FrequencyRelease.from_arrays(arrays).patch == 0
    with pytest.raises(DataError, match="patch, stride"):
        combine_frequency([rel, pixel])


def test_aux_generator_fits_through_the_patch_map() -> None:
    from feta_release.training.frequency import aux_draw, fit_aux_generator

    cfg = load_preset("tiny").replace(
        auxgen={"epochs": 2, "iterations_per_epoch": 5}, frequency={"patch": 4, "stride": 4}
    )
    x, y = _images(60), np.arange(60) % 3
    rel, _ = frequency_statistics(
        x, y, 3, features=90, sigma=0.5, n_public=60, rng=np.random.default_rng(2), patch=4, stride=4
    )
    res = fit_aux_generator(
        rel.embedding,
        rel.feature_map(),
        SHAPE,
        3,
        cfg,
        60,
        generator=torch.Generator().manual_seed(0),
        return_result=True,
    )
    assert res.steps == 10 and all(math.isfinite(v) for v in res.losses)
    assert res.losses[-1] < res.losses[0]
    imgs = aux_draw(res.generator, np.arange(6) % 3, torch.Generator().manual_seed(1))
    assert imgs.shape == (6, *SHAPE)
    with pytest.raises(DataError, match="embedding has 90 features but omega gives 64"):
        fit_aux_generator(
            rel.embedding,
            FeatureMap(SHAPE, 64, patch=4, stride=4),
            SHAPE,
            3,
            cfg,
            60,
            generator=torch.Generator().manual_seed(0),
        )


def test_secure_sum_contribution_uses_the_job_map() -> None:
    """The secure-aggregation path records the same phi as the direct release: decoded sum == exact sum within
    the Skellam noise (sigma 0.05 x clip 1 per entry) and the quantisation."""
    import feta_release.mechanisms.secure_sums as ss

    cfg = load_preset("tiny").replace(frequency={"features": 64, "sigma": 0.05, "patch": 6, "stride": 3})
    x, y = _images(40), np.arange(40) % 3
    res = ss.job_contribution(
        "frequency", x, y, 3, cfg, n_public=40, n_sites=1, modulus_bits=64, rng=np.random.default_rng(0)
    )
    lay = ss.frequency_layout(3, 64)
    rel = ss.decode_frequency(
        res,
        lay,
        ss.block_params(64, 1.0, 0.05, 1),
        total_public=40,
        bandwidth2=105.0,
        seed=1234,
        sigma=0.05,
        image_shape=SHAPE,
        patch=6,
        stride=3,
    )
    exact = embedding_sum(x, y, 3, FeatureMap(SHAPE, 64, patch=6, stride=3)) / 40
    assert rel.patch == 6 and float(np.abs(rel.embedding - exact).max()) < 0.05 * 6 / 40
    pixel = embedding_sum(x, y, 3, FeatureMap(SHAPE, 64)) / 40
    assert float(np.abs(rel.embedding - pixel).max()) > 0.05  # a different statistic: the map was used


def test_config_keeps_the_pixel_job_hash_and_refuses_bad_values() -> None:
    base = load_preset("cpu-eps10-nodpsgd").replace(frequency={"patch": 0, "stride": 1})
    assert "patch" not in base.to_dict()["frequency"] and "stride" not in base.to_dict()["frequency"]
    patched = base.replace(frequency={"patch": 7, "stride": 3})
    assert patched.to_dict()["frequency"]["patch"] == 7 and patched.to_dict() != base.to_dict()
    with pytest.raises(ConfigError, match=r"patch must be in \[0, 65536\]"):
        base.replace(frequency={"patch": -1})
    with pytest.raises(ConfigError, match=r"stride in \[1, 65536\]"):
        base.replace(frequency={"patch": 3, "stride": 0})
    with pytest.raises(ConfigError, match="applies to the patch map only"):  # a pixel job hashes one way only
        base.replace(frequency={"stride": 5})
    for bad in ({"patch": 2**64}, {"patch": 3, "stride": 2**64}, {"seed": -1}, {"seed": 2**64}):
        with pytest.raises(ConfigError):
            base.replace(frequency=bad)


def test_pooled_frequency_refuses_releases_of_another_map() -> None:
    from feta_release.federation.warmup import pooled_frequency

    x, y = _images(30), np.arange(30) % 3
    cfg = load_preset("tiny").replace(frequency={"features": 64, "patch": 6, "stride": 3})
    rel, _ = frequency_statistics(
        x, y, 3, features=64, sigma=1.0, n_public=30, rng=np.random.default_rng(1), patch=6, stride=3
    )
    arrays = {k: np.asarray(v) for k, v in rel.to_arrays().items()}
    assert pooled_frequency({"a": arrays}, {"a": 30}, cfg).patch == 6
    with pytest.raises(DataError, match="not made for this job"):
        pooled_frequency({"a": arrays}, {"a": 30}, cfg.replace(frequency={"patch": 0, "stride": 1}))


def test_train_refuses_a_map_too_big_for_the_images_before_writing(tmp_path) -> None:
    from feta_release.data import load_embedded
    from tests.support.training import train_run

    data = load_embedded().subset(np.arange(0, 5000, 25))
    cfg = load_preset("tiny").replace(frequency={"features": 64, "patch": 3, "stride": 1})  # 676 positions
    with pytest.raises(ConfigError, match="too few for 676 patch positions"):
        train_run(cfg, data, tmp_path / "run", n_synthetic=10)
    assert not (tmp_path / "run" / "site" / "ledger.sqlite").exists()
    with pytest.raises(ConfigError, match="too few for 676 patch positions"):  # a declared size: the same
        train_run(cfg, data, tmp_path / "declared", n_synthetic=10, public_size=200)
    assert not (tmp_path / "declared" / "site" / "ledger.sqlite").exists()


def test_node_refuses_a_map_too_big_for_its_declared_shape_before_charging(tmp_path) -> None:
    """A coordinator-signed job whose patch map cannot be built on the site's declared image shape is refused
    at the node before the ledger is charged (it used to fail only inside the release, after the charge)."""
    from coordinator.setup import sign_job_file
    from feta_release.federation import messages as fm
    from feta_release.ledger import Ledger
    from tests.support.federation import full_job, harness, make_federation

    fed = make_federation(tmp_path / "fed")
    signed, _ = sign_job_file(fed, full_job(frequency={"features": 64, "patch": 3, "stride": 1}), "job-fmap")
    grid = harness(fed)
    for kind in (fm.CENTRAL, fm.FREQUENCY):
        (rep,) = grid.send_and_receive(
            [grid.create_message(fm.make_payload({"job": signed}), kind, 100, "t")]
        )
        assert rep.has_error() and "patch positions" in rep.error.reason
    with Ledger(fed.sites[0].ledger) as led:
        assert led.job_events("job-fmap") == []


@pytest.mark.parametrize(
    "shape,positions,per",
    [((1, 28, 28), 64, 32), ((3, 32, 32), 81, 24), ((1, 64, 64), 400, 4), ((1, 8, 8), 1, 2048)],
)
def test_the_eps10_preset_map_fits_other_image_sizes(shape, positions, per) -> None:
    """``cpu-eps10-nodpsgd``'s 2,048 features shared out over the patch positions of other image sizes."""
    f = load_preset("cpu-eps10-nodpsgd").frequency
    fmap = FeatureMap(shape, f.features, f.bandwidth2, f.seed, f.patch, f.stride)
    assert (fmap.positions, fmap.per_position) == (positions, per)
    phi = fmap(torch.rand(2, *shape))
    assert phi.shape == (2, 2048) and torch.allclose(phi.norm(dim=1), torch.ones(2), atol=1e-5)
