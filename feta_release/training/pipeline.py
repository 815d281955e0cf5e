"""The local driver (``feta-release train``): one site's run, as the stage layer's loop.

Stages (``feta_release.stages``, in order): public pretraining (with ``[public]``) -> central release ->
spatial warm-up -> frequency release -> aux generator + frequency warm-up -> DP-SGD -> synthesis. Each is
switched off by the config (``[central] rounds = 0``, ``[frequency] sigma`` absent, ``[dpsgd] steps = 0``) or
by ``[job] method`` (``dpdm``: no warm-up; ``dp-feta``: central images only; ``feta-pro``: spatial then
frequency; ``feta-pro-freq``: frequency only), which the config applies itself (``config.METHOD_OFF``). This
module owns the run directory, the secret seed and the site ledger; the stages own what they compute.

Run directory (``RUN_DIR``) layout::

    run.json                 job hash, data fingerprint, plan, ledger (path, job id), stage status, wall and
                             CPU seconds per stage; "status": "running" | "complete"
    job.json                 the effective JobConfig (after the method switch) as plain JSON
    ledger.sqlite            the site ledger (default; ``--ledger PATH`` for a site's own): every release and
                             DP-SGD chunk is charged there BEFORE it runs, hash-chained and signed by the site
                             key; ``export`` attests from it
    privacy.json             an unsigned copy of the ledger's history for this run (events, planned history,
                             total (eps, delta), per-stage eps) for people and charts; export never reads it
    privacy-budget.png       bar chart: eps of each stage alone and the total
    released/central.npz     noisy central images as released (+ post-processed images); written once
    released/frequency.npz   noisy frequency statistics as released; written once
    checkpoints/             SITE-PRIVATE, never to be exported: model state after each warm-up stage,
                             aux generator, DP-SGD trainer state (model, EMA, Adam, generator), the secret
                             noise seed (``noise_seed.txt``), the run's site key when none is given
                             (``site.key``)
    grids/NN-<stage>.png     a grid of samples per class after each stage (01 = the central images
                             themselves); grids/auxgen-images.png: the aux generator's images
    pretrained.pt            with [public]: the model after public pretraining (public: reusable by
                             --pretrained)
    synthetic.npz            images float32 (N,C,H,W) in [0,1], labels int64 (N,), class_names; balanced
                             labels
    model.pt                 {"spec": denoiser spec, "state_dict": EMA weights, "class_names", "job_hash"}
    COMPLETE                 written last; a run without it is unfinished, whatever else exists

Privacy: released statistics are charged, then computed, then saved and recorded; on resume they are loaded,
never re-queried. DP-SGD is one round of all its steps, charged once before it runs and finished from its
checkpoint after a kill (see ``feta_release.stages.dpsgd``), so the final history equals the plan. A charge
beyond the plan or the target epsilon raises ``BudgetExceededError`` naming the rule, before anything runs.
When the run completes its job is closed in the ledger: nothing more can be charged for it, so its statement
is final.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from rich.markup import escape

from ..accounting import PrivacyEvent, epsilon, events_to_list
from ..config import JobConfig
from ..data import ImageDataset
from ..errors import ConfigError, DataError, PrivacyError
from ..files import private_dir
from ..ledger import Ledger
from ..mechanisms.count import (
    PATIENTS_STAGE,
    SIZE_SIGMA,
    SIZE_STAGE,
    draw_public_size,
    patients_event,
    size_event,
)
from ..planning import PrivacyPlan
from ..planning import plan as privacy_plan
from ..privacy_unit import PatientIndex
from ..randomness import numpy_generator_from
from ..signing import fingerprint, generate_keypair, load_private_key, sha256_file
from ..stages import STAGES, PublicInputs, RunAccount, RunContext, RunDir, SimulatedKill, run_budget
from ..stages.account import check_recorded_plan
from ..stages.base import now
from ..stages.context import initial_denoiser, private_key
from ..stages.pretrain import with_public
from ..viz import save_budget_chart
from .checkpoint import MODEL_FILE, atomic_write_bytes, atomic_write_json, config_hash, read_json
from .data_checks import check_data, check_data_content
from .device import resolve_device
from .progress import Reporter

FORMAT = "feta-release/run/v1"
SIZING = "sizing"  # run.json's status while a run draws its public size (before its plan exists)
# released/size.json: the drawn public size as released (its bytes recorded in the ledger)
SIZE_FILE = "size.json"
__all__ = ["FORMAT", "RunResult", "SimulatedKill", "check_data", "run_pipeline", "run_site_key"]


# -- configuration ---------------------------------------------------------------------------------


# -- run directory ---------------------------------------------------------------------------------


def _existing_state(root: Path) -> dict[str, Any] | None:
    """run.json of the run in ``root`` (None: no run there yet); refuse a file or a non-empty non-run
    directory."""
    rd = RunDir(root)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{root}: exists and is not a directory")
    if root.exists() and any(root.iterdir()):
        if not rd.run_json.exists():
            raise ConfigError(
                f"{root}: directory is not empty and holds no run.json: not a feta-release run; choose an "
                "empty or new --out directory"
            )
        return read_json(rd.run_json)
    return None


def _open_run_dir(
    root: Path, job_hash: str, data_fp: str, drawn: bool = False
) -> tuple[RunDir, dict[str, Any] | None]:
    """Create a fresh run dir or return the run.json of the resumable one; refuse anything else. ``drawn``:
    the run drew its public size (its sizing step made the directory and checked job and data)."""
    rd = RunDir(root)
    state = _existing_state(root)
    if state is not None:
        if state.get("status") == SIZING:
            if not drawn:
                raise ConfigError(
                    f"{root}: this run draws its public size (a noisy count, already charged); resume "
                    "it without --public-size, or use a new --out directory"
                )
            return rd, state
        if state.get("job_hash") != job_hash:
            raise ConfigError(
                f"{root}: belongs to a different job config (hash {str(state.get('job_hash'))[:12]}..., this "
                f"job {job_hash[:12]}...); use a new --out directory or the same job file to resume"
            )
        if state.get("data_fingerprint") != data_fp:
            raise DataError(
                f"{root}: was started on different data (fingerprint "
                f"{str(state.get('data_fingerprint'))[:12]}..., now {data_fp[:12]}...); resume with the same "
                "--data or use a new --out directory"
            )
        return rd, state
    root.mkdir(parents=True, exist_ok=True)
    return rd, None


# -- results ---------------------------------------------------------------------------------------


@dataclass
class RunResult:
    run_dir: Path
    epsilon: float
    delta: float
    events: list[PrivacyEvent]
    dpsgd_sigma: float | None
    dpsgd_steps_trained: int
    seconds: float
    stage_seconds: dict[str, float] = field(default_factory=dict)
    resumed: bool = False
    already_complete: bool = False


# -- the driver ------------------------------------------------------------------------------------


def run_pipeline(
    cfg: JobConfig,
    data: ImageDataset,
    out_dir: str | Path,
    *,
    n_synthetic: int | None = None,
    checkpoint_every: int = 10,
    grid_per_class: int = 8,
    reporter: Reporter | None = None,
    noise_seed: int | None = None,
    kill_after_steps: int | None = None,
    public_size: int | None = None,
    device: str = "cpu",
    ledger: str | Path | None = None,
    site_key: Ed25519PrivateKey | None = None,
    site_policy: Any = None,
    patients: PatientIndex | None = None,
    draw_patients: bool = False,
    job_for_size: Callable[[int], JobConfig] | None = None,
    public: PublicInputs | None = None,
) -> RunResult:
    """Run (or resume) the whole single-site pipeline into ``out_dir``; see the module docstring.

    ``n_synthetic``: images in synthetic.npz (default: the public size, balanced).
    ``public_size``: the PUBLIC nominal dataset size N (default: ``site_policy``'s declaration, else drawn
    from a noisy count charged first as the event ``size``, see ``feta_release.mechanisms.count``). Rates
    q = batch / N, the central/frequency denominators, the DP-SGD divisor and everything written into the run
    (and so into a release) use it; the exact count stays in this process.
    ``noise_seed``: fixed secret seed for tests only (default: drawn from the OS, kept in the run dir).
    ``kill_after_steps``: test hook, raise ``SimulatedKill`` after that many DP-SGD steps of this process.
    ``checkpoint_every``: DP-SGD steps between trainer checkpoints (the round is charged once, whatever it
    is). ``device``: ``auto``/``cpu``/``cuda`` (``feta_release.training.device``): where the networks train
    and sample. ``ledger``: the site ledger to charge (default ``RUN_DIR/ledger.sqlite``); ``site_key``: the
    key that signs it (default: ``RUN_DIR/checkpoints/site.key``, created at the first start).
    ``site_policy``: the site's verified ``SitePolicy``, required when the ledger lies outside the run
    directory (a site's own, shared ledger): every charge is checked against its caps.
    ``patients``: patient ids, public patient count and cap: DP-SGD then samples and clips whole PATIENTS and
    its events carry ``unit = "patient"`` (``feta_release.privacy_unit``); None: the unit is the image.
    ``draw_patients``: ``patients.n_public`` is a placeholder (no declared patient count): the run draws it
    from a noisy patient count, charged first as the event ``patients`` (``feta_release.mechanisms.count``).
    ``job_for_size``: the job as a function of the PUBLIC size (a job derived from public facts,
    ``feta_release.job_rules``): the run is ``job_for_size(N)`` once N is declared or drawn; ``cfg`` is then
    the job the size is drawn under (its hash names the sizing step, so a resume draws nothing again).
    ``public``: a PUBLIC image set and/or pretrained model file (``stages.pretrain``): the job's ``[public]``
    section is filled in to name them (or checked against them), and the denoiser is pretrained before any
    private image.
    """
    t_start = time.perf_counter()
    dev = resolve_device(device)  # refuse an absent GPU before anything is written
    rep = reporter or Reporter(enabled=False)
    if checkpoint_every < 1:
        raise ConfigError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    if ledger is not None and site_policy is None and _outside(Path(ledger), Path(out_dir)):
        raise ConfigError(_NEEDS_POLICY.format(ledger=ledger))  # before the run dir is made
    cfg = with_public(cfg, public, data.image_shape)  # named in the job: its hash covers the public inputs
    n_pub, patients, size_ev = _public_sizes(
        cfg,
        data,
        Path(out_dir),
        public_size,
        patients,
        draw_patients,
        site_policy,
        (ledger, site_key, noise_seed, rep),
    )
    if job_for_size is not None:
        cfg = with_public(job_for_size(n_pub), public, data.image_shape)  # derived from the public facts
    cfg = cfg.for_size(n_pub)  # sampling rates -> batches for the PUBLIC size
    # Plan before touching the directory (a drawn size aside): an infeasible plan leaves nothing behind.
    plan = _plan_for(cfg, data, n_pub, patients, site_policy, size_ev)
    for w in plan.warnings:
        rep.warn(w)
    job_hash = config_hash(cfg.to_dict())
    rd, state = _open_run_dir(Path(out_dir), job_hash, data.fingerprint(), drawn=bool(size_ev))
    resumed = state is not None and state.get("status") != SIZING
    state = _start_state(rd, state, cfg, data, plan, n_pub)
    account = _open_account(rd, state, cfg, plan, ledger, site_key, site_policy)
    if state.get("status") == "complete" and rd.complete_marker.exists():
        rep.log(f"[green]{escape(str(rd.root))} is already complete[/]; nothing to do")
        return _result(account, plan, state, 0.0, resumed=True, already_complete=True)
    state["status"] = "running"
    atomic_write_json(rd.run_json, state)
    account.write()  # (a drawn size's charge wrote it under the size-only plan)
    model = initial_denoiser(cfg, data.image_shape, data.n_classes).to(dev)  # the public init of both drivers
    ctx = RunContext(
        cfg=cfg,
        data=data,
        rd=rd,
        account=account,
        plan=plan,
        state=state,
        secret=_secret(rd, noise_seed, account),
        rep=rep,
        denoiser=model,
        n_public=n_pub,
        checkpoint_every=checkpoint_every,
        grid_per_class=grid_per_class,
        n_synthetic=n_synthetic,
        kill_after_steps=kill_after_steps,
        patients=patients,
        public=public,
    )
    _log_start(ctx, resumed)
    for stage in STAGES:
        if stage.enabled(cfg):
            t0 = now()
            stage.run(ctx)
            ctx.lap(stage.name, t0)
    return _finish(ctx, time.perf_counter() - t_start, resumed)


def _public_sizes(
    cfg: JobConfig,
    data: ImageDataset,
    root: Path,
    public_size: int | None,
    patients: PatientIndex | None,
    draw_patients: bool,
    site_policy: Any,
    run: tuple[Any, ...],
) -> tuple[int, PatientIndex | None, list[PrivacyEvent]]:
    """(public size, patient index, the noisy counts' events): the declared sizes (``public_size``, the signed
    policy's), else drawn by :func:`_drawn_size`. ``run``: (ledger, site key, noise seed, reporter)."""
    if public_size is None and site_policy is not None:
        public_size = int(site_policy.dataset_size)  # the administrator's signed declaration
    exact = _undeclared(data, public_size, patients if draw_patients else None)
    size_ev = [_COUNT_EVENTS[stage]() for stage in exact]  # no declared size: a noisy count draws it
    if exact:
        # Only what does not read the exact count is checked before the draw: planning at the exact (or
        # rounded) count would make whether train refuses, and its message, a function of N that no noise
        # covers. The size-dependent refusals (batch above the size, an infeasible plan) come after, at the
        # drawn size.
        check_data_content(cfg, data, declared=getattr(site_policy, "declared", None) is not None)
        ledger, site_key, noise_seed, rep = run
        drawn = _drawn_size(cfg, data, root, ledger, site_key, noise_seed, rep, exact)
        public_size, patients = _with_drawn(drawn, public_size, patients)
    assert public_size is not None, "a size is declared or drawn"
    return int(public_size), patients, size_ev


def _with_drawn(
    drawn: dict[str, int], public_size: int | None, patients: PatientIndex | None
) -> tuple[int | None, PatientIndex | None]:
    """(public size, patient index) with the drawn public counts in place of the undeclared ones."""
    if patients is not None and PATIENTS_STAGE in drawn:
        patients = dataclasses.replace(patients, n_public=drawn[PATIENTS_STAGE])
    return drawn.get(SIZE_STAGE, public_size), patients


def _undeclared(data: ImageDataset, public_size: int | None, patients: PatientIndex | None) -> dict[str, int]:
    """stage -> EXACT count of each size the run must draw (private: only ``_drawn_size`` adds noise to
    them)."""
    exact = {SIZE_STAGE: data.n} if public_size is None else {}
    if patients is not None:
        exact[PATIENTS_STAGE] = patients.n_patients
    return exact


def _plan_for(
    cfg: JobConfig,
    data: ImageDataset,
    n_pub: int,
    patients: PatientIndex | None,
    site_policy: Any,
    size_ev: list[PrivacyEvent],
) -> PrivacyPlan:
    """The run's privacy plan at public size ``n_pub`` (its data checked first); ``size_ev``: the drawn
    size's."""
    cfg = cfg.for_size(n_pub)
    check_data(cfg, data, n_pub, declared=getattr(site_policy, "declared", None) is not None)
    return privacy_plan(
        cfg,
        n_pub,
        image_shape=data.image_shape,
        n_classes=data.n_classes,
        dpsgd_unit="image" if patients is None else "patient",
        size=size_ev,
        patient_cap=None if patients is None else patients.cap,
    )  # a budget per patient


def _start_state(
    rd: RunDir,
    state: dict[str, Any] | None,
    cfg: JobConfig,
    data: ImageDataset,
    plan: PrivacyPlan,
    n_pub: int,
) -> dict[str, Any]:
    """run.json of a new run (and job.json), or the resumed one after checking it has this plan. A run that
    drew its size starts from the sizing step's run.json (its ledger, base hash and drawn size are kept)."""
    if state is None or state.get("status") == SIZING:
        state = {
            **(state or {}),
            "format": FORMAT,
            "job_name": cfg.job.name,
            "job_hash": config_hash(cfg.to_dict()),
            "data_fingerprint": data.fingerprint(),
            "data_source": data.source,
            "dataset_size": n_pub,  # public nominal size
            "class_names": list(data.class_names),
            "image_shape": list(data.image_shape),
            "method": cfg.job.method,
            "status": "running",
            "stages": {},
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        atomic_write_json(rd.root / "job.json", cfg.to_dict())
    check_recorded_plan(state, plan, rd.run_json)
    sgd = plan.event("dpsgd")
    state["plan"] = {
        "events": events_to_list(plan.events),
        "epsilon": plan.epsilon,
        "dpsgd_sigma": plan.noise_multiplier,
        "dpsgd_q": sgd.q if sgd else cfg.dpsgd.batch / n_pub,
        "dpsgd_steps": sgd.steps if sgd else 0,
    }
    return state


def _open_account(
    rd: RunDir,
    state: dict[str, Any],
    cfg: JobConfig,
    plan: PrivacyPlan,
    ledger: str | Path | None,
    site_key: Ed25519PrivateKey | None,
    site_policy: Any = None,
) -> RunAccount:
    """The site ledger this run charges (recorded in run.json at the first start: a resume charges the same).

    A ledger outside the run directory is a site's own, shared by its runs and jobs: charging it with only the
    job's own budget would let a local run push the site past its signed lifetime cap, so its signed policy is
    required."""
    key = site_key or _run_key(rd)
    rec = state.get("ledger")
    if rec is None:
        path = Path(ledger) if ledger is not None else rd.root / "ledger.sqlite"
        name = re.sub(r"[^A-Za-z0-9._-]", "-", cfg.job.name)[:64] or "job"
        rec = {"path": _stored_path(path, rd.root), "job_id": f"local-{name}-{secrets.token_hex(6)}"}
    stored = _ledger_path(rec["path"], rd.root)
    if ledger is not None and Path(ledger).resolve() != stored.resolve():
        raise ConfigError(
            f"{rd.root}: this run charges the ledger {stored}; resume it with that --ledger (or none)"
        )
    if site_policy is None and Path(rec["path"]).is_absolute():
        raise ConfigError(_NEEDS_POLICY.format(ledger=stored))
    state["ledger"] = {**rec, "site_key": fingerprint(key)}
    atomic_write_json(rd.run_json, state)
    # per patient when the plan is
    budget = dataclasses.replace(run_budget(cfg), patient_cap=plan.patient_cap)
    return RunAccount(
        Ledger(stored, key=key), rec["job_id"], plan, budget, rd.root / "privacy.json", site_policy
    )


# -- the public size of a run without a declared one (mechanisms.count) ------------------------------


def _drawn_size(
    cfg: JobConfig,
    data: ImageDataset,
    root: Path,
    ledger: str | Path | None,
    site_key: Ed25519PrivateKey | None,
    noise_seed: int | None,
    rep: Reporter,
    exact: dict[str, int],
) -> dict[str, int]:
    """The public sizes of a run given none: for each stage of ``exact`` (``size``: the image count;
    ``patients``: the patient count) a noisy count, charged in the run's ledger BEFORE anything else is
    released, drawn from the run's secret, saved in ``released/size.json`` and recorded. A resume reads them
    back (checked against the ledger's record), never charging or drawing again. The run has no signed policy
    here (a policy declares its sizes), so its ledger is its own (a shared one needs a policy). Returns stage
    -> public value."""
    rd = RunDir(root)
    state = _sizing_state(rd, cfg, data)
    events = [_COUNT_EVENTS[stage]() for stage in exact]
    account = _open_account(rd, state, cfg, _size_plan(cfg, events), ledger, site_key)
    path = rd.released(SIZE_FILE)
    if path.exists():
        drawn = json.loads(account.saved_release(next(iter(exact)), path))["counts"]
        if set(drawn) != set(exact):
            raise ConfigError(
                f"{root}: this run drew {sorted(drawn)}, not {sorted(exact)}; resume it with the same "
                "--public-size/--public-patients options, or use a new --out directory"
            )
        return {k: int(v) for k, v in drawn.items()}
    if any(account.charged(stage) > 0 for stage in exact):
        raise PrivacyError(
            f"{path} is missing but the public size was already charged (the run was killed between "
            "charging and saving it); it cannot be drawn again for free: start a new run directory"
        )
    secret = _secret(rd, noise_seed, account)  # bound in the ledger before the first charge
    rids = [account.charge(stage, 1) for stage in exact]
    drawn = {
        stage: draw_public_size(n, numpy_generator_from(private_key(secret, stage)))
        for stage, n in exact.items()
    }
    blob = json.dumps({"counts": drawn, "sigma": SIZE_SIGMA}, sort_keys=True).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, blob)
    for rid in rids:
        account.record(rid, blob)
    state["public_size"] = {"counts": drawn, "drawn": True, "sigma": SIZE_SIGMA}
    atomic_write_json(rd.run_json, state)
    said = ", ".join(f"{_COUNT_WORDS.get(k, k)} {v:,}" for k, v in drawn.items())
    rep.log(
        escape(
            f"public {said}: drawn from a noisy count (Gaussian, noise std {SIZE_SIGMA:g}, charged first); "
            "rates, denominators and the default number of synthetic images use it (declare a figure you "
            "would publish anyway with --public-size / --public-patients)"
        )
    )
    return drawn


_COUNT_EVENTS = {SIZE_STAGE: size_event, PATIENTS_STAGE: patients_event}
_COUNT_WORDS = {SIZE_STAGE: "size N =", PATIENTS_STAGE: "number of patients ="}


def _sizing_state(rd: RunDir, cfg: JobConfig, data: ImageDataset) -> dict[str, Any]:
    """run.json of a run that draws its size: the existing one (same job and data) or a new one (status
    sizing)."""
    base = config_hash(cfg.to_dict())  # the job before sizing (its batches follow the size drawn)
    state = _existing_state(rd.root)
    if state is None:
        rd.root.mkdir(parents=True, exist_ok=True)
        state = {
            "format": FORMAT,
            "job_name": cfg.job.name,
            "base_hash": base,
            "data_fingerprint": data.fingerprint(),
            "status": SIZING,
            "stages": {},
        }
        atomic_write_json(rd.run_json, state)
        return state
    if state.get("status") != SIZING and not (state.get("public_size") or {}).get("drawn"):
        raise ConfigError(
            f"{rd.root}: this run was started with the declared public size {state.get('dataset_size')}; "
            f"resume it with --public-size {state.get('dataset_size')}, or use a new --out directory"
        )
    if state.get("base_hash") != base or state.get("data_fingerprint") != data.fingerprint():
        raise ConfigError(
            f"{rd.root}: belongs to a different job config or data; use the same job file and --data "
            "to resume, or a new --out directory"
        )
    return state


def _size_plan(cfg: JobConfig, events: list[PrivacyEvent]) -> PrivacyPlan:
    """The plan of a run's sizing step: the noisy counts alone (the full plan needs the sizes they draw)."""
    p = cfg.privacy
    return PrivacyPlan(
        dataset_size=0,
        target_epsilon=float(p.epsilon),
        delta=float(p.delta),
        accountant=p.accountant,
        epsilon=epsilon(events, float(p.delta), p.accountant),
        noise_multiplier=None,
        calibrated=False,
        stages=(),
        history=tuple(events),
    )


_NEEDS_POLICY = (
    "{ledger}: a site ledger outside the run directory is charged under the site's signed policy; give "
    "--policy SITE.signed.json --trusted ADMIN.pub (or omit --ledger)"
)


def _outside(ledger: Path, root: Path) -> bool:
    return Path(_stored_path(ledger, root)).is_absolute()


def _stored_path(path: Path, root: Path) -> str:
    """The ledger's path as run.json keeps it: relative when inside the run dir (the run dir may move)."""
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path.resolve())


def _ledger_path(stored: str, root: Path) -> Path:
    p = Path(stored)
    return p if p.is_absolute() else root / p


def _run_key(rd: RunDir) -> Ed25519PrivateKey:
    """The run's own site key when none is given (created once, owner-only): ``export --site-key`` takes
    it."""
    path = rd.ckpt("site.key")
    private_dir(path.parent)
    if not path.exists():
        generate_keypair(path.parent, "site")
    return load_private_key(path)


def run_site_key(run_dir: str | Path) -> Ed25519PrivateKey:
    """The site key a run made for itself (``RUN_DIR/checkpoints/site.key``): the one its ledger is signed
    with when ``train`` was given no ``--site-key``."""
    return _run_key(RunDir(Path(run_dir)))


def _secret(rd: RunDir, noise_seed: int | None, account: RunAccount) -> int:
    """The run's noise secret, bound in its signed ledger like a checkpoint: a local user who could replace
    ``noise_seed.txt`` while the run is stopped would otherwise choose the noise of every later release and
    subtract it. (The ledger keeps the sha256 of 256 random bits: not searchable.)"""
    seed_file = rd.ckpt("noise_seed.txt")
    if seed_file.exists():
        data = account.saved_checkpoint(
            seed_file,
            fix=f"delete {seed_file} to resume with a fresh secret (new noise "
            "is as private as the old; nothing is charged twice)",
        )
        return int(data.decode().strip())
    secret = noise_seed if noise_seed is not None else secrets.randbits(256)  # >= 128 bits: not searchable
    data = f"{secret}\n".encode()
    account.bind_checkpoint(seed_file.name, data)  # before the file exists: a kill leaves no unbound secret
    private_dir(seed_file.parent)
    # 0600 from creation on: whoever reads it can subtract the noise
    atomic_write_bytes(seed_file, data, private=True)
    return secret


def _log_start(ctx: RunContext, resumed: bool) -> None:
    cfg, plan, sgd = ctx.cfg, ctx.plan, ctx.plan.event("dpsgd")
    ctx.rep.log(
        f"[bold]{cfg.job.name}[/] ({cfg.job.method}) on {ctx.data.n} images, {ctx.data.n_classes} classes: "
        f"planned epsilon {plan.epsilon:.3f} at delta {cfg.privacy.delta:g}"
        + (f"; DP-SGD sigma {sgd.sigma:.3f}, q {sgd.q:.4f}, {sgd.steps} steps" if sgd else "")
        + escape(f"; ledger {ctx.account.ledger.path}" + (" [resuming]" if resumed else ""))
    )


def _finish(ctx: RunContext, seconds: float, resumed: bool) -> RunResult:
    """privacy.json, chart, the job closed in the ledger, run.json, and the completion marker (last)."""
    doc = ctx.account.write(final=True, extra={"dpsgd_steps_trained": ctx.dpsgd_trained})
    _budget_chart(doc, ctx.rd.root / "privacy-budget.png")
    if ctx.cfg.sampler.uses_aux and ctx.aux_pool_sha256 is None:
        raise PrivacyError(
            "the aux-image pool was not drawn in this run; rerun `feta-release train` to finish it"
        )
    ctx.account.close(ctx.state["job_hash"], sha256_file(ctx.rd.root / MODEL_FILE), ctx.aux_pool_sha256)
    st = ctx.state
    st.update(
        status="complete",
        dpsgd_steps_trained=ctx.dpsgd_trained,
        finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    st["stage_seconds"] = {**st.get("stage_seconds", {}), **ctx.stage_seconds}
    st["stage_cpu_seconds"] = {**st.get("stage_cpu_seconds", {}), **ctx.stage_cpu}
    atomic_write_json(ctx.rd.run_json, st)
    atomic_write_bytes(ctx.rd.complete_marker, b"complete\n")
    ctx.rep.log(
        f"[green]done[/]: epsilon {doc['epsilon']:.3f} at delta {ctx.cfg.privacy.delta:g} (accountant "
        f"{ctx.cfg.privacy.accountant}); per stage "
        f"{', '.join(f'{k} {v:.3f}' for k, v in doc['per_stage_epsilon'].items())}"
    )
    return _result(ctx.account, ctx.plan, st, seconds, resumed=resumed, stage_seconds=ctx.stage_seconds)


def _result(
    account: RunAccount,
    plan: PrivacyPlan,
    state: dict[str, Any],
    seconds: float,
    *,
    resumed: bool,
    already_complete: bool = False,
    stage_seconds: dict[str, float] | None = None,
) -> RunResult:
    b, events = account.budget, account.events
    return RunResult(
        account.report_path.parent,
        epsilon(events, b.delta, b.accountant),
        b.delta,
        events,
        plan.noise_multiplier,
        int(state.get("dpsgd_steps_trained", 0)),
        seconds,
        stage_seconds or {},
        resumed,
        already_complete,
    )


def _budget_chart(doc: dict[str, Any], path: Path) -> None:
    per = doc.get("per_stage_epsilon", {})
    if per:
        save_budget_chart(per, path, target=doc["target_epsilon"], delta=doc["delta"])
