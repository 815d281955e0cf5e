"""Whole-history privacy accounting: heterogeneous subsampled-Gaussian events composed with RDP (or PRV).

Every stage of a release (central-image rounds, the frequency release, DP-SGD steps) is a Poisson-subsampled
Gaussian mechanism and is recorded as one :class:`PrivacyEvent` ``(stage, sigma, q, steps)``.  The total
(epsilon, delta) of a release is always computed over the WHOLE history: reference code of the published
methods logs an epsilon that leaves the warm-up stages out; here no figure a user sees does that.

The analysis is Opacus' (``opacus.accountants.analysis``): ``compute_rdp`` for the subsampled Gaussian and
``get_privacy_spent``, whose RDP -> (eps, delta) conversion is the tighter one of Balle et al. 2020 (Thm 21),
over the orders 1.1 .. 10.9 (step 0.1) and 12 .. 63.  The PRV option uses Opacus' numerical composition of
privacy loss random variables (Gopi et al. 2021).

This module must import WITHOUT torch: offline release verification recomputes epsilon from a release's
event history on machines that have only numpy, scipy and onnxruntime.  ``import opacus`` runs opacus'
``__init__``, which imports torch, so the two analysis sources (pure numpy/scipy files) are loaded by file
path from the installed opacus package under a private module name instead (see ``_load_opacus_analysis``).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import numbers
import sys
import types
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal
from collections.abc import Iterable, Sequence

from .errors import PrivacyError

Accountant = Literal["rdp", "prv"]

# Opacus' RDPAccountant.DEFAULT_ALPHAS: 1.1 .. 10.9 step 0.1, then 12 .. 63.
RDP_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(12, 64)])

STAGES = ("central", "frequency", "dpsgd")

# Calibration refuses noise multipliers above this: with sigma that large DP-SGD learns nothing useful, so the
# plan is treated as infeasible and the user is told which warm-up stage to shrink.
MAX_NOISE_MULTIPLIER = 1000.0


@dataclass(frozen=True)
class PrivacyEvent:
    """``steps`` compositions of a Poisson-subsampled Gaussian mechanism.

    ``sigma`` is the noise multiplier (noise std / L2 sensitivity), ``q`` the Poisson sampling rate in (0, 1]
    (1.0 = no sampling).  The unit of privacy is one image of one site (add/remove neighbouring relation).
    """

    stage: str
    sigma: float
    q: float
    steps: int

    def __post_init__(self) -> None:
        if not isinstance(self.stage, str) or not self.stage:
            raise PrivacyError(f"privacy event: stage must be a non-empty string, got {self.stage!r}")
        real = isinstance(self.sigma, numbers.Real) and not isinstance(self.sigma, bool)
        if not (real and math.isfinite(self.sigma) and self.sigma > 0):
            raise PrivacyError(f"privacy event {self.stage!r}: sigma must be a finite number > 0, got {self.sigma!r}")
        if not (isinstance(self.q, numbers.Real) and not isinstance(self.q, bool) and 0 < self.q <= 1):
            raise PrivacyError(f"privacy event {self.stage!r}: sampling rate q must be in (0, 1], got {self.q!r}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, numbers.Integral) or self.steps < 0:
            raise PrivacyError(f"privacy event {self.stage!r}: steps must be an integer >= 0, got {self.steps!r}")
        # Normalise numpy scalars to Python numbers so that to_dict/from_dict and JSON round-trip exactly.
        object.__setattr__(self, "sigma", float(self.sigma))
        object.__setattr__(self, "q", float(self.q))
        object.__setattr__(self, "steps", int(self.steps))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrivacyEvent:
        if not isinstance(data, dict):
            raise PrivacyError(f"privacy event must be an object with stage, sigma, q, steps; got {data!r}")
        missing = sorted({"stage", "sigma", "q", "steps"} - set(data))
        if missing:
            raise PrivacyError(f"privacy event {data!r} lacks {', '.join(missing)}")
        extra = sorted(set(data) - {"stage", "sigma", "q", "steps"})
        if extra:
            raise PrivacyError(f"privacy event {data!r} has unknown key(s) {', '.join(extra)}")
        return cls(stage=data["stage"], sigma=data["sigma"], q=data["q"], steps=data["steps"])


def events_to_list(events: Iterable[PrivacyEvent]) -> list[dict[str, Any]]:
    return [e.to_dict() for e in events]


def events_from_list(items: Iterable[dict[str, Any]]) -> list[PrivacyEvent]:
    return [PrivacyEvent.from_dict(d) for d in items]


# -- opacus analysis, loaded without torch -------------------------------------------------------------------


def _load_opacus_analysis() -> types.ModuleType:
    """Load ``opacus/accountants/analysis`` (rdp.py + the prv sub-package) without running ``opacus/__init__``.

    Why: ``import opacus.accountants.analysis.rdp`` executes ``opacus/__init__.py`` and
    ``opacus/accountants/__init__.py``, which import torch; the analysis files themselves need only numpy and
    scipy.  We register a private package ``_feta_opacus_accountants`` whose ``analysis`` sub-package points at
    opacus' own directory, so the files' relative imports resolve inside it.  ``prv/domain.py`` imports
    ``RDPAccountant`` from ``opacus.accountants.rdp`` (a torch-importing module) only to compute epsilon of an
    RDP history; a four-line stand-in with opacus' default orders serves that.
    """
    root_name = "_feta_opacus_accountants"
    if root_name + ".analysis" in sys.modules:
        return sys.modules[root_name + ".analysis"]
    spec = importlib.util.find_spec("opacus")
    if spec is None or not spec.submodule_search_locations:
        raise PrivacyError("the opacus package is not installed; install feta-release's dependencies (pip install .)")
    analysis_dir = Path(list(spec.submodule_search_locations)[0]) / "accountants" / "analysis"

    root = types.ModuleType(root_name)
    root.__path__ = []  # a package with no files of its own: sub-modules are registered below
    sys.modules[root_name] = root

    analysis = types.ModuleType(root_name + ".analysis")
    analysis.__path__ = [str(analysis_dir)]
    analysis.__package__ = root_name + ".analysis"
    sys.modules[analysis.__name__] = analysis
    root.analysis = analysis  # type: ignore[attr-defined]

    rdp = _exec_file(root_name + ".analysis.rdp", analysis_dir / "rdp.py")
    analysis.rdp = rdp  # type: ignore[attr-defined]

    shim = types.ModuleType(root_name + ".rdp")

    class RDPAccountant:  # the part of opacus.accountants.RDPAccountant that prv/domain.py uses
        def __init__(self) -> None:
            self.history: list[tuple[float, float, int]] = []

        def get_epsilon(self, delta: float) -> float:
            return _rdp_epsilon(rdp, self.history, delta)

    shim.RDPAccountant = RDPAccountant  # type: ignore[attr-defined]
    sys.modules[shim.__name__] = shim
    root.rdp = shim  # type: ignore[attr-defined]

    prv = _exec_file(root_name + ".analysis.prv", analysis_dir / "prv" / "__init__.py", package_dir=analysis_dir / "prv")
    analysis.prv = prv  # type: ignore[attr-defined]
    return analysis


def _exec_file(name: str, path: Path, package_dir: Path | None = None) -> types.ModuleType:
    locations = [str(package_dir)] if package_dir is not None else None
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=locations)
    if spec is None or spec.loader is None:
        raise PrivacyError(f"cannot load opacus' privacy analysis from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=8192)
def _rdp_per_step_cached(rdp_mod: types.ModuleType, sigma: float, q: float) -> tuple[float, ...]:
    return tuple(rdp_mod.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(RDP_ORDERS)))


def _rdp_per_step(rdp_mod: types.ModuleType, sigma: float, q: float) -> np.ndarray:
    # Cached because calibration re-evaluates the same prior events at every bisection step.
    import numpy as np

    return np.asarray(_rdp_per_step_cached(rdp_mod, sigma, q))


def _rdp_epsilon(rdp_mod: types.ModuleType, history: Sequence[tuple[float, float, int]], delta: float) -> float:
    import numpy as np

    total = np.zeros(len(RDP_ORDERS))
    for sigma, q, steps in history:
        if steps:
            total = total + steps * _rdp_per_step(rdp_mod, float(sigma), float(q))
    if not np.any(total):
        return 0.0
    with warnings.catch_warnings():
        # "Optimal order is the largest alpha" is expected for tiny budgets; the bound is still valid.
        warnings.simplefilter("ignore")
        eps, _ = rdp_mod.get_privacy_spent(orders=list(RDP_ORDERS), rdp=total, delta=delta)
    return float(eps)


# -- public API ----------------------------------------------------------------------------------------------


def _check_delta(delta: float) -> None:
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise PrivacyError(f"delta must be in (0, 1), got {delta!r}")


def _history(events: Iterable[PrivacyEvent]) -> list[tuple[float, float, int]]:
    out = []
    for e in events:
        if not isinstance(e, PrivacyEvent):
            raise PrivacyError(f"expected PrivacyEvent, got {type(e).__name__}: {e!r}")
        if e.steps > 0:
            out.append((e.sigma, e.q, e.steps))
    return out


def epsilon(events: Iterable[PrivacyEvent], delta: float, accountant: Accountant = "rdp") -> float:
    """Total epsilon at ``delta`` of a heterogeneous event history (all stages composed)."""
    _check_delta(delta)
    history = _history(events)
    if not history:
        return 0.0
    analysis = _load_opacus_analysis()
    if accountant == "rdp":
        return _rdp_epsilon(analysis.rdp, history, delta)
    if accountant == "prv":
        return _prv_epsilon(analysis.prv, history, delta)
    raise PrivacyError(f"unknown accountant {accountant!r}; use 'rdp' or 'prv'")


def _prv_epsilon(prv: types.ModuleType, history: list[tuple[float, float, int]], delta: float) -> float:
    """Upper bound on epsilon by PRV composition (as opacus' PRVAccountant: eps_error 0.01, delta_error delta/1000)."""
    import numpy as np

    eps_error, delta_error = 0.01, delta / 1000
    prvs = [prv.PoissonSubsampledGaussianPRV(q, sigma) for sigma, q, _ in history]
    counts = [steps for _, _, steps in history]
    with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        # q = 1 (the unsampled frequency release) makes log(1 - q) = -inf inside the pdf's support test: harmless.
        warnings.simplefilter("ignore")
        L = prv.compute_safe_domain_size(prvs=prvs, max_self_compositions=counts, eps_error=eps_error,
                                         delta_error=delta_error)
        mesh = eps_error / np.sqrt(sum(counts) * np.log(12 / delta_error) / 2)
        domain = prv.Domain.create_aligned(-L, L, mesh)
        tprvs = [prv.TruncatedPrivacyRandomVariable(p, domain.t_min, domain.t_max) for p in prvs]
        dprvs = [prv.discretize(t, domain) for t in tprvs]
        composed = prv.compose_heterogeneous(dprvs=dprvs, num_self_compositions=counts)
        _, _, eps_upper = composed.compute_epsilon(delta, delta_error, eps_error)
    return float(eps_upper)


def epsilon_breakdown(events: Sequence[PrivacyEvent], delta: float, accountant: Accountant = "rdp") -> dict[str, float]:
    """Epsilon of each stage ALONE (not additive: composition is sub-additive), plus ``"total"`` over all."""
    stages: dict[str, list[PrivacyEvent]] = {}
    for e in events:
        stages.setdefault(e.stage, []).append(e)
    out = {stage: epsilon(evs, delta, accountant) for stage, evs in stages.items()}
    out["total"] = epsilon(events, delta, accountant)
    return out


def calibrate_noise_multiplier(
    prior_events: Sequence[PrivacyEvent],
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
    if not (isinstance(target_epsilon, (int, float)) and target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise PrivacyError(f"target epsilon must be a finite number > 0, got {target_epsilon!r}")
    if not (0 < q <= 1):
        raise PrivacyError(f"{stage}: sampling rate q must be in (0, 1], got {q} (is the batch larger than the dataset?)")
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

    hi = 1.0
    while total(hi) > target_epsilon:
        if hi >= max_sigma:
            raise PrivacyError(
                f"{stage}: even noise multiplier {max_sigma:g} does not fit the budget epsilon {target_epsilon} "
                f"after warm-up epsilon {spent:.3f}: shrink the warm-up ({_stage_list(prior)}) or use fewer {stage} "
                f"steps ({steps}) / a smaller sampling rate ({q:.4g})"
            )
        hi = min(hi * 2, max_sigma)
    lo = 0.0
    if hi > 1.0:
        lo = hi / 2
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if total(mid) > target_epsilon:
            lo = mid
        else:
            hi = mid
    return hi


def _stage_list(events: Sequence[PrivacyEvent]) -> str:
    names = sorted({e.stage for e in events if e.steps > 0})
    return ", ".join(names) if names else "none"
