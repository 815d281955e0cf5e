"""The ONE privacy planner: from a job and a site's PUBLIC dataset size to its privacy events and total
epsilon.

:func:`stage_events` is the only source of a site's events: the single-site ``train`` run, the federation's
coordinator (which plans with them and refuses a job that cannot fit) and every site's node (which enforces
them) call it. :func:`plan` reports on the same events (epsilon per stage, noise figures, warnings) for
``privacy plan`` and the runs. A plan is made before any data is touched. A site of a secure-aggregation job
charges SkellamEvents for its secure sums: :func:`secure_site_events` is the one source of its history (the
node, the coordinator, ``policy check --data`` and ``privacy plan --policy`` call it).

The stages of a job are, in order: central images (DP-FETA warm-up), frequency statistics (FETA-Pro warm-up),
DP-SGD fine-tuning. The warm-up stages have fixed noise; the DP-SGD noise multiplier is calibrated so that the
WHOLE history (prior spending + warm-up + every DP-SGD step) meets the target (epsilon, delta), or, when the
job fixes ``[dpsgd] noise_multiplier``, that value is used and checked against the budget. In a federation
each site calibrates for ITS public size and for min(job budget, its per-job budget); the warm-up events are
the PLANNED ones, so the sigma a site uses in round r does not depend on which requests were actually made.
The noisy counts a site charged for the job before it was opened (a drawn public size) are spent: they come
first in the history DP-SGD is calibrated over, with or without secure aggregation, so the job's total is the
budget, not the budget plus the counts.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .accountants.skellam import honest_shares, skellam_event
from .accounting import (
    MAX_NOISE_MULTIPLIER,
    Accountant,
    Event,
    PrivacyEvent,
    SkellamEvent,
    calibrate_noise_multiplier,
    epsilon,
    gaussian_only,
    has_secure_aggregation,
    smallest_fitting_sigma,
    unit_epsilon,
)
from .config import JobConfig
from .errors import FetaError, PolicyError, PrivacyError
from .mechanisms._checks import sampling_rate as mechanism_rate
from .mechanisms.count import SIZE_SIGMA
from .mechanisms.secure_sums import fedsgd_params, model_dim, secagg_threshold, secagg_warmup_events
from .mechanisms.selection import selection_event

__all__ = [
    "DEFAULT_DATASET_SIZE",
    "MOSTLY_NOISE",
    "STAGES",
    "PrivacyPlan",
    "StagePlan",
    "Target",
    "dpsgd_rounds",
    "merged",
    "plan",
    "round_sizes",
    "stage_sampling_rate",
    "secure_site_events",
    "secure_stage_events",
    "stage_event",
    "stage_events",
    "target",
]

# The embedded data's training split (5,000 MNIST digits, 20 % held out): the size assumed when none is given.
DEFAULT_DATASET_SIZE = 4000
# A release whose noise-to-signal figure is above this is mostly noise (the plan warns).
MOSTLY_NOISE = 0.5
_FIXES = {
    "central": "lower [central] sigma or rounds, raise [central] rate, or use more data",
    "frequency": "lower [frequency] sigma or features, or use more data",
    "selection": "lower [public] selection_sigma or selection_groups, or use more data",
}
STAGES = ("central", "frequency", "dpsgd")
_SECTION = {"selection": "[public] selection_sigma"}  # the config key of a stage that is not its own section
E = TypeVar("E", PrivacyEvent, Event)


@dataclass(frozen=True)
class Target:
    """The (epsilon, delta, accountant) a site calibrates DP-SGD for."""

    epsilon: float
    delta: float
    accountant: Accountant


def target(cfg: JobConfig, policy: Any | None = None) -> Target:
    """The job's ``[privacy]`` budget, capped by a site's signed per-job budget (its accountant wins)."""
    p = cfg.privacy
    if policy is None:
        return Target(float(p.epsilon), float(p.delta), p.accountant)
    return Target(min(p.epsilon, policy.job_epsilon), min(p.delta, policy.job_delta), policy.accountant)


def stage_sampling_rate(batch: int, n: int, section: str) -> float:
    """The Poisson sampling rate q = batch / n of a stage over the PUBLIC size ``n``, as the mechanisms
    compute it (``mechanisms._checks.sampling_rate``: the one computation), refused here with the job's
    section to change."""
    if batch > n:
        raise PrivacyError(
            f"[{section}] batch {batch} exceeds the dataset size {n} (sampling rate would be {batch / n:.3g} "
            f"> 1): shrink [{section}] batch to at most {n} (in a federation: each site's expected Poisson "
            "batch, at most its public size)"
        )
    return mechanism_rate(batch, n, f"[{section}]")


def round_sizes(total: int, per_round: int) -> list[int]:
    """``total`` DP-SGD steps in rounds of ``per_round`` (the last one shorter when it does not divide).

    >>> round_sizes(10, 4)
    [4, 4, 2]
    >>> sum(round_sizes(157, 50)) == 157
    True
    """
    if total < 0 or per_round < 1:
        raise PrivacyError(f"cannot split {total} DP-SGD steps into rounds of {per_round}")
    return [min(per_round, total - start) for start in range(0, total, per_round)]


def dpsgd_rounds(cfg: JobConfig, n: int, federated: bool) -> list[int]:
    """The DP-SGD round sizes of a schedule: a local run is one round of the job's steps/epochs (its driver
    may charge it in chunks, see ``rounds=`` of :func:`stage_events`); a federated site runs ``[federation]
    rounds`` rounds of ``local_steps`` steps each."""
    if federated:
        # FedSGD: one step a round
        per_round = 1 if cfg.federation.fedsgd else int(cfg.federation.local_steps)
        return [per_round] * cfg.federated_rounds if per_round > 0 else []
    steps = cfg.dpsgd_steps(n)
    return [steps] if steps > 0 else []


def warmup_events(cfg: JobConfig, n: int) -> list[PrivacyEvent]:
    """The warm-up releases' events (central images, frequency statistics) of a job sized for ``n``."""
    c, f = cfg.central, cfg.frequency
    out = []
    if c.rounds > 0:
        out.append(
            PrivacyEvent("central", float(c.sigma), stage_sampling_rate(c.batch, n, "central"), int(c.rounds))
        )
    if f.sigma is not None:
        out.append(PrivacyEvent("frequency", float(f.sigma), 1.0, 1))
    return out


def selection_events(cfg: JobConfig) -> list[PrivacyEvent]:
    """The semantic selection query's event (``[public] selection``; ``mechanisms.selection``: a noisy
    histogram of sensitivity 1 image), released before any other: it decides what pretraining uses."""
    return [selection_event(cfg.public.selection_sigma)] if cfg.public.selection else []


def site_dpsgd(policy: Any | None) -> dict[str, Any]:
    """How a site's SIGNED policy has DP-SGD sample (keyword arguments of :func:`stage_events`): a
    patient-level policy (``dataset.privacy_unit = "patient"``) samples its PUBLIC ``dataset.patients`` at q =
    batch / patients with events of unit "patient"; otherwise images at q = batch / ``dataset.size``. The
    coordinator and the node both read it from the signed policy only, so they plan the same events.
    ``patient_cap``: the policy's patient cap, so DP-SGD is calibrated for the budget PER PATIENT
    (``accounting.patient_epsilon``), the figure the site's ledger caps."""
    if policy is not None and getattr(policy, "privacy_unit", "image") == "patient":
        return patient_dpsgd(int(policy.patients), int(policy.patient_cap))
    return patient_dpsgd(None, None)


def patient_dpsgd(public_patients: int | None, patient_cap: int | None) -> dict[str, Any]:
    """How DP-SGD samples given the PUBLIC patient count (keyword arguments of :func:`plan`): with
    ``public_patients`` whole patients at q = batch / patients, events of unit "patient" (what ``train``, a
    patient-level node and its ledger charge); without, images at q = batch / images, ``patient_cap`` (if
    any) then turning the total into a per-patient one by group privacy. The one form every planner uses,
    so a printed plan is the history the ledger holds."""
    if public_patients is None:
        return {"dpsgd_unit": "image", "dpsgd_size": None, "patient_cap": patient_cap}
    return {
        "dpsgd_unit": "patient",
        "dpsgd_size": int(public_patients),
        "patient_cap": None if patient_cap is None else int(patient_cap),
    }


def stage_events(
    cfg: JobConfig,
    public_size: int,
    *,
    federated: bool = False,
    rounds: Sequence[int] | None = None,
    budget: Target | None = None,
    prior: Sequence[PrivacyEvent] = (),
    cache_dir: Path | None = None,
    dpsgd_unit: str = "image",
    dpsgd_size: int | None = None,
    size: PrivacyEvent | Sequence[PrivacyEvent] | None = None,
    patient_cap: int | None = None,
) -> list[PrivacyEvent]:
    """All privacy events of a job at one site of PUBLIC size ``public_size``, in order: what its ledger holds
    after the job. DP-SGD is one event per round with the calibrated (or configured) sigma.

    ``rounds``: the DP-SGD round sizes, in order (default :func:`dpsgd_rounds`: one round in a local run,
    ``[federation] rounds`` x ``local_steps`` in a federated one; ``round_sizes`` splits steps into rounds of
    at most a given size). sigma is calibrated for their sum,
    so how the steps are split never changes sigma, q or epsilon. ``budget``: what DP-SGD is calibrated for
    (default the job's ``[privacy]``); ``prior``: events already spent on the same data, composed in before
    calibrating; ``cache_dir``: remember calibrations on disk (a node answers each message in a fresh process
    and a calibration costs seconds; it is a pure function of its inputs, so the cache is exact). Raises
    PrivacyError naming the stage to shrink when the job cannot fit.
    ``dpsgd_unit``: ``"patient"`` for patient-level DP-SGD (patients Poisson-sampled at the same rate q, each
    patient's summed gradient clipped): the same (sigma, q, steps), the figure then holds per patient
    directly. ``dpsgd_size``: the PUBLIC count DP-SGD samples from when it is not ``public_size`` (a federated
    patient-level site: its public number of patients, so q = batch / patients; :func:`site_dpsgd` gives both
    from a policy). ``size``: the noisy count(s) that drew ``public_size`` (``mechanisms.count.size_event``; a
    local run without a declared size) and/or the public patient count (``patients_event``): this job's FIRST
    events, composed in before DP-SGD is calibrated; None: declared sizes.
    ``patient_cap``: the site's patient cap when the PATIENT is its unit of privacy: the budget is then a
    budget PER PATIENT (``accounting.patient_epsilon``: the image-level events by group privacy over the cap,
    the patient-level ones as they are), and sigma is calibrated so that the per-patient total meets it; None:
    per image.
    """
    n = _size(public_size)
    # [central]/[dpsgd] rate -> batch for this public size; a signed federated job's batches
    if not federated:
        cfg = cfg.for_size(n)  # are each site's expected batch as signed (the coordinator sized them)
    sizes = dpsgd_rounds(cfg, n, federated) if rounds is None else _round_sizes(rounds)
    first = count_events(size) + selection_events(cfg)
    events = _with_dpsgd(
        cfg,
        n,
        first + warmup_events(cfg, n),
        sizes,
        budget,
        prior,
        cache_dir,
        dpsgd_unit,
        _size(dpsgd_size) if dpsgd_size is not None else None,
        patient_cap,
    )
    return gaussian_only(events, "stage_events")


@dataclass(frozen=True)
class FedSGDShape:
    """What a site's FedSGD events depend on beside the job: the gradient's length (the model's trainable
    values), the job's sites and the honest noise shares the site counts on
    (``accountants.skellam.honest_shares``)."""

    dim: int
    n_sites: int
    shares: int


def fedsgd_shape(
    cfg: JobConfig, image_shape: tuple[int, ...], n_classes: int, n_sites: int, colluders: int
) -> FedSGDShape:
    """A site's :class:`FedSGDShape` from public values: the job's model on the sites' image shape, the job's
    sites and threshold, and the colluders the site's signed policy allows (the node and the coordinator call
    this)."""
    t = secagg_threshold(cfg.federation.secagg_threshold, n_sites)
    return FedSGDShape(
        model_dim(cfg.model, image_shape, n_classes),
        n_sites,
        honest_shares(n_sites, t, min(int(colluders), n_sites - 1)),
    )


def secure_stage_events(
    cfg: JobConfig,
    public_size: int,
    warmup: Sequence[Event],
    *,
    budget: Target | None = None,
    cache_dir: Path | None = None,
    fedsgd: FedSGDShape | None = None,
    dpsgd_unit: str = "image",
    dpsgd_size: int | None = None,
    patient_cap: int | None = None,
    size: PrivacyEvent | Sequence[PrivacyEvent] | None = None,
) -> list[Event]:
    """:func:`stage_events` of a federated site whose one-shot releases go through secure aggregation:
    ``warmup`` are its ``SkellamEvent``s (``mechanisms.secure_sums.secagg_warmup_events``: the semantic
    selection's first, then the warm-up releases'), so DP-SGD is calibrated over the history the ledger will
    hold. With ``[federation] fedsgd`` (``fedsgd`` then required)
    DP-SGD is one ``SkellamEvent`` per round (q, one step, the gradient's integer-domain sensitivities), its
    sigma calibrated so that the whole history counted over ``fedsgd.shares`` noise shares meets the
    budget. ``size``: the noisy counts the site charged for the job before it was opened (as in
    :func:`stage_events`): the history's FIRST events, returned first and calibrated over, so what the ledger
    holds meets the budget. :func:`secure_site_events` makes every argument from a site's public facts."""
    n = _size(public_size)
    warmup = count_events(size) + list(warmup)
    if cfg.public.selection and stage_event(warmup, "selection") is None:
        # the selection is a secure sum too: a history without its event would calibrate DP-SGD for less
        # than the ledger charges
        raise PrivacyError(
            "[public] selection under secure aggregation: the secure history given holds no selection "
            "event (mechanisms.secure_sums.secagg_warmup_events makes it); nothing planned"
        )
    if not cfg.federation.fedsgd:
        return _with_dpsgd(
            cfg,
            n,
            list(warmup),
            dpsgd_rounds(cfg, n, True),
            budget,
            (),
            cache_dir,
            dpsgd_unit,
            _size(dpsgd_size) if dpsgd_size is not None else None,
            patient_cap,
        )
    if dpsgd_unit != "image":
        # FedSGD samples and clips per image (edge/fedsgd.py): a patient-level site would be charged an
        # image-level event while it attests a per-patient epsilon
        raise PolicyError(
            f"[federation] fedsgd runs image-level DP-SGD only; this site's policy makes the "
            f"{dpsgd_unit} the unit of privacy: run the job without fedsgd"
        )
    if fedsgd is None:
        raise PrivacyError(
            "[federation] fedsgd: planning its rounds needs the model's size and the site's noise "
            "shares (FedSGDShape); none given"
        )
    return _with_fedsgd(cfg, n, list(warmup), fedsgd, budget or target(cfg), cache_dir)


def secure_site_events(
    cfg: JobConfig,
    public_size: int,
    image_shape: tuple[int, ...],
    n_classes: int,
    n_sites: int,
    policy: Any,
    *,
    counted: Sequence[PrivacyEvent] = (),
    cache_dir: Path | None = None,
) -> list[Event]:
    """THE history a site of a secure-aggregation job charges, in order: the noisy counts it charged for the
    job before it was opened (``counted``: ``mechanisms.count.counted_events`` of its job events), the
    ``SkellamEvent``s of its secure sums (selection, central, frequency), then DP-SGD (per-site rounds, or
    FedSGD's ``SkellamEvent``s) calibrated over all of them for min(the job's budget, the policy's per-job
    budget). From public values and the site's signed ``policy`` only (its trust assumption
    ``counted_colluders``, budget and unit of privacy), so the node (``edge.protocol.planned``), the
    coordinator (``federation.secure_collect.secure_plan``: ``plan.json`` and its per-job check),
    ``policy check --data`` and ``privacy plan --policy`` all plan this one history. Why one function: a
    caller that assembled the history itself left the counted size out, so DP-SGD was calibrated for less than
    the ledger charged and the site spent more than the job's epsilon."""
    colluders = policy.counted_colluders(n_sites)
    warm = secagg_warmup_events(cfg, public_size, image_shape, n_classes, n_sites, colluders)
    return secure_stage_events(
        cfg,
        public_size,
        [e for e in warm if isinstance(e, SkellamEvent)],
        budget=target(cfg, policy),
        cache_dir=cache_dir,
        fedsgd=fedsgd_shape(cfg, image_shape, n_classes, n_sites, colluders)
        if cfg.federation.fedsgd
        else None,
        size=list(counted) or None,
        **site_dpsgd(policy),
    )


def fedsgd_event(cfg: JobConfig, n: int, shape: FedSGDShape, sigma: float, steps: int = 1) -> Event:
    """The SkellamEvent of ``steps`` FedSGD rounds at noise multiplier ``sigma`` for a site of public size
    ``n``."""
    q = stage_sampling_rate(cfg.dpsgd.batch, n, "dpsgd")
    params = fedsgd_params(shape.dim, cfg.dpsgd.clip, sigma, shape.n_sites)
    return skellam_event(params, "dpsgd", q, steps, shape.shares)


def _with_fedsgd(
    cfg: JobConfig, n: int, warm: list[Event], shape: FedSGDShape, tgt: Target, cache_dir: Path | None
) -> list[Event]:
    rounds = cfg.federated_rounds
    if rounds < 1:
        return warm
    if cfg.dpsgd.noise_multiplier is not None:
        sigma = float(cfg.dpsgd.noise_multiplier)
    else:
        check_warmup(warm, tgt)

        def calibrate() -> float:
            return smallest_fitting_sigma(
                lambda s: epsilon(warm + [fedsgd_event(cfg, n, shape, s, rounds)], tgt.delta),
                tgt.epsilon,
                tol=0.01,
                max_sigma=MAX_NOISE_MULTIPLIER,
                refusal=(
                    f"[dpsgd] FedSGD cannot meet epsilon {tgt.epsilon} at delta {tgt.delta}: even noise "
                    f"multiplier {MAX_NOISE_MULTIPLIER:g} is not enough for {rounds} rounds at q = "
                    f"{cfg.dpsgd.batch / n:.4g} over {shape.shares} noise share(s); use fewer [federation] "
                    "rounds or a smaller [dpsgd] batch"
                ),
            )

        key = [
            "fedsgd",
            [e.to_dict() for e in warm],
            cfg.dpsgd.batch,
            n,
            cfg.dpsgd.clip,
            rounds,
            shape.dim,
            shape.n_sites,
            shape.shares,
            tgt.epsilon,
            tgt.delta,
        ]
        sigma = _disk_cached(key, cache_dir, calibrate)
    return warm + [fedsgd_event(cfg, n, shape, sigma) for _ in range(rounds)]


def _with_dpsgd(
    cfg: JobConfig,
    n: int,
    warm: Sequence[Event],
    sizes: list[int],
    budget: Target | None,
    prior: Sequence[Event],
    cache_dir: Path | None,
    dpsgd_unit: str = "image",
    dpsgd_size: int | None = None,
    patient_cap: int | None = None,
) -> list[Event]:
    warm = list(warm)
    if sum(sizes) < 1:
        return warm
    if dpsgd_size is not None and cfg.dpsgd.batch > dpsgd_size:
        raise PrivacyError(
            f"[dpsgd] batch {cfg.dpsgd.batch} exceeds the site's {dpsgd_size} public patients (its "
            "policy's dataset.patients; patient-level DP-SGD samples patients at q = batch / patients): "
            f"shrink [dpsgd] batch to at most {dpsgd_size}"
        )
    q = stage_sampling_rate(cfg.dpsgd.batch, n if dpsgd_size is None else dpsgd_size, "dpsgd")
    if cfg.dpsgd.noise_multiplier is not None:
        sigma = float(cfg.dpsgd.noise_multiplier)
    else:
        tgt = budget or target(cfg)
        args: tuple[Any, ...] = (
            tuple(prior) + tuple(warm),
            q,
            sum(sizes),
            tgt.epsilon,
            tgt.delta,
            tgt.accountant,
        )
        if patient_cap is not None:  # the per-patient budget (an image-level site's key stays as it was)
            args += (dpsgd_unit, int(patient_cap))
        sigma = _cached_calibration(args, cache_dir)
    return warm + [PrivacyEvent("dpsgd", sigma, q, k, unit=dpsgd_unit) for k in sizes]


def count_events(size: PrivacyEvent | Sequence[PrivacyEvent] | None) -> list[PrivacyEvent]:
    """The noisy-count events of :func:`stage_events`'s ``size`` as a list (one event, several, or none)."""
    if size is None:
        return []
    return [size] if isinstance(size, PrivacyEvent) else list(size)


def _round_sizes(rounds: Sequence[int]) -> list[int]:
    sizes = list(rounds)
    if any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in sizes):
        raise PrivacyError(f"DP-SGD round sizes must be positive integers, got {sizes}")
    return sizes


def _size(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PrivacyError(f"dataset size must be a positive integer, got {n!r}")
    return n


def _cached_calibration(args: tuple[Any, ...], cache_dir: Path | None) -> float:
    return _disk_cached([[e.to_dict() for e in args[0]], *args[1:]], cache_dir, lambda: _calibrate(*args))


def _disk_cached(key_doc: Any, cache_dir: Path | None, compute: Callable[[], float]) -> float:
    if cache_dir is None:
        return compute()
    key = hashlib.sha256(json.dumps(key_doc).encode()).hexdigest()
    path = Path(cache_dir) / "calibrations" / f"{key}.json"
    if path.exists():
        return float(json.loads(path.read_text("utf-8"))["sigma"])
    sigma = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"sigma": sigma}), "utf-8")
    os.replace(tmp, path)
    return sigma


def check_warmup(prior_and_warm: Sequence[Event], budget: Target, patient_cap: int | None = None) -> float:
    """The warm-up's (and prior spending's) epsilon (per patient with ``patient_cap``); refuse, naming the
    figure and the biggest stage, when it leaves nothing."""
    evs = list(prior_and_warm)
    spent = unit_epsilon(evs, budget.delta, budget.accountant, patient_cap=patient_cap)
    if spent >= budget.epsilon:
        biggest = (
            max(evs, key=lambda e: epsilon([e], budget.delta, budget.accountant)).stage if evs else "prior"
        )
        what = (
            "epsilon"
            if patient_cap is None
            else (
                f"epsilon PER PATIENT (at most {patient_cap} image(s) each, the image-level releases by "
                f"group privacy over {patient_cap})"
            )
        )
        raise PrivacyError(
            f"the warm-up alone spends {what} {spent:.3f} at delta {budget.delta:g} >= the budget "
            f"{budget.epsilon}: shrink {_SECTION.get(biggest, f'[{biggest}]')} (fewer rounds / larger "
            "sigma), drop a warm-up stage, or raise [privacy] epsilon"
            + ("" if patient_cap is None else ", or lower the patient cap")
        )
    return spent


@functools.lru_cache(maxsize=256)
def _calibrate(
    prior: tuple[PrivacyEvent, ...],
    q: float,
    steps: int,
    eps: float,
    delta: float,
    acc: Accountant,
    unit: str = "image",
    patient_cap: int | None = None,
) -> float:
    # Deterministic, so caching is exact; the bisection costs ~0.5 s and a node recomputes it for every
    # request.
    spent = check_warmup(prior, Target(eps, delta, acc), patient_cap)
    try:
        if patient_cap is None:
            return calibrate_noise_multiplier(
                list(prior), q, steps, eps, delta, acc, max_sigma=MAX_NOISE_MULTIPLIER
            )
        return smallest_fitting_sigma(  # the per-patient total (ledger.check_spend's figure) meets the budget
            lambda s: unit_epsilon(
                list(prior) + [PrivacyEvent("dpsgd", s, q, steps, unit=unit)],
                delta,
                acc,
                patient_cap=patient_cap,
            ),
            eps,
            tol=0.01,
            max_sigma=MAX_NOISE_MULTIPLIER,
            refusal="",
        )
    except PrivacyError:
        raise PrivacyError(
            f"[dpsgd] cannot meet epsilon {eps}{'' if patient_cap is None else ' per patient'} at delta "
            f"{delta}: even noise multiplier {MAX_NOISE_MULTIPLIER:g} "
            f"is not enough for {steps} steps at q = {q:.4g} after the warm-up's epsilon {spent:.3f}. Shrink "
            f"[dpsgd] (fewer steps/epochs, smaller batch), or the warm-up ([central] rounds, [frequency] "
            f"sigma), or raise [privacy] epsilon"
        ) from None


def stage_event(events: Sequence[E], stage: str) -> E | None:
    """The event of one release of ``stage`` (one round's for DP-SGD) among a site's events."""
    return next((e for e in events if e.stage == stage), None)


_E = TypeVar("_E", PrivacyEvent, Event)


def merged(events: Sequence[_E]) -> list[_E]:
    """Events of one stage, sigma and q as one event with the steps summed (DP-SGD rounds or chunks of one
    sigma and q are one composition, so epsilon is unchanged), in order of first appearance.
    Secure-aggregation (Skellam) events are kept as they are."""
    out: dict[object, _E] = {}
    for i, e in enumerate(events):
        if not isinstance(e, PrivacyEvent):
            out[("as is", i)] = e
            continue
        key = (e.stage, e.sigma, e.q, e.unit)
        prev = out.get(key)
        out[key] = e if prev is None else dataclasses.replace(e, steps=prev.steps + e.steps)  # type: ignore[assignment]
    return list(out.values())


def stage_noise(
    cfg: JobConfig,
    stage: str,
    n: int,
    image_shape: tuple[int, int, int] = (1, 28, 28),
    n_classes: int = 10,
    sgd_sigma: float | None = None,
) -> tuple[float | None, str]:
    """A noise-to-signal figure a user can judge, per stage, from PUBLIC values only.

    central (mean): noise std per pixel of a released class-mean image, sigma * C / (batch / (n_classes *
    cells)), against the pixel scale 1 (pixels in [0, 1]).  central (mode): per-bin noise std sigma * sqrt(d)
    against the expected per-class batch.  frequency: norm of a class column's noise, sigma * sqrt(features) /
    n, against the column's largest possible norm 1 / n_classes (||phi|| = 1, balanced classes): a lower bound
    on the true ratio. dpsgd: norm of the noise on the mean clipped gradient of ONE step, sigma * C *
    sqrt(params) / batch (params: the parameters ``[dpsgd] trainable`` trains, one noise draw each), against
    its largest possible norm C; steps average it down, so it is reported, not warned about.
    """
    c_, h, w = image_shape
    if stage == "central" and cfg.central.rounds > 0:
        c = cfg.central
        d = c_ * max(1, int(h * c.downsample)) * max(1, int(w * c.downsample))
        per_class = c.batch / (n_classes * c.cells)  # expected size of one released sum (class, cell)
        if c.kind == "mode":
            r = c.sigma * math.sqrt(d) / per_class
            return r, f"per-bin noise {r:.2f} x the per-class batch {per_class:.0f}"
        clip = c.clip if c.clip is not None else math.sqrt(d)
        r = c.sigma * min(clip, math.sqrt(d)) / per_class
        return r, f"noise std {r:.3f} per pixel (pixels in [0, 1]), {per_class:.0f} images per released sum"
    if stage == "frequency" and (f_sigma := cfg.frequency.sigma) is not None:
        r = f_sigma * math.sqrt(cfg.frequency.features) / n * n_classes
        return r, f"noise norm >= {r:.2f} x a class column's signal"
    if stage == "size":  # the noisy count's std against the size it drew (the figure for sigma = SIZE_SIGMA)
        r = SIZE_SIGMA / n
        return r, f"count noise std {SIZE_SIGMA:g} images, {r:.1%} of the public size"
    if stage == "selection" and cfg.public.selection:  # noise std against a group's share of the votes
        r = cfg.public.selection_sigma * cfg.public.selection_groups / n
        return r, f"noise std {cfg.public.selection_sigma:g} votes per group, {r:.1%} of a group's even share"
    if stage == "dpsgd" and sgd_sigma is not None:
        params = _param_count(cfg, image_shape, n_classes)
        if params is None:
            return None, ""
        r = sgd_sigma * math.sqrt(params) / cfg.dpsgd.batch
        return r, (
            f"one step's noise norm {r:.2f} x the largest mean clipped gradient ({params:,} parameters "
            f"trained, {cfg.dpsgd.trainable}; batch {cfg.dpsgd.batch}); a larger batch at the same epsilon "
            "lowers it"
        )
    return None, ""


def _param_count(cfg: JobConfig, image_shape: tuple[int, int, int], n_classes: int) -> int | None:
    """The parameters DP-SGD trains ([dpsgd] trainable): its noise is drawn in these coordinates only."""
    from .model_size import dpsgd_dimension

    try:
        return dpsgd_dimension(cfg.model, image_shape, n_classes, cfg.dpsgd.trainable, cfg.dpsgd.lora_rank)
    except FetaError:
        return None  # a model that cannot be built is reported by training, not by the plan


# -- the report: epsilon per stage, noise-to-signal figures, warnings
# ---------------------------------------------


@dataclass(frozen=True)
class StagePlan:
    """One stage's row of a plan: its event, its epsilon alone and its noise figure."""

    stage: str
    enabled: bool
    sigma: float | None
    q: float | None
    steps: int
    epsilon: float  # this stage ALONE at delta
    share: float  # epsilon / sum of the stages' epsilons (composition is sub-additive: shares of that sum)
    note: str = ""
    noise_to_signal: float | None = None  # see stage_noise(); None where no figure applies
    noise_note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The row as JSON-ready fields."""
        return {
            "stage": self.stage,
            "enabled": self.enabled,
            "sigma": self.sigma,
            "q": self.q,
            "steps": self.steps,
            "epsilon": self.epsilon,
            "share": self.share,
            "note": self.note,
            "noise_to_signal": self.noise_to_signal,
            "noise_note": self.noise_note,
        }


@dataclass(frozen=True)
class PrivacyPlan:
    """A job's plan at one site: the history it charges, its total epsilon and one row per stage."""

    dataset_size: int
    target_epsilon: float
    delta: float
    accountant: Accountant
    # total over the whole history (all stages composed; PER PATIENT when ``patient_cap`` is set)
    epsilon: float
    noise_multiplier: float | None  # DP-SGD sigma (calibrated or configured); None when DP-SGD has 0 steps
    calibrated: bool
    stages: tuple[StagePlan, ...]
    history: tuple[Event, ...]  # prior + this job's events (stage_events / secure_site_events), in order
    prior: tuple[PrivacyEvent, ...] = field(default=())
    warnings: tuple[str, ...] = field(default=())
    patient_cap: int | None = None  # the patient cap of a per-patient budget (None: the budget is per image)
    # a secure-aggregation plan: the total if every other site colluded (own noise share only); else None
    worst_case_epsilon: float | None = None

    def stage(self, name: str) -> StagePlan:
        """The row of stage ``name``; KeyError for a stage the plan does not have."""
        for s in self.stages:
            if s.stage == name:
                return s
        raise KeyError(name)

    @property
    def events(self) -> list[Event]:
        """This job's events, one per stage (DP-SGD steps summed): what a single run's ledger charges."""
        return merged(self.history[len(self.prior) :])

    def event(self, stage: str) -> Event | None:
        """This job's merged event of ``stage``, None when the stage does not run."""
        return stage_event(self.events, stage)

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready fields (``privacy plan --json``)."""
        return {
            "dataset_size": self.dataset_size,
            "target_epsilon": self.target_epsilon,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "accountant": self.accountant,
            "noise_multiplier": self.noise_multiplier,
            "calibrated": self.calibrated,
            "stages": [s.to_dict() for s in self.stages],
            "history": [e.to_dict() for e in self.history],
            "warnings": list(self.warnings),
            **({} if self.worst_case_epsilon is None else {"worst_case_epsilon": self.worst_case_epsilon}),
            **(
                {}
                if self.patient_cap is None
                else {"epsilon_unit": "patient", "patient_cap": self.patient_cap}
            ),
        }


@dataclass(frozen=True)
class SecureSite:
    """A site of a secure-aggregation job, for :func:`plan`: the job's number of sites and the site's signed
    ``policy`` (its trust assumption, budget and unit of privacy: :func:`secure_site_events`)."""

    n_sites: int
    policy: Any


def site_form(cfg: JobConfig, policy: Any, n_sites: int) -> dict[str, Any]:
    """How a federated site's node plans ``cfg`` (keyword arguments of :func:`plan`; ``cfg`` as signed,
    ``JobConfig.with_secure_default`` resolved): a secure-aggregation job as :class:`SecureSite`, where the
    site counts only the noise shares of the peers it pins; otherwise at its own per-job budget and DP-SGD
    sampling (:func:`target`, :func:`site_dpsgd`)."""
    if cfg.federation.secure_aggregation:
        return {"secure": SecureSite(n_sites, policy)}
    return {"budget": target(cfg, policy), **site_dpsgd(policy)}


def plan(
    cfg: JobConfig,
    public_size: int,
    *,
    federated: bool = False,
    rounds: Sequence[int] | None = None,
    budget: Target | None = None,
    prior: Sequence[PrivacyEvent] = (),
    image_shape: tuple[int, int, int] = (1, 28, 28),
    n_classes: int = 10,
    dpsgd_unit: str = "image",
    dpsgd_size: int | None = None,
    size: PrivacyEvent | Sequence[PrivacyEvent] | None = None,
    patient_cap: int | None = None,
    secure: SecureSite | None = None,
) -> PrivacyPlan:
    """The plan of a job at a site of PUBLIC size ``public_size``: :func:`stage_events` plus what they cost.

    ``rounds``, ``dpsgd_unit``, ``dpsgd_size``, ``size``, ``patient_cap`` (the total then PER PATIENT): see
    :func:`stage_events`; ``image_shape``/``n_classes``
    (public) only feed the noise-to-signal figures (default: the embedded data).
    ``secure``: the job sums its releases by secure aggregation at this federated site: the history is
    :func:`secure_site_events`' (the SkellamEvents the node charges and the coordinator plans, ``size``
    first), its budget, unit and patient cap the policy's (``budget``, ``dpsgd_unit``, ``dpsgd_size``,
    ``patient_cap`` and ``prior`` are then not given), and the plan states the worst case too.
    Raises PrivacyError naming the stage to shrink when the plan cannot meet the budget.
    """
    n = _size(public_size)
    if secure is not None:
        events, tgt, patient_cap = _secure_plan_events(
            cfg, n, image_shape, n_classes, secure, size, (budget, prior, dpsgd_size, patient_cap)
        )
        prior = ()
    else:
        cfg = cfg if federated else cfg.for_size(n)
        tgt = budget or target(cfg)
        prior = list(prior)
        check_warmup(
            prior + count_events(size) + selection_events(cfg) + warmup_events(cfg, n), tgt, patient_cap
        )
        events = list(
            stage_events(
                cfg,
                n,
                federated=federated,
                rounds=rounds,
                budget=tgt,
                prior=prior,
                dpsgd_unit=dpsgd_unit,
                dpsgd_size=dpsgd_size,
                size=size,
                patient_cap=patient_cap,
            )
        )
    history = list(prior) + events
    total = unit_epsilon(history, tgt.delta, tgt.accountant, patient_cap=patient_cap)
    _check_total(events, total, tgt, patient_cap)
    stages = _stage_rows(cfg, n, list(prior), events, tgt, image_shape, n_classes)
    warnings = tuple(
        f"[{s.stage}] at N = {n}: {s.noise_note}: the release would be mostly noise (noise-to-signal "
        f"{s.noise_to_signal:.2f} > {MOSTLY_NOISE}); {_FIXES.get(s.stage, 'spend more epsilon on it')}"
        for s in stages
        # DP-SGD's per-step figure is averaged down by the steps: reported, not warned about
        if s.stage != "dpsgd" and s.noise_to_signal is not None and s.noise_to_signal > MOSTLY_NOISE
    )
    sgd = next((s for s in stages if s.stage == "dpsgd" and s.enabled), None)
    return PrivacyPlan(
        dataset_size=n,
        target_epsilon=tgt.epsilon,
        delta=tgt.delta,
        accountant=tgt.accountant,
        epsilon=total,
        noise_multiplier=sgd.sigma if sgd else None,
        calibrated=sgd is not None and cfg.dpsgd.noise_multiplier is None,
        stages=stages,
        history=tuple(history),
        prior=tuple(prior),
        warnings=warnings,
        patient_cap=patient_cap,
        worst_case_epsilon=(
            unit_epsilon(history, tgt.delta, tgt.accountant, patient_cap=patient_cap, view="worst_case")
            if has_secure_aggregation(history)
            else None
        ),
    )


def _secure_plan_events(
    cfg: JobConfig,
    n: int,
    image_shape: tuple[int, int, int],
    n_classes: int,
    secure: SecureSite,
    size: PrivacyEvent | Sequence[PrivacyEvent] | None,
    given: tuple[Any, ...],
) -> tuple[list[Event], Target, int | None]:
    """(events, budget, patient cap) of :func:`plan` at a site of a secure job: :func:`secure_site_events`,
    the one history the node charges and the coordinator plans, under the site's policy."""
    if any(v for v in given):
        raise PrivacyError(
            "a secure-aggregation plan takes its budget, unit of privacy and patient cap from the site's "
            "policy, and plans no prior spending: give the policy only"
        )
    pol = secure.policy
    events = secure_site_events(
        cfg, n, image_shape, n_classes, secure.n_sites, pol, counted=count_events(size)
    )
    return events, target(cfg, pol), site_dpsgd(pol)["patient_cap"]


def _check_total(events: Sequence[Event], total: float, tgt: Target, patient_cap: int | None) -> None:
    """A configured ``[dpsgd] noise_multiplier`` may leave the total above the budget: refused."""
    if total <= tgt.epsilon + 1e-9:
        return
    sgd = stage_event(events, "dpsgd")
    steps = sum(e.steps for e in events if e.stage == "dpsgd")
    raise PrivacyError(
        f"[dpsgd] noise_multiplier {_row_sigma(sgd) if sgd else None} gives a total epsilon"
        f"{'' if patient_cap is None else ' per patient'} {total:.3f} above the "
        f"budget {tgt.epsilon}: raise [dpsgd] noise_multiplier (or remove it to calibrate), or use fewer "
        f"steps than {steps}"
    )


def _row_sigma(e: Event) -> float:
    """The noise multiplier a plan row shows: a Gaussian event's sigma; for a secure sum's SkellamEvent, that
    of the noise shares the site counts on, sqrt(mu) / its L2 sensitivity (the integer domain's, so a little
    below the pooled sigma for the rounding's inflation of the clip)."""
    return e.sigma if isinstance(e, PrivacyEvent) else math.sqrt(e.mu) / e.l2


def _by_stage(events: Sequence[Event]) -> dict[str, Event]:
    """One event per stage, its steps summed (a stage's releases, DP-SGD rounds or FedSGD's per-round
    SkellamEvents, share one noise and rate: the summed event composes to the same epsilon)."""
    out: dict[str, Event] = {}
    for e in merged(events):
        prev = out.get(e.stage)
        out[e.stage] = e if prev is None else dataclasses.replace(prev, steps=prev.steps + e.steps)
    return out


def _secure_note(e: Event, tgt: Target) -> str:
    if not isinstance(e, SkellamEvent):
        return ""
    own = epsilon([e], tgt.delta, view="worst_case")
    return f"; secure sum (Skellam), sigma of the counted noise shares; own share alone: epsilon {own:.3f}"


def _stage_notes(cfg: JobConfig, by_stage: dict[str, Event]) -> dict[str, str]:
    c, f = cfg.central, cfg.frequency
    sgd = by_stage.get("dpsgd")
    return {
        "central": (
            f"{c.kind} images, {c.rounds} round(s)"
            + (f" x {c.cells} {c.cell_rule} cells" if c.cells > 1 else "")
            if "central" in by_stage
            else "disabled (rounds = 0)"
        ),
        "frequency": (
            f"{f.features} random Fourier features"
            + (f" of {f.patch}x{f.patch} patches, stride {f.stride}" if f.patch else "")
            if "frequency" in by_stage
            else "disabled (no sigma)"
        ),
        "dpsgd": (
            ("configured" if cfg.dpsgd.noise_multiplier is not None else "calibrated")
            + (
                ", FedSGD: one pooled step a round"
                if cfg.federation.fedsgd and cfg.federation.secure_aggregation
                else ""
            )
            + (
                "; unit: the PATIENT (patients sampled, per-patient clip; no group conversion)"
                if getattr(sgd, "unit", "image") == "patient"
                else ""
            )
            if sgd
            else "disabled (0 steps)"
        ),
        "size": "noisy image count -> public size",
        "patients": "noisy patient count -> public patients",
        "selection": f"noisy histogram over {cfg.public.selection_groups} public groups -> pretrain on "
        f">= {cfg.public.selection_keep:.0%} of the public set",
    }


def _stage_rows(
    cfg: JobConfig,
    n: int,
    prior: list[PrivacyEvent],
    events: list[Event],
    tgt: Target,
    image_shape: tuple[int, int, int],
    n_classes: int,
) -> tuple[StagePlan, ...]:
    by_stage = _by_stage(events)
    notes = _stage_notes(cfg, by_stage)
    rows: list[tuple[str, Event | None, str]] = [(s, by_stage.get(s), notes[s]) for s in STAGES]
    # noisy counts drew undeclared sizes; the selection is released first
    for name in reversed([s for s in by_stage if s in ("size", "patients", "selection")]):
        rows.insert(0, (name, by_stage[name], notes[name]))
    alone = {name: (epsilon([ev], tgt.delta, tgt.accountant) if ev else 0.0) for name, ev, _ in rows}
    if prior:
        rows.insert(0, ("prior", None, f"{len(prior)} event(s) already spent"))
        alone["prior"] = epsilon(prior, tgt.delta, tgt.accountant)
    summed = sum(alone.values()) or 1.0
    sgd = by_stage.get("dpsgd")
    sgd_sigma = _row_sigma(sgd) if sgd else None
    noise = {name: stage_noise(cfg, name, n, image_shape, n_classes, sgd_sigma) for name, _, _ in rows}
    return tuple(
        StagePlan(
            stage=name,
            enabled=ev is not None or name == "prior",
            sigma=_row_sigma(ev) if ev else None,
            q=ev.q if ev else None,
            steps=ev.steps if ev else (sum(e.steps for e in prior) if name == "prior" else 0),
            epsilon=alone[name],
            share=alone[name] / summed,
            note=note + (_secure_note(ev, tgt) if ev else ""),
            noise_to_signal=noise[name][0],
            noise_note=noise[name][1],
        )
        for name, ev, note in rows
    )
