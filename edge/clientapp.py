"""The site's Flower ClientApp: the only code that touches the site's images.

Every releasing handler follows the same order:
  1. verify the job (signed by a coordinator key this site's policy allows, naming this site);
  2. derive the request id from the job id and phase (never a free-form id from the coordinator),
     and answer a replay from the ledger's record (no second charge, no fresh noise);
  3. check the request against the signed policy (mechanism allowed, σ ≥ minimum, caps);
  4. compute the spend with the site's own accountant over its own history and refuse if over budget
     (pre-check, before any work);
  5. compute the release (all noise is added here, on site);
  6. charge the ledger and store the released payload in ONE committed transaction;
  7. only then return the result.
Refusals are raised as ``PolicyError``/``BudgetExceededError``: the runtime turns them into an error
reply whose reason names the rule.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from feta_release.errors import PolicyError
from feta_release.federation import messages as fm

from .site import Site, site_for

log = logging.getLogger("feta.node")

app = ClientApp()


def _job(site: Site, doc: dict[str, Any], *, attesting: bool = False) -> Any:
    """The verified job, bound to its id at this site (one id names one signed job, by body hash and full
    signer key); refused once the job's final attestation closed it (only a repeated attest is answered)."""
    from feta_release.policy.jobs import verify_job

    if "job" not in doc:
        raise PolicyError("request carries no signed job; refused")
    job = verify_job(doc["job"], site.policy, source="job in request")
    site.ledger.bind_job(job.job_id, job.digest, job.signer_sha256)
    if not attesting and site.ledger.is_closed(job.job_id):
        raise PolicyError(f"job {job.job_id} is closed at site {site.site_id}: its final attestation was signed, "
                          "so nothing more is answered for it; start a new job")
    return job


def _replay(site: Site, job: Any, rid: str, mechanism: str, events: list[Any]) -> RecordDict | None:
    prior = site.ledger.check(job.job_id, rid, mechanism, events, site.policy)
    if prior is None:
        return None
    log.info("replayed request %s: answering from the ledger (not charged again)", rid)
    return fm.payload_from_bytes(prior.response or b"")


def _commit_and_reply(msg: Message, site: Site, job: Any, rid: str, mechanism: str, events: list[Any],
                      doc: dict[str, Any], arrays: dict[str, np.ndarray]) -> Message:
    from feta_release.accounting import events_to_list

    doc = {**doc, "site_id": site.site_id, "request_id": rid, "events": events_to_list(events)}
    payload = fm.make_payload(doc, arrays)
    charged = site.ledger.charge(job.job_id, rid, mechanism, events, site.policy, response=fm.payload_bytes(payload))
    if charged.replay:  # raced with an identical request that committed first: answer with ITS record
        payload = fm.payload_from_bytes(charged.response or b"")
    return Message(payload, reply_to=msg)


def _local_timing(site: Site, rid: str, seconds: float) -> None:
    """On-site compute time, kept in the site's own work directory (for the site's administrator and
    ``bench/bench_federation.py``): it tracks the realised Poisson batch size, so it is never sent."""
    import json

    with open(site.work_dir / "compute_seconds.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"request_id": rid, "seconds": round(seconds, 3)}) + "\n")


def _generator(seed_material: str) -> Any:
    """Fresh, unpredictable noise for each release (the coordinator must not be able to predict it): the whole
    generator state from 256 OS bits (a 63-bit ``manual_seed`` could be searched exhaustively)."""
    from feta_release.randomness import os_torch_generator

    del seed_material
    return os_torch_generator()


# -- handlers --------------------------------------------------------------------------------------


@app.query("hello")
def hello(msg: Message, context: Context) -> Message:
    """Identify the site for a job: site id, public size, its signed policy, what it has spent (no release)."""
    site = site_for(context.node_config)
    doc, _ = fm.read_payload(msg.content)
    job = _job(site, doc)
    from feta_release.signing import public_key_pem

    reply = {
        "site_id": site.site_id,
        "dataset_size": site.n_public,  # the policy's public nominal size, never the exact count
        "image_shape": list(site.data.image_shape),
        "n_classes": int(site.data.n_classes),
        "class_names": list(site.data.class_names),
        "policy": _signed_policy_document(context),
        "site_public_key": public_key_pem(site.key),
        "lifetime_events": [e for r in site.ledger.requests() for e in r["events"]],
        "job_events": site.ledger.job_events(job.job_id),
    }
    return Message(fm.make_payload(reply), reply_to=msg)


def _signed_policy_document(context: Context) -> Any:
    import json
    from pathlib import Path

    from .site import CFG_POLICY

    return json.loads(Path(str(context.node_config[CFG_POLICY])).read_text("utf-8"))


@app.query("central")
def central(msg: Message, context: Context) -> Message:
    from feta_release.policy.enforce import check_request

    from .admission import request_for
    from .releases import release_central

    site = site_for(context.node_config)
    doc, _ = fm.read_payload(msg.content)
    job = _job(site, doc)
    rid = fm.request_id(job.job_id, "central")
    event, request = request_for("central", job, site.policy, site.n_public)
    if (rd := _replay(site, job, rid, "central", [event])) is not None:
        return Message(rd, reply_to=msg)
    check_request(site.policy, request, job_events=_job_events(site, job))
    t0 = time.perf_counter()
    arrays, events = release_central(site.data, job.config, site.n_public)
    _local_timing(site, rid, time.perf_counter() - t0)
    return _commit_and_reply(msg, site, job, rid, "central", events, {}, arrays)


@app.query("frequency")
def frequency(msg: Message, context: Context) -> Message:
    from feta_release.policy.enforce import check_request

    from .admission import request_for
    from .releases import release_frequency

    site = site_for(context.node_config)
    doc, _ = fm.read_payload(msg.content)
    job = _job(site, doc)
    rid = fm.request_id(job.job_id, "frequency")
    event, request = request_for("frequency", job, site.policy, site.n_public)
    if (rd := _replay(site, job, rid, "frequency", [event])) is not None:
        return Message(rd, reply_to=msg)
    check_request(site.policy, request, job_events=_job_events(site, job))
    t0 = time.perf_counter()
    arrays, events = release_frequency(site.data, job.config, site.n_public)
    _local_timing(site, rid, time.perf_counter() - t0)
    return _commit_and_reply(msg, site, job, rid, "frequency", events, {}, arrays)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One federated DP-SGD round: global weights in, ``local_steps`` DP-SGD steps on site, weights out."""
    from feta_release.policy.enforce import check_request

    from .admission import request_for
    from .releases import dpsgd_round

    site = site_for(context.node_config)
    doc, arrays = fm.read_payload(msg.content)
    job = _job(site, doc)
    rnd = int(doc.get("round", -1))
    rounds = job.config.federation.rounds
    if not 0 <= rnd < rounds:
        raise PolicyError(f"round {rnd} is outside the job's {rounds} rounds; refused")
    rid = fm.request_id(job.job_id, "train", rnd)
    # σ is calibrated HERE, by the site, for its own size and budget over its own history of this job.
    event, request = request_for("dpsgd", job, site.policy, site.n_public, cache_dir=site.work_dir)
    if (rd := _replay(site, job, rid, "dpsgd", [event])) is not None:
        return Message(rd, reply_to=msg)
    check_request(site.policy, request, job_events=_job_events(site, job))
    t0 = time.perf_counter()
    weights = dpsgd_round(site.data, job.config, arrays, event, _generator(rid), site.n_public)
    _local_timing(site, rid, time.perf_counter() - t0)
    # Only public values go with the weights: the per-example loss of the private batch and the on-site
    # seconds (which track the realised Poisson batch size) are un-noised functions of the data.
    info = {"round": rnd, "num_examples": site.n_public, "sigma": event.sigma, "q": event.q}
    return _commit_and_reply(msg, site, job, rid, "dpsgd", [event], info, weights)


@app.query("attest")
def attest(msg: Message, context: Context) -> Message:
    """The site's signed, FINAL statement of what this job spent here, from its own ledger (no release).

    Attesting closes the job at this site first: no charge for it can commit afterwards, so the figures
    signed are the job's last. A repeated attest (a retry) signs the same, closed history again."""
    from .attest import site_attestation

    site = site_for(context.node_config)
    doc, _ = fm.read_payload(msg.content)
    job = _job(site, doc, attesting=True)
    return Message(fm.make_payload({"attestation": site_attestation(site, job)}), reply_to=msg)


def _job_events(site: Site, job: Any, exclude_stage: str | None = None) -> list[Any]:
    from feta_release.accounting import events_from_list

    evs = events_from_list(site.ledger.job_events(job.job_id))
    return [e for e in evs if e.stage != exclude_stage]
