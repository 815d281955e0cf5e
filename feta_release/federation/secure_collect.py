"""The coordinator's side of a secure sum (``[federation] secure_aggregation = true``): runs the four SecAgg+
stages over the job's sites (``query.secagg``, answered by edge/secure.py), removes the masks
(``SecAggCoordinator``), decodes the modular sum and divides by a PUBLIC denominator. It sees the sum only; a
site that drops after masking is covered by the threshold (its seed is rebuilt from the others' shares), a
malformed vector is refused and its site treated as dropped, fewer than the threshold ends the phase with
nothing decoded.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from ..accounting import PrivacyEvent, SkellamEvent
from ..errors import PolicyError
from ..mechanisms import secure_sums as ss
from ..planning import secure_site_events, selection_events, warmup_events
from ..policy.enforce import own_share_request, request_of, skellam_own_sigma, skellam_request
from . import messages as fm
from .secagg import (
    ALREADY_RELEASED,
    AlreadyReleased,
    KeyAdvert,
    RoundConfig,
    SecAggCoordinator,
    SetupIncomplete,
)

Asked = tuple[dict[str, tuple[dict[str, Any], dict[str, np.ndarray]]], dict[str, str]]


class Driver(Protocol):
    """What of ``JobDriver`` a secure sum uses."""

    cfg: Any
    job: Any
    sites: dict[str, Any]

    def _ask(
        self,
        phase: str,
        message_type: str,
        targets: dict[str, dict[str, Any]],
        arrays: dict[str, np.ndarray] | None = None,
        timeout: float | None = None,
        group: str = "",
    ) -> Asked: ...

    def emit(self, phase: str, message: str, **fields: Any) -> None: ...


def secure_plan(d: Driver, site: Any, counted: Sequence[PrivacyEvent] = ()) -> tuple[list[Any], list[Any]]:
    """(the requests its policy checks, the events it will charge) of one site of a secure job: THE planner's
    history of the site (``planning.secure_site_events``, the node's call), the selection and warm-up
    releases as its SkellamEvents (its own max_colluders), DP-SGD calibrated over them and over ``counted``
    (the noisy counts the site charged for the job before it was opened: spent already, so neither requested
    nor in the returned events)."""
    cfg, n = d.cfg, len(d.job.sites)
    history = secure_site_events(
        cfg, site.size, tuple(site.image_shape), site.n_classes, n, site.policy, counted=counted
    )
    charged = history[len(counted) :]
    skellam = {e.stage: e for e in charged if isinstance(e, SkellamEvent) and e.stage != "dpsgd"}
    gaussian = (
        selection_events(cfg)
        + warmup_events(cfg, site.size)
        + [e for e in charged if isinstance(e, PrivacyEvent)]
    )
    # min_sigma is the site's rule on its OWN noise share, as the node checks it
    requests = [
        own_share_request(request_of(e, cfg), skellam_own_sigma(skellam[e.stage]))
        if e.stage in skellam
        else request_of(e, cfg)
        for e in gaussian
    ]
    fedsgd = [
        skellam_request(e, cfg, None, n)
        for e in charged
        if isinstance(e, SkellamEvent) and e.stage == "dpsgd"
    ]
    return requests + fedsgd, charged


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: Any) -> bytes:
    return base64.b64decode(str(text), validate=True)


def phase_layout(d: Driver, phase: str) -> ss.Layout:
    info = next(iter(d.sites.values()))
    c, f = d.cfg.central, d.cfg.frequency
    if phase == "central":
        return ss.central_layout(info.image_shape, info.n_classes, c.rounds, c.clip, c.downsample, c.cells)
    if phase == "dpsgd":
        return ss.fedsgd_layout(ss.model_dim(d.cfg.model, info.image_shape, info.n_classes), d.cfg.dpsgd.clip)
    if phase == "selection":
        return ss.selection_layout(d.cfg.public.selection_groups)
    return ss.frequency_layout(info.n_classes, f.features)


def _ask_stage(
    d: Driver,
    phase: str,
    stage: str,
    per_site: dict[str, dict[str, Any]],
    base: dict[str, Any],
    arrays: dict[str, np.ndarray] | None = None,
) -> Asked:
    ok, failed = d._ask(
        phase,
        fm.SECAGG,
        {sid: {**base, "stage": stage, **doc} for sid, doc in per_site.items()},
        arrays=arrays,
        group=f"secagg-{phase}-{stage}",
    )
    for sid, why in failed.items():
        d.emit(phase, f"secure sum: site {sid} failed at {stage}: {why}", site=sid, error=why)
    return ok, failed


def secure_sum(
    d: Driver,
    phase: str,
    attempt: int = 0,
    *,
    round_no: int | None = None,
    weights: dict[str, np.ndarray] | None = None,
) -> tuple[np.ndarray, list[str]]:
    """The modular sum (uint64 residues mod 2^b) of the sites' Skellam contributions, and who is in it.
    ``round_no`` / ``weights``: a FedSGD round (its number in the round id and the requests, the global
    weights sent with the masking stage); ``weights`` is any public input of the masking stage (the
    selection's centroids)."""
    sites = sorted(d.sites)
    nodes = {sid: int(d.sites[sid].node_id) for sid in sites}
    by_node = {n: sid for sid, n in nodes.items()}
    site_keys = {str(nodes[sid]): d.sites[sid].policy.site_key for sid in sites}
    if any(not k for k in site_keys.values()):
        raise PolicyError(
            "secure aggregation needs every site's key in its signed policy (site_key); "
            f"missing for {[by_node[int(n)] for n, k in site_keys.items() if not k]}"
        )
    t = ss.secagg_threshold(d.cfg.federation.secagg_threshold, len(d.job.sites))
    label = phase if round_no is None else f"{phase}:{round_no}"
    cfg = RoundConfig(
        f"{d.job.job_id}:{label}:{attempt}",
        tuple(nodes.values()),
        t,
        phase_layout(d, phase).dim,
        ss.DEFAULT_MODULUS_BITS,
    )
    co = SecAggCoordinator(cfg)
    base = {
        "phase": phase,
        "round_id": cfg.round_id,
        "nodes": nodes,
        "modulus_bits": cfg.modulus_bits,
        **({} if round_no is None else {"round": round_no}),
    }
    ok, failed = _ask_stage(d, phase, "setup", {sid: {} for sid in sites}, base)
    released = sorted(sid for sid, why in failed.items() if ALREADY_RELEASED in str(why))
    if released:
        raise AlreadyReleased(
            f"secure aggregation, {label}: site(s) {', '.join(released)} already released their "
            "masked contribution under a key setup this coordinator no longer holds (it stopped "
            "between masking and unmask); that sum cannot be decoded and its budget is spent"
        )
    adverts: dict[int, KeyAdvert] = {
        nodes[s]: (_unb64(r["pk1"]), _unb64(r["pk2"]), _unb64(r["sig"])) for s, (r, _) in ok.items()
    }
    keys = co.collect_keys(adverts)
    bcast = {str(n): [_b64(k[0]), _b64(k[1]), _b64(k[2])] for n, k in keys.items()}
    ok, _ = _ask_stage(
        d, phase, "share_keys", {by_node[n]: {"keys": bcast, "site_keys": site_keys} for n in keys}, base
    )
    routed = co.route_shares(
        {nodes[s]: {int(n): _unb64(ct) for n, ct in r["shares"].items()} for s, (r, _) in ok.items()}
    )
    ok, _ = _ask_stage(
        d,
        phase,
        "collect_masked_vectors",
        {
            by_node[n]: {"shares": {str(src): _b64(ct) for src, ct in cts.items()}}
            for n, cts in routed.items()
        },
        base,
        weights,
    )
    unmask = co.collect_masked(
        {nodes[s]: arrays.get("masked", np.zeros(0, np.uint64)) for s, (_, arrays) in ok.items()}
    )
    for n, why in co.refused.items():
        d.emit(phase, f"secure sum: site {by_node.get(n, n)} left out: {why}", site=by_node.get(n), error=why)
    ok, _ = _ask_stage(
        d, phase, "unmask", {by_node[n]: {"active": a, "dead": dd} for n, (a, dd) in unmask.items()}, base
    )
    total = co.finish(
        {nodes[s]: {int(n): _unb64(sh) for n, sh in r["shares"].items()} for s, (r, _) in ok.items()}
    )
    contributors = sorted(by_node[n] for n in co.contributors)
    d.emit(
        phase,
        f"secure sum of {len(contributors)} site(s) decoded: {', '.join(contributors)}",
        sites=contributors,
    )
    return total, contributors


MAX_SETUP_ATTEMPTS = 3


def sum_with_redo(d: Driver, phase: str, **round_args: Any) -> tuple[np.ndarray, list[str]]:
    """A site that left before the masking stage: nothing was masked, so nothing was charged anywhere; the
    round is redone under a new round id (each site masks against every site of the job, so it cannot go on
    without it)."""
    for attempt in range(MAX_SETUP_ATTEMPTS):
        try:
            return secure_sum(d, phase, attempt, **round_args)
        except SetupIncomplete as exc:
            d.emit(phase, f"secure sum: key setup {attempt} incomplete ({exc}); redone", error=str(exc))
    raise PolicyError(
        f"secure aggregation, {phase}: the key setup did not complete with every site of job "
        f"{d.job.job_id} in {MAX_SETUP_ATTEMPTS} attempts; nothing was released; rerun the job when "
        f"all sites are up"
    )


def collect_secure(
    d: Driver, phase: str, public: dict[str, np.ndarray] | None = None
) -> tuple[dict[str, np.ndarray], list[str]]:
    """The decoded ``phase`` release (arrays of one ``CentralRelease`` / ``FrequencyRelease``; the selection's
    summed ``histogram``) and its sites. ``public``: the public arrays every site gets with the masking stage
    (the selection's centroids)."""
    residues, contributors = sum_with_redo(d, phase, weights=public)
    if phase == "selection":
        pb = d.cfg.public
        total = ss.decode_selection(residues, pb.selection_groups, pb.selection_sigma, len(d.job.sites))
        return {"histogram": total}, contributors
    return _decode_warmup(d, phase, residues, contributors), contributors


def _decode_warmup(
    d: Driver, phase: str, residues: np.ndarray, contributors: list[str]
) -> dict[str, np.ndarray]:
    """The decoded central / frequency sum as the arrays of one site's release (PUBLIC denominators)."""
    lay, info, cfg = phase_layout(d, phase), next(iter(d.sites.values())), d.cfg
    sizes = {sid: int(d.sites[sid].size) for sid in contributors}
    n = len(d.job.sites)
    if phase == "central":
        c = cfg.central
        params = ss.block_params(lay.block_dim, lay.clip, c.sigma, n)
        small = ss.small_shape(info.image_shape, c.downsample)
        rel = ss.decode_central(
            residues,
            lay,
            params,
            rounds=c.rounds,
            n_classes=info.n_classes,
            denominator=len(contributors) * c.batch / (info.n_classes * c.cells),
            image_shape=tuple(info.image_shape),
            small_shape=small,
            sigma=c.sigma,
            q=c.batch / max(sizes.values()),
            cells=c.cells,
        )
        arrays = {k: np.asarray(v) for k, v in rel.to_arrays().items()}
    else:
        f = cfg.frequency
        params = ss.block_params(lay.block_dim, 1.0, f.sigma, n)
        freq = ss.decode_frequency(
            residues,
            lay,
            params,
            total_public=sum(sizes.values()),
            bandwidth2=f.bandwidth2,
            seed=f.seed,
            sigma=f.sigma,
            image_shape=tuple(info.image_shape),
            patch=f.patch,
            stride=f.stride,
        )
        arrays = {k: np.asarray(v) for k, v in freq.to_arrays().items()}  # type: ignore[attr-defined]
    return arrays
