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
from feta_release.mechanisms.count import counted_events
from feta_release.planning import (
    selection_events,
    site_dpsgd,
    stage_event,
    stage_events,
    target,
    warmup_events,
)
from feta_release.policy.enforce import (
    MechanismRequest,
    check_budget,
    check_request,
    check_resources,
    own_share_request,
    request_of,
)
from feta_release.policy.errors import PolicyBudgetExceeded, PolicyViolation
from feta_release.policy.jobs import verify_job

MECHANISM_ORDER = ("selection", "central", "frequency", "dpsgd")


_DISABLED = {
    "central": "the job disables central images ([central] rounds = 0); nothing to release",
    "frequency": "the job disables the frequency release ([frequency] sigma unset); nothing to release",
    "selection": "the job asks no semantic selection ([public] selection = false); nothing to release",
    "dpsgd": "the job has no DP-SGD ([federation] rounds x local_steps = 0); nothing to train",
}


def request_for(
    mechanism: str,
    job: Any,
    policy: Any,
    n: int,
    cache_dir: Path | None = None,
    counted: Sequence[PrivacyEvent] = (),
    exact_share: bool = False,
) -> tuple[PrivacyEvent, MechanismRequest]:
    """The privacy event a handler will release (the planner's, ``feta_release.planning``) and the request it
    checks against the policy: the Gaussian form (a secure job's charged events are the SkellamEvents of
    ``planning.secure_site_events``; its warm-up requests keep this form for the policy's sigma and cap
    rules). ``counted``: the noisy counts this site already charged for the job (``mechanisms.count``: a
    ``train`` run's drawn public size), first in its history, so DP-SGD is calibrated over them too.
    ``exact_share``: the caller checks a secure release's ``min_sigma`` against its exact Skellam own share
    (the node, which knows its data's shape); otherwise it is checked against sigma / sqrt(sites)."""
    cfg = job.config
    if mechanism not in _DISABLED:
        raise PolicyError(f"unknown mechanism {mechanism!r}")
    # The warm-up releases need no DP-SGD calibration (seconds, and a job whose DP-SGD cannot fit is the
    # coordinator's refusal to make); the DP-SGD round is the planner's calibrated one.
    if mechanism != "dpsgd":
        events: list[PrivacyEvent] = [*selection_events(cfg), *warmup_events(cfg, n)]
    else:  # the unit and the DP-SGD population (public patients or images) come from the signed policy only
        events = stage_events(
            cfg,
            n,
            federated=True,
            budget=target(cfg, policy),
            cache_dir=cache_dir,
            size=list(counted) or None,
            **site_dpsgd(policy),
        )
    ev = stage_event(events, mechanism)
    if ev is None:
        raise PrivacyError(_DISABLED[mechanism])
    req = request_of(ev, cfg, job)
    summed = mechanism != "dpsgd" and cfg.federation.secure_aggregation
    if summed and not exact_share:
        # no data at hand (policy check): the own share's sigma / sqrt(n); the node checks the exact Skellam
        # share
        req = own_share_request(req, ev.sigma / math.sqrt(max(len(job.sites), 1)))
    return ev, req


def job_mechanisms(cfg: Any) -> list[str]:
    """The releases a job asks of each site, in order (DP-SGD once per federated round)."""
    out = ["selection"] if cfg.public.selection else []
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

    def add(self, rule: str, message: str) -> None:
        """Record a failing rule once (every DP-SGD round makes the same request, and the planner's refusal of
        a job is the same for each of its releases)."""
        if not any(r == rule and (rule not in ("job", "plan") or m == message) for r, m in self.failures):
            self.failures.append((rule, message))

    @property
    def accepted(self) -> bool:
        return not self.failures


def admit(
    policy: Any,
    signed_job: Any,
    *,
    source: str = "<job>",
    job_events: list[Event] | None = None,
    lifetime_events: list[Event] | None = None,
    now: Any = None,
    data_shape: tuple[tuple[int, int, int], int] | None = None,
) -> Admission:
    """Every rule of ``policy`` that ``signed_job`` breaks at this site (empty: the node would serve it).

    ``data_shape``: (image shape, classes) of the site's data. With it, a secure-aggregation job is judged in
    the form the node charges (its SkellamEvents, FedSGD rounds included: :func:`secure_admit`); without it
    (the sensitivities depend on the shape) in its Gaussian form."""
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
    # the node's next check (edge.protocol.verified_job): nothing else is judged for a job it cannot hold
    try:
        check_resources(policy, job)
    except PolicyViolation as exc:
        res.failures.append((exc.rule, str(exc)))
        return res
    if data_shape is not None and job.config.federation.secure_aggregation:
        return explained(
            secure_admit(res, policy, job, data_shape, job_events or [], lifetime_events or [], now),
            policy,
            job,
        )
    new = _gaussian_requests(res, policy, job, job_events or [], now)
    refit = new is None
    if refit:  # the job cannot be planned here: judge its budget as if its batches were fixed
        new = _planned_with_fitting_batches(res, policy, job)
    try:
        res.job_epsilon, _ = check_budget(policy, job_events or [], lifetime_events or [], new or [])
    except PolicyBudgetExceeded as exc:
        res.add(
            exc.rule, str(exc) + (" (planned with each batch cut to the site's public size)" if refit else "")
        )
    return explained(res, policy, job)


def _gaussian_requests(
    res: Admission, policy: Any, job: Any, job_events: list[Event], now: Any
) -> list[PrivacyEvent] | None:
    """Check every request of ``job`` in the node's order, each failing rule once; return the events the job
    would charge (also those of requests a rule refuses: the budget is judged in the same pass), None when the
    planner refuses the job itself."""
    n = int(policy.dataset_size)  # the public size: what the node's accountant and caps use
    history = list(job_events)
    new: list[PrivacyEvent] = []
    planned = True
    for mech in job_mechanisms(job.config):
        try:
            ev, req = request_for(mech, job, policy, n)
        except PolicyViolation as exc:
            res.add(exc.rule, str(exc))
            planned = False
            continue
        # the planner's refusal of the job: the same line for every request, said once
        except FetaError as exc:
            res.add("job", str(exc))
            planned = False
            continue
        new.append(ev)
        try:
            check_request(policy, req, job_events=history, now=now)
        except PolicyViolation as exc:
            res.add(exc.rule, str(exc))
        history.append(ev)
    return new if planned else None


def _planned_with_fitting_batches(res: Admission, policy: Any, job: Any) -> list[PrivacyEvent] | None:
    """The job's events with its central and DP-SGD batches cut to what the site's public sizes allow, so that
    a batch refusal and a budget refusal show in one pass (None: it cannot be planned even so; why is added to
    ``res``)."""
    cfg = job.config
    n = int(policy.dataset_size)
    fixed = cfg.replace(
        central={"batch": max(1, min(int(cfg.central.batch), n))},
        dpsgd={"batch": max(1, min(int(cfg.dpsgd.batch), int(policy.dpsgd_population)))},
    )
    job2 = dataclasses.replace(job, config=fixed)
    try:
        return [request_for(m, job2, policy, n)[0] for m in job_mechanisms(fixed)]
    except FetaError as exc:
        res.add("job", f"{exc} (planned with each batch cut to the site's public size)")
        return None


def _budget_fix(policy: Any, job: Any, rule: str) -> str:
    """The fix that applies to a budget refusal: whose number is the limit, and who changes it."""
    cfg = job.config
    if cfg.federation.secure_aggregation and len(job.sites) > 1 and not policy.peers:
        return no_peers_cause(len(job.sites))
    if rule == "budget.lifetime.epsilon":
        return (
            "fix: this site's lifetime budget is the limit: raise budget.lifetime.epsilon in the POLICY "
            "(raise version, re-sign) only if its administrator accepts more spending on these data"
        )
    if float(policy.job_epsilon) < float(cfg.privacy.epsilon):
        return (
            f"fix: the limit is this site's POLICY cap budget.per_job.epsilon = {policy.job_epsilon:g}, "
            f"below the job's [privacy] epsilon = {cfg.privacy.epsilon:g}: raise the POLICY's cap (raise "
            "version, re-sign), or the coordinator lowers the JOB's epsilon to at most "
            f"{policy.job_epsilon:g}"
        )
    return (
        f"fix: the limit is the JOB (its [privacy] epsilon = {cfg.privacy.epsilon:g} fits this site's cap "
        f"{policy.job_epsilon:g}, but its releases spend more): the coordinator lowers the JOB's epsilon or "
        "adds noise"
    )


def no_peers_cause(n_sites: int) -> str:
    """Why a multi-site secure-aggregation job spends more at a site that pins no peers, and the fix."""
    return (
        f"cause: no peers pinned: this site's policy pins no other site's key ([secure_aggregation] peers), "
        "so no other site's noise share counts and its epsilon is that of its own share (sigma / "
        f"sqrt({n_sites})) alone; fix: pin the other sites' keys/site-signing.pub (`site init --peer "
        "SITE_ID=FILE`, or [secure_aggregation.peers] in the policy), raise version and re-sign; or the "
        "coordinator runs the job with per-site noise ([federation] secure_aggregation = false)"
    )


def explained(res: Admission, policy: Any, job: Any) -> Admission:
    """Each budget or planner refusal with the fix that applies (the policy's cap or the job's epsilon,
    peers)."""
    out = []
    for rule, msg in res.failures:
        if rule.startswith("budget.") or "epsilon" in msg and rule in ("job", "plan"):
            msg = _planner_advice(msg, policy, job) + "; " + _budget_fix(policy, job, rule)
        out.append((rule, msg))
    res.failures = out
    return res


def _planner_advice(msg: str, policy: Any, job: Any) -> str:
    """The planner says "raise [privacy] epsilon": wrong advice where the site's own cap is the limit."""
    if float(policy.job_epsilon) < float(job.config.privacy.epsilon):
        return msg.replace(", or raise [privacy] epsilon", "")
    return msg


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


def secure_admit(
    res: Admission,
    policy: Any,
    job: Any,
    data_shape: tuple[tuple[int, int, int], int],
    job_events: list[Any],
    lifetime_events: list[Any],
    now: Any,
) -> Admission:
    """A secure-aggregation job judged as the node charges it: the requests (``min_sigma`` against the site's
    OWN noise share, FedSGD rounds as one Skellam request of R steps) and the budget and worst-case caps over
    the SkellamEvents. The plan is the coordinator's own (``secure_collect.secure_plan``, which calls the
    planner the node calls), so the check, the coordinator and the node agree."""
    from feta_release.federation.plan import public_size
    from feta_release.federation.secure_collect import secure_plan

    # the public size as the coordinator reads it from the signed policy (plan.public_size)
    site = _SiteShape(policy, public_size(policy), tuple(data_shape[0]), int(data_shape[1]))  # type: ignore[arg-type]
    # the noisy counts the site charged for the job first (its ledger's job events), as the node counts them
    counted = counted_events(job_events)
    try:
        requests, charged = secure_plan(_JobView(job.config, job), site, counted)  # type: ignore[arg-type]
    except FetaError as exc:
        res.failures.append(("plan", str(exc)))
        return res
    history = list(job_events)
    for req in requests:
        try:
            check_request(policy, dataclasses.replace(req, job=job), job_events=history, now=now)
        except PolicyViolation as exc:
            res.add(exc.rule, str(exc))
        history.append(req.event())
    try:
        res.job_epsilon, _ = check_budget(policy, job_events, lifetime_events, charged)
    except PolicyBudgetExceeded as exc:
        res.add(exc.rule, str(exc))
    return res
