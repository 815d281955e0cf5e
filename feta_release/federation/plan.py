"""The privacy events a federated job costs at one site: computed identically by the site (which
enforces them) and by the coordinator (which plans with them and refuses a job that cannot fit).

Each site's DP-SGD σ is calibrated for ITS public size and budget: the job's planned history at that
site (central images, frequency release) plus all rounds of DP-SGD must stay within
min(job ε, site per-job ε) at min(job δ, site per-job δ). The warm-up events are the PLANNED ones, so
the σ a site uses in round r does not depend on which earlier requests the coordinator actually made.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from ..accounting import PrivacyEvent, calibrate_noise_multiplier
from ..config import JobConfig
from ..errors import PrivacyError


def central_event(cfg: JobConfig, n: int) -> PrivacyEvent | None:
    c = cfg.central
    if c.rounds <= 0:
        return None
    if c.batch > n:
        raise PrivacyError(f"[central] batch {c.batch} is larger than a site's public dataset size {n}: in a federation "
                           "the batch is each site's expected Poisson batch; lower it")
    return PrivacyEvent("central", float(c.sigma), c.batch / n, int(c.rounds))


def frequency_event(cfg: JobConfig) -> PrivacyEvent | None:
    f = cfg.frequency
    if f.sigma is None:
        return None
    return PrivacyEvent("frequency", float(f.sigma), 1.0, 1)


def warmup_events(cfg: JobConfig, n: int) -> list[PrivacyEvent]:
    return [e for e in (central_event(cfg, n), frequency_event(cfg)) if e is not None]


def dpsgd_rate(cfg: JobConfig, n: int) -> float:
    q = cfg.dpsgd.batch / n
    if not 0 < q <= 1:
        raise PrivacyError(
            f"[dpsgd] batch {cfg.dpsgd.batch} is larger than a site's public dataset size {n}: in a federation the "
            "batch is each site's expected Poisson batch; lower it"
        )
    return q


def target(cfg: JobConfig, policy: Any | None) -> tuple[float, float, str]:
    """(ε, δ, accountant) a site calibrates for: the job's, capped by the site's per-job budget."""
    eps, delta, acc = cfg.privacy.epsilon, cfg.privacy.delta, cfg.privacy.accountant
    if policy is not None:
        eps, delta, acc = min(eps, policy.job_epsilon), min(delta, policy.job_delta), policy.accountant
    return eps, delta, acc


def site_sigma(cfg: JobConfig, n: int, policy: Any | None = None, cache_dir: Path | None = None) -> float:
    """The DP-SGD noise multiplier of a site. ``cache_dir``: remember calibrations on disk (each message runs
    in a fresh process at a real node, and a calibration costs seconds; the result is a pure function of
    its inputs, so the cache is exact)."""
    if cfg.dpsgd.noise_multiplier is not None:
        return float(cfg.dpsgd.noise_multiplier)
    total_steps = cfg.federation.rounds * cfg.federation.local_steps
    if total_steps < 1:
        raise PrivacyError("[federation] rounds x local_steps must be >= 1 to calibrate DP-SGD")
    eps, delta, acc = target(cfg, policy)
    args = (tuple(warmup_events(cfg, n)), dpsgd_rate(cfg, n), total_steps, eps, delta, acc)
    if cache_dir is None:
        return _calibrate(*args)
    key = hashlib.sha256(json.dumps([[e.to_dict() for e in args[0]], *args[1:]]).encode()).hexdigest()
    path = Path(cache_dir) / "calibrations" / f"{key}.json"
    if path.exists():
        return float(json.loads(path.read_text("utf-8"))["sigma"])
    sigma = _calibrate(*args)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"sigma": sigma}), "utf-8")
    os.replace(tmp, path)
    return sigma


@functools.lru_cache(maxsize=256)
def _calibrate(prior: tuple[PrivacyEvent, ...], q: float, steps: int, eps: float, delta: float, acc: str) -> float:
    # Deterministic, so caching is exact; the bisection costs ~0.5 s per call and every request recomputes it.
    return calibrate_noise_multiplier(list(prior), q, steps, eps, delta, acc)


def round_event(cfg: JobConfig, n: int, sigma: float) -> PrivacyEvent:
    """One federated round at a site: ``local_steps`` DP-SGD steps at rate q."""
    return PrivacyEvent("dpsgd", float(sigma), dpsgd_rate(cfg, n), int(cfg.federation.local_steps))


def site_plan(cfg: JobConfig, n: int, policy: Any | None = None) -> list[PrivacyEvent]:
    """All events of the job at a site, in order (what its ledger will hold after the job)."""
    evs = warmup_events(cfg, n)
    if cfg.federation.rounds > 0:
        sigma = site_sigma(cfg, n, policy)
        evs += [round_event(cfg, n, sigma)] * cfg.federation.rounds
    return evs


def public_size(policy: Any) -> int:
    """A site's PUBLIC size, fixed by its signed policy (never a number from a reply).

    The nominal size when the policy declares one, else the policy's dataset size.
    """
    for attr in ("public_size", "nominal_size"):
        value = getattr(policy, attr, None)
        if value is not None:
            return int(value)
    return int(policy.dataset_size)


def fedavg_weights(sizes: dict[str, int]) -> dict[str, float]:
    """FedAvg weights from each answering site's PUBLIC dataset size."""
    total = sum(sizes.values())
    if total <= 0 or any(s <= 0 or not math.isfinite(s) for s in sizes.values()):
        raise PrivacyError(f"FedAvg needs positive public sizes, got {sizes}")
    return {k: v / total for k, v in sizes.items()}
