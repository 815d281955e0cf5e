"""Distributed Skellam mechanism: quantization round trip, conditional rounding's norm bound, exact modular
sums, the noise shares' distribution, wrap-around bound, refusals."""

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
    base: dict[str, object] = {
        "dim": 10,
        "clip": 1.0,
        "scale": 64.0,
        "noise_multiplier": 1.0,
        "n_sites": 3,
        "modulus_bits": 32,
    }
    base.update(over)
    return sk.SkellamParams(**base)  # type: ignore[arg-type]


def records_strategy(max_rows: int = 6, dim: int = 10) -> st.SearchStrategy[np.ndarray]:
    row = st.lists(st.floats(-3, 3, allow_nan=False, width=32), min_size=dim, max_size=dim)
    return st.lists(row, min_size=0, max_size=max_rows).map(
        lambda rows: np.array(rows, dtype=np.float64).reshape(-1, dim)
    )


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
@given(
    recs=records_strategy(),
    scale=st.sampled_from([4.0, 64.0, 1024.0]),
    rotate=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
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
@given(
    x=st.lists(st.floats(-20, 20, allow_nan=False), min_size=1, max_size=30),
    beta=st.sampled_from([0.0, 1e-6, 0.1, sk.DEFAULT_BETA, 0.9]),
    seed=st.integers(0, 2**32 - 1),
)
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
    # 0.3 rounds to 1 w.p. 0.3; the sure bound (0.6 + sqrt(4) >= 2) rejects nothing, so the mean is 0.3 +- 4
    # sd
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
        # with no records the signal is 0: a wrap is |noise_j| >= m/2 - Delta2 - 1 for some j (the bound's
        # event contains the true wrap event, so observed wraps of the weaker event are a fair check)
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
    # 3 rows at a time, a partial last chunk
    monkeypatch.setattr(sk, "QUANTIZE_CHUNK_VALUES", 3 * p.padded_dim)
    decoded = sk.dequantize_sum(sk.to_modular(sk.quantize_records(recs, p, np.random.default_rng(9)), 32), p)
    clipped = recs / np.maximum(1.0, np.linalg.norm(recs, axis=1, keepdims=True))
    assert np.linalg.norm(decoded - clipped.sum(axis=0)) <= len(recs) * math.sqrt(p.padded_dim) / p.scale


@pytest.mark.parametrize("seed", [0, 12345, np.int64(7)])
def test_integer_seeds_are_refused_everywhere(seed: object) -> None:
    """A seed a coordinator could choose makes the noise share known and subtractable: only Generators
    pass."""
    p = params()
    with pytest.raises(PrivacyError, match="numpy Generator"):
        sk.quantize_records(np.zeros((1, 10)), p, seed)  # type: ignore[arg-type]
    with pytest.raises(PrivacyError, match="numpy Generator"):
        sk.skellam_noise(3, 4.0, seed)  # type: ignore[arg-type]
    with pytest.raises(PrivacyError, match="numpy Generator"):
        sk.site_contribution(np.zeros((1, 10)), p, seed)  # type: ignore[arg-type]


# -- conditional rounding does the same work whatever the data
# ------------------------------------------------


def _state_after_quantizing(recs: np.ndarray, p: sk.SkellamParams) -> object:
    gen = np.random.default_rng(11)
    sk.quantize_records(recs, p, gen)
    return gen.bit_generator.state


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 40), dim=st.sampled_from([7, 49, 196]), data=st.data())
def test_rounding_draws_the_same_randomness_whatever_the_records(
    rows: int, dim: int, data: st.DataObject
) -> None:
    """The reply latency of a secure sum must not follow how many records sit at the clip norm: records at the
    norm (rejected ~10 % of the time by the norm bound) and records at a fraction of it (never rejected)
    consume exactly the same random words from the same generator (the same final state)."""
    p = params(dim=dim, scale=1024.0)
    g = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="records"))
    direction = g.standard_normal((rows, dim))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    fraction = data.draw(st.floats(0.0, 0.6), label="norm of the others")
    at_clip = _state_after_quantizing(direction * 1.5, p)  # clipped to the norm
    assert _state_after_quantizing(direction * fraction, p) == at_clip
    assert _state_after_quantizing(np.zeros((rows, dim)), p) == at_clip


def test_rounding_draws_a_fixed_number_of_uniforms_per_value() -> None:
    """K candidates per record, counted on a wrapped generator: the same count for clipped and small
    records."""

    class Counting(np.random.Generator):
        def __init__(self) -> None:
            super().__init__(np.random.PCG64(3))
            self.values = 0

        def random(self, size=None, dtype=np.float64, out=None):  # type: ignore[no-untyped-def,override]
            self.values += int(np.prod(size))
            return super().random(size, dtype, out)

    p = params(dim=49, scale=1024.0)
    recs = np.random.default_rng(4).standard_normal((300, 49))
    counts = []
    for norm in (5.0, 1.0, 0.5, 0.0):
        gen = Counting()
        sk.quantize_records(recs / np.linalg.norm(recs, axis=1, keepdims=True) * norm, p, gen)
        counts.append(gen.values)
    assert counts == [sk.ROUNDING_CANDIDATES * 300 * 49] * 4


def test_constant_work_rounding_has_the_conditional_distribution_of_rejection_sampling() -> None:
    """The first accepted of the K candidates is the unbiased rounding conditioned on the norm bound, exactly
    as redrawing until accepted: chi-square against the exact conditional law of every outcome, with a bound
    that rejects ~30 % of the draws (so the fallback batch is exercised too)."""
    x = np.array([0.5, 0.7, 1.4])
    bound = 2.2
    floor, frac = np.floor(x), x - np.floor(x)
    outcomes = [floor + np.array(bits) for bits in np.ndindex(2, 2, 2)]
    prob = np.array([np.prod(np.where(np.array(bits) == 1, frac, 1 - frac)) for bits in np.ndindex(2, 2, 2)])
    accepted = np.array([np.linalg.norm(o) <= bound for o in outcomes])
    assert 0.2 < prob[~accepted].sum() < 0.5
    expected = np.where(accepted, prob, 0) / prob[accepted].sum()
    n = 40_000
    out = sk.conditional_round(np.repeat(x[None, :], n, axis=0), bound, np.random.default_rng(8))
    assert (np.linalg.norm(out, axis=1) <= bound + 1e-12).all()
    index = ((out - floor) * np.array([4, 2, 1])).sum(axis=1).astype(np.int64)
    counts = np.bincount(index, minlength=8)
    assert (counts[~accepted] == 0).all()
    assert stats.chisquare(counts[accepted], n * expected[accepted]).pvalue > 1e-4
