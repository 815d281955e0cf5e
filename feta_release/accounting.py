"""Whole-history privacy accounting: heterogeneous subsampled-Gaussian events composed with RDP (or PRV).

Every stage of a release (central-image rounds, the frequency release, DP-SGD steps) is a Poisson-subsampled
Gaussian mechanism and is recorded as one :class:`PrivacyEvent` ``(stage, sigma, q, steps)``.  The total
(epsilon, delta) of a release is always computed over the WHOLE history: reference code of the published
methods logs an epsilon that leaves the warm-up stages out; here no figure a user sees does that.

The analysis is Microsoft's prv-accountant, a numpy/scipy library: its RDP accountant (the subsampled
Gaussian's RDP by TF Privacy's series at Opacus' default orders 1.1 .. 10.9 step 0.1 and 12 .. 63, and the
RDP -> (eps, delta) conversion of Balle et al. 2020 Thm 21) and its PRV accountant (numerical composition of
privacy loss random variables, Gopi et al. 2021) with Opacus' PRVAccountant settings.  Both give exactly
Opacus' numbers, so releases made before the move still verify (verify.py re-composes to 1e-6);
tests/accounting/test_accounting.py cross-checks them against Opacus and against Google's dp-accounting.
(dp-accounting 0.6's own fractional-order series sums absolute values: a valid but looser bound, up to ~2 %
above Opacus at sigma 2, q 0.2, 1,000 steps, which would make every earlier release fail verification; it
stays a test oracle.)

This module must import WITHOUT torch and without opacus: offline release verification recomputes epsilon from
a release's event history on machines that have only numpy, scipy and prv-accountant (the light install,
requirements-verify.txt); prv-accountant is imported lazily, at the first epsilon computed.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from .errors import PrivacyError

__all__ = [
    "MAX_NOISE_MULTIPLIER",
    "RDP_ORDERS",
    "Accountant",
    "Event",
    "PrivacyEvent",
    "SkellamEvent",
    "View",
    "calibrate_noise_multiplier",
    "epsilon",
    "epsilon_breakdown",
    "event_from_dict",
    "event_to_dict",
    "events_from_list",
    "events_to_list",
    "group_epsilon",
    "patient_epsilon",
    "unit_epsilon",
    "worst_case_epsilon",
]

Accountant = Literal["rdp", "prv"]
View = Literal["assumed", "worst_case"]

# Opacus' RDPAccountant.DEFAULT_ALPHAS: 1.1 .. 10.9 step 0.1, then 12 .. 63.
RDP_ORDERS: tuple[float, ...] = tuple(
    [1 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(12, 64)]
)

STAGES = ("central", "frequency", "dpsgd")
# What one privacy event protects (PrivacyEvent.unit); feta_release.privacy_unit states what that means.
UNITS = ("image", "patient")

# Default cap (policy.document.SitePolicy.worst_case_cap, ledger.Budget) on a secure-aggregation job's
# worst-case epsilon (own noise share only) when the policy sets no secure_aggregation.max_worst_case_epsilon,
# as a multiple of the per-job epsilon cap. Why 3: a job calibrated to the per-job cap over h honest shares
# has an own-share epsilon about sqrt(h) times larger unsampled (Gaussian-like regime) and 2-3x larger for
# subsampled DP-SGD at h = 2-3 (docs/secure-aggregation.md's table: 5.3 -> 14.8 at 3 shares); 3x admits those
# jobs and refuses one whose noise is spread so thin over many sites that a coalition of all the others would
# leave this site nearly unprotected. A stricter site sets the field.
DEFAULT_WORST_CASE_FACTOR = 3.0


def worst_case_epsilon_cap(explicit: Any, epsilon: Any) -> float:
    """A site's cap on its worst-case ε (every other site colludes): the policy's explicit
    ``secure_aggregation`` cap, else DEFAULT_WORST_CASE_FACTOR x the ε cap it stands beside (per job or
    lifetime). The one rule of the node's ledger, its policy and the verifier."""
    return float(explicit) if explicit is not None else DEFAULT_WORST_CASE_FACTOR * float(epsilon)


# Calibration refuses noise multipliers above this: with sigma that large DP-SGD learns nothing useful, so the
# plan is treated as infeasible and the user is told which warm-up stage to shrink.
MAX_NOISE_MULTIPLIER = 1000.0


@dataclass(frozen=True)
class PrivacyEvent:
    """``steps`` compositions of a Poisson-subsampled Gaussian mechanism.

    ``sigma`` is the noise multiplier (noise std / L2 sensitivity), ``q`` the Poisson sampling rate in (0, 1]
    (1.0 = no sampling).  ``unit`` is what one add/remove changes: ``"image"`` (one image of one site, the
    default) or ``"patient"`` (one patient with all of their images: patient-level DP-SGD samples patients and
    clips each patient's summed gradient, so the accountant's figure holds per patient directly). The unit
    does not change the analysis, only what the figure protects; an image-level event serialises exactly as
    before (no ``unit`` key), so earlier ledgers and releases read and verify unchanged.
    """

    stage: str
    sigma: float
    q: float
    steps: int
    unit: str = "image"

    def __post_init__(self) -> None:
        if not isinstance(self.stage, str) or not self.stage:
            raise PrivacyError(f"privacy event: stage must be a non-empty string, got {self.stage!r}")
        real = isinstance(self.sigma, numbers.Real) and not isinstance(self.sigma, bool)
        if not (real and math.isfinite(self.sigma) and self.sigma > 0):
            raise PrivacyError(
                f"privacy event {self.stage!r}: sigma must be a finite number > 0, got {self.sigma!r}"
            )
        if not (isinstance(self.q, numbers.Real) and not isinstance(self.q, bool) and 0 < self.q <= 1):
            raise PrivacyError(
                f"privacy event {self.stage!r}: sampling rate q must be in (0, 1], got {self.q!r}"
            )
        if isinstance(self.steps, bool) or not isinstance(self.steps, numbers.Integral) or self.steps < 0:
            raise PrivacyError(
                f"privacy event {self.stage!r}: steps must be an integer >= 0, got {self.steps!r}"
            )
        if self.unit not in UNITS:
            raise PrivacyError(
                f"privacy event {self.stage!r}: unit must be one of {', '.join(UNITS)}, got {self.unit!r}"
            )
        # Normalise numpy scalars to Python numbers so that to_dict/from_dict and JSON round-trip exactly.
        object.__setattr__(self, "sigma", float(self.sigma))
        object.__setattr__(self, "q", float(self.q))
        object.__setattr__(self, "steps", int(self.steps))

    def to_dict(self) -> dict[str, Any]:
        """The event as JSON-ready fields (an image-level event without its ``unit``)."""
        d = asdict(self)
        # the default stays implicit: image-level events are byte-identical to before
        if d["unit"] == "image":
            del d["unit"]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrivacyEvent:
        """The event of :meth:`to_dict`'s fields; unknown or missing keys are refused."""
        if not isinstance(data, dict):
            raise PrivacyError(f"privacy event must be an object with stage, sigma, q, steps; got {data!r}")
        missing = sorted({"stage", "sigma", "q", "steps"} - set(data))
        if missing:
            raise PrivacyError(f"privacy event {data!r} lacks {', '.join(missing)}")
        extra = sorted(set(data) - {"stage", "sigma", "q", "steps", "unit"})
        if extra:
            raise PrivacyError(f"privacy event {data!r} has unknown key(s) {', '.join(extra)}")
        return cls(
            stage=data["stage"],
            sigma=data["sigma"],
            q=data["q"],
            steps=data["steps"],
            unit=data.get("unit", "image"),
        )


@dataclass(frozen=True)
class SkellamEvent:
    """``steps`` Poisson-subsampled (rate ``q``) releases of an integer sum under distributed Skellam noise
    (secure aggregation), with integer-domain sensitivities ``l2`` / ``l1`` of one record.

    ``mu``: the variance of the noise shares the site counts on under its signed trust assumption (the honest
    sites' shares); ``mu_worst``: the variance of its OWN share alone (every other site colludes with the
    coordinator and subtracts its share). One event carries both, so one ledger row answers both questions:
    ``epsilon(history)`` (charged, assumed) and ``epsilon(history, view="worst_case")``.
    """

    stage: str
    q: float
    steps: int
    l2: float
    l1: float
    mu: float
    mu_worst: float | None = None  # None: the same as mu (a site counting only its own share)

    def __post_init__(self) -> None:
        if not isinstance(self.stage, str) or not self.stage:
            raise PrivacyError(f"Skellam event: stage must be a non-empty string, got {self.stage!r}")
        if self.mu_worst is None:
            object.__setattr__(self, "mu_worst", self.mu)
        for name in ("q", "l2", "l1", "mu", "mu_worst"):
            v = getattr(self, name)
            if not (
                isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and float(v) > 0
            ):
                raise PrivacyError(
                    f"Skellam event {self.stage!r}: {name} must be a finite number > 0, got {v!r}"
                )
            object.__setattr__(self, name, float(v))
        if self.q > 1:
            raise PrivacyError(f"Skellam event {self.stage!r}: q must be in (0, 1], got {self.q}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, numbers.Integral) or self.steps < 0:
            raise PrivacyError(
                f"Skellam event {self.stage!r}: steps must be an integer >= 0, got {self.steps!r}"
            )
        object.__setattr__(self, "steps", int(self.steps))
        if self.worst_mu > self.mu * (1 + 1e-12):
            raise PrivacyError(
                f"Skellam event {self.stage!r}: the own share's variance mu_worst {self.mu_worst} "
                f"exceeds the counted shares' mu {self.mu}; the own share is one of them"
            )

    @property
    def worst_mu(self) -> float:
        """The noise variance of the site's own share alone (every other site colluding)."""
        return float(self.mu if self.mu_worst is None else self.mu_worst)

    def rdp(self, orders: Sequence[float] = RDP_ORDERS, *, worst_case: bool = False) -> np.ndarray:
        """RDP curve of the ``steps`` releases (noise variance ``mu``, or ``mu_worst`` with
        ``worst_case``)."""
        mu = self.worst_mu if worst_case else self.mu
        return self.steps * _skellam_step_curve(tuple(orders), self.q, self.l2, self.l1, mu)

    def to_dict(self) -> dict[str, Any]:
        """The event as JSON-ready fields, tagged ``kind: skellam``."""
        return {"kind": "skellam", **asdict(self)}

    @classmethod
    def from_dict(cls, data: object) -> SkellamEvent:
        """The event of :meth:`to_dict`'s fields, exactly those keys."""
        if not isinstance(data, dict) or set(data) != set(_SKELLAM_KEYS) or data.get("kind") != "skellam":
            raise PrivacyError(
                f"Skellam event must be an object with exactly {', '.join(_SKELLAM_KEYS)} "
                f'(kind "skellam"); got {data!r}'
            )
        return cls(**{k: v for k, v in data.items() if k != "kind"})


_SKELLAM_KEYS = ("kind", "stage", "q", "steps", "l2", "l1", "mu", "mu_worst")

# One privacy event of a site's history: a subsampled Gaussian, or a Skellam sum under secure aggregation.
Event = PrivacyEvent | SkellamEvent


@functools.lru_cache(maxsize=4096)
def _skellam_step_curve(orders: tuple[float, ...], q: float, l2: float, l1: float, mu: float) -> np.ndarray:
    """RDP curve of ONE subsampled Skellam release. Cached: a FedSGD history holds one identical event per
    round, and the general subsampling bound costs ~0.3 s per curve (read-only: callers multiply, never
    write)."""

    @functools.cache
    def per_step(a: float) -> float:
        return skellam_rdp(a, l2, l1, mu)

    curve = np.array([poisson_subsampled_rdp(a, q, per_step) for a in orders])
    curve.flags.writeable = False
    return curve


def event_to_dict(e: Event | dict[str, Any]) -> dict[str, Any]:
    """The stored form (ledger rows, attestations, manifests): Gaussian events keep their four keys (old
    ledgers and releases read unchanged), Skellam events carry ``"kind": "skellam"``."""
    return event_from_dict(e).to_dict() if isinstance(e, dict) else e.to_dict()


def event_from_dict(data: dict[str, Any]) -> Event:
    """A Gaussian or Skellam event from its JSON fields (``kind`` tells them apart)."""
    if isinstance(data, dict) and data.get("kind") == "skellam":
        return SkellamEvent.from_dict(data)
    return PrivacyEvent.from_dict(data)


def events_to_list(events: Iterable[Event]) -> list[dict[str, Any]]:
    """A history as JSON-ready fields, in order."""
    return [e.to_dict() for e in events]


def events_from_list(items: Iterable[dict[str, Any]]) -> list[Event]:
    """A history from :func:`events_to_list`'s fields, in order."""
    return [event_from_dict(d) for d in items]


def gaussian_only(events: Iterable[Event], where: str) -> list[PrivacyEvent]:
    """The history as subsampled-Gaussian events, for code that reads sigma (a local run); a Skellam event
    there is refused, never dropped silently."""
    out = list(events)
    if any(not isinstance(e, PrivacyEvent) for e in out):
        raise PrivacyError(
            f"{where}: the history holds secure-aggregation (Skellam) events, which this step cannot "
            "read; it applies to per-site-noise histories only"
        )
    return [e for e in out if isinstance(e, PrivacyEvent)]


# -- Skellam RDP (Agarwal, Kairouz, Liu 2021) and Poisson subsampling of any mechanism (Zhu & Wang 2019)
# --------


def skellam_rdp(order: float, l2: float, l1: float, mu: float) -> float:
    """RDP at ``order`` of adding Sk(mu/2, mu/2) noise to an integer query with sensitivities ``l2``, ``l1``
    (see :mod:`feta_release.accountants.skellam` for the statement and its cross-checks)."""
    if not order > 1:
        raise PrivacyError(f"Skellam RDP: the order must be > 1, got {order!r}")
    if not (math.isfinite(mu) and mu > 0):
        raise PrivacyError(f"Skellam RDP: variance mu must be a finite number > 0, got {mu!r}")
    a = float(order)
    correction = min(((2 * a - 1) * l2**2 + 6 * l1) / (4 * mu**2), 3 * l1 / (2 * mu))
    return a * l2**2 / (2 * mu) + correction


def poisson_subsampled_rdp(order: float, q: float, rdp: Callable[[float], float]) -> float:
    """Zhu & Wang 2019's general upper bound on the RDP of a Poisson-subsampled mechanism (any RDP curve):
    at integer orders a >= 2 (a fractional order takes ceil), capped by the unsampled value."""
    from scipy import special

    if not (0 < q <= 1):
        raise PrivacyError(f"subsampled RDP: sampling rate q must be in (0, 1], got {q!r}")
    unsampled = rdp(order)
    if q == 1:
        return unsampled
    a = max(2, math.ceil(order))
    head = [
        (a - 1) * math.log1p(-q) + math.log1p((a - 1) * q),
        math.log(special.comb(a, 2)) + 2 * math.log(q) + (a - 2) * math.log1p(-q) + rdp(2),
    ]
    ms = np.arange(3, a + 1)
    eps = np.array([rdp(int(m)) for m in ms])
    tail = (
        math.log(3)
        + special.gammaln(a + 1)
        - special.gammaln(ms + 1)
        - special.gammaln(a - ms + 1)
        + (a - ms) * math.log1p(-q)
        + ms * math.log(q)
        + (ms - 1) * eps
    )
    bound = float(special.logsumexp(np.concatenate([head, tail]))) / (a - 1)
    return min(bound, unsampled)


# -- the analysis: prv-accountant (numpy/scipy only, no torch, no opacus) ------------------------------------


@functools.lru_cache(maxsize=65536)
def _rdp_at(sigma: float, q: float, alpha: float) -> float:
    # Cached because calibration re-evaluates the same prior events at every bisection step.
    from prv_accountant import PoissonSubsampledGaussianMechanism  # type: ignore[import-untyped]

    return float(
        PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=sigma).rdp(alpha)
    )


@functools.cache
def _cached_mechanism_class() -> type:
    from prv_accountant import PoissonSubsampledGaussianMechanism  # type: ignore[import-untyped]

    class CachedMechanism(PoissonSubsampledGaussianMechanism):  # type: ignore[misc]
        """prv-accountant's subsampled Gaussian whose RDP at an order is computed once per (sigma, q)."""

        def rdp(self, alpha: float) -> float:
            return _rdp_at(float(self.sigma), float(self.p), float(alpha))

    return CachedMechanism


def _rdp_epsilon(history: Sequence[tuple[float, float, int]], delta: float) -> float:
    from prv_accountant.other_accountants import RDP  # type: ignore[import-untyped]

    mech = _cached_mechanism_class()
    acc = RDP(
        prvs=[mech(sampling_probability=q, noise_multiplier=sigma) for sigma, q, _ in history],
        orders=list(RDP_ORDERS),
    )
    _, _, eps = acc.compute_epsilon(delta=delta, num_self_compositions=[steps for _, _, steps in history])
    return float(eps)


def gaussian_rdp_curve(sigma: float, q: float) -> np.ndarray:
    """RDP of ONE Poisson-subsampled Gaussian step at every order of ``RDP_ORDERS`` (prv-accountant's
    analysis, the same numbers ``epsilon`` composes); other accountants (Skellam) add their curves to it."""
    return np.array([_rdp_at(float(sigma), float(q), float(a)) for a in RDP_ORDERS])


def epsilon_from_rdp(rdp: np.ndarray, delta: float) -> float:
    """Epsilon at ``delta`` of an RDP curve over ``RDP_ORDERS``, with the conversion ``epsilon`` uses
    (prv-accountant's RDP accountant, as in TF Privacy and Opacus): min over orders of
    rdp - log(delta * a) / (a - 1) + log(1 - 1 / a)."""
    _check_delta(delta)
    a = np.asarray(RDP_ORDERS)
    eps = np.asarray(rdp, dtype=float) - np.log(delta * a) / (a - 1) + np.log1p(-1 / a)
    return float(max(0.0, np.nanmin(eps)))


# -- public API ----------------------------------------------------------------------------------------------


def _check_delta(delta: float) -> None:
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise PrivacyError(f"delta must be in (0, 1), got {delta!r}")


def _history(events: Iterable[object]) -> list[tuple[float, float, int]]:
    out = []
    for e in events:
        if not isinstance(e, PrivacyEvent):
            raise PrivacyError(f"expected PrivacyEvent or SkellamEvent, got {type(e).__name__}: {e!r}")
        if e.steps > 0:
            out.append((e.sigma, e.q, e.steps))
    return out


def epsilon(
    events: Iterable[Event], delta: float, accountant: Accountant = "rdp", *, view: View = "assumed"
) -> float:
    """Total epsilon at ``delta`` of a heterogeneous event history (all stages composed): THE one function for
    a job's or a lifetime's epsilon, whatever mixes of Gaussian and Skellam events it holds.

    A history with a Skellam event is composed by adding RDP curves over ``RDP_ORDERS`` (whatever
    ``accountant`` says: the PRV accountant has no Skellam privacy-loss distribution, and RDP is a valid upper
    bound). ``view``: ``"assumed"`` counts each Skellam release's noise shares under the site's trust
    assumption (what is charged); ``"worst_case"`` only the site's own share (every other site colludes with
    the coordinator)."""
    _check_delta(delta)
    events = list(events)
    if view not in ("assumed", "worst_case"):
        raise PrivacyError(f"unknown epsilon view {view!r}; use 'assumed' or 'worst_case'")
    if any(isinstance(e, SkellamEvent) for e in events):
        return _mixed_epsilon(events, delta, worst_case=view == "worst_case")
    history = _history(events)
    if not history:
        return 0.0
    if accountant == "rdp":
        return _rdp_epsilon(history, delta)
    if accountant == "prv":
        return _prv_epsilon(history, delta)
    raise PrivacyError(f"unknown accountant {accountant!r}; use 'rdp' or 'prv'")


def _mixed_epsilon(events: Sequence[Event], delta: float, *, worst_case: bool) -> float:
    """RDP composition of subsampled-Gaussian and Skellam events (curves added over the same orders)."""
    total = history_rdp(events, view="worst_case" if worst_case else "assumed")
    return epsilon_from_rdp(total, delta) if np.any(total) else 0.0


def history_rdp(events: Iterable[Event], *, view: View = "assumed") -> np.ndarray:
    """The RDP curve over ``RDP_ORDERS`` of a (mixed) history: Gaussian curves times their steps plus Skellam
    curves (own share only with ``view="worst_case"``), the sum :func:`epsilon` converts for a history with a
    Skellam event."""
    total = np.zeros(len(RDP_ORDERS))
    for e in events:
        if e.steps == 0:
            continue
        if isinstance(e, SkellamEvent):
            total = total + e.rdp(worst_case=view == "worst_case")
        elif isinstance(e, PrivacyEvent):
            total = total + e.steps * gaussian_rdp_curve(e.sigma, e.q)
        else:
            raise PrivacyError(f"expected PrivacyEvent or SkellamEvent, got {type(e).__name__}: {e!r}")
    return total


def group_epsilon(events: Iterable[Event], delta: float, k: int, *, view: View = "assumed") -> float:
    """Epsilon of a history at ``delta`` for a GROUP of ``k`` records (one patient of at most k capped images)
    of events that protect one record, by (ε, δ) group privacy: (ε_r, δ_r) per record gives (k·ε_r,
    k·e^{(k-1)ε_r}·δ_r) per group (Vadhan 2017, Lemma 2.2).

    The per-record δ_r is chosen, per RDP order a > k, as the largest one whose group δ is exactly ``delta``:
    with ε_r(L) = A_a + L/(a-1) (the RDP conversion of :func:`epsilon_from_rdp`, L = log 1/δ_r), the group
    condition log k + (k-1)·ε_r - L <= log delta is linear in L, so L* = (log(k/delta) + (k-1)·A_a) / (1 -
    (k-1)/(a-1)) (and at least log(k/delta), where ε_r = 0); the figure is the smallest k·ε_r(L*) over the
    orders. Every (a, δ_r) is a valid pair, so the minimum is an upper bound for any accountant (RDP whatever
    the site's accountant says: the group step needs one curve over many δ_r). Orders <= k cannot pay for the
    group's δ: they are skipped."""
    _check_delta(delta)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise PrivacyError(f"group size must be an integer >= 1, got {k!r}")
    events = list(events)
    if k == 1:
        return epsilon(events, delta, "rdp", view=view)
    curve = history_rdp(events, view=view)
    if not np.any(curve):
        return 0.0
    a = np.asarray(RDP_ORDERS)
    usable = a > k
    if not usable.any():
        raise PrivacyError(
            f"group privacy over {k} records needs an RDP order above {k}; the largest is {a.max():g}"
        )
    a, curve = a[usable], curve[usable]
    base = curve + np.log1p(-1 / a) - np.log(a) / (a - 1)
    floor = math.log(k / delta)
    with np.errstate(invalid="ignore", over="ignore"):
        lstar = np.maximum((floor + (k - 1) * base) / (1 - (k - 1) / (a - 1)), floor)
        per_record = np.maximum(base + lstar / (a - 1), 0.0)
    return float(k * np.nanmin(per_record))


def patient_epsilon(
    events: Iterable[Event], delta: float, cap: int, accountant: Accountant = "rdp", *, view: View = "assumed"
) -> float:
    """Epsilon PER PATIENT at ``delta`` (the whole δ: a per-patient budget's δ is met, not exceeded) of a
    history at a site that keeps at most ``cap`` images per patient: THE per-patient figure that every cap
    (per job, lifetime, worst case), the DP-SGD calibration, the statement and ``verify`` use.

    Patient-level events (``unit = "patient"``: patient-level DP-SGD samples and clips whole patients) hold
    per patient as they are; the image-level ones (warm-up releases, noisy counts, Skellam sums) change by one
    record per image, so by at most ``cap`` records per patient and hold per patient by group privacy
    (:func:`group_epsilon`). The two parts compose by basic composition with δ split in half; with ``cap`` = 1
    (every patient one image) or one part empty, the history is composed as one at the full δ."""
    events = list(events)
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise PrivacyError(f"patient cap must be an integer >= 1, got {cap!r}")
    image = [e for e in events if e.steps > 0 and getattr(e, "unit", "image") != "patient"]
    patient = [e for e in events if e.steps > 0 and getattr(e, "unit", "image") == "patient"]
    if cap == 1 or not image:
        return epsilon(events, delta, accountant, view=view)
    if not patient:
        return group_epsilon(image, delta, cap, view=view)
    return group_epsilon(image, delta / 2, cap, view=view) + epsilon(
        patient, delta / 2, accountant, view=view
    )


def unit_name(patient_cap: int | None) -> str:
    """The unit of privacy a site's figures are in, by its patient cap (None: no cap, the image)."""
    return "image" if patient_cap is None else "patient"


def per_unit(unit: str) -> str:
    """The words after a site's ε that say what one ε protects, "per image" or "per patient" (``unit``: the
    site's unit, :func:`unit_name`). Every line that states a site's ε names its unit with these words, so
    the figures of a federation that mixes units read alike wherever they are printed."""
    if unit not in ("image", "patient"):
        raise ValueError(f"unit of privacy must be 'image' or 'patient', got {unit!r}")
    return f"per {unit}"


def site_epsilon_words(site: str, eps: float, unit: str) -> str:
    """One site's ε in a line that lists sites: ``site-a ε=0.998 per image`` (:func:`per_unit`)."""
    return f"{site} ε={eps:.3f} {per_unit(unit)}"


def unit_epsilon(
    events: Iterable[Event],
    delta: float,
    accountant: Accountant = "rdp",
    *,
    patient_cap: int | None,
    view: View = "assumed",
) -> float:
    """The epsilon a budget caps: per patient (:func:`patient_epsilon`) at a patient-level site
    (``patient_cap`` set), else the history's epsilon per image (:func:`epsilon`)."""
    if patient_cap is None:
        return epsilon(events, delta, accountant, view=view)
    return patient_epsilon(events, delta, patient_cap, accountant, view=view)


def worst_case_epsilon(events: Iterable[Event], delta: float) -> float:
    """Epsilon of a history if every other site colluded with the coordinator (see :func:`epsilon`)."""
    return epsilon(events, delta, view="worst_case")


def has_secure_aggregation(events: Iterable[Event]) -> bool:
    return any(isinstance(e, SkellamEvent) for e in events)


def _prv_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    """Upper bound on epsilon by PRV composition (Gopi et al. 2021, Microsoft's prv-accountant) with Opacus'
    PRVAccountant settings: eps_error 0.01, delta_error delta/1000."""
    import numpy as np
    from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant  # type: ignore[import-untyped]

    prvs = [
        PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=sigma)
        for sigma, q, _ in history
    ]
    counts = [steps for _, _, steps in history]
    with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        # q = 1 (the unsampled frequency release) makes log(1 - q) = -inf inside the pdf's support test:
        # harmless.
        warnings.simplefilter("ignore")
        try:
            acc = PRVAccountant(
                prvs=prvs, max_self_compositions=counts, eps_error=0.01, delta_error=delta / 1000
            )
            _, _, eps_upper = acc.compute_epsilon(delta=delta, num_self_compositions=counts)
        except RuntimeError:
            # prv-accountant refuses a discretisation whose mean drifts (very low sigma at a high rate,
            # epsilon in the hundreds); RDP's bound is then the stated figure: still an upper bound, only less
            # tight.
            return _rdp_epsilon(history, delta)
    return float(eps_upper)


def epsilon_breakdown(
    events: Sequence[Event],
    delta: float,
    accountant: Accountant = "rdp",
    *,
    view: View = "assumed",
    patient_cap: int | None = None,
) -> dict[str, float]:
    """Epsilon of each stage ALONE (not additive: composition is sub-additive), plus ``"total"`` over all, in
    the site's unit (:func:`unit_epsilon`): per patient where ``patient_cap`` is set."""
    stages: dict[str, list[Event]] = {}
    for e in events:
        stages.setdefault(e.stage, []).append(e)
    out = {
        stage: unit_epsilon(evs, delta, accountant, patient_cap=patient_cap, view=view)
        for stage, evs in stages.items()
    }
    out["total"] = unit_epsilon(events, delta, accountant, patient_cap=patient_cap, view=view)
    return out


def calibrate_noise_multiplier(
    prior_events: Sequence[Event],
    q: float,
    steps: int,
    target_epsilon: float,
    delta: float,
    accountant: Accountant = "rdp",
    tol: float = 0.01,
    stage: str = "dpsgd",
    max_sigma: float = MAX_NOISE_MULTIPLIER,
) -> float:
    """Smallest noise multiplier (within ``tol``) for ``steps`` more events at rate ``q`` so that the WHOLE
    history ``prior_events + [(stage, sigma, q, steps)]`` stays within ``(target_epsilon, delta)``.

    Doubling from sigma = 1 until the budget holds, then bisection until the bracket is narrower than ``tol``;
    the upper end of the bracket is returned, so the total epsilon is always <= target.
    """
    _check_delta(delta)
    if not (0 < tol <= 0.01):
        raise PrivacyError(f"calibration tolerance must be in (0, 0.01], got {tol}")
    if not (
        isinstance(target_epsilon, (int, float)) and target_epsilon > 0 and math.isfinite(target_epsilon)
    ):
        raise PrivacyError(f"target epsilon must be a finite number > 0, got {target_epsilon!r}")
    if not (0 < q <= 1):
        raise PrivacyError(
            f"{stage}: sampling rate q must be in (0, 1], got {q} (is the batch larger than the dataset?)"
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise PrivacyError(f"{stage}: steps must be an integer >= 1 to calibrate, got {steps!r}")
    prior = list(prior_events)
    spent = epsilon(prior, delta, accountant)
    if spent >= target_epsilon:
        raise PrivacyError(
            f"the warm-up stages alone already spend epsilon {spent:.3f} >= target {target_epsilon}: "
            f"shrink them ({_stage_list(prior)}: fewer rounds or larger sigma) or raise [privacy] epsilon"
        )

    def total(sigma: float) -> float:
        return epsilon(prior + [PrivacyEvent(stage, sigma, q, steps)], delta, accountant)

    too_much = (
        f"{stage}: even noise multiplier {max_sigma:g} does not fit the budget epsilon {target_epsilon} "
        f"after warm-up epsilon {spent:.3f}: shrink the warm-up ({_stage_list(prior)}) or use fewer {stage} "
        f"steps ({steps}) / a smaller sampling rate ({q:.4g})"
    )
    return smallest_fitting_sigma(total, target_epsilon, tol=tol, max_sigma=max_sigma, refusal=too_much)


def smallest_fitting_sigma(
    eps_of: Callable[[float], float], target_epsilon: float, *, tol: float, max_sigma: float, refusal: str
) -> float:
    """Smallest noise multiplier with ``eps_of(sigma) <= target_epsilon`` (eps_of decreasing in sigma):
    doubling from 1 until it fits (``refusal`` as a PrivacyError past ``max_sigma``), then bisection to a
    bracket narrower than ``tol``; the upper end is returned, so the epsilon always fits. Shared by every
    accountant's calibration."""
    hi = 1.0
    while eps_of(hi) > target_epsilon:
        if hi >= max_sigma:
            raise PrivacyError(refusal)
        hi = min(hi * 2, max_sigma)
    lo = hi / 2 if hi > 1.0 else 0.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if eps_of(mid) > target_epsilon:
            lo = mid
        else:
            hi = mid
    return hi


def _stage_list(events: Sequence[Event]) -> str:
    names = sorted({e.stage for e in events if e.steps > 0})
    return ", ".join(names) if names else "none"
