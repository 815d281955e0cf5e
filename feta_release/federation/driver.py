"""The coordinator's job, over any Flower ``Grid`` (the real SuperLink's or the in-process harness).

Phases: wait for the job's sites -> plan within every site's policy (refuse before any release) ->
collect central images + frequency statistics (one request each per site) -> warm-up (the
synthesizer's own stages, on released statistics only) -> federated DP-SGD rounds (FedAvg weighted
by public sizes) -> per-site attestations -> model + histories on disk for the release step.

Every phase's result is checkpointed in ``out_dir/state`` before the next starts. A restarted
coordinator picks up from there; any request it does send again carries the same deterministic
request id, which the site's ledger answers from its record without charging twice.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Message
from torch import nn

from ..accounting import events_from_list, site_epsilon_words, unit_name
from ..config import JobConfig
from ..errors import FetaError, PolicyError
from ..mechanisms.count import counted_events
from ..planning import site_dpsgd, stage_events, target
from ..policy.document import open_signed_policy
from ..policy.enforce import check_job_fits, request_of
from ..policy.errors import JobDoesNotFit
from ..policy.jobs import verify_job_with_keys
from ..progress_events import LOG_FILE, Sink, append_event
from ..signing import load_public_key, verify_document
from ..training.checkpoint import atomic_write_bytes, npz_bytes
from ..training.ema import EMA
from . import checkpoint_io, fedsgd, plan
from . import messages as fm
from .anchors import AnchorStore
from .secure_collect import collect_secure, secure_plan

Progress = Callable[[dict[str, Any]], None]


class SiteUnavailable(FetaError):
    """Too few sites answered a phase (fewer than [federation] min_sites)."""


@dataclass
class SiteInfo:
    site_id: str
    node_id: int
    size: int
    policy: Any  # SitePolicy (integrity-checked with the key embedded in its signature)
    signed_policy: dict[str, Any]
    image_shape: tuple[int, int, int]
    n_classes: int
    class_names: list[str]
    lifetime_events: list[dict[str, Any]] = field(default_factory=list)
    # this job's, already charged (a resumed job)
    job_events: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class JobResult:
    out_dir: Path
    sites: list[str]
    rounds_done: int
    skipped: dict[int, list[str]]
    timings: dict[str, float]
    attestations: dict[str, Any]


def global_ema(model: nn.Module, cfg: JobConfig) -> EMA:
    """The EMA of the global model, per DP-SGD step with ``training.ema.EMA``'s warm-up, as ``train``'s
    trainer keeps it (docs/architecture.md, "the EMA is per step"). A FedSGD round is one step the coordinator
    takes: it folds it itself. A per-site round's steps run at the sites: each continues this EMA over its
    ``local_steps`` and returns it, and the coordinator FedAvgs the returned EMAs into it
    (:func:`fold_site_emas`)."""
    return EMA(model, cfg.dpsgd.ema)


def fold_site_emas(ema: EMA, averaged: dict[str, np.ndarray], steps_done: int) -> None:
    """The global EMA after a per-site round: the sites' EMAs FedAvg-ed (``averaged``), ``steps_done`` job
    steps."""
    ema.load_state_dict(
        {
            "decay": ema.decay,
            "warmup": ema.warmup,
            "num_updates": int(steps_done),
            "shadow": {k: torch.from_numpy(np.asarray(v)) for k, v in averaged.items()},
        }
    )


def _registered_names(grid: Any) -> dict[int, str]:
    """{node id: name it was registered under} when the Grid tells (a SuperLink with node auth does)."""
    get_nodes = getattr(grid, "get_nodes", None)
    if get_nodes is None:
        return {}
    try:
        return {int(n.node_id): str(n.name) for n in get_nodes() if getattr(n, "name", "")}
    except Exception:  # noqa: BLE001 - an older Runtime API without node info: names unknown, not fatal
        return {}


def secure_fix_hint(exc: JobDoesNotFit, sites: dict[str, SiteInfo], n_sites: int) -> JobDoesNotFit:
    """The refusal of a secure-aggregation job (the default for >= 2 sites), with the fix: a site's epsilon
    counts only the noise shares its SIGNED policy trusts (``secure_aggregation.peers`` pinned,
    ``max_colluders``), so a job sized for the pooled noise may not fit a site that trusts fewer; or opt out
    of secure aggregation."""
    few = sorted(sid for sid, s in sites.items() if s.policy.counted_colluders(n_sites) > 0)
    why = (
        f"site(s) {', '.join(few)} count fewer than all {n_sites} noise shares (their policies pin no peer "
        "keys in secure_aggregation.peers or allow max_colluders > 0); "
        if few
        else ""
    )
    hint = (
        f"this job sums its releases by secure aggregation (the default for >= 2 sites): {why}fix: raise the "
        "job's noise, have the sites pin each other's keys, or set [federation] secure_aggregation = false "
        "(per-site noise)"
    )
    return JobDoesNotFit([*exc.problems, (exc.site or "", "federation.secure_aggregation", hint)])


def update_problem(sent: dict[str, np.ndarray], reply: dict[str, np.ndarray]) -> str | None:
    """Why a site's round reply is not a model of the weights sent (None: it is): the same tensors, each of
    the same shape, numbers, all finite. FedAvg would broadcast a scalar or a (1,)-array into every
    weight, and one NaN makes the global model NaN at every site."""
    if set(reply) != set(sent):
        missing, extra = sorted(set(sent) - set(reply)), sorted(set(reply) - set(sent))
        return f"reply refused: its tensors are not the model's (missing {missing[:3]}, unknown {extra[:3]})"
    for k, v in sent.items():
        got = reply[k]
        if got.shape != v.shape or (got.dtype.kind not in "fiu" and got.dtype != v.dtype):
            return (
                f"reply refused: tensor {k!r} is {got.dtype} {tuple(got.shape)}, the model's is {v.dtype} "
                f"{v.shape}"
            )
        if not np.all(np.isfinite(got)):
            return f"reply refused: tensor {k!r} holds NaN or infinite values"
    return None


def release_problem(arrays: dict[str, np.ndarray]) -> str | None:
    """Why a site's central/frequency release cannot be pooled (None: it can): NaN or infinite numbers would
    make the pooled warm-up set, and so the global model every site trains on, NaN."""
    # the released numbers (a central release's clip is NaN when it has none)
    data = ("values", "embedding", "histogram")
    bad = sorted(
        k
        for k in data
        if k in arrays and (arrays[k].dtype.kind not in "fiu" or not np.all(np.isfinite(arrays[k])))
    )
    return f"release refused: {', '.join(bad)} are not finite numbers" if bad else None


def hello_problem(doc: Any) -> str | None:
    """Why a node's hello cannot be read as a site's (None: it can be): a site_id string, a signed-policy
    object, a list of lifetime events. Anything else is that node's refusal, not the job's end (a KeyError or
    TypeError out of wait_for_sites stopped the job for every site)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("site_id"), str):
        return "hello refused: it names no site_id string"
    policy = doc.get("policy")
    if not isinstance(policy, dict) or not isinstance(policy.get("signature", {}), dict):
        return f"hello refused: site {doc['site_id']!r} sent no signed-policy object"
    if not isinstance(doc.get("lifetime_events", []), list):
        return f"hello refused: site {doc['site_id']!r} sent lifetime_events that are not a list"
    return None


def attestation_problem(att: Any, sid: str, site_key: str | None, job: Any) -> str | None:
    """Why ``att`` is not site ``sid``'s final spend statement for this job (None: it is), as verify will
    check it: signed by the site key its signed policy names (not whatever key the reply embeds), for this
    site, this signed job, final."""
    if not (isinstance(att, dict) and isinstance(att.get("statement"), dict)):
        return "attestation refused: the reply holds no {statement, signature}"
    if not site_key:
        return (
            f"attestation refused: site {sid}'s signed policy names no site_key, so no key may sign its spend"
        )
    try:
        verify_document(
            att["statement"],
            att.get("signature"),
            [load_public_key(site_key.encode())],
            f"attestation of site {sid}",
        )
    except FetaError as exc:
        return f"attestation refused: {exc} (only the site_key of its signed policy may sign it)"
    st = att["statement"]
    want = {"site_id": sid, "job_id": job.job_id, "job_sha256": job.digest, "final": True}
    wrong = [k for k, v in want.items() if st.get(k) != v]
    return (
        f"attestation refused: its {', '.join(wrong)} are not this site's final statement for this job"
        if wrong
        else None
    )


def other_jobs(lifetime: list[dict[str, Any]], job: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``lifetime`` without ``job`` (a sub-multiset of it: the same ledger's rows), each of ``job``'s events
    removed once. Identical events are interchangeable for the accountant, so which copy goes does not
    matter."""
    left = Counter(json.dumps(e, sort_keys=True) for e in job)
    out = []
    for e in lifetime:
        k = json.dumps(e, sort_keys=True)
        if left[k] > 0:
            left[k] -= 1
        else:
            out.append(e)
    return out


class JobDriver:
    anchors: AnchorStore | None = None  # the sites' last attested ledger positions (None: not checked)

    def __init__(
        self,
        grid: Any,
        signed_job: dict[str, Any],
        out_dir: str | Path,
        *,
        coordinator_key: Any = None,
        progress: Progress | None = None,
        wait_timeout: float = 300.0,
        query_timeout: float | None = None,
        poll_interval: float = 1.0,
        anchors: AnchorStore | None = None,
    ) -> None:
        self.grid = grid
        self.anchors = anchors
        self.signed_job = signed_job
        embedded = signed_job.get("signature", {}).get("public_key") if isinstance(signed_job, dict) else None
        keys = (
            [coordinator_key.public_key()]
            if coordinator_key is not None
            else ([embedded] if embedded else [])
        )
        self.job = verify_job_with_keys(signed_job, keys, "job")
        self.cfg = self.job.config
        self.key = coordinator_key
        self.out = Path(out_dir)
        self.state = self.out / "state"
        self.state.mkdir(parents=True, exist_ok=True)
        self.progress = progress or (lambda ev: None)
        self.wait_timeout = wait_timeout
        self.query_timeout = query_timeout if query_timeout is not None else self.cfg.federation.round_timeout
        self.poll = poll_interval
        self.sites: dict[str, SiteInfo] = {}
        self.timings: dict[str, float] = {}
        self.skipped: dict[int, list[str]] = {}
        self._log_path = self.out / LOG_FILE
        # site -> its planned DP-SGD round event (sent each round)
        self.planned_dpsgd: dict[str, dict[str, Any]] = {}
        # the pooled central images the warm-up used (federation/job.py): with [dpsgd] public_batch, sent with
        # every per-site round as public input (post-processing of the releases)
        self.public_central: tuple[np.ndarray, np.ndarray] | None = None
        # stage boundaries (federation/job.py): (stage, central images or the model after it)
        self.observe: Callable[[str, Any], None] = lambda stage, what: None

    # -- plumbing --------------------------------------------------------------------------------
    def emit(self, phase: str, message: str, **fields: Any) -> None:
        ev = {"t": time.time(), "phase": phase, "message": message, **fields}
        append_event(self._log_path, ev)
        self.progress(ev)

    def sink(self, phase: str) -> Sink:
        """The stage functions' progress (``progress_events``): their events in ``phase``, logged as
        :meth:`emit` logs."""
        return lambda ev: self.emit(phase, **ev)

    def _ask(
        self,
        phase: str,
        message_type: str,
        targets: dict[str, dict[str, Any]],
        arrays: dict[str, np.ndarray] | None = None,
        timeout: float | None = None,
        group: str = "",
    ) -> tuple[dict[str, tuple[dict[str, Any], dict[str, np.ndarray]]], dict[str, str]]:
        """Send one message per site; return ({site: (doc, arrays)}, {site: failure reason})."""
        msgs, by_node = [], {}
        for site_id, doc in targets.items():
            node = self.sites[site_id].node_id if site_id in self.sites else int(doc.pop("_node"))
            content = fm.make_payload({"job": self.signed_job, **doc}, arrays)
            msgs.append(
                Message(content, dst_node_id=node, message_type=message_type, group_id=group or phase)
            )
            by_node[node] = site_id
        replies = self.grid.send_and_receive(
            msgs, timeout=timeout if timeout is not None else self.query_timeout
        )
        ok: dict[str, tuple[dict[str, Any], dict[str, np.ndarray]]] = {}
        failed: dict[str, str] = {}
        for rep in replies:
            sid = by_node.get(rep.metadata.src_node_id)
            if sid is None:
                continue
            if rep.has_error():
                failed[sid] = rep.error.reason
                continue
            try:  # one site's unreadable reply is that site's failure, not the job's end
                ok[sid] = fm.read_payload(rep.content)
            except PolicyError as exc:
                failed[sid] = str(exc)
        for sid in by_node.values():
            if sid not in ok and sid not in failed:
                failed[sid] = "no reply before the timeout (node down or too slow)"
        return ok, failed

    # -- phases ----------------------------------------------------------------------------------
    def wait_for_sites(self) -> None:
        t0 = time.monotonic()
        wanted = set(self.job.sites)
        asked: set[int] = set()
        refusals: dict[str, str] = {}
        self.emit("wait", f"waiting for sites {', '.join(sorted(wanted))}")
        while True:
            nodes = [n for n in self.grid.get_node_ids() if n not in asked]
            if nodes:
                targets = {f"node-{n}": {"_node": n} for n in nodes}
                ok, failed = self._ask("wait", fm.HELLO, targets, timeout=min(self.query_timeout, 120.0))
                names = _registered_names(self.grid)
                for key, (doc, _) in ok.items():
                    node = int(key.removeprefix("node-"))
                    asked.add(node)
                    why = hello_problem(doc)
                    if why is not None:
                        failed[key] = why  # reported below, as a node that refused
                    elif doc["site_id"] in wanted:
                        self._admit(node, doc, names.get(node))
                for key, reason in failed.items():
                    node = int(key.removeprefix("node-"))
                    if "timeout" not in reason:
                        asked.add(node)
                        refusals[f"node {node}"] = reason
                        self.emit("wait", f"node {node} refused the job: {reason}")
            if wanted <= set(self.sites):
                break
            if time.monotonic() - t0 > self.wait_timeout:
                missing = sorted(wanted - set(self.sites))
                extra = f"; refusals: {refusals}" if refusals else ""
                raise SiteUnavailable(
                    f"sites {', '.join(missing)} did not join within {self.wait_timeout:.0f} s{extra}"
                )
            time.sleep(self.poll)
        shapes = {(s.image_shape, s.n_classes) for s in self.sites.values()}
        if len(shapes) != 1:
            raise FetaError(f"sites disagree on image shape / classes: {shapes}; they cannot train one model")
        self.timings["wait"] = time.monotonic() - t0

    def _admit(self, node: int, doc: dict[str, Any], registered: str | None) -> None:
        """Admit ``node`` as the site it claims, or refuse before anything is released.

        The identity is bound three ways: the node's registered name at the SuperLink (node
        authentication binds it to the node's key) must be the site id; one site id is held by one
        node only (a second node claiming it is an impostor or a replay: stop); the size used for
        FedAvg and planning is the PUBLIC size from the site's signed policy, never a reply's number.
        """
        sid = doc["site_id"]
        if registered and registered != sid:
            raise PolicyError(
                f"node {node} is registered as {registered!r} but claims to be site {sid!r}; refused "
                "(a node may speak only for the site its key was registered for)"
            )
        held = self.sites.get(sid)
        if held is not None and held.node_id != node:
            raise PolicyError(
                f"node {node} claims site {sid!r}, which node {held.node_id} already holds; refused "
                "before any release (two nodes for one site: one is an impostor)"
            )
        signed = doc["policy"]
        embedded = signed.get("signature", {}).get("public_key")
        pol = open_signed_policy(signed, [embedded], f"policy of site {sid}")
        if pol.site_id != sid:
            raise PolicyError(f"node {node} says it is site {sid} but its policy is for {pol.site_id}")
        size = plan.public_size(pol)
        # a deleted or rolled-back ledger would re-grant spent budget: refused here, before any plan or
        # release
        carried = self.anchors.check(sid, doc.get("ledger")) if self.anchors is not None else []
        # the data schema from the SIGNED policy (dataset.classes/image_shape, the site's public declaration),
        # as the size is; the reply's copy only for a policy signed before the declaration existed
        d = pol.declared
        shape, names = (
            (tuple(d.image_shape), list(d.class_names))
            if d is not None
            else (tuple(doc["image_shape"]), list(doc["class_names"]))
        )
        self.sites[sid] = SiteInfo(
            sid,
            node,
            size,
            pol,
            signed,
            shape,
            len(names),
            names,
            carried + list(doc.get("lifetime_events", [])),
            list(doc.get("job_events") or []) if isinstance(doc.get("job_events"), list) else [],
        )
        self.emit("wait", f"site {sid} joined (node {node}, public size {size})", site=sid)

    def plan_sites(self) -> dict[str, Any]:
        planned, policies, life, charged, counts = {}, {}, {}, {}, {}
        for sid, s in self.sites.items():
            # noisy counts the site charged for this job before it was opened (a `train` run's drawn public
            # size): first in its history, as the node plans and its ledger counts them (so in the job's
            # planned ε and events); spent already, so counted with its lifetime
            counted = counts[sid] = counted_events(events_from_list(s.job_events))
            if self.cfg.federation.secure_aggregation:  # the sites charge SkellamEvents for the warm-up sums
                planned[sid], charged[sid] = secure_plan(self, s, counted)
            else:
                # the site's unit and public patient count come from its SIGNED policy (hello), as the node
                # plans
                evs = stage_events(
                    self.cfg,
                    s.size,
                    federated=True,
                    budget=target(self.cfg, s.policy),
                    size=counted or None,
                    **site_dpsgd(s.policy),
                )
                planned[sid] = [request_of(e, self.cfg) for e in evs if e not in counted]
            policies[sid] = s.policy
            # what the site spent on OTHER jobs: this job's own charges are part of its plan already (a
            # resumed job counted them twice and was refused at a site whose lifetime cap fits the job once)
            own = [e.to_dict() for e in events_from_list(s.job_events) if e not in counted]
            life[sid] = events_from_list(other_jobs(s.lifetime_events, own))
        try:
            job_eps = check_job_fits(
                policies,
                planned,
                job=self.job,
                lifetime_events=life,
                charged=charged if self.cfg.federation.secure_aggregation else None,
                counted=counts,
            )
        except JobDoesNotFit as exc:
            raise (
                secure_fix_hint(exc, self.sites, len(self.job.sites))
                if self.cfg.federation.secure_aggregation
                else exc
            ) from None
        doc: dict[str, dict[str, Any]] = {
            sid: {
                "size": self.sites[sid].size,
                "planned_epsilon": job_eps[sid],
                "dpsgd_sigma": next((r.sigma for r in planned[sid] if r.mechanism == "dpsgd"), None),
                "events": [e.to_dict() for e in counts[sid]]
                + (
                    [e.to_dict() for e in charged[sid]]
                    if sid in charged
                    else [r.event().to_dict() for r in planned[sid]]
                ),
            }
            for sid in planned
        }
        for sid, v in doc.items():
            v["privacy_unit"] = self.sites[sid].policy.privacy_unit  # from the site's signed policy, per site
            if (sgd := next((e for e in v["events"] if e["stage"] == "dpsgd"), None)) is not None:
                self.planned_dpsgd[sid] = sgd
        atomic_write_bytes(self.out / "plan.json", json.dumps(doc, indent=2).encode("utf-8"))
        # each figure in its site's unit, the one its caps bound (per patient at a patient-level site)
        self.emit(
            "plan",
            "job fits every site's policy: "
            + ", ".join(
                site_epsilon_words(k, v["planned_epsilon"], unit_name(self.sites[k].policy.unit_cap))
                for k, v in doc.items()
            ),
        )
        return doc

    def _collect(
        self, phase: str, message_type: str, arrays: dict[str, np.ndarray] | None = None
    ) -> dict[str, dict[str, np.ndarray]]:
        """One release per site, cached on disk: a restart does not ask again for what it holds. ``arrays``:
        the public input every site gets with the request (the selection's centroids)."""
        t0 = time.monotonic()
        have: dict[str, dict[str, np.ndarray]] = {}
        for sid in self.sites:
            p = self.state / f"{phase}_{sid}.npz"
            if p.exists():
                with np.load(p) as z:
                    have[sid] = {k: z[k] for k in z.files}
        todo: dict[str, dict[str, Any]] = {sid: {} for sid in self.sites if sid not in have}
        if todo:
            self.emit(phase, f"asking {len(todo)} site(s) for {phase} releases")
            ok, failed = self._ask(phase, message_type, todo, arrays=arrays)
            for sid in sorted(ok):
                why = release_problem(ok[sid][1])
                if why is not None:  # not kept, not pooled: the site's budget is spent, its release unused
                    del ok[sid]
                    failed[sid] = why
            for sid, (doc, arrays) in ok.items():
                atomic_write_bytes(self.state / f"{phase}_{sid}.json", json.dumps(doc).encode("utf-8"))
                atomic_write_bytes(self.state / f"{phase}_{sid}.npz", npz_bytes(**arrays))
                have[sid] = arrays
                self.emit(phase, f"site {sid}: {phase} released", site=sid)
            for sid, reason in failed.items():
                self.emit(phase, f"site {sid}: no {phase} release: {reason}", site=sid, error=reason)
        if len(have) < self.cfg.federation.min_sites:
            raise SiteUnavailable(
                f"{phase}: only {len(have)} site(s) released, [federation] min_sites = "
                f"{self.cfg.federation.min_sites}"
            )
        self.timings[phase] = time.monotonic() - t0
        return have

    def _collect_secure(
        self, phase: str, arrays: dict[str, np.ndarray] | None = None
    ) -> dict[str, dict[str, np.ndarray]]:
        """One secure sum (``secure_collect``), cached on disk like ``_collect``. Every contributing site maps
        to the SAME decoded release, so the warm-up's public-size-weighted combination of them is that sum
        itself. ``arrays``: the public input every site gets with the masking stage (the centroids)."""
        t0 = time.monotonic()
        p, meta = self.state / f"{phase}_secure.npz", self.state / f"{phase}_secure.json"
        if p.exists() and meta.exists():
            with np.load(p) as z:
                arrays = {k: z[k] for k in z.files}
            contributors = list(json.loads(meta.read_text("utf-8"))["sites"])
        else:
            self.emit(phase, f"secure sum of the {phase} releases of {len(self.sites)} site(s)")
            arrays, contributors = collect_secure(self, phase, arrays)
            atomic_write_bytes(p, npz_bytes(**arrays))
            atomic_write_bytes(meta, json.dumps({"sites": contributors}).encode("utf-8"))
        if len(contributors) < self.cfg.federation.min_sites:
            raise SiteUnavailable(
                f"{phase}: only {len(contributors)} site(s) in the secure sum, [federation] "
                f"min_sites = {self.cfg.federation.min_sites}"
            )
        self.timings[phase] = time.monotonic() - t0
        return {sid: arrays for sid in contributors}

    def collect_selection(self, centroids: np.ndarray) -> np.ndarray | None:
        """The semantic selection query (``[public] selection``): the sites' noisy histograms over the public
        groups (``centroids``: means of public thumbnails, the only thing sent; never a public image), summed.
        A secure-aggregation job sums them by a secure sum: each site adds its Skellam noise share, masks,
        and only the noisy SUM is decoded (``secure_collect``); otherwise each site adds its own full
        Gaussian noise and the released histograms are summed here. Either way post-processing of DP
        releases. None when the job asks no selection."""
        if not self.cfg.public.selection:
            return None
        public = {"centroids": np.asarray(centroids, dtype=np.float32)}
        if self.cfg.federation.secure_aggregation:
            got = self._collect_secure("selection", public)
            summed = got[min(got)]  # every contributor maps to the one decoded sum
            self._check_histograms({"the decoded secure sum": summed})
            return summed["histogram"].astype(np.float64)
        got = self._collect("selection", fm.SELECTION, public)
        self._check_histograms({f"site {sid}": a for sid, a in got.items()})
        return np.sum([got[sid]["histogram"].astype(np.float64) for sid in sorted(got)], axis=0)

    def _check_histograms(self, got: dict[str, dict[str, np.ndarray]]) -> None:
        want = (int(self.cfg.public.selection_groups),)
        bad = sorted(sid for sid, a in got.items() if "histogram" not in a or a["histogram"].shape != want)
        if bad:
            raise PolicyError(f"selection: {', '.join(bad)} holds a histogram that is not {want[0]} counts")

    def collect_central(self, prototypes: np.ndarray | None = None) -> dict[str, dict[str, np.ndarray]]:
        """Each site's central images; ``prototypes``: the public cell prototypes every site gets with the
        request (``[central] cell_rule = "aux"``: k-means centres of the aux generator's images)."""
        if self.cfg.central.rounds <= 0:
            return {}
        if self.cfg.federation.secure_aggregation:
            return self._collect_secure("central")
        arrays = None if prototypes is None else {"prototypes": np.asarray(prototypes, dtype=np.float64)}
        return self._collect("central", fm.CENTRAL, arrays)

    def collect_frequency(self) -> dict[str, dict[str, np.ndarray]]:
        if self.cfg.frequency.sigma is None:
            return {}
        if self.cfg.federation.secure_aggregation:
            return self._collect_secure("frequency")
        return self._collect("frequency", fm.FREQUENCY)

    def rounds(self, model: nn.Module, ema: EMA) -> int:
        """Federated DP-SGD; checkpoint after every round. Returns the number of rounds done.

        ``ema``: see :func:`global_ema`; after each round the sites' EMAs FedAvg-ed. A FedSGD job
        (``[federation] fedsgd``) runs its rounds as secure sums of gradient shares instead (``fedsgd``)."""
        if self.cfg.federation.fedsgd:
            return fedsgd.run_rounds(self, model, ema)
        ck = checkpoint_io.load_round(self.state)
        start = 0
        if ck is not None:
            model.load_state_dict(ck["model"])
            ema.load_state_dict(ck["ema"])
            start = int(ck["round"])
            self.skipped = {int(k): v for k, v in ck.get("skipped", {}).items()}
            self.emit("dpsgd", f"resuming after round {start}")
        R = self.cfg.federated_rounds
        t0 = time.monotonic()
        for r in range(start, R):
            tr = time.monotonic()
            answered = self._round(r, model, ema)
            checkpoint_io.save_round(
                self.state,
                {
                    "model": model.state_dict(),
                    "ema": ema.state_dict(),
                    "round": r + 1,
                    "skipped": {str(k): v for k, v in self.skipped.items()},
                },
            )
            # Sites send weights and public values only (no loss, no on-site seconds): see edge/clientapp.py.
            self.emit(
                "dpsgd",
                f"round {r + 1}/{R}: {len(answered)} site(s)",
                round=r + 1,
                rounds=R,
                seconds=time.monotonic() - tr,
                sites=answered,
            )
        self.timings["dpsgd"] = time.monotonic() - t0
        return R

    def _round(self, r: int, model: nn.Module, ema: EMA | None = None) -> list[str]:
        """Round ``r``: send the global weights and their EMA, FedAvg the answers (weighted by public sizes)
        into ``model`` and ``ema`` (None: a fresh one from the weights, as round 0 starts)."""
        ema = ema if ema is not None else global_ema(model, self.cfg)
        weights = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
        sent = fm.with_ema(weights, {k: v.detach().cpu().numpy() for k, v in ema.shadow.items()})
        # each site's planned event goes with its request: the node refuses one that is not its own plan
        targets = {
            sid: {"round": r, **({"event": self.planned_dpsgd[sid]} if sid in self.planned_dpsgd else {})}
            for sid in self.sites
        }
        ok, failed = self._ask("dpsgd", fm.TRAIN, targets, arrays=self._with_public(sent), group=f"round-{r}")
        for sid in sorted(ok):
            why = update_problem(sent, ok[sid][1])
            if why is not None:  # never averaged: a broadcastable or non-finite reply would move every weight
                del ok[sid]
                failed[sid] = why
        if len(ok) < self.cfg.federation.min_sites:
            raise SiteUnavailable(
                f"round {r + 1}: only {len(ok)} site(s) answered ({failed}); "
                f"[federation] min_sites = {self.cfg.federation.min_sites}"
            )
        if failed:
            self.skipped[r] = sorted(failed)
            for sid, why in failed.items():
                self.emit("dpsgd", f"round {r + 1}: site {sid} skipped ({why})", site=sid, error=why)
        w = plan.fedavg_weights({sid: self.sites[sid].size for sid in ok})
        new = {k: np.asarray(sum(w[sid] * ok[sid][1][k].astype(np.float64) for sid in ok)) for k in sent}
        new_weights, new_ema = fm.split_ema(new)
        model.load_state_dict(
            {k: torch.from_numpy(np.asarray(v, dtype=weights[k].dtype)) for k, v in new_weights.items()}
        )
        fold_site_emas(ema, new_ema, (r + 1) * self.cfg.federation.local_steps)
        return sorted(ok)

    def _with_public(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A round's arrays, with the pooled central images when the job mixes them into every step."""
        if self.cfg.dpsgd.public_batch == 0:
            return arrays
        if self.public_central is None or len(self.public_central[1]) == 0:
            raise FetaError(
                f"job {self.job.job_id}: [dpsgd] public_batch mixes released central images, but no site "
                "released any; set [central] rounds > 0 or public_batch = 0"
            )
        return fm.with_round_public(arrays, self.public_central)

    def attestations(self) -> dict[str, Any]:
        ok, failed = self._ask("attest", "query.attest", {sid: {} for sid in self.sites})
        out = {}
        for sid, (doc, _) in ok.items():
            why = attestation_problem(doc.get("attestation"), sid, self.sites[sid].policy.site_key, self.job)
            if why is None:
                out[sid] = doc["attestation"]
                if self.anchors is not None:  # the ledger position the next job's hello must extend
                    self.anchors.record(sid, self.job.job_id, doc["attestation"]["statement"])
            else:  # not released under this site: verify would refuse the whole release for it
                failed[sid] = why
        for sid, reason in failed.items():
            self.emit("attest", f"site {sid}: no attestation: {reason}", site=sid, error=reason)
        return out  # written with the job's other records by release.jobdir.write_job_files
