"""Central images (mean / mode): noise scale, sensitivity, per-class independence, sampling, refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from scipy.stats import norm

from feta_release.accounting import PrivacyEvent
from feta_release.errors import DataError, PrivacyError
from feta_release.mechanisms.central import (
    CentralRelease,
    central_images,
    central_query,
    clip_rows,
    combine_central,
    downsample_nearest,
    postprocess_central,
    stretch_contrast,
)

K = 4


def data(
    n: int = 200, shape: tuple[int, int, int] = (1, 12, 12), seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    return g.random((n, *shape), dtype=np.float32), np.arange(n) % K


def test_event_and_shapes() -> None:
    x, y = data()
    rel, ev = central_images(
        x, y, K, rounds=3, batch=50, sigma=2.0, n_public=200, rng=np.random.default_rng(0)
    )
    assert ev == PrivacyEvent("central", 2.0, 0.25, 3)
    assert rel.values.shape == (3 * K, 1, 6, 6) and rel.values.dtype == np.float32
    assert rel.labels.tolist() == list(range(K)) * 3
    assert rel.denominator == 50 / K and rel.clip == pytest.approx(6.0)  # sqrt(1*6*6)
    mode, ev2 = central_images(
        x, y, K, kind="mode", rounds=2, batch=50, sigma=2.0, n_public=200, rng=np.random.default_rng(0)
    )
    assert ev2 == PrivacyEvent("central", 2.0, 0.25, 2) and mode.bins == 2
    assert set(np.unique(mode.values)) <= {0.25, 0.75}  # bin midpoints of 2 bins
    colour, _ = central_images(
        *data(shape=(3, 8, 8)),
        K,
        kind="mode",
        rounds=1,
        batch=50,
        sigma=1.0,
        n_public=200,
        rng=np.random.default_rng(0),
    )
    assert colour.bins == 16
    back = CentralRelease.from_arrays(rel.to_arrays())
    assert np.array_equal(back.values, rel.values) and back.clip == rel.clip and back.kind == "mean"


def test_mean_noise_scale_matches_sigma_times_clip() -> None:
    """With q = 1 the query is deterministic, so released * B_c - query is exactly the noise.

    20 rounds x 4 classes x 36 pixels = 2,880 draws: the sample std has relative standard error
    1/sqrt(2n) = 1.3 %; a 6 % tolerance is > 4.5 standard errors (false failure rate < 1e-5 at a fixed seed)
    yet rules out a wrong scale such as sigma*C/B_c or sigma alone."""
    x, y = data()
    sigma, batch = 3.0, 200
    rel, _ = central_images(
        x, y, K, rounds=20, batch=batch, sigma=sigma, n_public=200, rng=np.random.default_rng(123)
    )
    query, sens = central_query(x, y, K)
    noise = rel.values.reshape(20, K, -1) * rel.denominator - query[None]
    assert sens == pytest.approx(6.0)
    assert noise.std() == pytest.approx(sigma * sens, rel=0.06)
    assert abs(noise.mean()) < 4 * sigma * sens / math.sqrt(noise.size)  # unbiased: within 4 standard errors


def test_mean_divides_by_public_denominator_not_actual_count() -> None:
    x, y = data(n=120)
    y = np.where(np.arange(120) < 90, 0, 1)  # very unequal classes: 90 vs 30 (K = 2)
    rel, _ = central_images(
        x, y, 2, rounds=1, batch=120, sigma=1e-9, n_public=120, rng=np.random.default_rng(0)
    )
    sums, _ = central_query(x, y, 2)
    assert np.allclose(rel.values.reshape(2, -1), sums / 60.0, atol=1e-6)  # B_c = 120 / 2, not 90 or 30


def test_poisson_sampling_rate() -> None:
    """All-ones images: released * B_c at any pixel counts the sampled images of that class."""
    n, q = 400, 0.3
    x = np.ones((n, 1, 4, 4), dtype=np.float32)
    y = np.arange(n) % 2
    rel, _ = central_images(
        x, y, 2, rounds=50, batch=int(q * n), sigma=1e-9, n_public=n, rng=np.random.default_rng(7)
    )
    # a downsampled all-ones 2x2 image has norm 2 = C, so clipping leaves it intact: each pixel of a class's
    # sum counts that class's sampled images exactly
    counts = rel.values[:, 0, 0, 0] * rel.denominator
    assert np.allclose(counts, np.round(counts), atol=1e-5)
    # Binomial(200, 0.3) per class and round: mean 60, sd 6.5; 100 draws -> se 0.65; allow 4 se.
    assert abs(counts.mean() - q * n / 2) < 4 * math.sqrt(n / 2 * q * (1 - q) / counts.size)
    assert counts.std() == pytest.approx(math.sqrt(n / 2 * q * (1 - q)), rel=0.3)


def test_mode_noise_scale_via_flip_rate() -> None:
    """2 bins, every image black: H[pixel] = (m, 0).  A pixel comes out white iff noise0 - noise1 < -m, with
    noise std sigma*sqrt(P) per bin: P(black) = Phi(m / (sigma * sqrt(2P))).  Picking sigma so that this is
    Phi(1) = 0.841, 30 rounds x 36 pixels = 1,080 Bernoulli draws give se 0.011; tolerance 0.05 (> 4 se)
    still rejects the scale without sqrt(P) (P(black) ~ 1.0) or with P instead of sqrt(P) (~0.53)."""
    m = 40
    x = np.zeros((m, 1, 12, 12), dtype=np.float32)
    y = np.zeros(m, dtype=np.int64)
    p = 36
    sigma = m / math.sqrt(2 * p)
    rel, _ = central_images(
        x, y, 1, kind="mode", rounds=30, batch=m, sigma=sigma, n_public=m, rng=np.random.default_rng(5)
    )
    black = float((rel.values == 0.25).mean())
    assert black == pytest.approx(norm.cdf(1.0), abs=0.05)


def test_mode_without_noise_is_the_true_mode() -> None:
    x = np.zeros((30, 1, 4, 4), dtype=np.float32)
    x[:20, :, :2] = 1.0  # top half white in 20 of 30 images
    y = np.zeros(30, dtype=np.int64)
    rel, _ = central_images(
        x,
        y,
        1,
        kind="mode",
        rounds=1,
        batch=30,
        sigma=1e-6,
        n_public=30,
        rng=np.random.default_rng(0),
        downsample=1.0,
    )
    assert np.all(rel.values[0, 0, :2] == 0.75) and np.all(rel.values[0, 0, 2:] == 0.25)


@pytest.mark.parametrize("kind", ["mean", "mode"])
def test_sensitivity_worst_case_neighbours(kind: str) -> None:
    """Add one image (all-ones: the max-norm image) to a class: the pre-noise query moves by <= its bound,
    with equality for the worst case; removal is the same pair read the other way."""
    x, y = data()
    base, bound = central_query(x, y, K, kind=kind)
    for extra, cls in [
        (np.ones((1, 1, 12, 12), np.float32), 0),
        (np.zeros((1, 1, 12, 12), np.float32), 3),
        (np.random.default_rng(1).random((1, 1, 12, 12), dtype=np.float32), 2),
    ]:
        plus, _ = central_query(np.concatenate([x, extra]), np.append(y, cls), K, kind=kind)
        diff = float(np.linalg.norm(plus - base))
        assert diff <= bound + 1e-9
        if kind == "mode" or extra.max() == 1.0 and extra.min() == 1.0:
            assert diff == pytest.approx(bound)  # tight: mode always, mean for the all-ones image
    # A lower clip bound caps the all-ones image's contribution at exactly that bound.
    base, bound = central_query(x, y, K, clip=2.5)
    plus, _ = central_query(
        np.concatenate([x, np.ones((1, 1, 12, 12), np.float32)]), np.append(y, 1), K, clip=2.5
    )
    assert bound == 2.5 and np.linalg.norm(plus - base) == pytest.approx(2.5, rel=1e-6)


@pytest.mark.parametrize("kind", ["mean", "mode"])
def test_per_class_outputs_ignore_other_classes(kind: str) -> None:
    x, y = data()
    x2 = x.copy()
    x2[y == 1] = 1.0 - x2[y == 1]  # change every image of class 1 only
    a, _ = central_images(
        x, y, K, kind=kind, rounds=3, batch=100, sigma=0.5, n_public=200, rng=np.random.default_rng(9)
    )
    b, _ = central_images(
        x2, y, K, kind=kind, rounds=3, batch=100, sigma=0.5, n_public=200, rng=np.random.default_rng(9)
    )
    other = a.labels != 1
    assert np.array_equal(a.values[other], b.values[other])
    assert not np.array_equal(a.values[~other], b.values[~other])
    qa, _ = central_query(x, y, K, kind=kind)
    qb, _ = central_query(x2, y, K, kind=kind)
    assert np.array_equal(np.delete(qa, 1, axis=0), np.delete(qb, 1, axis=0))


def test_refuses_bad_parameters() -> None:
    x, y = data()
    ok = dict(rounds=1, batch=10, sigma=1.0, n_public=200, rng=np.random.default_rng(0))
    for bad, err in [
        (dict(sigma=0.0), PrivacyError),
        (dict(sigma=-1.0), PrivacyError),
        (dict(sigma=float("nan")), PrivacyError),
        (dict(batch=201), PrivacyError),
        (dict(batch=0), PrivacyError),
        (dict(rounds=0), PrivacyError),
        (dict(n_public=0), PrivacyError),
        (dict(kind="median"), PrivacyError),
        (dict(rng=None), PrivacyError),
        (dict(clip=0.0), PrivacyError),
        (dict(kind="mode", bins=1), PrivacyError),
    ]:
        with pytest.raises(err):
            central_images(x, y, K, **{**ok, **bad})
    with pytest.raises(DataError, match="empty"):
        central_images(x[:0], y[:0], K, **ok)
    nan = x.copy()
    nan[3, 0, 1, 1] = np.nan
    with pytest.raises(DataError, match="NaN"):
        central_images(nan, y, K, **ok)
    with pytest.raises(DataError, match=r"\[0, 1\]"):
        central_images(x * 2, y, K, **ok)
    with pytest.raises(DataError, match="labels"):
        central_images(x, y + 1, K, **ok)
    with pytest.raises(DataError, match="labels"):
        central_images(x, y[:-1], K, **ok)
    with pytest.raises(DataError, match="float"):
        central_images((x * 255).astype(np.uint8), y, K, **ok)


@settings(max_examples=50, deadline=None)
@given(arrays(np.float32, (5, 7), elements=st.floats(-100, 100, width=32)), st.floats(0.01, 50))
def test_clipping_bound_property(x: np.ndarray, clip: float) -> None:
    out = clip_rows(x, clip)
    norms = np.linalg.norm(out.astype(np.float64), axis=1)
    assert np.all(norms <= clip * (1 + 1e-5))
    small = np.linalg.norm(x.astype(np.float64), axis=1) <= clip
    assert np.allclose(out[small], x[small])  # rows inside the ball are untouched


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 5), st.integers(2, 6), st.sampled_from(["mean", "mode"]), st.integers(0, 2**31))
def test_release_invariants(rounds: int, n_classes: int, kind: str, seed: int) -> None:
    g = np.random.default_rng(seed)
    x = g.random((40, 1, 6, 6), dtype=np.float32)
    y = g.integers(0, n_classes, 40)
    rel, ev = central_images(
        x,
        y,
        n_classes,
        kind=kind,
        rounds=rounds,
        batch=20,
        sigma=1.0,
        n_public=40,
        rng=np.random.default_rng(seed),
    )
    assert rel.values.shape == (rounds * n_classes, 1, 3, 3) and np.isfinite(rel.values).all()
    assert ev.steps == rounds and ev.q == 0.5
    img, lab = postprocess_central(rel)
    assert img.shape == (rounds * n_classes, 1, 6, 6) and img.min() >= 0 and img.max() <= 1
    assert np.array_equal(lab, rel.labels)


def test_downsample_nearest_takes_every_other_pixel() -> None:
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4) / 16
    assert np.array_equal(downsample_nearest(x, 0.5)[0, 0], x[0, 0, ::2, ::2])


def test_postprocess_is_documented_pipeline() -> None:
    x, y = data()
    rel, _ = central_images(
        x, y, K, rounds=1, batch=100, sigma=1.0, n_public=200, rng=np.random.default_rng(0)
    )
    const = CentralRelease(
        np.full_like(rel.values, 0.4),
        rel.labels,
        1,
        "mean",
        rel.denominator,
        (1, 12, 12),
        K,
        1.0,
        0.5,
        rel.clip,
        None,
    )
    img, _ = postprocess_central(const)
    assert np.allclose(img, 0.4, atol=1e-6)  # upsample, median and sharpen all keep a constant image
    wild = CentralRelease(
        rel.values * 50, rel.labels, 1, "mean", rel.denominator, (1, 12, 12), K, 1.0, 0.5, rel.clip, None
    )
    img, _ = postprocess_central(wild)
    assert img.min() >= 0 and img.max() <= 1  # clamped
    # A single salt pixel is removed by the 3x3 median blur (colour: no sharpening applied).
    salt = np.zeros((1, 3, 8, 8), np.float32)
    salt[0, :, 4, 4] = 1.0
    rel3 = CentralRelease(salt, np.zeros(1, np.int64), 1, "mean", 1.0, (3, 8, 8), 1, 1.0, 1.0, 1.0, None)
    img, _ = postprocess_central(rel3)
    assert img.max() == 0.0


def test_combine_central_weighted_average() -> None:
    x, y = data()
    a, _ = central_images(x, y, K, rounds=2, batch=100, sigma=1.0, n_public=200, rng=np.random.default_rng(1))
    b, _ = central_images(x, y, K, rounds=2, batch=100, sigma=1.0, n_public=200, rng=np.random.default_rng(2))
    c = combine_central([a, b], [300, 100])
    assert np.allclose(c.values, 0.75 * a.values + 0.25 * b.values, atol=1e-6)
    short, _ = central_images(
        x, y, K, rounds=1, batch=100, sigma=1.0, n_public=200, rng=np.random.default_rng(2)
    )
    with pytest.raises(DataError):
        combine_central([a, short], [1, 1])
    with pytest.raises(DataError):
        combine_central([a, b], [1])
    with pytest.raises(DataError):
        combine_central([], [])


@settings(max_examples=40, deadline=None)
@given(arrays(np.float32, (3, 1, 6, 6), elements=st.floats(0, 1, width=32)))
def test_stretch_contrast_keeps_range_shape_and_pixel_order(x: np.ndarray) -> None:
    y = stretch_contrast(x)
    assert y.shape == x.shape and y.dtype == np.float32 and y.min() >= 0 and y.max() <= 1
    # monotone per image: a brighter pixel stays as bright
    for a, b in zip(x.reshape(3, -1), y.reshape(3, -1)):
        order = np.argsort(a, kind="stable")
        assert np.all(np.diff(b[order]) >= -1e-6)


def test_stretch_contrast_brightens_a_dim_digit_and_clears_its_background() -> None:
    g = np.random.default_rng(0)
    x = np.abs(g.normal(0, 0.03, (1, 1, 14, 14))).astype(np.float32)  # noisy floor
    x[0, 0, 3:11, 6:8] += 0.4  # a dim stroke
    y = stretch_contrast(x)
    assert y[0, 0, 3:11, 6:8].mean() > 0.9 and np.median(y) == 0.0
    rel = CentralRelease(x, np.zeros(1, np.int64), 1, "mean", 1.0, (1, 14, 14), 1, 1.0, 1.0, 2.0, None)
    plain, stretched = postprocess_central(rel)[0], postprocess_central(rel, stretch=True)[0]
    assert np.median(stretched) == 0.0 < np.median(plain)  # the noisy floor is cleared


def test_stretch_contrast_refuses_bad_quantiles() -> None:
    with pytest.raises(DataError, match="low < high"):
        stretch_contrast(np.zeros((1, 1, 4, 4), np.float32), 0.9, 0.5)


@pytest.mark.parametrize("seed", [0, 7, np.int64(3), True])
def test_mechanisms_refuse_an_integer_seed_for_their_noise(seed: object) -> None:
    """A reproducible integer seed would make the released noise known to whoever knows the seed (and
    subtractable); the central and frequency mechanisms take a numpy Generator only (OS- or run-secret-seeded;
    a test builds its own explicitly)."""
    from feta_release.mechanisms.frequency import frequency_statistics

    x, y = data()
    with pytest.raises(PrivacyError, match="integer seeds are refused"):
        central_images(x, y, K, rounds=1, batch=10, sigma=1.0, n_public=200, rng=seed)  # type: ignore[arg-type]
    with pytest.raises(PrivacyError, match="integer seeds are refused"):
        frequency_statistics(x, y, K, features=10, sigma=1.0, n_public=200, rng=seed)  # type: ignore[arg-type]
