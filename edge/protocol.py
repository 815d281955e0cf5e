"""The node's release protocol, written once: every releasing handler is a compute function wrapped by it.

For each request, in this order:
  1. verify the job (signed by a coordinator key this site's policy allows, naming this site, not closed);
  2. derive the request id from the job id, phase and round (never a free-form id from the coordinator)
     and answer a replay from the ledger's record (no second charge, no fresh noise);
  3. check the request against the signed policy (mechanism allowed, σ ≥ minimum, caps), and the
     coordinator's payload against the job (``admit``: public input only, no image is read yet);
  4. charge the ledger (budget re-checked under its write lock; committed before any image is read), so
     whatever the computation reveals, its failure included, is already paid for;
  5. compute the release with fresh OS noise (:class:`ReleaseRng`); all noise is added here, on site;
  6. record the released payload in the ledger (a replay gets exactly these bytes);
  7. only then reply.
A computation that fails after step 4 releases nothing: its cause stays in the site's log (an exception
text could depend on the images) and the coordinator gets one line saying the request was charged and
answered with nothing; it is marked failed in the ledger and never run again. A request whose process was
KILLED after step 4 (never recorded, never failed) is finished when it comes again for a DP-SGD round
(``release(resume= True)``: from the round's own checkpoint, ``edge.releases.RoundCheckpoint``), and refused
for the other releases. Refusals before step 4 are ``PolicyError``/``BudgetExceededError`` naming the rule;
the runtime turns them into an error reply.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import Context, Message, RecordDict

from feta_release.accounting import Event, PrivacyEvent, SkellamEvent, events_from_list, events_to_list
from feta_release.errors import ConfigError, PolicyError, PrivacyError
from feta_release.federation import messages as fm
from feta_release.federation.plan import check_requested
from feta_release.mechanisms.count import counted_events
from feta_release.mechanisms.feature_map import check_feature_map
from feta_release.mechanisms.secure_sums import secagg_warmup_events
from feta_release.planning import secure_site_events, stage_event
from feta_release.policy.enforce import (
    MechanismRequest,
    check_request,
    check_resources,
    own_share_request,
    request_of,
    skellam_own_sigma,
    skellam_request,
)
from feta_release.policy.jobs import Job, verify_job
from feta_release.randomness import os_numpy_generator, os_torch_generator

from .admission import request_for
from .site import Site, site_for

log = logging.getLogger("feta.node")

Arrays = dict[str, np.ndarray]
Handler = Callable[[Message, Context], Message]
# The message phase of each mechanism (request ids are ``job:phase:round``).
PHASES = {"selection": "selection", "central": "central", "frequency": "frequency", "dpsgd": "train"}


class ReleaseRng:
    """The one source of release noise: every generator it hands out is seeded with 256 fresh OS bits.

    It takes no argument on purpose: nothing the coordinator sends (job id, request id, the job's seed) can
    reach a seed, so nobody but the site can predict, replay or subtract the noise of a release."""

    def numpy(self) -> np.random.Generator:
        return os_numpy_generator()

    def torch(self) -> torch.Generator:
        return os_torch_generator()


@dataclass(frozen=True)
class Request:
    """What a compute function receives beside the site, the job and the noise source."""

    rid: str
    round: int
    event: Event  # planned, checked against the policy and charged before the computation runs
    doc: dict[str, Any]
    arrays: Arrays


Compute = Callable[[Site, Job, Request, ReleaseRng], tuple[Arrays, list[Event]]]
Admit = Callable[[Site, Job, Request], None]
Public = Callable[[Site, Request], dict[str, Any]]


def verified_job(site: Site, doc: dict[str, Any], *, attesting: bool = False) -> Job:
    """The verified job, bound to its id at this site (one id names one signed job, by body hash and full
    signer key); refused once the job's final attestation closed it (only a repeated attest is answered)."""
    if "job" not in doc:
        raise PolicyError("request carries no signed job; refused")
    job = verify_job(doc["job"], site.policy, source="job in request")
    # the job's model and per-step work, from its config: before anything is built
    check_resources(site.policy, job)
    # public values only (the job's [frequency] and the policy's declared shape): refused before any charge
    try:
        check_feature_map(job.config.frequency, tuple(site.policy.declared.image_shape))
    except (ConfigError, PrivacyError) as exc:
        raise PolicyError(f"job {job.job_id}: {exc}; refused") from None
    site.ledger.bind_job(job.job_id, job.digest, job.signer_sha256)
    if not attesting and site.ledger.is_closed(job.job_id):
        raise PolicyError(
            f"job {job.job_id} is closed at site {site.site_id}: its final attestation was signed, "
            "so nothing more is answered for it; start a new job"
        )
    return job


def job_events(site: Site, job: Job) -> list[Event]:
    return events_from_list(site.ledger.job_events(job.job_id))


def secure_warmup(site: Site, job: Job) -> list[Event] | None:
    """The site's SkellamEvents of the job's one-shot releases (the selection, the warm-up statistics) when
    the job sums them by secure aggregation (its own trust assumption, ``secure_aggregation.max_colluders``,
    decides the noise shares counted), else None."""
    cfg = job.config
    if not cfg.federation.secure_aggregation:
        return None
    events = secagg_warmup_events(
        cfg,
        site.n_public,
        tuple(site.data.image_shape),
        int(site.data.n_classes),
        len(job.sites),
        site.policy.counted_colluders(len(job.sites)),
    )
    return [e for e in events if isinstance(e, SkellamEvent)]


def planned(site: Site, job: Job, mechanism: str) -> tuple[Event, MechanismRequest]:
    """The event this site charges for ``mechanism`` in ``job`` and the request its policy checks."""
    counted = counted_events(job_events(site, job))
    secure = secure_warmup(site, job)
    if secure is not None and mechanism == "dpsgd":
        return _secure_dpsgd(site, job, counted)
    event, mreq = request_for(
        mechanism, job, site.policy, site.n_public, cache_dir=site.work_dir, counted=counted, exact_share=True
    )
    if secure is not None:  # the selection and warm-up releases: secure sums
        charged = stage_event(secure, mechanism)
        if charged is None:
            raise PrivacyError(f"the job has no secure {mechanism} release; nothing to release")
        return charged, own_share_request(mreq, skellam_own_sigma(charged))
    return event, mreq


def _secure_dpsgd(site: Site, job: Job, counted: list[PrivacyEvent]) -> tuple[Event, MechanismRequest]:
    """One DP-SGD round's event in a secure job, from THE planner's history of the site
    (``planning.secure_site_events``: the coordinator's plan is the same call), and its request: a per-site
    round's Gaussian form, or a FedSGD round's (``min_sigma`` against the site's own share)."""
    cfg, n_sites = job.config, len(job.sites)
    events = secure_site_events(
        cfg,
        site.n_public,
        tuple(site.data.image_shape),
        int(site.data.n_classes),
        n_sites,
        site.policy,
        counted=counted,
        cache_dir=site.work_dir,
    )
    event = stage_event(events, "dpsgd")
    if event is None:
        raise PrivacyError(
            "the job has no DP-SGD ([federation] rounds x local_steps = 0); nothing to train"
            if not cfg.federation.fedsgd
            else "the job has no FedSGD rounds ([federation] rounds = 0); nothing to train"
        )
    if isinstance(event, SkellamEvent):
        return event, skellam_request(event, cfg, job, n_sites)
    return event, request_of(event, cfg, job)


def _check_mode(mechanism: str, job: Job, secure: bool) -> None:
    """A job's one-shot releases (the selection, the warm-up statistics) go EITHER through secure aggregation
    OR out with per-site noise, never both; its DP-SGD rounds EITHER as FedSGD noise shares (``[federation]
    fedsgd``) OR as per-site-noise rounds."""
    fed = job.config.federation
    if mechanism == "dpsgd":
        if bool(fed.secure_aggregation and fed.fedsgd) != secure:
            raise PolicyError(
                f"job {job.job_id} runs its DP-SGD rounds "
                + (
                    "as FedSGD over secure aggregation; a per-site round (full noise, unmasked) is refused"
                    if not secure
                    else "with per-site noise ([federation] fedsgd unset); a FedSGD secure-sum round is "
                    "refused"
                )
            )
        return
    if bool(fed.secure_aggregation) == secure:
        return
    if secure:
        raise PolicyError(
            f"job {job.job_id} does not set [federation] secure_aggregation: its {mechanism} release "
            "is per-site; a secure-aggregation request for it is refused"
        )
    raise PolicyError(
        f"job {job.job_id} sums its {mechanism} release by secure aggregation; a per-site "
        f"{mechanism} release (full noise, unmasked) is refused"
    )


def _round(mechanism: str, job: Job, doc: dict[str, Any]) -> int:
    if mechanism != "dpsgd":
        return 0
    rnd, rounds = int(doc.get("round", -1)), job.config.federated_rounds
    if not 0 <= rnd < rounds:
        raise PolicyError(f"round {rnd} is outside the job's {rounds} rounds; refused")
    return rnd


def _local_timing(site: Site, rid: str, seconds: float) -> None:
    """On-site compute time, kept in the site's own work directory (for the site's administrator and
    ``bench/bench_federation.py``): it tracks the realised Poisson batch size, so it is never sent."""
    with open(site.work_dir / "compute_seconds.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"request_id": rid, "seconds": round(seconds, 3)}) + "\n")


def _recorded(response: bytes | None) -> RecordDict:
    return fm.payload_from_bytes(response or b"")


def _compute_and_record(
    compute: Compute, site: Site, job: Job, req: Request, public: Public | None
) -> RecordDict:
    """Run ``compute`` for a request that is already charged, build the reply and record it.

    Everything after the charge is under one catch: any failure (the computation, the public fields, building
    or recording the payload) releases nothing and sends a fixed message, because an exception's text can
    depend on the images and Flower forwards it to the coordinator."""
    t0 = time.perf_counter()
    try:
        arrays, events = compute(site, job, req, ReleaseRng())
        if events_to_list(events) != events_to_list([req.event]):
            raise PrivacyError(f"the computation reported events {events}, not the charged {req.event}")
        doc = {
            **(public(site, req) if public else {}),
            "site_id": site.site_id,
            "request_id": req.rid,
            "events": events_to_list(events),
        }
        payload = fm.make_payload(doc, arrays)
        site.ledger.record_response(req.rid, fm.payload_bytes(payload))
    except Exception:
        log.exception("request %s failed after it was charged; nothing released", req.rid)
        _mark_failed(site, req.rid)
        raise PrivacyError(
            f"request {req.rid} failed at site {site.site_id} after its privacy cost was charged; "
            "nothing was released (the cause is in the site's log); the request cannot be retried"
        ) from None
    _local_timing(site, req.rid, time.perf_counter() - t0)
    return payload


def _mark_failed(site: Site, rid: str) -> None:
    """A failed request is never run again (its failure may depend on the data), unlike a killed one."""
    try:
        site.ledger.mark_failed(rid)
    except Exception:  # noqa: BLE001 - the ledger's own refusal: the request stays charged, and refused as before
        log.exception("request %s: could not mark it failed", rid)


def _answer(
    site: Site, job: Job, mechanism: str, req: Request, compute: Compute, public: Public | None
) -> RecordDict:
    """Steps 4-6: charge, compute, record. Returns the recorded payload (a racing twin's, if it won)."""
    charged = site.ledger.charge(job.job_id, req.rid, mechanism, [req.event], site.policy)
    if charged.replay:  # an identical request committed first: answer with ITS record, nothing computed
        return _recorded(charged.response)
    return _compute_and_record(compute, site, job, req, public)


def release(
    mechanism: str,
    *,
    admit: Admit | None = None,
    public: Public | None = None,
    secure: bool = False,
    resume: bool = False,
) -> Callable[[Compute], Handler]:
    """Wrap ``compute`` in the protocol of this module as a ClientApp handler for ``mechanism``.

    ``admit`` refuses a payload before the charge (it may read the coordinator's input, never the images);
    ``public`` adds reply fields, each a public value fixed by the signed job and policy; ``secure``: the
    handler releases the masked secure-aggregation contribution (charged as the site's SkellamEvent);
    ``resume``: a request charged but interrupted (its process killed: never recorded, never failed) is
    computed once more, from the site's own checkpoint when ``compute`` keeps one, and its one answer
    recorded, not charged again. Nothing of the killed computation left the site, so one answer leaves it, as
    charged."""

    def wrap(compute: Compute) -> Handler:
        def handler(msg: Message, context: Context) -> Message:
            site = site_for(context.node_config)
            doc, arrays = fm.read_payload(msg.content)
            job = verified_job(site, doc)
            _check_mode(mechanism, job, secure)
            rnd = _round(mechanism, job, doc)
            rid = fm.request_id(job.job_id, PHASES[mechanism], rnd)
            # σ of a DP-SGD round is calibrated HERE, by the site, for its own size and budget.
            event, mreq = planned(site, job, mechanism)
            # the coordinator's plan must be the site's own
            check_requested(doc.get("event"), event, site.site_id)
            req = Request(rid, rnd, event, doc, arrays)
            if resume and site.ledger.interrupted(job.job_id, rid, mechanism, [event]):
                log.info("request %s was interrupted after its charge: finishing it (not charged again)", rid)
                if admit is not None:
                    admit(site, job, req)
                return Message(_compute_and_record(compute, site, job, req, public), reply_to=msg)
            prior = site.ledger.check(job.job_id, rid, mechanism, [event], site.policy)
            if prior is not None:
                log.info("replayed request %s: answering from the ledger (not charged again)", rid)
                return Message(_recorded(prior.response), reply_to=msg)
            check_request(site.policy, mreq, job_events=job_events(site, job))
            if admit is not None:
                admit(site, job, req)
            return Message(_answer(site, job, mechanism, req, compute, public), reply_to=msg)

        # The handler keeps the compute function's name and doc (not its signature: Flower calls (msg,
        # context)).
        return functools.update_wrapper(
            handler, compute, assigned=("__module__", "__name__", "__qualname__", "__doc__"), updated=()
        )

    return wrap
