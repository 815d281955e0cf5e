"""Distributed Skellam mechanism: quantization round trip, conditional rounding's norm bound, exact modular sums,
the noise shares' distribution, wrap-around bound, refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import special, stats

from feta_release.errors import DataError, PrivacyError
from feta_release.mechanisms import skellam as sk


def params(**over: object) -> sk.SkellamParams:
    base: dict[str, object] = {"dim": 10, "clip": 1.0, "scale": 64.0, "noise_multiplier": 1.0, "n_sites": 3,
                               "modulus_bits": 32}
    base.update(over)
    return sk.SkellamParams(**base)  # type: ignore[arg-type]


def records_strategy(max_rows: int = 6, dim: int = 10) -> st.SearchStrategy[np.ndarray]:
    row = st.lists(st.floats(-3, 3, allow_nan=False, width=32), min_size=dim, max_size=dim)
    return st.lists(row, min_size=0, max_size=max_rows).map(lambda rows: np.array(rows, dtype=np.float64).reshape(-1, dim))


@settings(max_examples=40, deadline=None)
@given(x=st.lists(st.floats(-50, 50, allow_nan=False), min_size=1, max_size=40), rotate=st.booleans())
def test_rotation_is_orthogonal_and_inverted(x: list[float], rotate: bool) -> None:
    p = params(dim=len(x), rotate=rotate)
    v = np.array(x)
    r = sk.rotate(v, p)
    assert r.shape == (p.padded_dim,)
    assert np.linalg.norm(r) == pytest.approx(np.linalg.norm(v), rel=1e-9, abs=1e-9)
    np.testing.assert_allclose(sk.unrotate(r, p), v, atol=1e-9)


@settings(max_examples=40, deadline=None)
@given(recs=records_strategy(), scale=st.sampled_from([4.0, 64.0, 1024.0]), rotate=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_quantize_dequantize_round_trip(recs: np.ndarray, scale: float, rotate: bool, seed: int) -> None:
    """Without noise the decoded sum is the sum of the CLIPPED records up to the rounding error: each rounded
    record is within 1 of its scaled value in every coordinate, so the error is <= R sqrt(d') / s in L2."""
    p = params(scale=scale, rotate=rotate)
    q = sk.quantize_records(recs, p, np.random.default_rng(seed))
    decoded = sk.dequantize_sum(sk.to_modular(q, p.modulus_bits), p)
    norms = np.linalg.norm(recs, axis=1, keepdims=True)
    clipped = recs * np.minimum(1.0, p.clip / np.maximum(norms, 1e-300))
    err = np.linalg.norm(decoded - clipped.sum(axis=0))
    assert err <= len(recs) * math.sqrt(p.padded_dim) / scale + 1e-9


@settings(max_examples=60, deadline=None)
@given(x=st.lists(st.floats(-20, 20, allow_nan=False), min_size=1, max_size=30),
       beta=st.sampled_from([0.0, 1e-6, 0.1, sk.DEFAULT_BETA, 0.9]), seed=st.integers(0, 2**32 - 1))
def test_conditional_rounding_respects_its_norm_bound(x: list[float], beta: float, seed: int) -> None:
    v = np.array([x] * 8)
    scaled_norm = float(np.linalg.norm(v[0]))
    bound = sk.rounded_l2_bound(scaled_norm, beta, v.shape[1])
    out = sk.conditional_round(v, bound, np.random.default_rng(seed))
    assert out.dtype == np.int64
    assert (np.linalg.norm(out, axis=1) <= bound + 1e-9).all()
    assert (np.abs(out - v) < 1).all()  # a rounding, never a jump of a whole grid step


def test_conditional_rounding_is_unbiased() -> None:
    v = np.full((20000, 4), 0.3)
    out = sk.conditional_round(v, sk.rounded_l2_bound(0.6, 0.0, 4), np.random.default_rng(1))
    # 0.3 rounds to 1 w.p. 0.3; the sure bound (0.6 + sqrt(4) >= 2) rejects nothing, so the mean is 0.3 +- 4 sd
    assert abs(out.mean() - 0.3) < 4 * math.sqrt(0.21 / out.size)


def test_sensitivity_bounds_every_rounded_record() -> None:
    p = params(dim=50, scale=16.0)
    g = np.random.default_rng(3)
    recs = g.normal(size=(500, 50))
    for r in recs:
        q = sk.quantize_records(r[None, :], p, g)
        assert np.linalg.norm(q) <= p.l2_sensitivity + 1e-9
        assert np.abs(q).sum() <= p.l1_sensitivity + 1e-9


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(2, 64), data=st.data())
def test_modular_sum_is_exact_without_wrap(bits: int, data: st.DataObject) -> None:
    half = 1 << (bits - 1)
    total = data.draw(st.integers(-half, half - 1))
    n = data.draw(st.integers(1, 6))
    parts = [data.draw(st.integers(-(2**62), 2**62)) for _ in range(n - 1)]
    vectors = [np.array([p], dtype=np.int64) for p in parts]
    last = total - sum(parts)  # any integer: only its residue matters
    vectors.append(np.array([((last + 2**63) % 2**64) - 2**63], dtype=np.int64))
    residues = [sk.to_modular(v, bits) for v in vectors]
    assert all(int(r[0]) < (1 << bits) for r in residues)
    assert int(sk.centered(sk.modular_sum(residues, bits), bits)[0]) == total


def test_noise_shares_sum_to_the_stated_skellam_distribution() -> None:
    """n shares Sk(mu/n) sum to Sk(mu): mean 0, variance mu, and the pmf e^-mu I_k(mu) (chi-square fit)."""
    p = params(noise_multiplier=0.5, scale=8.0, n_sites=4)  # mu = (0.5 * 8)^2 = 16
    g = np.random.default_rng(7)
    draws = 200_000
    total = sum(sk.skellam_noise(draws, p.site_mu, g) for _ in range(p.n_sites))
    assert abs(total.mean()) < 5 * math.sqrt(p.mu / draws)
    # sample variance: sd ~ mu sqrt((2 + kurtosis/mu... ) / N) ~ 0.4 % here; 3 % is > 7 sd
    assert total.var() == pytest.approx(p.mu, rel=0.03)
    ks = np.arange(-15, 16)
    expected = special.ive(np.abs(ks), p.mu) * draws
    observed = np.array([(total == k).sum() for k in ks])
    tail_exp = draws - expected.sum()
    tail_obs = draws - observed.sum()
    _, pval = stats.chisquare(np.append(observed, tail_obs), np.append(expected, tail_exp))
    assert pval > 1e-4


def test_sites_contributions_decode_to_sum_plus_noise_of_the_stated_variance() -> None:
    p = params(dim=8, rotate=False, scale=32.0, noise_multiplier=2.0, n_sites=3)
    g = np.random.default_rng(11)
    recs = [g.uniform(-0.2, 0.2, size=(5, 8)) for _ in range(p.n_sites)]
    true = sum(r.sum(axis=0) for r in recs)
    errs = []
    for _ in range(3000):
        shares = [sk.site_contribution(r, p, g) for r in recs]
        errs.append(sk.dequantize_sum(sk.modular_sum(shares, p.modulus_bits), p) - true)
    e = np.array(errs)
    # total noise std sigma * clip = 2 in real units; rounding adds <= 15 records * 1/4 / s^2 of variance
    assert abs(e.mean()) < 0.05
    assert e.std() == pytest.approx(2.0, rel=0.03)


def test_wrap_probability_bounds_the_observed_wraps_and_modulus_choice() -> None:
    p = params(dim=16, rotate=False, scale=10.0, noise_multiplier=1.0)  # mu = 100
    g = np.random.default_rng(5)
    for bits in (5, 6, 7):
        q = sk.SkellamParams(16, 1.0, 10.0, 1.0, 3, bits, rotate=False)
        bound = sk.wrap_probability(q, 1)
        # with no records the signal is 0: a wrap is |noise_j| >= m/2 - Delta2 - 1 for some j (the bound's event
        # contains the true wrap event, so observed wraps of the weaker event are a fair check)
        noise = sk.skellam_noise((4000 * 16), q.mu, g).reshape(4000, 16)
        t = q.modulus / 2 - q.l2_sensitivity - 1
        observed = (np.abs(noise) >= t).any(axis=1).mean() if t > 0 else 1.0
        assert observed <= bound + 3 * math.sqrt(max(bound, 1e-4) / 4000)
    bits = sk.choose_modulus_bits(p, 1000, 1e-9)
    chosen = sk.SkellamParams(16, 1.0, 10.0, 1.0, 3, bits, rotate=False)
    smaller = sk.SkellamParams(16, 1.0, 10.0, 1.0, 3, bits - 1, rotate=False)
    assert sk.wrap_probability(chosen, 1000) <= 1e-9 < sk.wrap_probability(smaller, 1000)
    with pytest.raises(PrivacyError, match="no modulus"):
        sk.choose_modulus_bits(params(scale=2.0**60), 10**6)


def test_contribution_outside_the_modulus_or_malformed_is_refused() -> None:
    p = params(modulus_bits=16)
    ok = sk.site_contribution(np.zeros((1, 10)), p, np.random.default_rng(0))
    assert sk.check_contribution(ok, p, "site-a") is ok
    bad = ok.copy()
    bad[3] = np.uint64(1 << 16)
    with pytest.raises(PrivacyError, match="outside the modulus"):
        sk.check_contribution(bad, p, "site-a")
    with pytest.raises(PrivacyError, match="site-a: expected 10 uint64"):
        sk.check_contribution(ok.astype(np.int64), p, "site-a")
    with pytest.raises(PrivacyError, match="expected 10"):
        sk.check_contribution(ok[:-1], p, "site-a")


def test_bad_parameters_and_inputs_are_refused() -> None:
    with pytest.raises(PrivacyError, match="modulus_bits"):
        params(modulus_bits=65)
    with pytest.raises(PrivacyError, match="scale"):
        params(scale=0.0)
    with pytest.raises(PrivacyError, match="noise multiplier"):
        params(noise_multiplier=float("nan"))
    with pytest.raises(PrivacyError, match="beta"):
        params(beta=1.0)
    with pytest.raises(DataError, match=r"shape \(R, 10\)"):
        sk.quantize_records(np.zeros((2, 9)), params(), np.random.default_rng(0))
    with pytest.raises(DataError, match="NaN"):
        sk.quantize_records(np.full((2, 10), np.nan), params(), np.random.default_rng(0))
    with pytest.raises(PrivacyError, match="variance"):
        sk.skellam_noise(3, 0.0, np.random.default_rng(0))


def test_chunked_quantization_sums_every_record(monkeypatch: pytest.MonkeyPatch) -> None:
    p = params(dim=10, scale=2.0**16)
    recs = np.random.default_rng(2).normal(size=(37, 10))
    monkeypatch.setattr(sk, "QUANTIZE_CHUNK_VALUES", 3 * p.padded_dim)  # 3 rows at a time, a partial last chunk
    decoded = sk.dequantize_sum(sk.to_modular(sk.quantize_records(recs, p, np.random.default_rng(9)), 32), p)
    clipped = recs / np.maximum(1.0, np.linalg.norm(recs, axis=1, keepdims=True))
    assert np.linalg.norm(decoded - clipped.sum(axis=0)) <= len(recs) * math.sqrt(p.padded_dim) / p.scale


@pytest.mark.parametrize("seed", [0, 12345, np.int64(7)])
def test_integer_seeds_are_refused_everywhere(seed: object) -> None:
    """A seed a coordinator could choose makes the noise share known and subtractable: only Generators pass."""
    p = params()
    with pytest.raises(PrivacyError, match="numpy Generator"):
        sk.quantize_records(np.zeros((1, 10)), p, seed)  # type: ignore[arg-type]
    with pytest.raises(PrivacyError, match="numpy Generator"):
        sk.skellam_noise(3, 4.0, seed)  # type: ignore[arg-type]
    with pytest.raises(PrivacyError, match="numpy Generator"):
        sk.site_contribution(np.zeros((1, 10)), p, seed)  # type: ignore[arg-type]
