"""RDP of the (distributed) Skellam mechanism, with Poisson subsampling, and the two epsilons a site states
under secure aggregation.

Skellam RDP (Agarwal, Kairouz, Liu 2021, Thm 3.5 / Cor 4.1), restated for Z ~ Sk(mu/2, mu/2) (variance mu) in
the integer domain, for an integer shift of L2 norm <= D2 and L1 norm <= D1, at any order a > 1:

    eps(a) = a D2^2 / (2 mu) + min( ((2a - 1) D2^2 + 6 D1) / (4 mu^2),  3 D1 / (2 mu) )

The first term is the Gaussian's a D2^2 / (2 mu) at the same variance; the second vanishes as mu grows.
(The paper writes Sk(mu', mu') with variance 2 mu'; mu = 2 mu' gives the form above.)  The tests check it
against a direct numerical summation of the Renyi divergence between Sk(mu) and Sk(mu) + shift.

Poisson subsampling at rate q (add/remove neighbours): dp-accounting's RdpAccountant amplifies only Gaussian
events (a PoissonSampledDpEvent must bottom out in a GaussianDpEvent), so the general upper bound of Zhu &
Wang 2019 ("Poisson Subsampled Renyi Differential Privacy", Thm 6) is used, which holds for ANY mechanism with
RDP curve eps(.) at integer orders a >= 2:

    (a-1) eps_q(a) <= log[ (1-q)^(a-1) (1 + (a-1) q) + C(a,2) q^2 (1-q)^(a-2) e^eps(2)
                            + 3 sum_{l=3..a} C(a,l) (1-q)^(a-l) q^l e^((l-1) eps(l)) ]

At a fractional order the bound at ceil(a) is used (Renyi divergence does not decrease with the order), and at
every order the result is capped by the unsampled eps(a) (subsampling never hurts: joint convexity).

Epsilon from RDP uses the same conversion as :mod:`feta_release.accounting` (opacus' get_privacy_spent, Balle
et al. 2020), over the same orders, so a Skellam curve can be added to the Gaussian stages' curves.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..accounting import (  # noqa: F401 - skellam_rdp and poisson_subsampled_rdp are re-exported
    RDP_ORDERS,
    PrivacyEvent,
    SkellamEvent,
    epsilon,
    epsilon_from_rdp,
    poisson_subsampled_rdp,
    skellam_rdp,
    smallest_fitting_sigma,
)
from ..errors import PrivacyError
from ..mechanisms.skellam import SkellamParams


def skellam_rdp_curve(
    params: SkellamParams, q: float, steps: int, mu: float | None = None, orders: Sequence[float] = RDP_ORDERS
) -> np.ndarray:
    """RDP over ``orders`` of ``steps`` Poisson-subsampled releases with noise variance ``mu`` (default: all
    the shares, ``params.mu``; pass a smaller one for the shares a site can count on)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise PrivacyError(f"Skellam accounting: steps must be an integer >= 0, got {steps!r}")
    var = params.mu if mu is None else mu
    return SkellamEvent("skellam", q, steps, params.l2_sensitivity, params.l1_sensitivity, var).rdp(orders)


def skellam_epsilon(
    params: SkellamParams, q: float, steps: int, delta: float, noise_shares: int | None = None
) -> float:
    """Epsilon of ``steps`` releases when ``noise_shares`` of the n sites' noise shares protect the sum
    (default: all n)."""
    shares = params.n_sites if noise_shares is None else noise_shares
    if isinstance(shares, bool) or not isinstance(shares, int) or not (1 <= shares <= params.n_sites):
        raise PrivacyError(
            f"Skellam accounting: noise_shares must be an integer in [1, {params.n_sites}], got {shares!r}"
        )
    if not (0 < delta < 1):
        raise PrivacyError(f"delta must be in (0, 1), got {delta!r}")
    curve = skellam_rdp_curve(params, q, steps, params.site_mu * shares)
    return epsilon_from_rdp(curve, delta) if np.any(curve) else 0.0  # no release, no loss


@dataclass(frozen=True)
class SiteEpsilons:
    """The two epsilons one site computes, charges and attests for a secure-aggregation release.

    ``assumed``: under the site's signed trust assumption (at most ``colluders`` other sites collude with a
    coordinator that may lie), the noise that protects its records is the shares of the honest sites in the
    sums the coordinator can decode.  Although the sites refuse a sum below ``threshold``, a coordinator that
    gives different sites different alive/dropped views can decode sums over fewer
    sites: :func:`honest_shares` derives the fewest honest shares it can reach (a lower bound, below
    ``threshold - colluders`` in general).  When one vector can be unmasked alone (2 (threshold - colluders)
    <= n - colluders) ``isolable`` is True and only the site's own share is counted.  ``worst_case``: every
    other site colludes and subtracts its share, so only the site's own share Sk(mu / n) is left.
    """

    assumed: float
    worst_case: float
    honest_shares: int
    colluders: int
    n_sites: int
    threshold: int
    isolable: bool = False  # a split view can unmask this site's vector alone: honest_shares is then 1

    def statement(self, delta: float) -> str:
        """The plain-words sentence for the certificate."""
        counted = (
            f"at least {self.honest_shares} honest noise share(s) of {self.n_sites} in every sum, with the "
            f"round refused below {self.threshold} sites"
            if not self.isolable
            else f"this site's own noise share only: with a threshold of {self.threshold} of {self.n_sites} "
            f"sites a lying coordinator and its colluders can unmask one site's vector alone"
        )
        return (
            f"epsilon {self.assumed:.3g} (delta {delta:g}) if at most {self.colluders} of the other "
            f"{self.n_sites - 1} sites collude with the coordinator ({counted}); "
            f"epsilon {self.worst_case:.3g} if all of them collude (this site's own noise share only)"
        )


def isolable(n_sites: int, threshold: int, colluders: int) -> bool:
    """Whether a split view can unmask one site's vector alone (see :func:`honest_shares`, case 1)."""
    return 2 * (threshold - colluders) <= n_sites - colluders


def honest_shares(n_sites: int, threshold: int, colluders: int) -> int:
    """The fewest honest noise shares in any sum containing this site that a lying coordinator with
    ``colluders`` colluding sites can decode: a lower bound, so counting it is conservative.

    Premises (enforced by ``feta_release.federation.secagg``): every site masks against EVERY other site of
    the job (no key setup or collect without all of them), so the coordinator cannot pick a site's peers; each
    honest site answers one unmask request per sum, revealing for each other site either the share of its seed
    (alive) or of its mask key sk1 (dropped), never both, with at least ``threshold`` sites alive, itself
    among them; a key setup of several sums goes on at a site only after a sum that called every site alive
    (no key share out before a later sum, which is masked against every site again), so each sum of it is
    bounded as one sum. With h = n - c honest sites and T = threshold - c: a secret of an honest site is
    rebuilt iff >= T honest sites (other than itself, for sk1) reveal its share; each honest site calls at
    most h - T honest sites dropped.

    A decoded sum over a set S of honest sites (this site in it) needs every seed in S and, for every pair
    s in S, j outside S (honest), the pairwise key: sk1_s or sk1_j (a mask whose key is unknown is uniform).
      1. If some sk1_s (s in S) is rebuilt, s's seed is too: {s} alone decodes.  Possible iff T honest sites
         call s dropped and T - 1 others (with s itself) call it alive, disjoint: 2T <= h -> 1 share.
      2. Otherwise every honest j outside S needs T "dropped" calls from honest sites other than itself: o T
         of them (o = h - |S|), while a site in S makes at most min(h - T, o) and one outside at most
         min(h - T, o - 1).  The least |S| for which o T fits is the bound returned (<= T; e.g. n = 5, t = 3,
         c = 0 gives 2, reached by tests/federation/test_secagg.py's two-site split view, not t - c = 3).
    """
    h, big_t = n_sites - colluders, threshold - colluders
    if big_t <= 0:
        return 1
    if isolable(n_sites, threshold, colluders):
        return 1
    for s in range(1, big_t + 1):
        o = h - s
        if o * big_t <= s * min(h - big_t, o) + o * min(h - big_t, max(o - 1, 0)):
            return s
    return big_t


def site_epsilons(
    params: SkellamParams, q: float, steps: int, delta: float, threshold: int, colluders: int
) -> SiteEpsilons:
    """(a) epsilon under ``colluders`` colluding sites and (b) the worst case (own share only); see
    SiteEpsilons."""
    n = params.n_sites
    if isinstance(threshold, bool) or not isinstance(threshold, int) or not (1 <= threshold <= n):
        raise PrivacyError(f"secure aggregation: threshold must be an integer in [1, {n}], got {threshold!r}")
    if isinstance(colluders, bool) or not isinstance(colluders, int) or not (0 <= colluders <= n - 1):
        raise PrivacyError(
            f"secure aggregation: colluders must be an integer in [0, {n - 1}] (the other sites), "
            f"got {colluders!r}"
        )
    honest = honest_shares(n, threshold, colluders)
    return SiteEpsilons(
        assumed=skellam_epsilon(params, q, steps, delta, honest),
        worst_case=skellam_epsilon(params, q, steps, delta, 1),
        honest_shares=honest,
        colluders=colluders,
        n_sites=n,
        threshold=threshold,
        isolable=isolable(n, threshold, colluders),
    )


def calibrate_skellam_noise(
    params: SkellamParams,
    q: float,
    steps: int,
    target_epsilon: float,
    delta: float,
    noise_shares: int | None = None,
    tol: float = 0.01,
    max_sigma: float = 1000.0,
) -> float:
    """Smallest noise multiplier (within ``tol``; the upper end of the bracket, so epsilon <= target) for
    which ``steps`` releases protected by ``noise_shares`` of the n shares stay within ``target_epsilon`` at
    ``delta``. Calibrate with the shares the site can count on (e.g. ``SiteEpsilons.honest_shares``)."""
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise PrivacyError(
            f"Skellam calibration: target epsilon must be a finite number > 0, got {target_epsilon!r}"
        )

    def eps(sigma: float) -> float:
        return skellam_epsilon(
            dataclasses.replace(params, noise_multiplier=sigma), q, steps, delta, noise_shares
        )

    return smallest_fitting_sigma(
        eps,
        target_epsilon,
        tol=tol,
        max_sigma=max_sigma,
        refusal=(
            f"Skellam calibration: even noise multiplier {max_sigma:g} exceeds epsilon {target_epsilon} over "
            f"{steps} releases at q={q:g}; use fewer releases or a larger budget"
        ),
    )


# -- events a ledger stores (SkellamEvent lives in feta_release.accounting), composed with the Gaussian stages
# --


def skellam_event(params: SkellamParams, stage: str, q: float, steps: int, noise_shares: int) -> SkellamEvent:
    """The event of ``steps`` releases of ``params`` when ``noise_shares`` of the n shares protect the sum."""
    if (
        isinstance(noise_shares, bool)
        or not isinstance(noise_shares, int)
        or not (1 <= noise_shares <= params.n_sites)
    ):
        raise PrivacyError(
            f"Skellam accounting: noise_shares must be an integer in [1, {params.n_sites}], "
            f"got {noise_shares!r}"
        )
    return SkellamEvent(
        stage,
        q,
        steps,
        params.l2_sensitivity,
        params.l1_sensitivity,
        params.site_mu * noise_shares,
        params.site_mu,
    )


def composed_epsilon(
    gaussian: Iterable[PrivacyEvent], skellam: Iterable[SkellamEvent], delta: float
) -> float:
    """Epsilon of a whole history mixing subsampled-Gaussian and Skellam events (RDP curves added over the
    same orders): :func:`feta_release.accounting.epsilon` over the mixed list."""
    return epsilon([*gaussian, *skellam], delta)
