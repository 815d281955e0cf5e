"""The node's side of secure aggregation (docs/secure-aggregation.md): the four SecAgg+ stages of one secure
sum, for a job with ``[federation] secure_aggregation = true``.

One message type (``query.secagg``); the request names the release (``phase``: selection | central |
frequency | dpsgd) and the stage:

  setup                   fresh ECDH keys, the advert signed by the site key (nothing about the data: not
                          charged);
  share_keys              checks every advert against the site key the coordinator relays for that node (its
                          own must be this site's key), Shamir-shares its secrets encrypted to each peer (not
                          charged);
  collect_masked_vectors  THE release: through ``edge.protocol.release`` (verify job -> replay -> policy ->
                          charge the site's SkellamEvent -> compute the Skellam contribution with fresh OS
                          noise, mask it -> record -> reply); a repeated request replays the recorded masked
                          vector, never charges twice; a request under ANOTHER key setup is refused (its
                          recorded contribution cannot be re-masked without a second release);
  unmask                  the shares of this sum (one request per sum; the state machine refuses a second).

State between the stages (it holds the round's secrets) is in the site's work directory, mode 0600, one file
per job and phase: every Flower message runs in a fresh ClientApp process.

Why the stages are re-wired instead of Flower's ``secaggplus_mod``: see ``feta_release.federation.secagg``.
The site keys that authenticate the key adverts are the ones this site's ADMIN-SIGNED policy pins
(``secure_aggregation.peers``), never the coordinator's relay; a job naming an unpinned site, or a relayed key
that differs, is refused. A policy that pins no peers takes the relay, and then counts no other site's noise
share.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Context, Message
from flwr.common.secure_aggregation.secaggplus_constants import Stage

from feta_release.errors import PolicyError
from feta_release.federation import messages as fm
from feta_release.federation.secagg import (
    ALREADY_RELEASED,
    RoundConfig,
    SecAggError,
    SecAggSite,
    ed25519_signer,
    ed25519_verifier,
)
from feta_release.files import atomic_write_bytes
from feta_release.mechanisms import secure_sums as ss
from feta_release.mechanisms import skellam as sk
from feta_release.policy.jobs import Job
from feta_release.policy.secure_aggregation import check_pinned_peers
from feta_release.signing import load_public_key, public_key_pem

from .protocol import PHASES, Handler, planned, verified_job
from .site import Site, site_for

# selection: the semantic selection histogram (its centroids come with the masking stage); dpsgd: one FedSGD
# round per sum (edge/fedsgd.py)
PHASE_NAMES = ("selection", "central", "frequency", "dpsgd")
MIN_MODULUS_BITS = 16  # the modulus is the coordinator's choice (utility only: decoding is post-processing)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: Any, what: str) -> bytes:
    try:
        return base64.b64decode(str(text), validate=True)
    except ValueError:
        raise SecAggError(f"secure aggregation: {what} is not base64; refused") from None


def _enc(v: Any) -> Any:
    if isinstance(v, bytes):
        return {"b": _b64(v)}
    if isinstance(v, list):
        return [_enc(x) for x in v]
    return v


def _dec(v: Any) -> Any:
    if isinstance(v, dict):
        return _unb64(v["b"], "stored state")
    if isinstance(v, list):
        return [_dec(x) for x in v]
    return v


def layout(job: Job, phase: str, image_shape: tuple[int, ...], n_classes: int) -> ss.Layout:
    """The public shape of the job's secure ``phase`` sum (the coordinator computes the same)."""
    c, f = job.config.central, job.config.frequency
    if phase == "central":
        return ss.central_layout(image_shape, n_classes, c.rounds, c.clip, c.downsample, c.cells)
    if phase == "dpsgd":
        return ss.fedsgd_layout(ss.model_dim(job.config.model, image_shape, n_classes), job.config.dpsgd.clip)
    if phase == "selection":
        return ss.selection_layout(job.config.public.selection_groups)
    return ss.frequency_layout(n_classes, f.features)


def round_config(site: Site, job: Job, doc: dict[str, Any], node_id: int) -> RoundConfig:
    """This sum's public parameters, from the signed job and this site's own data shape; the coordinator's doc
    only names the nodes (each a site of the job, this site on its own node) and the modulus."""
    phase, nodes = doc.get("phase"), doc.get("nodes")
    if phase not in PHASE_NAMES or not isinstance(nodes, dict):
        raise SecAggError(
            f"secure aggregation: phase must be one of {PHASE_NAMES} with a nodes map; got {phase!r}"
        )
    # every site of the job, so that this site masks against all of them (a coordinator picking a site's peers
    # can unmask its vector: docs/secure-aggregation.md)
    if set(nodes) != set(job.sites) or nodes.get(site.site_id) != node_id:
        raise SecAggError(
            f"secure aggregation: the nodes map must name every site of job {job.job_id} and no "
            f"other, this site ({site.site_id}) on node {node_id}; refused"
        )
    bits = doc.get("modulus_bits")
    if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_MODULUS_BITS <= bits <= 64:
        raise SecAggError(f"secure aggregation: modulus_bits must be an integer in [{MIN_MODULUS_BITS}, 64]")
    rid = str(doc.get("round_id", ""))
    # a FedSGD sum is bound to its DP-SGD round: the key setup of round r cannot carry round r + 1's gradient
    prefix = f"{job.job_id}:{phase}:" + (f"{_fedsgd_round(doc)}:" if phase == "dpsgd" else "")
    if not rid.startswith(prefix):
        raise SecAggError(
            f"secure aggregation: round id {rid!r} does not belong to job {job.job_id}, {phase} "
            f"(expected {prefix}...)"
        )
    lay = layout(job, str(phase), tuple(site.data.image_shape), int(site.data.n_classes))
    t = ss.secagg_threshold(job.config.federation.secagg_threshold, len(job.sites))
    return RoundConfig(rid, tuple(int(n) for n in nodes.values()), t, lay.dim, bits)


def _fedsgd_round(doc: dict[str, Any]) -> int:
    rnd = doc.get("round")
    if isinstance(rnd, bool) or not isinstance(rnd, int) or rnd < 0:
        raise SecAggError(
            f"secure aggregation: a FedSGD sum must name its DP-SGD round (an integer >= 0), got {rnd!r}"
        )
    return rnd


def _state_path(site: Site, job: Job, phase: str) -> Path:
    return site.work_dir / "secagg" / f"{job.job_id}.{phase}.json"


def save_state(site: Site, job: Job, phase: str, st: SecAggSite, site_keys: dict[str, str]) -> None:
    """Atomically, mode 0600 (it holds the round's secrets; they never leave the site)."""
    path = _state_path(site, job, phase)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)  # mkdir's mode does not fix a directory that already exists
    body = {
        "node_id": st.node_id,
        "round_id": st.config.round_id,
        "node_ids": list(st.config.node_ids),
        "modulus_bits": st.config.modulus_bits,
        "site_keys": site_keys,
        "record": {k: _enc(v) for k, v in st.to_record().items()},
    }
    atomic_write_bytes(path, json.dumps(body).encode("utf-8"), private=True)


def load_state(site: Site, job: Job, doc: dict[str, Any]) -> tuple[SecAggSite, dict[str, str]]:
    """This site's state for the request's sum; refused when the request is for another round or node set."""
    phase = str(doc.get("phase"))
    path = _state_path(site, job, phase)
    if not path.exists():
        raise SecAggError(
            f"secure aggregation: no key setup for job {job.job_id} {phase} at site {site.site_id}; "
            "start with the setup stage"
        )
    body = json.loads(path.read_text("utf-8"))
    cfg = round_config(site, job, doc, int(body["node_id"]))
    if (cfg.round_id, list(cfg.node_ids), cfg.modulus_bits) != (
        body["round_id"],
        body["node_ids"],
        body["modulus_bits"],
    ):
        raise SecAggError(
            f"secure aggregation: the request's round {cfg.round_id} differs from this site's key "
            f"setup {body['round_id']} (nodes or modulus changed); refused"
        )
    keys = {int(n): load_public_key(pem.encode()) for n, pem in body["site_keys"].items()}
    st = SecAggSite.from_record(
        int(body["node_id"]),
        cfg,
        {k: _dec(v) for k, v in body["record"].items()},
        ed25519_signer(site.key),
        ed25519_verifier(keys),
    )
    return st, dict(body["site_keys"])


def _setup(site: Site, job: Job, doc: dict[str, Any], node_id: int) -> dict[str, Any]:
    # a job naming a site whose key is not pinned: refused up front
    check_pinned_peers(site.policy, job.sites)
    _refuse_setup_of_released(site, job, doc)
    st = SecAggSite(
        node_id, round_config(site, job, doc, node_id), ed25519_signer(site.key), ed25519_verifier({})
    )
    pk1, pk2, sig = st.setup()
    save_state(site, job, str(doc["phase"]), st, {})
    return {"pk1": _b64(pk1), "pk2": _b64(pk2), "sig": _b64(sig)}


def _advert_keys(site: Site, job: Job, doc: dict[str, Any], node_id: int) -> dict[str, str]:
    """node id -> the PEM that must sign that node's key advert: this site's own key, and the other sites'
    keys PINNED by this site's policy (``secure_aggregation.peers``); only without pins the coordinator's
    relay."""
    relayed_by_node = {str(k): str(v) for k, v in dict(doc.get("site_keys", {})).items()}
    if relayed_by_node.get(str(node_id)) != public_key_pem(site.key):
        raise SecAggError(
            f"secure aggregation: the site key relayed for this site's node {node_id} is not "
            f"{site.site_id}'s own; refused"
        )
    nodes = {str(s): int(n) for s, n in dict(doc.get("nodes", {})).items()}
    relayed = {s: relayed_by_node[str(n)] for s, n in nodes.items() if str(n) in relayed_by_node}
    pinned = check_pinned_peers(site.policy, job.sites, relayed)
    keys = {str(nodes[s]): pem for s, pem in pinned.items() if s in nodes}
    keys[str(node_id)] = public_key_pem(site.key)
    return keys


def _share_keys(site: Site, job: Job, doc: dict[str, Any]) -> dict[str, Any]:
    st, _ = load_state(site, job, doc)
    site_keys = _advert_keys(site, job, doc, st.node_id)
    st.verify = ed25519_verifier({int(n): load_public_key(pem.encode()) for n, pem in site_keys.items()})
    keys = {
        int(n): (_unb64(a[0], "pk1"), _unb64(a[1], "pk2"), _unb64(a[2], "signature"))
        for n, a in dict(doc.get("keys", {})).items()
    }
    shares = st.share_keys(keys)
    save_state(site, job, str(doc["phase"]), st, site_keys)
    return {"shares": {str(n): _b64(ct) for n, ct in shares.items()}}


def _unmask(site: Site, job: Job, doc: dict[str, Any]) -> dict[str, Any]:
    st, keys = load_state(site, job, doc)
    active = [int(n) for n in doc.get("active", [])]
    dead = [int(n) for n in doc.get("dead", [])]
    try:
        shares = st.unmask(active, dead)
    finally:  # a refused unmask still ends this sum (SecAggSite advances first): keep that on disk
        if st.round_index >= st.config.rounds:  # the last sum of the setup: no secret (sk1, sk2) is kept
            _state_path(site, job, str(doc["phase"])).unlink(missing_ok=True)
        else:
            save_state(site, job, str(doc["phase"]), st, keys)
    return {"shares": {str(n): _b64(s) for n, s in shares.items()}}


def admit_masked(site: Site, job: Job, doc: dict[str, Any]) -> None:
    """Before the charge: the request fits this site's key setup, at the right stage, with a share from each
    peer (public input only: a malformed request is refused, not charged)."""
    st, _ = load_state(site, job, doc)
    if st.stage != Stage.SHARE_KEYS:
        raise SecAggError(
            f"secure aggregation: masked vector asked at stage {st.stage!r} (expected after "
            "share_keys); refused"
        )
    peers = {int(n) for n in dict(doc.get("shares", {}))}
    # masking against fewer peers than all can isolate this site
    if peers != set(st.public_keys) - {st.node_id}:
        raise SecAggError(
            f"secure aggregation: shares from {sorted(peers)}, but every other site of the key setup "
            f"{sorted(set(st.public_keys) - {st.node_id})} must send one; refused"
        )


def masked_contribution(
    site: Site, job: Job, doc: dict[str, Any], rng: np.random.Generator, noisy_sum: np.ndarray | None = None
) -> np.ndarray:
    """The site's Skellam contribution for the request's sum, masked (called by the charged release only).
    ``noisy_sum``: the contribution as the caller computed it (integer records' sum + noise share, not
    reduced; a FedSGD round, edge/fedsgd.py; the selection, from the request's centroids), reduced here mod
    the key setup's modulus."""
    st, keys = load_state(site, job, doc)
    phase, cfg, d = str(doc["phase"]), job.config, site.data
    n_sites, bits = len(job.sites), st.config.modulus_bits
    if noisy_sum is not None:
        contribution = sk.to_modular(noisy_sum, bits)
    # parameters (cells included) from the SIGNED job, never the request
    elif phase in ("central", "frequency"):
        contribution = ss.job_contribution(
            phase,
            d.images,
            d.labels,
            d.n_classes,
            cfg,
            n_public=site.n_public,
            n_sites=n_sites,
            modulus_bits=bits,
            rng=rng,
        )
    else:
        raise SecAggError(
            f"secure aggregation: the {phase} contribution is computed by its own release; refused"
        )
    ciphertexts = {int(n): _unb64(ct, "share") for n, ct in dict(doc.get("shares", {})).items()}
    masked = st.masked_vector(ciphertexts, contribution)
    save_state(site, job, phase, st, keys)
    return masked


def _released_under(site: Site, job: Job, doc: dict[str, Any]) -> str | None:
    """The key setup (round id) under which this site already released the request's contribution, or None."""
    phase = str(doc.get("phase"))
    event, _ = planned(site, job, phase)
    rnd = _fedsgd_round(doc) if phase == "dpsgd" else 0
    prior = site.ledger.check(
        job.job_id, fm.request_id(job.job_id, PHASES[phase], rnd), phase, [event], site.policy
    )
    if prior is None:
        return None
    recorded, _ = fm.read_payload(fm.payload_from_bytes(prior.response or b""))
    return str(recorded.get("round_id"))


def _refuse_another_setup(site: Site, job: Job, doc: dict[str, Any]) -> None:
    """A contribution already released under one key setup is not released again under another: re-masking
    it would need its noise again (kept nowhere) or a fresh draw (a second charge). Replays of the SAME setup
    pass through to the ledger's recorded answer."""
    released = _released_under(site, job, doc)
    if released is not None and released != doc.get("round_id"):
        raise PolicyError(
            f"site {site.site_id} already released its {doc.get('phase')} contribution for job "
            f"{job.job_id} under key setup {released}; it is not released again under "
            f"{doc.get('round_id')} (that would be a second release); nothing was charged"
        )


def _refuse_setup_of_released(site: Site, job: Job, doc: dict[str, Any]) -> None:
    """A new key setup for a contribution already released is refused (a coordinator restarted between the
    masking and the unmask stage): it would overwrite the secrets that sum's unmask needs, and a replay of the
    recorded vector could then never be unmasked. The coordinator reads ``ALREADY_RELEASED`` and gives that
    sum up."""
    released = _released_under(site, job, doc)
    if released is not None:
        raise SecAggError(
            f"secure aggregation: site {site.site_id} {ALREADY_RELEASED} (job {job.job_id}, "
            f"{doc.get('phase')}, key setup {released}); no new key setup for it"
        )


def handle(msg: Message, context: Context, masked: dict[str, Handler]) -> Message:
    """Dispatch one ``query.secagg`` request by stage (the masked-vector stage to the charged release)."""
    site = site_for(context.node_config)
    doc, _ = fm.read_payload(msg.content)
    job = verified_job(site, doc)
    if not job.config.federation.secure_aggregation:
        raise PolicyError(f"job {job.job_id} does not set [federation] secure_aggregation; refused")
    phase, stage = doc.get("phase"), doc.get("stage")
    if phase not in PHASE_NAMES:
        raise SecAggError(f"secure aggregation: unknown phase {phase!r}; refused")
    with sum_lock(site, job, str(phase)):
        if stage == "collect_masked_vectors":
            _refuse_another_setup(site, job, doc)
            return masked[str(phase)](msg, context)
        steps: dict[str, Callable[[], dict[str, Any]]] = {
            "setup": lambda: _setup(site, job, doc, int(context.node_id)),
            "share_keys": lambda: _share_keys(site, job, doc),
            "unmask": lambda: _unmask(site, job, doc),
        }
        if stage not in steps:
            raise SecAggError(f"secure aggregation: unknown stage {stage!r}; refused")
        reply = {**steps[str(stage)](), "site_id": site.site_id, "phase": phase, "stage": stage}
    return Message(fm.make_payload(reply), reply_to=msg)


@contextmanager
def sum_lock(site: Site, job: Job, phase: str) -> Iterator[None]:
    """Hold this site's lock on one sum's state across load, answer and save.

    Flower may run two ClientApp processes for one node at once: without the lock two ``unmask`` requests with
    conflicting views of who dropped could both read the state before either saved it, and both be answered —
    revealing both kinds of share for the same peer, which lets the coordinator strip every mask but the
    site's own (its vector decoded alone). ``flock`` is released by the kernel if the process dies."""
    state = _state_path(site, job, phase)
    lock = state.parent / "locks" / state.name  # empty; kept apart from the state files, which hold secrets
    lock.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
