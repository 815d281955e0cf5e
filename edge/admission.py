"""Does a site's signed policy admit a signed job? The node's own enforcement, callable offline.

The node's handlers (``edge.clientapp``) build each mechanism request with :func:`request_for` and
check it with ``feta_release.policy.enforce.check_request``; :func:`admit` runs the same two
functions over every request of the job in the order the node would meet them, plus the same
budget check, so ``feta-release policy check`` and ``job verify --policy`` answer exactly what the
node would (one code path). Unlike the node, which stops at the first refusal, it collects EVERY
failing rule so an administrator fixes them all in one pass.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from feta_release.accounting import Event, PrivacyEvent
from feta_release.errors import FetaError, PolicyError, PrivacyError
from feta_release.planning import secure_stage_events, site_dpsgd, stage_event, stage_events, target, warmup_events
from feta_release.policy.enforce import (
    MechanismRequest, check_budget, check_request, check_resources, own_share_request, request_of,
)
from feta_release.policy.errors import PolicyBudgetExceeded, PolicyViolation
from feta_release.policy.jobs import verify_job

MECHANISM_ORDER = ("central", "frequency", "dpsgd")


_DISABLED = {
    "central": "the job disables central images ([central] rounds = 0); nothing to release",
    "frequency": "the job disables the frequency release ([frequency] sigma unset); nothing to release",
    "dpsgd": "the job has no DP-SGD ([federation] rounds x local_steps = 0); nothing to train",
}


def request_for(mechanism: str, job: Any, policy: Any, n: int, cache_dir: Path | None = None,
                secure_warmup: Sequence[Event] | None = None) -> tuple[PrivacyEvent, MechanismRequest]:
    """The privacy event a handler will release (the planner's, ``feta_release.planning``) and the request it
    checks against the policy. ``secure_warmup``: the site's ``SkellamEvent``s when the job sums its warm-up
    releases by secure aggregation (DP-SGD is then calibrated over them; the warm-up requests keep their
    Gaussian form for the policy's sigma and cap rules, the charged event is the Skellam one)."""
    cfg = job.config
    if mechanism not in _DISABLED:
        raise PolicyError(f"unknown mechanism {mechanism!r}")
    # The warm-up releases need no DP-SGD calibration (seconds, and a job whose DP-SGD cannot fit is the
    # coordinator's refusal to make); the DP-SGD round is the planner's calibrated one.
    if mechanism != "dpsgd":
        events: list[Event] = list(warmup_events(cfg, n))
    elif secure_warmup is not None:
        events = secure_stage_events(cfg, n, secure_warmup, budget=target(cfg, policy), cache_dir=cache_dir,
                                     **site_dpsgd(policy))
    else:  # the unit and the DP-SGD population (public patients or images) come from the signed policy only
        events = list(stage_events(cfg, n, federated=True, budget=target(cfg, policy), cache_dir=cache_dir,
                                   **site_dpsgd(policy)))
    ev = stage_event(events, mechanism)
    if ev is None:
        raise PrivacyError(_DISABLED[mechanism])
    if not isinstance(ev, PrivacyEvent):
        raise PrivacyError(f"{mechanism}: the planner returned a {type(ev).__name__}, not a Gaussian request")
    req = request_of(ev, cfg, job)
    if mechanism != "dpsgd" and cfg.federation.secure_aggregation and secure_warmup is None:
        # no data at hand (policy check): the own share's sigma / sqrt(n); the node checks the exact Skellam share
        req = own_share_request(req, ev.sigma / math.sqrt(max(len(job.sites), 1)))
    return ev, req


def job_mechanisms(cfg: Any) -> list[str]:
    """The releases a job asks of each site, in order (DP-SGD once per federated round)."""
    out = []
    if cfg.central.rounds > 0:
        out.append("central")
    if cfg.frequency.sigma is not None:
        out.append("frequency")
    return out + ["dpsgd"] * cfg.federated_rounds


@dataclass
class Admission:
    site_id: str
    job_id: str | None
    failures: list[tuple[str, str]] = field(default_factory=list)  # (rule, message)
    job_epsilon: float | None = None  # with the site's accountant, when every request passed

    @property
    def accepted(self) -> bool:
        return not self.failures


def admit(policy: Any, signed_job: Any, *, source: str = "<job>", job_events: list[Event] | None = None,
          lifetime_events: list[Event] | None = None, now: Any = None,
          data_shape: tuple[tuple[int, int, int], int] | None = None) -> Admission:
    """Every rule of ``policy`` that ``signed_job`` breaks at this site (empty: the node would serve it).

    ``data_shape``: (image shape, classes) of the site's data. With it, a secure-aggregation job is judged in the
    form the node charges (its SkellamEvents, FedSGD rounds included: :func:`secure_admit`); without it (the
    sensitivities depend on the shape) in its Gaussian form."""
    res = Admission(policy.site_id, None)
    try:
        job = verify_job(signed_job, policy, source)  # the node's first check (edge.clientapp._job)
    except PolicyViolation as exc:
        res.failures.append((exc.rule, str(exc)))
        return res
    except PolicyError as exc:
        res.failures.append(("job", str(exc)))
        return res
    res.job_id = job.job_id
    try:  # the node's next check (edge.protocol.verified_job): nothing else is judged for a job it cannot hold
        check_resources(policy, job)
    except PolicyViolation as exc:
        res.failures.append((exc.rule, str(exc)))
        return res
    if data_shape is not None and job.config.federation.secure_aggregation:
        return secure_admit(res, policy, job, data_shape, job_events or [], lifetime_events or [], now)
    n = int(policy.dataset_size)  # the public size: what the node's accountant and caps use
    history = list(job_events or [])
    new: list[PrivacyEvent] = []
    for mech in job_mechanisms(job.config):
        try:
            ev, req = request_for(mech, job, policy, n)
            check_request(policy, req, job_events=history, now=now)
        except PolicyViolation as exc:
            res.failures.append((exc.rule, str(exc)))
            if mech == "dpsgd":
                break  # every round is the same request: one line is enough
            continue
        except FetaError as exc:
            res.failures.append((f"mechanisms.{mech}", str(exc)))
            if mech == "dpsgd":
                break
            continue
        history.append(ev)
        new.append(ev)
    try:
        res.job_epsilon, _ = check_budget(policy, job_events or [], lifetime_events or [], new)
    except PolicyBudgetExceeded as exc:
        res.failures.append((exc.rule, str(exc)))
    return res


@dataclass
class _SiteShape:
    """What ``secure_collect.secure_plan`` reads of a site: its signed policy, public size and data shape."""

    policy: Any
    size: int
    image_shape: tuple[int, int, int]
    n_classes: int


@dataclass
class _JobView:
    cfg: Any
    job: Any


def secure_admit(res: Admission, policy: Any, job: Any, data_shape: tuple[tuple[int, int, int], int],
                 job_events: list[Any], lifetime_events: list[Any], now: Any) -> Admission:
    """A secure-aggregation job judged as the node charges it: the requests (``min_sigma`` against the site's OWN
    noise share, FedSGD rounds as one Skellam request of R steps) and the budget and worst-case caps over the
    SkellamEvents. The plan is the coordinator's own (``secure_collect.secure_plan``, which calls the planner the
    node calls), so the check, the coordinator and the node agree."""
    from feta_release.federation.plan import public_size
    from feta_release.federation.secure_collect import secure_plan

    # the public size as the coordinator reads it from the signed policy (plan.public_size)
    site = _SiteShape(policy, public_size(policy), tuple(data_shape[0]), int(data_shape[1]))  # type: ignore[arg-type]
    try:
        requests, charged = secure_plan(_JobView(job.config, job), site)  # type: ignore[arg-type]
    except FetaError as exc:
        res.failures.append(("plan", str(exc)))
        return res
    history = list(job_events)
    for req in requests:
        try:
            check_request(policy, dataclasses.replace(req, job=job), job_events=history, now=now)
        except PolicyViolation as exc:
            res.failures.append((exc.rule, str(exc)))
            continue
        history.append(req.event())
    try:
        res.job_epsilon, _ = check_budget(policy, job_events, lifetime_events, charged)
    except PolicyBudgetExceeded as exc:
        res.failures.append((exc.rule, str(exc)))
    return res
