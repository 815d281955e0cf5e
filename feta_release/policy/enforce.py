"""Enforcement: what a node checks before each release, and what a coordinator checks before a job.

Rules and the request fields they read (caps on rounds/steps are per job at this site: the request's own
steps plus those already recorded for the job):

  mechanisms.<m>.allowed      the mechanism must be allowed
  mechanisms.<m>.min_sigma    sigma (noise multiplier) >= minimum
  mechanisms.central.max_rounds   job rounds (sum of central ``steps``) <= cap
  mechanisms.central.max_cells    slant cells per class (``cells``) <= cap (default DEFAULT_MAX_CELLS: the
                                  event is
                              the same for any number of cells, only the release's shape, and so the site's
                              memory after the charge, grows)
  mechanisms.<m>.max_batch    expected batch (``batch``, or q * dataset.size) <= cap   (central, dpsgd; dpsgd
                              at a patient-level site: q * dataset.patients)
  dataset.privacy_unit        a DP-SGD request's unit is the policy's (patient or image); warm-up requests:
                              image
  mechanisms.frequency.max_features  features <= cap
  mechanisms.dpsgd.max_steps  job DP-SGD steps <= cap
  mechanisms.dpsgd.max_clip   clip <= cap (sensitivity bound)
  coordinators                the request's job was signed by a coordinator this policy allows
  job.sites                   the job names this site
  app_bundles                 the app bundle's sha256 is allowed
  budget.per_job.epsilon / budget.lifetime.epsilon   composed with the site's accountant
  resources.max_model_parameters   the job's denoiser, counted from its [model] without building it  } per
                                   job,
  resources.max_physical_batch     [dpsgd] physical_batch                                            } before
  resources.max_pass_rows          [dpsgd] physical_batch x noise_multiplicity                        }
                                   anything
  resources.max_message_mb         one coordinator message (edge: checked before it is decoded)       } is
                                   built
  resources.max_worker_memory_mb   the computing processes' memory limit (edge.resources)
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..accounting import Event, PrivacyEvent
from ..errors import BudgetExceededError, ConfigError, PolicyError, PrivacyError
from ..ledger import as_budget, check_spend
from ..model_size import denoiser_parameters
from .document import MECHANISMS, MechanismRule, SitePolicy, check_validity
from .errors import JobDoesNotFit, PolicyBudgetExceeded, PolicyViolation
from .jobs import Job

# Without a cap a coordinator could sign cells = 10**6; the event is unchanged, but the release's shape
# would exhaust the site's memory after the charge (budget spent, nothing released).
DEFAULT_MAX_CELLS = 64

# The resource caps a policy that does not set them runs under (``resources``). A 2 KB signed job with
# ``channels = 1024`` made a node allocate 6 GB to check the coordinator's weights against its model: the caps
# are checked from the job's config before anything is built. The defaults admit every shipped preset with
# room to spare (paper-mnist: 1.4 M parameters, physical batch 64 x 32 noise draws = 2048 rows) and bound what
# one job can take.
DEFAULT_RESOURCES: Mapping[str, float] = {
    "max_model_parameters": 20_000_000,
    "max_physical_batch": 256,
    "max_pass_rows": 4096,
    "max_message_mb": 512,
    "max_worker_memory_mb": 16384,
}


@dataclass(frozen=True)
class MechanismRequest:
    """One mechanism call a coordinator asks of a site."""

    mechanism: str  # "central" | "frequency" | "dpsgd"
    sigma: float  # noise multiplier
    q: float = 1.0  # Poisson sampling rate
    steps: int = 1  # compositions in this call (central: rounds; dpsgd: local steps; frequency: 1)
    batch: int | None = None  # expected batch; None: q * dataset.size
    features: int | None = None  # frequency: number of random features
    cells: int | None = None  # central: slant cells per class (the release's shape; not its sensitivity)
    clip: float | None = None  # dpsgd: per-example L2 clip
    job: Job | None = None
    app_bundle: str | None = None  # sha256 of the app bundle that asks
    unit: str = "image"  # what one add/remove changes (PrivacyEvent.unit): "patient" for patient-level DP-SGD
    # secure aggregation: the sum's sigma, of which ``sigma`` is this site's share
    pooled_sigma: float | None = None

    def event(self) -> PrivacyEvent:
        return PrivacyEvent(
            stage=self.mechanism, sigma=self.sigma, q=self.q, steps=self.steps, unit=self.unit
        )

    @classmethod
    def coerce(cls, request: MechanismRequest | PrivacyEvent | Mapping[str, Any]) -> MechanismRequest:
        if isinstance(request, MechanismRequest):
            return request
        if isinstance(request, PrivacyEvent):
            return cls(
                mechanism=request.stage,
                sigma=request.sigma,
                q=request.q,
                steps=request.steps,
                unit=request.unit,
            )
        if isinstance(request, Mapping):
            d = dict(request)
            if "rounds" in d:  # central requests may say rounds
                d["steps"] = d.pop("rounds")
            d.setdefault("mechanism", d.pop("stage", None))
            try:
                return cls(**d)
            except TypeError as exc:
                raise PolicyError(f"malformed mechanism request {request!r}: {exc}") from None
        raise PolicyError(f"malformed mechanism request {request!r}")


def request_of(event: PrivacyEvent, cfg: Any, job: Job | None = None) -> MechanismRequest:
    """The request a planned event makes of a site, with the job fields its policy rules read."""
    extra: dict[str, Any] = {}
    if event.stage == "central":
        extra.update(batch=cfg.central.batch, cells=cfg.central.cells)
    elif event.stage == "frequency":
        extra["features"] = cfg.frequency.features
    elif event.stage == "dpsgd":
        extra.update(batch=cfg.dpsgd.batch, clip=cfg.dpsgd.clip)
    return MechanismRequest(event.stage, event.sigma, event.q, event.steps, job=job, unit=event.unit, **extra)


def own_share_request(req: MechanismRequest, own_sigma: float) -> MechanismRequest:
    """A secure-aggregation release: ``min_sigma`` is checked against this site's OWN noise share (what is
    left if every other site colludes), not the pooled sigma of the sum."""
    return dataclasses.replace(req, sigma=float(own_sigma), pooled_sigma=float(req.sigma))


def skellam_own_sigma(event: Any) -> float:
    """The noise multiplier of a Skellam event's own share: sqrt(mu_worst) / its l2 sensitivity (the scaled
    clip with the rounding bound, so a little below sigma / sqrt(n))."""
    return math.sqrt(float(event.mu_worst)) / float(event.l2)


def skellam_request(event: Any, cfg: Any, job: Job | None = None, n_sites: int = 1) -> MechanismRequest:
    """The request a Skellam event (a secure-aggregation release, e.g. a FedSGD round) makes of a site's
    policy: the Gaussian form of its stage, one step at its rate, ``min_sigma`` against the site's OWN noise
    share."""
    own = skellam_own_sigma(event)
    pooled = PrivacyEvent(
        str(event.stage), own * math.sqrt(max(int(n_sites), 1)), float(event.q), int(event.steps)
    )
    return own_share_request(request_of(pooled, cfg, job), own)


def _fmt(x: float) -> str:
    return f"{x:g}"


def check_app_bundle(policy: SitePolicy, sha256: str) -> None:
    """Refuse an app bundle whose hash the policy does not list (check BEFORE importing any of its code)."""
    if sha256 not in policy.app_bundles:
        raise PolicyViolation(
            "app_bundles",
            f"app bundle sha256 {sha256} is not in the policy's allow-list "
            f"({len(policy.app_bundles)} allowed)",
            site=policy.site_id,
        )


def check_job(policy: SitePolicy, job: Job) -> None:
    if job.signer_sha256 not in policy.coordinator_fingerprints():
        raise PolicyViolation(
            "coordinators",
            f"job {job.job_id} is signed by coordinator {job.signer}, which this policy does not allow",
            site=policy.site_id,
        )
    if policy.site_id not in job.sites:
        raise PolicyViolation("job.sites", f"job {job.job_id} does not name this site", site=policy.site_id)
    check_resources(policy, job)


def resource_cap(policy: SitePolicy, name: str) -> float:
    """The policy's ``resources.<name>``, or its default (``DEFAULT_RESOURCES``)."""
    return float(policy.resources.get(name, DEFAULT_RESOURCES[name]))


def _over(policy: SitePolicy, rule: str, job: Job, what: str, value: float) -> None:
    cap = resource_cap(policy, rule)
    if value > cap:
        raise PolicyViolation(
            f"resources.{rule}",
            f"job {job.job_id}: {what} {value:,.0f} > cap {cap:,.0f}; refused "
            f"before anything was built (raise resources.{rule} in the site's policy to allow it)",
            site=policy.site_id,
        )


def check_resources(policy: SitePolicy, job: Job) -> None:
    """Refuse a job whose model or per-step work exceeds the policy's resource caps: from the job's config and
    the policy's declared data shape alone (public; nothing is built or allocated). A policy without a
    declared shape is refused by a node before any job (edge/site.py); its model is then not counted here."""
    d = job.config.dpsgd
    _over(policy, "max_physical_batch", job, "[dpsgd] physical_batch", int(d.physical_batch))
    _over(
        policy,
        "max_pass_rows",
        job,
        "[dpsgd] physical_batch x noise_multiplicity",
        int(d.physical_batch) * int(d.noise_multiplicity),
    )
    if policy.declared is None:
        return
    try:
        params = denoiser_parameters(
            job.config.model, tuple(policy.declared.image_shape), int(policy.declared.n_classes)
        )
    except ConfigError as exc:
        raise PolicyViolation(
            "resources.max_model_parameters",
            f"job {job.job_id}: its [model] cannot be built for this site's declared images: {exc}",
            site=policy.site_id,
        ) from None
    _over(policy, "max_model_parameters", job, "[model] parameters", params)


def check_request(
    policy: SitePolicy,
    request: MechanismRequest | PrivacyEvent | Mapping[str, Any],
    *,
    job_events: Iterable[Event] = (),
    require_job: bool = True,
    require_stated: bool = True,
    now: dt.datetime | str | None = None,
) -> MechanismRequest:
    """Refuse (:class:`PolicyViolation` naming the rule) a request the policy does not allow.

    ``job_events``: events already recorded for this job at this site (the step/round caps are per job).
    ``require_job``: a node always requires a verified job; the coordinator's planner checks without one.
    ``require_stated``: refuse a request that does not state features (frequency) or clip (dpsgd) when the
    policy caps them; a planner that does not know them yet passes False (the node checks them later).
    ``now``: the policy must be valid at this time (default: the clock), so a long-running node stops
    releasing when its policy expires. Budgets are checked separately by :func:`check_budget`.
    """
    req = MechanismRequest.coerce(request)
    site = policy.site_id
    check_validity(policy, now, f"policy of site {site}")
    m = req.mechanism
    if m not in MECHANISMS:
        raise PolicyViolation(
            "mechanisms", f"unknown mechanism {m!r}; known: {', '.join(MECHANISMS)}", site=site
        )
    rule = policy.mechanisms[m]
    base = f"mechanisms.{m}"
    if not rule.allowed:
        fix = (
            (
                "; the policy allows no semantic selection: add mechanisms.selection {allowed = true, "
                "min_sigma} to the POLICY (re-sign), or run the job with [public] selection = false"
            )
            if m == "selection"
            else ""
        )
        raise PolicyViolation(f"{base}.allowed", f"mechanism {m} is not allowed at this site{fix}", site=site)
    if req.job is not None:
        check_job(policy, req.job)
    elif require_job:
        raise PolicyViolation(
            "coordinators",
            f"{m} request carries no verified job; every request must belong to "
            "a job signed by an allowed coordinator",
            site=site,
        )
    if req.app_bundle is not None:
        check_app_bundle(policy, req.app_bundle)
    _check_numbers(req, rule, site)
    _check_caps(policy, req, rule, job_events, require_stated)
    return req


def _check_numbers(req: MechanismRequest, rule: MechanismRule, site: str) -> None:
    """The request's own numbers are well-formed: σ finite, positive and >= the rule's minimum; q in (0, 1];
    steps a non-negative integer (a peer's message can carry anything)."""
    m = req.mechanism
    base = f"mechanisms.{m}"
    sigma = req.sigma
    if (
        not (isinstance(sigma, (int, float)) and math.isfinite(sigma))
        or sigma < (rule.min_sigma or 0.0)
        or sigma <= 0
    ):
        raise PolicyViolation(
            f"{base}.min_sigma",
            f"requested σ={sigma} < minimum {_fmt(rule.min_sigma or 0.0)}" + _share_note(req, rule),
            site=site,
        )
    if not (isinstance(req.q, (int, float)) and 0 < req.q <= 1):
        raise PolicyViolation(f"{base}", f"sampling rate q={req.q} must be in (0, 1]", site=site)
    if isinstance(req.steps, bool) or not isinstance(req.steps, int) or req.steps < 0:
        raise PolicyViolation(f"{base}", f"steps={req.steps!r} must be an integer >= 0", site=site)


def _share_note(req: MechanismRequest, rule: MechanismRule) -> str:
    """Why a secure-aggregation request's sigma is smaller than the job's: min_sigma judges this site's
    share."""
    if req.pooled_sigma is None or not isinstance(req.sigma, (int, float)) or not req.sigma > 0:
        return ""
    return (
        " (σ is this site's own noise share under secure aggregation: the job's pooled "
        f"σ={req.pooled_sigma:.4g} over √{(req.pooled_sigma / req.sigma) ** 2:.3g} sites; fix: lower "
        f"mechanisms.{req.mechanism}.min_sigma in the POLICY to at most {req.sigma:.3g}, or the coordinator "
        "adds noise)"
    )


def _check_caps(
    policy: SitePolicy,
    req: MechanismRequest,
    rule: MechanismRule,
    job_events: Iterable[Event],
    require_stated: bool,
) -> None:
    """The rule's caps: steps/rounds per job (counting ``job_events``), unit of privacy, batch, cells,
    features, clip; an unstated features/clip is refused when capped and ``require_stated``."""
    m = req.mechanism
    site = policy.site_id
    base = f"mechanisms.{m}"
    caps = rule.caps
    prior = sum(e.steps for e in job_events if e.stage == m)
    steps_cap = "max_rounds" if m == "central" else "max_steps"
    if steps_cap in caps and prior + req.steps > caps[steps_cap]:
        what = "rounds" if m == "central" else "steps"
        raise PolicyViolation(
            f"{base}.{steps_cap}",
            f"{what} for this job would be {prior + req.steps} "
            f"({prior} done + {req.steps} requested) > cap {caps[steps_cap]}",
            site=site,
        )
    check_unit(policy, req)
    if "max_batch" in caps:
        population = policy.dpsgd_population if m == "dpsgd" else policy.dataset_size
        batch = req.batch if req.batch is not None else req.q * population
        if batch > caps["max_batch"]:
            raise PolicyViolation(
                f"{base}.max_batch", f"expected batch {_fmt(batch)} > cap {caps['max_batch']}", site=site
            )
    max_cells = int(caps.get("max_cells", DEFAULT_MAX_CELLS))
    if req.cells is not None and req.cells > max_cells:
        raise PolicyViolation(
            f"{base}.max_cells",
            f"requested {req.cells} slant cells per class > cap "
            f"{max_cells}"
            + (
                "" if "max_cells" in caps else " (the default; a policy may set mechanisms.central.max_cells)"
            ),
            site=site,
        )
    if "max_features" in caps:
        if req.features is None and require_stated:
            raise PolicyViolation(
                f"{base}.max_features", "request does not state its number of features", site=site
            )
        if req.features is not None and req.features > caps["max_features"]:
            raise PolicyViolation(
                f"{base}.max_features",
                f"requested {req.features} features > cap {caps['max_features']}",
                site=site,
            )
    if "max_clip" in caps:
        if req.clip is None and require_stated:
            raise PolicyViolation(f"{base}.max_clip", "request does not state its clip norm", site=site)
        if req.clip is not None and req.clip > caps["max_clip"]:
            raise PolicyViolation(
                f"{base}.max_clip",
                f"requested clip {_fmt(req.clip)} > cap {_fmt(caps['max_clip'])}",
                site=site,
            )


def check_unit(policy: SitePolicy, req: MechanismRequest) -> None:
    """The request's unit of privacy must be the policy's: DP-SGD at a patient-level site samples and clips
    whole patients (an image-level request would protect one image only, a patient with many images much
    less); a patient-level request at an image-level site has no declared patients to sample. The warm-up
    releases are image-level at every site (the patient cap bounds them by group privacy)."""
    want = policy.privacy_unit if req.mechanism == "dpsgd" else "image"
    if req.unit != want:
        raise PolicyViolation(
            "dataset.privacy_unit",
            f"{req.mechanism} request has unit {req.unit!r} but this site's "
            f"signed policy makes the {want} the unit of {req.mechanism} (dataset.privacy_unit = "
            f"{policy.privacy_unit!r}); the coordinator must plan this site from its signed policy",
            site=policy.site_id,
        )


def check_budget(
    policy: SitePolicy,
    job_events: Iterable[Event],
    lifetime_events: Iterable[Event],
    new_events: Iterable[Event],
    *,
    job_scope: str = "this job",
) -> tuple[float, float]:
    """(ε of the job after, ε of the site's lifetime after) with the policy's accountant, or refuse.

    ``job_events``: already recorded for this job at this site; ``lifetime_events``: everything already
    recorded at this site (all jobs, this one included); ``new_events``: what this release would add.
    Raises :class:`PolicyBudgetExceeded` (a ``BudgetExceededError``) naming ``budget.per_job.epsilon``
    or ``budget.lifetime.epsilon`` with spent / after / cap: the ledger's own check (``check_spend``).
    """
    return check_spend(
        as_budget(policy),
        list(job_events),
        list(lifetime_events),
        list(new_events),
        job_scope=job_scope,
        site=policy.site_id,
    )


def _with_job_defaults(req: MechanismRequest, job: Job | None) -> MechanismRequest:
    """Fill what a planned event does not say (job, clip, features) from the signed job's config."""
    if job is None:
        return req
    fill: dict[str, Any] = {}
    if req.job is None:
        fill["job"] = job
    if req.mechanism == "dpsgd" and req.clip is None:
        fill["clip"] = job.config.dpsgd.clip
    if req.mechanism == "frequency" and req.features is None:
        fill["features"] = job.config.frequency.features
    return dataclasses.replace(req, **fill) if fill else req


def check_job_fits(
    policies: Mapping[str, SitePolicy],
    planned: Mapping[str, Sequence[MechanismRequest | PrivacyEvent | Mapping[str, Any]]],
    *,
    job: Job | None = None,
    lifetime_events: Mapping[str, Sequence[Event]] | None = None,
    now: dt.datetime | str | None = None,
    charged: Mapping[str, Sequence[Event]] | None = None,
    counted: Mapping[str, Sequence[Event]] | None = None,
) -> dict[str, float]:
    """Coordinator side, before anything is released: every site's planned requests must pass its policy.

    ``charged[site]`` (optional): the events the site will charge when they are not the requests' Gaussian
    ones (secure aggregation: SkellamEvents); the budget (and worst-case) check then runs on them.
    ``counted[site]`` (optional): what the site charged under this job before it was opened (a ``train``
    run's drawn public size, ``mechanisms.count.counted_events``): first in the job's history, as the site's
    ledger counts it, so every request is checked over it and the returned ε is the job's total. They are part
    of ``lifetime_events[site]`` already (spent).

    ``planned[site]``: the whole job's requests at that site, in order (PrivacyEvents are fine: clip and
    features come from ``job.config`` when a job is given; batch is q * the site's public size).
    ``lifetime_events[site]`` (optional): what the site reports it has already spent.
    Returns each site's planned job ε; raises :class:`JobDoesNotFit` listing every (site, rule, reason).
    """
    problems: list[tuple[str, str, str]] = []
    result: dict[str, float] = {}
    sites = list(planned)
    if job is not None:
        sites += [s for s in job.sites if s not in planned]
    for site in sites:
        pol = policies.get(site)
        if pol is None:
            problems.append((site, "policy", f"site {site}: no verified policy to plan against"))
            continue
        if pol.site_id != site:
            problems.append((site, "site_id", f"site {site}: its policy is for site {pol.site_id}"))
            continue
        first = list((counted or {}).get(site, ()))
        history: list[Any] = list(first)
        ok = True
        for item in planned.get(site, ()):
            try:
                req = _with_job_defaults(MechanismRequest.coerce(item), job)
                check_request(pol, req, job_events=history, require_job=False, require_stated=False, now=now)
                history.append(req.event())
            except (PolicyViolation, PolicyBudgetExceeded) as exc:
                problems.append((site, exc.rule, str(exc)))
                ok = False
                break
            except (PolicyError, PrivacyError) as exc:
                problems.append((site, "request", f"site {site}: {exc}"))
                ok = False
                break
        if not ok:
            continue
        try:
            prior = list((lifetime_events or {}).get(site, ()))
            spend = list(charged[site]) if charged is not None and site in charged else history[len(first) :]
            job_eps, _ = check_budget(pol, first, prior, spend, job_scope="the planned job")
            result[site] = job_eps
        except PolicyBudgetExceeded as exc:
            problems.append((site, exc.rule, str(exc)))
        except BudgetExceededError as exc:  # pragma: no cover - accounting raising its own budget error
            problems.append((site, "budget", f"site {site}: {exc}"))
    if problems:
        raise JobDoesNotFit(problems)
    return result
