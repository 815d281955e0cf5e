"""Skellam RDP: the paper's bound against an INDEPENDENT numerical Renyi divergence (direct summation over the
support of the Skellam pmf e^-mu I_k(mu)), its Gaussian limit, Poisson subsampling, and the site's two
epsilons."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import special

from feta_release.accountants import skellam as acc
from feta_release.accounting import RDP_ORDERS, PrivacyEvent, epsilon, epsilon_from_rdp
from feta_release.errors import PrivacyError
from feta_release.mechanisms.skellam import SkellamParams


def log_pmf(ks: np.ndarray, mu: float) -> np.ndarray:
    """log P(Z = k) for Z ~ Sk(mu/2, mu/2): e^{-mu} I_|k|(mu) (ive is the exponentially scaled Bessel I)."""
    with np.errstate(divide="ignore"):
        return np.log(special.ive(np.abs(ks), mu))


def support(mu: float, shift: int) -> np.ndarray:
    half = int(abs(shift) + 60 * math.sqrt(mu) + 200)
    return np.arange(-half, half + 1)


def renyi_1d(alpha: float, mu: float, shift: int) -> float:
    """D_alpha(Sk + shift || Sk) by summation: 1/(a-1) log sum_k p(k - shift)^a p(k)^(1-a)."""
    ks = support(mu, shift)
    lp, lq = log_pmf(ks - shift, mu), log_pmf(ks, mu)
    ok = np.isfinite(lp) & np.isfinite(lq)
    return float(special.logsumexp(alpha * lp[ok] + (1 - alpha) * lq[ok])) / (alpha - 1)


def renyi_mixture(alpha: float, mu: float, shift: int, q: float) -> float:
    """max over both directions of D_alpha between (1-q) Sk + q (Sk + shift) and Sk (Poisson subsampling,
    1-d)."""
    ks = support(mu, shift)
    lq = log_pmf(ks, mu)
    lmix = np.logaddexp(math.log1p(-q) + lq, math.log(q) + log_pmf(ks - shift, mu))
    ok = np.isfinite(lq) & np.isfinite(lmix)
    fwd = special.logsumexp(alpha * lmix[ok] + (1 - alpha) * lq[ok]) / (alpha - 1)
    bwd = special.logsumexp(alpha * lq[ok] + (1 - alpha) * lmix[ok]) / (alpha - 1)
    return float(max(fwd, bwd))


@pytest.mark.parametrize("mu", [1.0, 4.0, 30.0, 200.0, 2000.0])
@pytest.mark.parametrize("shift", [1, 2, 5])
def test_rdp_bound_dominates_the_numerical_divergence(mu: float, shift: int) -> None:
    for alpha in (1.1, 1.5, 2.0, 3.0, 8.0, 20.0, 63.0):
        numeric = renyi_1d(alpha, mu, shift)
        bound = acc.skellam_rdp(alpha, l2=shift, l1=shift, mu=mu)
        assert numeric <= bound * (1 + 1e-9) + 1e-12, (alpha, numeric, bound)


@pytest.mark.parametrize("mu", [400.0, 5000.0])
def test_rdp_bound_is_close_to_the_numerical_divergence_for_large_mu(mu: float) -> None:
    for shift in (1, 3):
        for alpha in (2.0, 8.0, 32.0):
            numeric = renyi_1d(alpha, mu, shift)
            bound = acc.skellam_rdp(alpha, l2=shift, l1=shift, mu=mu)
            assert bound <= numeric * 1.05, (alpha, numeric, bound)


def test_multidimensional_shift_uses_the_l1_and_l2_terms() -> None:
    """A product distribution's divergence is the sum over coordinates; the bound with ||s||_2, ||s||_1 covers
    it."""
    mu, shift = 50.0, (1, -2, 3)
    l2, l1 = math.sqrt(sum(s * s for s in shift)), float(sum(abs(s) for s in shift))
    for alpha in (1.5, 2.0, 10.0, 40.0):
        numeric = sum(renyi_1d(alpha, mu, s) for s in shift)
        assert numeric <= acc.skellam_rdp(alpha, l2, l1, mu) + 1e-12


@settings(max_examples=30, deadline=None)
@given(alpha=st.floats(1.01, 64), l2=st.floats(0.5, 50), mu_exp=st.floats(5, 9))
def test_rdp_approaches_the_gaussian_for_large_mu(alpha: float, l2: float, mu_exp: float) -> None:
    mu = 10.0**mu_exp
    gauss = alpha * l2**2 / (2 * mu)
    bound = acc.skellam_rdp(alpha, l2, l2 * 10, mu)
    assert gauss <= bound
    assert bound / gauss == pytest.approx(1.0, rel=1e-3)


@pytest.mark.parametrize("mu,shift,q", [(4.0, 1, 0.1), (30.0, 2, 0.01), (200.0, 5, 0.3), (10.0, 1, 0.9)])
def test_subsampled_bound_dominates_the_numerical_mixture_divergence(mu: float, shift: int, q: float) -> None:
    def rdp(a: float) -> float:
        return acc.skellam_rdp(a, shift, shift, mu)

    for alpha in (1.5, 2.0, 3.0, 4.5, 10.0, 30.0):
        numeric = renyi_mixture(alpha, mu, shift, q)
        bound = acc.poisson_subsampled_rdp(alpha, q, rdp)
        assert numeric <= bound + 1e-12, (alpha, numeric, bound)
        assert bound <= rdp(alpha) + 1e-15  # never worse than no subsampling


def test_subsampling_amplifies_and_q1_is_the_unsampled_curve() -> None:
    def rdp(a: float) -> float:
        return acc.skellam_rdp(a, 1, 1, 25.0)

    assert acc.poisson_subsampled_rdp(4.0, 1.0, rdp) == rdp(4.0)
    assert acc.poisson_subsampled_rdp(4.0, 0.01, rdp) < rdp(4.0) / 100


def test_skellam_epsilon_is_close_to_the_gaussian_for_fine_quantization() -> None:
    """q = 1: both are unamplified curves, so Skellam (D2 slightly above c s) is just above the Gaussian."""
    p = SkellamParams(dim=64, clip=1.0, scale=2.0**12, noise_multiplier=4.0, n_sites=3)
    sk_eps = acc.skellam_epsilon(p, 1.0, 20, 1e-5)
    gauss = epsilon([PrivacyEvent("central", 4.0, 1.0, 20)], 1e-5)
    assert gauss <= sk_eps <= gauss * 1.02


def test_epsilon_conversion_matches_dp_accounting() -> None:
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    p = SkellamParams(dim=100, clip=1.0, scale=256.0, noise_multiplier=2.0, n_sites=4)
    curve = acc.skellam_rdp_curve(p, 0.05, 200)
    ours = epsilon_from_rdp(curve, 1e-6)
    theirs, _ = compute_epsilon(list(RDP_ORDERS), list(curve), 1e-6)
    assert ours == pytest.approx(theirs, rel=1e-6)


def test_site_epsilons_assumed_and_worst_case() -> None:
    p = SkellamParams(dim=100, clip=1.0, scale=256.0, noise_multiplier=3.0, n_sites=4)
    none = acc.site_epsilons(p, 1.0, 10, 1e-5, threshold=4, colluders=0)
    one = acc.site_epsilons(p, 1.0, 10, 1e-5, threshold=4, colluders=1)
    low_threshold = acc.site_epsilons(p, 1.0, 10, 1e-5, threshold=2, colluders=0)
    everyone = acc.site_epsilons(p, 1.0, 10, 1e-5, threshold=4, colluders=3)
    assert none.honest_shares == 4 and one.honest_shares == 3
    # 2 of 4: two pairs of honest sites given different views unmask one vector; only the own share counts
    assert low_threshold.isolable and low_threshold.honest_shares == 1
    assert low_threshold.assumed == low_threshold.worst_case
    assert "own noise share only: with a threshold of 2 of 4" in low_threshold.statement(1e-5)
    assert none.assumed == pytest.approx(acc.skellam_epsilon(p, 1.0, 10, 1e-5))
    assert none.assumed < one.assumed < everyone.assumed == everyone.worst_case
    assert none.assumed < low_threshold.assumed  # fewer sites may be summed, so fewer shares are guaranteed
    assert none.worst_case == one.worst_case == acc.skellam_epsilon(p, 1.0, 10, 1e-5, noise_shares=1)
    # own share alone is the noise multiplier sigma / sqrt(n): the Gaussian at that sigma is a lower reference
    assert none.worst_case >= epsilon([PrivacyEvent("x", 3.0 / 2, 1.0, 10)], 1e-5)
    assert not (none.isolable or one.isolable) and everyone.honest_shares == 1
    text = one.statement(1e-5)
    assert "at most 1 of the other 3 sites" in text and "own noise share only" in text


@given(n=st.integers(2, 12), data=st.data())
def test_honest_shares_count_only_what_a_split_view_cannot_take(n: int, data: st.DataObject) -> None:
    """The counting behind ``isolable``: the coordinator isolates a victim iff it can find two disjoint groups
    of honest sites, A (the victim may be in it) and B (not the victim), each reaching the threshold with the
    colluders. Checked against a direct search over the group sizes."""
    t = data.draw(st.integers(1, n), label="threshold")
    c = data.draw(st.integers(0, n - 1), label="colluders")
    p = SkellamParams(dim=4, clip=1.0, scale=16.0, noise_multiplier=1.0, n_sites=n)
    e = acc.site_epsilons(p, 1.0, 1, 1e-5, threshold=t, colluders=c)
    honest = n - c  # the victim included
    split = any(a + c >= t and b + c >= t for a in range(1, honest + 1) for b in range(0, honest - a + 1))
    assert e.isolable == split
    # not split: sums over fewer than t - c honest sites may still decode (honest_shares' counting bound)
    assert e.honest_shares == 1 if split else 1 <= e.honest_shares <= t - c


def test_refusals() -> None:
    p = SkellamParams(dim=10, clip=1.0, scale=16.0, noise_multiplier=1.0, n_sites=3)
    with pytest.raises(PrivacyError, match="colluders must be an integer in \\[0, 2\\]"):
        acc.site_epsilons(p, 1.0, 1, 1e-5, 3, 3)
    with pytest.raises(PrivacyError, match="threshold"):
        acc.site_epsilons(p, 1.0, 1, 1e-5, 4, 0)
    with pytest.raises(PrivacyError, match="order must be > 1"):
        acc.skellam_rdp(1.0, 1, 1, 1.0)
    with pytest.raises(PrivacyError, match="sampling rate"):
        acc.poisson_subsampled_rdp(2.0, 0.0, lambda a: 0.1)
    with pytest.raises(PrivacyError, match="noise_shares"):
        acc.skellam_epsilon(p, 1.0, 1, 1e-5, noise_shares=0)


def test_calibration_meets_the_target_and_is_tight() -> None:
    import dataclasses

    p = SkellamParams(dim=100, clip=1.0, scale=1024.0, noise_multiplier=1.0, n_sites=3)
    sigma = acc.calibrate_skellam_noise(p, 0.05, 100, 1.0, 1e-5, noise_shares=2)
    at = dataclasses.replace(p, noise_multiplier=sigma)
    below = dataclasses.replace(p, noise_multiplier=sigma - 0.01)
    assert acc.skellam_epsilon(at, 0.05, 100, 1e-5, 2) <= 1.0 < acc.skellam_epsilon(below, 0.05, 100, 1e-5, 2)
    with pytest.raises(PrivacyError, match="even noise multiplier"):
        acc.calibrate_skellam_noise(p, 1.0, 10**6, 0.01, 1e-5, max_sigma=4.0)


def test_events_compose_with_the_gaussian_stages_and_round_trip() -> None:
    import json

    p = SkellamParams(dim=100, clip=1.0, scale=1024.0, noise_multiplier=4.0, n_sites=3)
    ev = acc.skellam_event(p, "dpsgd", 0.05, 200, noise_shares=2)
    assert acc.SkellamEvent.from_dict(json.loads(json.dumps(ev.to_dict()))) == ev
    gauss = [PrivacyEvent("central", 5.0, 0.1, 10), PrivacyEvent("frequency", 20.0, 1.0, 1)]
    assert acc.composed_epsilon(gauss, [], 1e-5) == pytest.approx(epsilon(gauss, 1e-5), rel=1e-9)
    assert acc.composed_epsilon([], [ev], 1e-5) == pytest.approx(
        acc.skellam_epsilon(p, 0.05, 200, 1e-5, 2), rel=1e-9
    )
    both = acc.composed_epsilon(gauss, [ev], 1e-5)
    assert max(epsilon(gauss, 1e-5), acc.composed_epsilon([], [ev], 1e-5)) < both
    # RDP composition is sub-additive
    assert both < epsilon(gauss, 1e-5) + acc.composed_epsilon([], [ev], 1e-5)
    with pytest.raises(PrivacyError, match="exactly kind, stage"):
        acc.SkellamEvent.from_dict({**ev.to_dict(), "sigma": 1.0})
    with pytest.raises(PrivacyError, match="mu must be"):
        acc.SkellamEvent("x", 0.1, 1, 1.0, 1.0, 0.0)
