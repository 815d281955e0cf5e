"""Frequency statistics (random Fourier features): features, noise scale, sensitivity, streaming, refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from feta_release.accounting import PrivacyEvent
from feta_release.errors import DataError, PrivacyError
from feta_release.mechanisms import frequency as fm
from feta_release.mechanisms.frequency import (
    FrequencyRelease,
    combine_frequency,
    embedding_sum,
    frequency_statistics,
    rff_features,
    rff_frequencies,
)

K = 3


def data(
    n: int = 90, shape: tuple[int, int, int] = (1, 6, 6), seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    return g.random((n, *shape), dtype=np.float32), np.arange(n) % K


def test_frequencies_are_seeded_numpy_draws() -> None:
    w = rff_frequencies(36, 400, 105.0, seed=11)
    assert w.shape == (36, 200) and w.dtype == torch.float32
    assert torch.equal(w, rff_frequencies(36, 400, 105.0, seed=11))  # same public seed -> same omega
    assert not torch.equal(w, rff_frequencies(36, 400, 105.0, seed=12))
    expected = np.random.Generator(np.random.PCG64(11)).standard_normal((36, 200)) / math.sqrt(105.0)
    assert np.array_equal(w.numpy(), expected.astype(np.float32))  # bit-identical on any machine
    # std 1/sqrt(105) from 7,200 draws: relative se of the std 0.8 %, tolerance 4 %.
    assert float(w.std()) == pytest.approx(1 / math.sqrt(105.0), rel=0.04)


@settings(max_examples=50, deadline=None)
@given(
    arrays(np.float32, (4, 10), elements=st.floats(0, 1, width=32)), st.integers(1, 64), st.integers(0, 999)
)
def test_features_have_unit_norm(x: np.ndarray, half: int, seed: int) -> None:
    phi = rff_features(torch.from_numpy(x), rff_frequencies(10, 2 * half, 105.0, seed))
    assert phi.shape == (4, 2 * half) and phi.dtype == torch.float32
    assert torch.allclose(phi.norm(dim=1), torch.ones(4), atol=1e-5)


def test_features_approximate_the_gaussian_kernel() -> None:
    """phi(x).phi(x') -> exp(-||x-x'||^2 / (2 b2)).  With F/2 = 10,000 frequencies the estimate's std is
    < 1/sqrt(2 * 10,000) = 0.007; tolerance 0.035 (5 sd)."""
    g = np.random.default_rng(3)
    x = torch.from_numpy(g.random((6, 36), dtype=np.float32))
    phi = rff_features(x, rff_frequencies(36, 20000, 5.0, seed=1))
    approx = (phi @ phi.T).numpy()
    d2 = ((x[:, None] - x[None]) ** 2).sum(-1).numpy()
    assert np.allclose(approx, np.exp(-d2 / (2 * 5.0)), atol=0.035)


def test_features_are_differentiable() -> None:
    x = torch.rand(2, 36, requires_grad=True)
    rff_features(x, rff_frequencies(36, 64, 105.0, 0)).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_event_and_noise_scale() -> None:
    """Noise = release - clean statistic; std must be sigma / N.  2,000 x 3 = 6,000 draws: relative se of
    the sample std 0.9 %; tolerance 5 % (> 5 se), far from e.g. sigma alone or sigma / sqrt(N)."""
    x, y = data()
    sigma, n_public = 4.0, 90
    rel, ev = frequency_statistics(
        x, y, K, features=2000, sigma=sigma, seed=2, n_public=n_public, rng=np.random.default_rng(42)
    )
    assert ev == PrivacyEvent("frequency", sigma, 1.0, 1)
    assert rel.embedding.shape == (2000, K) and rel.embedding.dtype == np.float32
    clean = embedding_sum(x, y, K, rff_frequencies(36, 2000, 105.0, 2)) / n_public
    noise = rel.embedding.astype(np.float64) - clean
    assert noise.std() == pytest.approx(sigma / n_public, rel=0.05)
    assert abs(noise.mean()) < 4 * (sigma / n_public) / math.sqrt(noise.size)


def test_statistic_definition() -> None:
    x, y = data(n=9)
    w = rff_frequencies(36, 50, 105.0, 0)
    phi = rff_features(torch.from_numpy(x.reshape(9, -1)), w).double().numpy()
    expected = np.stack([phi[y == k].sum(0) for k in range(K)], axis=1)
    assert np.allclose(embedding_sum(x, y, K, w), expected, atol=1e-5)


@settings(max_examples=12, deadline=None)
@given(arrays(np.float32, (1, 1, 6, 6), elements=st.floats(0, 1, width=32)), st.integers(0, K - 1))
def test_sensitivity_is_one_over_n(extra: np.ndarray, cls: int) -> None:
    """Adding any one image moves E = sum phi (x) onehot / N by exactly ||phi|| / N = 1/N (Frobenius)."""
    x, y = data(n=30)
    n_public = 30
    w = rff_frequencies(36, 200, 105.0, 4)
    base = embedding_sum(x, y, K, w) / n_public
    plus = embedding_sum(np.concatenate([x, extra]), np.append(y, cls), K, w) / n_public
    assert np.linalg.norm(plus - base) == pytest.approx(1 / n_public, rel=1e-4)


def test_streams_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """No buffer of N x features: the feature map never sees more than ``chunk`` images at once."""
    seen: list[tuple[int, int]] = []
    real = fm._features_into

    def spy(x: torch.Tensor, omega: torch.Tensor, proj: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
        seen.append((x.shape[0], phi.shape[0]))
        return real(x, omega, proj, phi)

    monkeypatch.setattr(fm, "_features_into", spy)
    x, y = data(n=90)
    a, _ = frequency_statistics(
        x, y, K, features=100, sigma=1.0, n_public=90, rng=np.random.default_rng(1), chunk=7
    )
    assert max(r for r, _ in seen) == 7 and sum(r for r, _ in seen) == 90
    assert {buf for _, buf in seen} == {7}  # the feature buffer itself holds 7 rows
    seen.clear()
    b, _ = frequency_statistics(
        x, y, K, features=100, sigma=1.0, n_public=90, rng=np.random.default_rng(1), chunk=512
    )
    assert seen == [(45, 45), (45, 45)]  # steps capped at half the public size (feature_map.release_chunk)
    assert np.allclose(a.embedding, b.embedding, atol=1e-6)  # chunking does not change the statistic


def test_per_class_columns_ignore_other_classes() -> None:
    x, y = data()
    x2 = x.copy()
    x2[y == 2] = 1.0 - x2[y == 2]
    a, _ = frequency_statistics(x, y, K, features=300, sigma=1.0, n_public=90, rng=np.random.default_rng(3))
    b, _ = frequency_statistics(x2, y, K, features=300, sigma=1.0, n_public=90, rng=np.random.default_rng(3))
    assert np.array_equal(a.embedding[:, :2], b.embedding[:, :2])
    assert not np.array_equal(a.embedding[:, 2], b.embedding[:, 2])


def test_refuses_bad_parameters() -> None:
    x, y = data()
    ok = dict(features=100, sigma=1.0, n_public=90, rng=np.random.default_rng(0))
    for bad in [
        dict(sigma=0.0),
        dict(sigma=-2.0),
        dict(features=101),
        dict(features=0),
        dict(n_public=0),
        dict(chunk=0),
        dict(rng="seed"),
        dict(bandwidth2=0.0),
    ]:
        with pytest.raises(PrivacyError):
            frequency_statistics(x, y, K, **{**ok, **bad})
    with pytest.raises(DataError, match="empty"):
        frequency_statistics(x[:0], y[:0], K, **ok)
    nan = x.copy()
    nan[0, 0, 0, 0] = np.nan
    with pytest.raises(DataError, match="NaN"):
        frequency_statistics(nan, y, K, **ok)
    with pytest.raises(DataError, match="labels"):
        frequency_statistics(x, y - 1, K, **ok)


def test_combine_weighted_by_public_sizes() -> None:
    x, y = data()
    a, _ = frequency_statistics(
        x[:60], y[:60], K, features=100, sigma=1.0, n_public=60, rng=np.random.default_rng(1)
    )
    b, _ = frequency_statistics(
        x[60:], y[60:], K, features=100, sigma=1.0, n_public=30, rng=np.random.default_rng(2)
    )
    c = combine_frequency([a, b])
    assert c.n_public == 90
    assert np.allclose(c.embedding, (60 * a.embedding + 30 * b.embedding) / 90, atol=1e-6)
    # Without noise, combining sites equals the statistic of the pooled data.
    a0, _ = frequency_statistics(
        x[:60], y[:60], K, features=100, sigma=1e-9, n_public=60, rng=np.random.default_rng(1)
    )
    b0, _ = frequency_statistics(
        x[60:], y[60:], K, features=100, sigma=1e-9, n_public=30, rng=np.random.default_rng(2)
    )
    pooled, _ = frequency_statistics(
        x, y, K, features=100, sigma=1e-9, n_public=90, rng=np.random.default_rng(3)
    )
    assert np.allclose(combine_frequency([a0, b0]).embedding, pooled.embedding, atol=1e-6)
    # Saved arrays (e.g. a loaded .npz) and explicit public sizes are accepted.
    d = combine_frequency([a.to_arrays(), b.to_arrays()], sizes=[1, 1])
    assert np.allclose(d.embedding, (a.embedding + b.embedding) / 2, atol=1e-6)
    back = FrequencyRelease.from_arrays({k: np.copy(v) for k, v in a.to_arrays().items()})
    assert np.array_equal(back.embedding, a.embedding)
    assert (back.n_public, back.features, back.bandwidth2, back.seed, back.sigma, back.image_shape) == (
        a.n_public,
        a.features,
        a.bandwidth2,
        a.seed,
        a.sigma,
        a.image_shape,
    )
    assert torch.equal(back.omega(), a.omega())
    other, _ = frequency_statistics(
        x, y, K, features=100, sigma=1.0, n_public=90, rng=np.random.default_rng(1), seed=99
    )
    with pytest.raises(DataError, match="same public frequencies"):
        combine_frequency([a, other])
    with pytest.raises(DataError):
        combine_frequency([])


@settings(max_examples=40, deadline=None)
@given(log_bw=st.floats(-300, 6), bright=st.floats(0.0, 1.0), seed=st.integers(0, 2**31 - 1))
def test_every_record_row_is_finite_with_norm_at_most_one_for_any_bandwidth(log_bw, bright, seed) -> None:
    """Whatever bandwidth2 the coordinator signs, phi(x) is finite with ||phi(x)|| <= 1 for every image
    alone (streamed sums and the differentiable features alike), so the sensitivity holds and no NaN flags a
    record."""
    x = np.full((4, 36), bright, dtype=np.float32)
    x[0] = 0.0
    omega = rff_frequencies(36, 8, bandwidth2=10.0**log_bw, seed=seed)
    phi = rff_features(torch.from_numpy(x), omega)
    assert torch.isfinite(phi).all() and (phi.norm(dim=1) <= 1 + 1e-5).all()
    labels = np.zeros(4, dtype=np.int64)
    total = embedding_sum(x.reshape(4, 1, 6, 6), labels, 1, omega)
    assert np.isfinite(total).all() and np.linalg.norm(total) <= 4 + 1e-4


@pytest.mark.parametrize("clip", [7.0e-45, 1.07e-44, 1e-7, float("nan"), float("inf")])
def test_a_clip_below_the_float32_floor_is_refused_by_every_clipping_mechanism(clip) -> None:
    """A subnormal clip rounded each clipped entry UP (one record moved a sum by ~2x the clip the
    noise is scaled to). Central query, DP-SGD's clip_and_sum and the job config all refuse below MIN_CLIP."""
    from feta_release.config import load_preset
    from feta_release.errors import ConfigError
    from feta_release.mechanisms.central import central_query
    from feta_release.training.dpsgd import clip_and_sum

    with pytest.raises(PrivacyError, match="clip must be a finite number >= 1e-06"):
        central_query(np.ones((1, 1, 4, 4), np.float32), np.array([0]), 2, kind="mean", clip=clip)
    with pytest.raises(PrivacyError, match="clip must be a finite number >= 1e-06"):
        clip_and_sum({"w": torch.ones(1, 3)}, clip)
    for section in ("central", "dpsgd"):
        with pytest.raises(ConfigError, match=rf"\[{section}\] clip(: must be finite| must be >= 1e-06)"):
            load_preset("tiny").replace(**{section: {"clip": clip}})
