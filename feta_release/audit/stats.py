"""The statistics of an empirical privacy audit: Clopper-Pearson bounds, the hypothesis-test ε bound, and the
one-run bound of Steinke, Nasr and Jagielski (NeurIPS 2023).

Every function here turns observations into a LOWER bound on ε that holds with the stated confidence: if the
mechanism really were (ε, δ)-DP, the returned value would exceed ε with probability at most 1 - confidence.
scipy's beta / binomial distributions are used where installed; the exact fallbacks (log-space binomial sums
and bisection) give the same numbers to ~1e-9 and are tested against scipy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def _log_pmf(k: int, n: int, p: float) -> float:
    if p <= 0.0:
        return 0.0 if k == 0 else -math.inf
    if p >= 1.0:
        return 0.0 if k == n else -math.inf
    return (
        math.lgamma(n + 1)
        - math.lgamma(k + 1)
        - math.lgamma(n - k + 1)
        + k * math.log(p)
        + (n - k) * math.log1p(-p)
    )


def binom_cdf_exact(k: int, n: int, p: float) -> float:
    """P[Binomial(n, p) <= k], summed in log space (no scipy)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    logs = [_log_pmf(i, n, p) for i in range(k + 1)]
    top = max(logs)
    if top == -math.inf:
        return 0.0
    return min(1.0, math.exp(top) * sum(math.exp(v - top) for v in logs))


def _bisect(f, lo: float, hi: float, iters: int = 200) -> float:  # type: ignore[no-untyped-def]
    """The root of a function decreasing from >0 at lo to <0 at hi."""
    for _ in range(iters):
        mid = (lo + hi) / 2
        if f(mid) > 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def cp_upper(k: int, n: int, alpha: float, exact: bool = False) -> float:
    """One-sided Clopper-Pearson upper bound: the largest p with P[Bin(n, p) <= k] >= alpha."""
    _check(k, n, alpha)
    if k >= n:
        return 1.0
    if not exact:
        try:
            from scipy.stats import beta
        except ImportError:
            exact = True
        else:
            return float(beta.ppf(1 - alpha, k + 1, n - k))
    return _bisect(lambda p: binom_cdf_exact(k, n, p) - alpha, 0.0, 1.0)


def cp_lower(k: int, n: int, alpha: float, exact: bool = False) -> float:
    """One-sided Clopper-Pearson lower bound: the smallest p with P[Bin(n, p) >= k] >= alpha."""
    _check(k, n, alpha)
    return 1.0 - cp_upper(n - k, n, alpha, exact)


def clopper_pearson(k: int, n: int, confidence: float = 0.95, exact: bool = False) -> tuple[float, float]:
    """Two-sided Clopper-Pearson interval for a binomial proportion (each tail (1 - confidence) / 2)."""
    a = (1 - confidence) / 2
    return cp_lower(k, n, a, exact), cp_upper(k, n, a, exact)


def _check(k: int, n: int, alpha: float) -> None:
    if not (0 <= k <= n and n >= 1):
        raise ValueError(f"need 0 <= k <= n and n >= 1, got k={k}, n={n}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")


def epsilon_from_rates(fpr: float, fnr: float, delta: float) -> float:
    """The ε that any (ε, δ)-DP mechanism must have for a test with these error rates (upper bounds of them):
    (ε, δ)-DP implies FPR + e^ε FNR >= 1 - δ and FNR + e^ε FPR >= 1 - δ (Kairouz et al. 2015)."""
    best = 0.0
    for a, b in ((fpr, fnr), (fnr, fpr)):
        num = 1.0 - delta - a
        if num > 0:
            best = max(best, math.inf if b <= 0 else math.log(num / b))
    return best


def threshold_bound(
    null: np.ndarray, alt: np.ndarray, threshold: float, delta: float, confidence: float = 0.95
) -> tuple[float, dict[str, float]]:
    """ε lower bound of the test "alternative if score > threshold" on scores under the two neighbours.

    FPR and FNR each get a one-sided Clopper-Pearson upper bound at (1 - confidence) / 2: by the union bound
    both hold together with probability >= confidence, and then so does the ε bound.
    """
    a = (1 - confidence) / 2
    fp, fn = int((null > threshold).sum()), int((alt <= threshold).sum())
    fpr, fnr = cp_upper(fp, len(null), a), cp_upper(fn, len(alt), a)
    return epsilon_from_rates(fpr, fnr, delta), {
        "false_positives": fp,
        "false_negatives": fn,
        "fpr_upper": fpr,
        "fnr_upper": fnr,
        "threshold": float(threshold),
    }


def expected_threshold_bound(fpr: float, tpr: float, n: int, delta: float, confidence: float = 0.95) -> float:
    """The bound ``threshold_bound`` would give on ``n`` runs per neighbour if the counts were at their
    expectation (false positives fpr·n, false negatives (1 - tpr)·n): the typical outcome, for planning how
    many runs an audit needs (never a bound itself)."""
    a = (1 - confidence) / 2
    fp, fn = int(round(fpr * n)), int(round((1.0 - tpr) * n))
    return epsilon_from_rates(cp_upper(min(fp, n), n, a), cp_upper(min(fn, n), n, a), delta)


def expected_gaussian_bound(
    mu: float, n: int, delta: float, confidence: float = 0.95, steps: int = 400
) -> float:
    """The best ``expected_threshold_bound`` over thresholds for a Gaussian shift ``mu`` (noise 1): what an
    audit of a mechanism that is exactly GDP(mu) typically shows with ``n`` evaluation runs per neighbour."""
    best = 0.0
    for t in np.linspace(-2.0, 9.0, steps):
        fpr = 0.5 * math.erfc(t / math.sqrt(2.0))
        tpr = 0.5 * math.erfc((t - mu) / math.sqrt(2.0))
        best = max(best, expected_threshold_bound(fpr, tpr, n, delta, confidence))
    return best


def best_threshold(
    null: np.ndarray, alt: np.ndarray, delta: float, candidates: int = 256, confidence: float = 0.95
) -> float:
    """The threshold that maximises the bound on THESE scores (use it on fresh scores only: choosing it on the
    scores it is then evaluated on would overstate the bound).

    Scored at the evaluation's own ``confidence``: scoring at 0.5 (nearly the point estimate) picked
    thresholds in the extreme tails, where a handful of chance counts in the fitting half look like a large ε
    and the fresh half then shows nothing: the audits at the presets' σ measured 0 for that reason
    (docs/audit.md)."""
    pooled = np.concatenate([null, alt])
    grid = np.unique(np.quantile(pooled, np.linspace(0.0, 1.0, candidates)))
    return float(max(grid, key=lambda t: threshold_bound(null, alt, t, delta, confidence)[0]))


# -- one run: Steinke, Nasr & Jagielski 2023 -----------------------------------------------------------------


def _binom_sf_ge(v: int, r: int, p: float) -> float:
    """P[Binomial(r, p) >= v]."""
    try:
        from scipy.stats import binom
    except ImportError:
        return 1.0 - binom_cdf_exact(v - 1, r, p)
    return float(binom.sf(v - 1, r, p))


def one_run_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """P[at least v of r guesses correct] for an (ε, δ)-DP mechanism with m canaries, each included with
    probability 1/2 (their Theorem 3.1 with the δ term): the guesses are dominated by randomized response with
    accuracy e^ε / (1 + e^ε), plus 2 m δ times the largest average binomial mass just below v."""
    if not (0 <= v <= r <= m):
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    q = 1.0 / (1.0 + math.exp(-eps))
    beta = _binom_sf_ge(v, r, q)
    alpha, mass = 0.0, 0.0
    logs = [_log_pmf(v - i, r, q) for i in range(1, v + 1)]
    for i, lp in enumerate(logs, start=1):
        mass += math.exp(lp)
        alpha = max(alpha, mass / i)
    return min(1.0, beta + alpha * 2 * m * delta)


def one_run_epsilon(m: int, r: int, v: int, delta: float, alpha: float = 0.05) -> float:
    """The largest ε that the observed v correct of r guesses rejects at level alpha (0 if none)."""
    if r == 0 or one_run_p_value(m, r, v, 0.0, delta) >= alpha:
        return 0.0
    hi = 1.0
    while one_run_p_value(m, r, v, hi, delta) < alpha:
        hi *= 2
        if hi > 1e3:
            return math.inf
    return _bisect(lambda e: alpha - one_run_p_value(m, r, v, e, delta), 0.0, hi, iters=60)


def one_run_guesses(scores: np.ndarray, included: np.ndarray, guesses: int) -> tuple[int, int]:
    """Guess "in" for the guesses/2 highest scores and "out" for the guesses/2 lowest; (r, correct)."""
    order = np.argsort(scores, kind="stable")
    k = guesses // 2
    outs, ins = order[:k], order[len(order) - k :]
    return 2 * k, int((~included[outs]).sum() + included[ins].sum())


def one_run_bound(
    scores: np.ndarray,
    included: np.ndarray,
    delta: float,
    confidence: float = 0.95,
    grid: Sequence[float] = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
) -> tuple[float, dict[str, int]]:
    """The best bound over a FIXED grid of guess counts (fractions of m), Bonferroni-corrected over the grid
    so that picking the best one keeps the stated confidence."""
    m = len(scores)
    alpha = (1 - confidence) / len(grid)
    best, info = 0.0, {"guesses": 0, "correct": 0}
    for frac in grid:
        r, v = one_run_guesses(scores, included, max(2, int(frac * m)))
        eps = one_run_epsilon(m, r, v, delta, alpha)
        if eps > best or info["guesses"] == 0:
            best, info = max(best, eps), {"guesses": r, "correct": v}
    return best, info
