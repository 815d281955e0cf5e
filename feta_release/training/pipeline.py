"""The single-site ``train`` pipeline: plan -> central release -> spatial warm-up -> frequency release -> aux
generator -> frequency warm-up -> DP-SGD -> samples, with crash-safe checkpoints and a privacy ledger.

Stages are functions of (model, released statistics, config); each is switched off by the config
(``[central] rounds = 0``, ``[frequency] sigma`` absent, ``[dpsgd] steps = 0``) or by ``[job] method``
(``dpdm``: no warm-up; ``dp-feta``: central images only; ``feta-pro``: spatial then frequency;
``feta-pro-freq``: frequency only), see :func:`apply_method`.

Run directory (``RUN_DIR``) layout::

    run.json                 job hash, data fingerprint, plan, stage status, wall and CPU seconds per stage;
                             "status": "running" | "complete"
    job.json                 the effective JobConfig (after the method switch) as plain JSON
    privacy.json             FULL charged event history, planned history, total (eps, delta), accountant,
                             per-stage eps; rewritten (atomically, fsynced) BEFORE every mechanism / DP-SGD step
    privacy-budget.png       bar chart: eps of each stage alone and the total
    released/central.npz     noisy central images as released (+ post-processed images); written once
    released/frequency.npz   noisy frequency statistics as released; written once
    checkpoints/             SITE-PRIVATE, never to be exported: model state after each warm-up stage,
                             aux generator, DP-SGD trainer state (model, EMA, Adam, generator), the secret
                             noise seed (``noise_seed.txt``)
    grids/NN-<stage>.png     a grid of samples per class after each stage (01 = the central images themselves);
                             grids/auxgen-images.png: the aux generator's images
    synthetic.npz            images float32 (N,C,H,W) in [0,1], labels int64 (N,), class_names; balanced labels
    model.pt                 {"spec": denoiser spec, "state_dict": EMA weights, "class_names", "job_hash"}
    COMPLETE                 written last; a run without it is unfinished, whatever else exists

Privacy: released statistics are charged, then computed, then saved; on resume they are loaded, never
re-queried. Each DP-SGD step is charged (privacy.json on disk) before it runs; the trainer state is
checkpointed every ``checkpoint_every`` steps, so after a kill, the steps charged since the last checkpoint
are lost progress, never re-charged: the run continues from the checkpoint with the REMAINING planned
steps, so the final history equals the plan. A charge that would exceed the plan or the target epsilon
raises ``BudgetExceededError`` before the step.

Randomness: the public ``[job] seed`` drives model init, warm-up training and synthesis; everything that
touches private data (mechanism noise, Poisson sampling, DP-SGD noise) uses a secret seed drawn from the
OS at the first start and kept in ``checkpoints/noise_seed.txt`` (a public seed would let anyone subtract
the noise).
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

import numpy as np
import torch

from ..accounting import PrivacyEvent, epsilon, epsilon_breakdown, events_from_list, events_to_list
from ..config import JobConfig
from ..data import ImageDataset
from ..errors import BudgetExceededError, ConfigError, DataError, PrivacyError
from .checkpoint import atomic_write_bytes, atomic_write_json, config_hash, load_torch, read_json, save_torch
from .progress import Reporter

FORMAT = "feta-release/run/v1"
PRIVACY_FORMAT = "feta-release/privacy/v1"


class SimulatedKill(RuntimeError):
    """Raised by the test hook ``kill_after_steps`` to simulate a crash in the middle of DP-SGD."""


# -- configuration ---------------------------------------------------------------------------------


def apply_method(cfg: JobConfig) -> JobConfig:
    """The effective config of ``[job] method``: switch the warm-up stages the method does not use off."""
    m = cfg.job.method
    if m == "dpdm":
        return cfg.replace(central={"rounds": 0}, frequency={"sigma": None})
    if m == "dp-feta":
        return cfg.replace(frequency={"sigma": None})
    if m == "feta-pro-freq":
        return cfg.replace(central={"rounds": 0})
    return cfg


def check_data(cfg: JobConfig, data: ImageDataset) -> None:
    """Refuse data the job cannot be run on, with what to change."""
    if data.n == 0:
        raise DataError(f"{data.source}: no images")
    counts = data.class_counts()
    empty = [data.class_names[c] for c in np.flatnonzero(counts == 0)]
    if empty:
        raise DataError(
            f"{data.source}: class(es) {', '.join(map(repr, empty))} have no images; every class needs training "
            "images (remove the empty class folders or add images)"
        )
    if cfg.dpsgd.batch > data.n and cfg.dpsgd_steps(data.n) > 0:
        raise DataError(
            f"{data.source}: {data.n} images, fewer than the DP-SGD batch [dpsgd] batch = {cfg.dpsgd.batch} "
            f"(sampling rate q = {cfg.dpsgd.batch / data.n:.3g} > 1); lower [dpsgd] batch below {data.n}, or give "
            f"[dpsgd] rate (a sampling rate: the batch then follows the dataset size)"
        )
    if cfg.central.rounds > 0 and cfg.central.batch > data.n:
        raise DataError(
            f"{data.source}: {data.n} images, fewer than [central] batch = {cfg.central.batch} (q > 1); "
            f"lower [central] batch below {data.n}, or give [central] rate (a sampling rate: the batch then follows "
            f"the dataset size)"
        )


# -- privacy ledger of a run -----------------------------------------------------------------------


@dataclass
class PlannedRun:
    events: list[PrivacyEvent]  # the whole planned history (warm-up events + DP-SGD)
    dpsgd_sigma: float | None
    dpsgd_q: float
    dpsgd_steps: int
    epsilon: float  # total planned epsilon with the configured accountant
    n_public: int = 0  # the PUBLIC nominal size every rate and denominator uses (never the exact count)


def plan_run(cfg: JobConfig, n: int, image_shape: tuple[int, int, int] = (1, 28, 28), n_classes: int = 10,
             warnings: list[str] | None = None) -> PlannedRun:
    """Whole-history plan (``feta_release.planning.plan_job``): warm-up events as configured, DP-SGD sigma
    calibrated for what is left. Raises PrivacyError naming the stage to shrink when it cannot fit.
    The plan's noise-to-signal warnings are appended to ``warnings`` when given."""
    from ..planning import plan_job

    pl = plan_job(cfg, n, image_shape=image_shape, n_classes=n_classes)
    if warnings is not None:
        warnings.extend(pl.warnings)
    sgd = next((e for e in pl.history if e.stage == "dpsgd"), None)
    return PlannedRun(
        events=list(pl.history),
        dpsgd_sigma=pl.noise_multiplier if sgd else None,
        dpsgd_q=sgd.q if sgd else cfg.for_size(n).dpsgd.batch / n,
        dpsgd_steps=sgd.steps if sgd else 0,
        epsilon=pl.epsilon,
        n_public=int(n),
    )


class RunLedger:
    """Charged privacy events of one run, persisted to ``privacy.json`` BEFORE each release/step."""

    def __init__(self, path: Path, cfg: JobConfig, plan: PlannedRun, n: int) -> None:
        self.path = path
        self.cfg = cfg
        self.plan = plan
        self.n = n
        self.events: list[PrivacyEvent] = []
        if path.exists():
            doc = read_json(path)
            planned = events_from_list(doc["planned"])
            if planned != plan.events:
                raise PrivacyError(
                    f"{path}: the recorded plan {events_to_list(planned)} differs from this job's plan "
                    f"{events_to_list(plan.events)}; this run directory belongs to another job or data"
                )
            self.events = events_from_list(doc["events"])

    def charged(self, stage: str) -> int:
        return sum(e.steps for e in self.events if e.stage == stage)

    def planned(self, stage: str) -> PrivacyEvent | None:
        return next((e for e in self.plan.events if e.stage == stage), None)

    def charge(self, stage: str, steps: int = 1) -> None:
        """Record ``steps`` more compositions of ``stage``'s planned event, on disk, or refuse."""
        plan = self.planned(stage)
        if plan is None:
            raise BudgetExceededError(f"stage {stage!r} is not in this run's privacy plan; nothing was released")
        done = self.charged(stage)
        if done + steps > plan.steps:
            raise BudgetExceededError(
                f"{stage}: {done} of {plan.steps} planned compositions already charged; {steps} more would exceed "
                f"the plan (and so the budget); nothing was released"
            )
        new = self._merged(stage, plan, done + steps)
        p = self.cfg.privacy
        if p.accountant == "rdp":  # cheap (~25 ms): check the real total every time
            eps = epsilon(new, p.delta, "rdp")
            if eps > p.epsilon * (1 + 1e-9):
                raise BudgetExceededError(
                    f"{stage}: the next composition would bring epsilon to {eps:.4f} > [privacy] epsilon "
                    f"{p.epsilon}; stopped before it (nothing released)"
                )
        # PRV totals take seconds: the prefix-of-the-plan check above bounds them (the plan is <= target).
        self.events = new
        self.write()

    def _merged(self, stage: str, plan: PrivacyEvent, total_steps: int) -> list[PrivacyEvent]:
        # One event per stage with a running count: a thousand DP-SGD steps stay one (sigma, q, steps) entry.
        out = [e for e in self.events if e.stage != stage]
        out.append(PrivacyEvent(stage, plan.sigma, plan.q, total_steps))
        order = {e.stage: i for i, e in enumerate(self.plan.events)}
        return sorted(out, key=lambda e: order.get(e.stage, 99))

    def summary(self, with_breakdown: bool = False) -> dict[str, Any]:
        p = self.cfg.privacy
        doc: dict[str, Any] = {
            "format": PRIVACY_FORMAT,
            "accountant": p.accountant,
            "delta": p.delta,
            "target_epsilon": p.epsilon,
            "dataset_size": self.n,
            "unit": "one image of one site (add/remove)",
            "planned": events_to_list(self.plan.events),
            "planned_epsilon": self.plan.epsilon,
            "events": events_to_list(self.events),
        }
        if p.accountant == "rdp" or with_breakdown:
            doc["epsilon"] = epsilon(self.events, p.delta, p.accountant)
        if with_breakdown:
            doc["per_stage_epsilon"] = epsilon_breakdown(self.events, p.delta, p.accountant) if self.events else {}
        return doc

    def write(self, *, final: bool = False, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        doc = self.summary(with_breakdown=final)
        doc["complete"] = final
        if extra:
            doc.update(extra)
        atomic_write_json(self.path, doc)
        return doc


# -- run directory ---------------------------------------------------------------------------------


@dataclass
class RunDir:
    root: Path

    @property
    def run_json(self) -> Path:
        return self.root / "run.json"

    @property
    def complete_marker(self) -> Path:
        return self.root / "COMPLETE"

    def ckpt(self, name: str) -> Path:
        return self.root / "checkpoints" / name

    def released(self, name: str) -> Path:
        return self.root / "released" / name

    def grid(self, index: int, stage: str) -> Path:
        return self.root / "grids" / f"{index:02d}-{stage}.png"


def _open_run_dir(root: Path, job_hash: str, data_fp: str) -> tuple[RunDir, dict[str, Any] | None]:
    """Create a fresh run dir or return the run.json of the resumable one; refuse anything else."""
    rd = RunDir(root)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{root}: exists and is not a directory")
    if root.exists() and any(root.iterdir()):
        if not rd.run_json.exists():
            raise ConfigError(
                f"{root}: directory is not empty and holds no run.json: not a feta-release run; choose an empty "
                "or new --out directory"
            )
        state = read_json(rd.run_json)
        if state.get("job_hash") != job_hash:
            raise ConfigError(
                f"{root}: belongs to a different job config (hash {str(state.get('job_hash'))[:12]}..., this job "
                f"{job_hash[:12]}...); use a new --out directory or the same job file to resume"
            )
        if state.get("data_fingerprint") != data_fp:
            raise DataError(
                f"{root}: was started on different data (fingerprint {str(state.get('data_fingerprint'))[:12]}..., "
                f"now {data_fp[:12]}...); resume with the same --data or use a new --out directory"
            )
        return rd, state
    root.mkdir(parents=True, exist_ok=True)
    return rd, None


def _seed_from(*parts: Any) -> int:
    h = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def _gen(*parts: Any) -> torch.Generator:
    """A generator for PUBLIC randomness (model init, post-processing of released values, sampling)."""
    return torch.Generator().manual_seed(_seed_from(*parts))


def _private_key(secret: int, stage: str) -> bytes:
    """256 bits for a stage that touches private data, from the run's secret (itself 256 OS bits; kept in the run
    dir so a resumed run continues the same streams)."""
    return hashlib.sha256(f"{secret}/{stage}".encode()).digest()


def _private_rng(secret: int, stage: str) -> np.random.Generator:
    from ..randomness import numpy_generator_from

    return numpy_generator_from(_private_key(secret, stage))


def _private_gen(secret: int, stage: str) -> torch.Generator:
    from ..randomness import torch_generator_from

    return torch_generator_from(_private_key(secret, stage))


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


# -- the pipeline ----------------------------------------------------------------------------------


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
    before_dpsgd_step: Callable[[int], None] | None = None,
    public_size: int | None = None,
    device: str = "cpu",
) -> RunResult:
    """Run (or resume) the whole single-site pipeline into ``out_dir``; see the module docstring.

    ``n_synthetic``: images in synthetic.npz (default: the public size, balanced).
    ``public_size``: the PUBLIC nominal dataset size N (default: the count rounded to 2 significant digits). Rates
    q = batch / N, the central/frequency denominators, the DP-SGD divisor and everything written into the run (and
    so into a release) use it; the exact count stays in this process.
    ``noise_seed``: fixed secret seed for tests only (default: drawn from the OS, kept in the run dir).
    ``kill_after_steps``: test hook, raise ``SimulatedKill`` after that many DP-SGD steps of this process.
    ``device``: ``auto``/``cpu``/``cuda`` (``feta_release.training.device``): where the networks train and sample.
    """
    from .device import resolve_device

    dev = resolve_device(device)
    t_start = time.perf_counter()
    rep = reporter or Reporter(enabled=False)
    if checkpoint_every < 1:
        raise ConfigError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    from ..data.commitment import suggest_public_size

    n_pub = int(public_size) if public_size is not None else suggest_public_size(data.n)
    cfg = apply_method(cfg).for_size(n_pub)  # sampling rates -> batches for the PUBLIC size
    check_data(cfg, data)
    # Plan before touching the directory: an infeasible plan leaves nothing behind.
    plan_warnings: list[str] = []
    plan = plan_run(cfg, n_pub, data.image_shape, data.n_classes, plan_warnings)
    for w in plan_warnings:
        rep.log(f"[yellow]warning[/]: {w}")
    job_hash = config_hash(cfg.to_dict())
    data_fp = data.fingerprint()
    root = Path(out_dir)
    rd, state = _open_run_dir(root, job_hash, data_fp)
    resumed = state is not None
    if state is not None and state.get("status") == "complete" and rd.complete_marker.exists():
        rep.log(f"[green]{root} is already complete[/]; nothing to do")
        doc = read_json(root / "privacy.json")
        return RunResult(root, doc["epsilon"], doc["delta"], events_from_list(doc["events"]), plan.dpsgd_sigma,
                         int(state.get("dpsgd_steps_trained", 0)), 0.0, resumed=True, already_complete=True)
    if state is None:
        state = {
            "format": FORMAT,
            "job_name": cfg.job.name,
            "job_hash": job_hash,
            "data_fingerprint": data_fp,
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
    state["plan"] = {"events": events_to_list(plan.events), "epsilon": plan.epsilon,
                     "dpsgd_sigma": plan.dpsgd_sigma, "dpsgd_q": plan.dpsgd_q, "dpsgd_steps": plan.dpsgd_steps}
    state["status"] = "running"
    atomic_write_json(rd.run_json, state)

    seed_file = rd.ckpt("noise_seed.txt")
    if seed_file.exists():
        secret = int(seed_file.read_text().strip())
    else:
        secret = noise_seed if noise_seed is not None else secrets.randbits(256)  # >= 128 bits: not searchable
        atomic_write_bytes(seed_file, f"{secret}\n".encode())
        os.chmod(seed_file, 0o600)  # whoever reads it can subtract the noise

    ledger = RunLedger(rd.root / "privacy.json", cfg, plan, n_pub)
    if not ledger.path.exists():
        ledger.write()
    rep.log(
        f"[bold]{cfg.job.name}[/] ({cfg.job.method}) on {data.n} images, {data.n_classes} classes: planned "
        f"epsilon {plan.epsilon:.3f} at delta {cfg.privacy.delta:g}"
        + (f"; DP-SGD sigma {plan.dpsgd_sigma:.3f}, q {plan.dpsgd_q:.4f}, {plan.dpsgd_steps} steps" if plan.dpsgd_steps else "")
        + (" [resuming]" if resumed else "")
    )
    stage_seconds: dict[str, float] = {}
    stage_cpu: dict[str, float] = {}  # process CPU seconds (all threads): comparable across busy machines

    def mark(stage: str, **info: Any) -> None:
        state["stages"][stage] = {"done": True, **info}
        atomic_write_json(rd.run_json, state)

    from ..models.edm import build_denoiser, denoiser_spec

    torch.manual_seed(_seed_from(cfg.job.seed, "init"))
    denoiser = build_denoiser(cfg.model, data.image_shape, data.n_classes).to(dev)
    grid_index = 0

    def grid(stage: str, model: torch.nn.Module) -> None:
        nonlocal grid_index
        grid_index += 1
        _sample_grid(model, cfg, data, rd.grid(grid_index, stage), grid_per_class, _grid_title(stage, ledger))

    # 1. central images (DP release; charged once, saved once)
    central = None
    if cfg.central.rounds > 0:
        t0 = _now()
        central = _central_stage(cfg, data, rd, ledger, _private_rng(secret, "central"), rep)
        from ..viz import save_grid

        grid_index += 1
        save_grid(central[0], central[1], rd.grid(grid_index, "central-images"),
                  per_class=min(grid_per_class, cfg.central.rounds),
                  n_classes=data.n_classes, class_names=data.class_names,
                  title=_grid_title("released central images", ledger))
        _lap(stage_seconds, stage_cpu, "central", t0)

    # 2. spatial warm-up (post-processing of the central images)
    if central is not None and cfg.warmup.spatial_iterations > 0:
        t0 = _now()
        ck = rd.ckpt("after-spatial.pt")
        if ck.exists():
            denoiser.load_state_dict(load_torch(ck)["model"])
            rep.log("spatial warm-up: loaded from checkpoint")
        else:
            from .spatial import spatial_warmup

            with rep.task("spatial warm-up", cfg.warmup.spatial_iterations) as adv:
                res = spatial_warmup(denoiser, central[0], central[1], cfg, generator=_gen(cfg.job.seed, "spatial"),
                                     progress=lambda i, n, loss: adv(1, info=f"loss {loss:.3f}"))
            save_torch(ck, {"model": denoiser.state_dict()})
            mark("spatial", final_loss=res.final_loss, steps=res.steps)
        grid("after-spatial", denoiser)
        _lap(stage_seconds, stage_cpu, "spatial", t0)

    # 3. frequency statistics (DP release) -> aux generator -> frequency warm-up
    if cfg.frequency.sigma is not None:
        t0 = _now()
        stats = _frequency_stage(cfg, data, rd, ledger, _private_rng(secret, "frequency"), rep)
        _lap(stage_seconds, stage_cpu, "frequency-release", t0)
        t0 = _now()
        _frequency_warmup(cfg, data, rd, denoiser, stats, rep, grid, mark, n_pub, central)
        _lap(stage_seconds, stage_cpu, "frequency-warmup", t0)

    # 4. DP-SGD on the real images
    trained = 0
    final_model: torch.nn.Module = denoiser
    if plan.dpsgd_steps > 0:
        t0 = _now()
        final_model, trained = _dpsgd_stage(
            cfg, data, rd, ledger, plan, denoiser, _private_gen(secret, "dpsgd"), rep, checkpoint_every,
            kill_after_steps, before_dpsgd_step, state,
        )
        mark("dpsgd", steps_trained=trained, steps_charged=ledger.charged("dpsgd"))
        grid("after-dpsgd", final_model)
        _lap(stage_seconds, stage_cpu, "dpsgd", t0)

    # 5. synthetic set, model, privacy report, completion marker (last)
    t0 = _now()
    n_syn = n_pub if n_synthetic is None else int(n_synthetic)
    _write_synthetic(final_model, cfg, data, rd.root / "synthetic.npz", n_syn, rep)
    save_torch(rd.root / "model.pt", {
        "spec": denoiser_spec(cfg.model, data.image_shape, data.n_classes),
        "state_dict": {k: v.cpu() for k, v in final_model.state_dict().items()},
        "class_names": list(data.class_names),
        "job_hash": job_hash,
        "sampler": cfg.to_dict()["sampler"],
    })
    _lap(stage_seconds, stage_cpu, "synthesis", t0)
    doc = ledger.write(final=True, extra={"dpsgd_steps_trained": trained})
    _budget_chart(doc, rd.root / "privacy-budget.png")
    state["status"] = "complete"
    state["dpsgd_steps_trained"] = trained
    state["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    state["stage_seconds"] = {**state.get("stage_seconds", {}), **stage_seconds}
    state["stage_cpu_seconds"] = {**state.get("stage_cpu_seconds", {}), **stage_cpu}
    atomic_write_json(rd.run_json, state)
    atomic_write_bytes(rd.complete_marker, b"complete\n")
    eps = float(doc["epsilon"])
    rep.log(f"[green]done[/]: epsilon {eps:.3f} at delta {cfg.privacy.delta:g} (accountant {cfg.privacy.accountant}); "
            f"per stage {', '.join(f'{k} {v:.3f}' for k, v in doc['per_stage_epsilon'].items())}")
    return RunResult(rd.root, eps, cfg.privacy.delta, ledger.events, plan.dpsgd_sigma, trained,
                     time.perf_counter() - t_start, stage_seconds, resumed)


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _lap(wall: dict[str, float], cpu: dict[str, float], stage: str, t0: tuple[float, float]) -> None:
    wall[stage] = time.perf_counter() - t0[0]
    cpu[stage] = time.process_time() - t0[1]


# -- stages ----------------------------------------------------------------------------------------


def _central_stage(cfg, data, rd, ledger, rng, rep) -> tuple[np.ndarray, np.ndarray]:
    """Released central images: load if already released, else charge -> query -> save. Returns the
    post-processed images (M, C, H, W) in [0, 1] and their labels."""
    from ..mechanisms.central import central_images, postprocess_central

    path = rd.released("central.npz")
    if path.exists():
        z = np.load(path)
        rep.log(f"central images: loaded {len(z['labels'])} released images (not re-queried)")
        return z["images"], z["labels"]
    if ledger.charged("central") > 0:
        raise PrivacyError(
            f"{path} is missing but the central release was already charged (the run was killed between "
            "charging and saving it); it cannot be re-queried without spending more: start a new run directory"
        )
    c = cfg.central
    ledger.charge("central", c.rounds)
    release, event = central_images(
        data.images, data.labels, data.n_classes, kind=c.kind, rounds=c.rounds, batch=c.batch, sigma=c.sigma,
        clip=c.clip, downsample=c.downsample, bins=c.bins, n_public=ledger.n, rng=rng,
    )
    _check_event(event, ledger.planned("central"))
    images, labels = postprocess_central(release, stretch=c.stretch)
    arrays = {f"raw_{k}": v for k, v in release.to_arrays().items()}
    atomic_write_bytes(path, _npz_bytes(images=images.astype(np.float32), labels=labels.astype(np.int64), **arrays))
    rep.log(f"central images: released {len(labels)} {c.kind} images ({c.rounds} round(s), sigma {c.sigma})")
    return images.astype(np.float32), labels.astype(np.int64)


def _frequency_stage(cfg, data, rd, ledger, rng, rep) -> np.ndarray:
    """Released noisy RFF embedding (features, n_classes): loaded if already released, else charged, queried
    and saved."""
    from ..mechanisms.frequency import frequency_statistics

    path = rd.released("frequency.npz")
    if path.exists():
        rep.log("frequency statistics: loaded the released statistics (not re-queried)")
        return np.load(path)["embedding"]
    if ledger.charged("frequency") > 0:
        raise PrivacyError(
            f"{path} is missing but the frequency release was already charged (killed between charging and "
            "saving); it cannot be re-queried without spending more: start a new run directory"
        )
    f = cfg.frequency
    ledger.charge("frequency", 1)
    release, event = frequency_statistics(
        data.images, data.labels, data.n_classes, features=f.features, sigma=f.sigma, bandwidth2=f.bandwidth2,
        seed=f.seed, chunk=f.chunk, n_public=ledger.n, rng=rng,
    )
    _check_event(event, ledger.planned("frequency"))
    atomic_write_bytes(path, _npz_bytes(
        embedding=release.embedding, n_public=np.int64(release.n_public), features=np.int64(release.features),
        bandwidth2=np.float64(release.bandwidth2), seed=np.int64(release.seed), sigma=np.float64(release.sigma),
    ))
    rep.log(f"frequency statistics: released a {release.embedding.shape} embedding (sigma {f.sigma})")
    return release.embedding


def mix_central(images: torch.Tensor, labels: torch.Tensor, central: tuple[np.ndarray, np.ndarray] | None,
                cfg: JobConfig, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The frequency warm-up set: aux images, plus (``[warmup] frequency_mix_central``) as many RandAugment-ed
    copies of the released central images, cycled over them. Only released images are used: post-processing."""
    if not cfg.warmup.frequency_mix_central or central is None or len(labels) == 0:
        return images, labels
    from .augment import rand_augment

    idx = np.resize(np.arange(len(central[1])), len(labels))
    src = torch.from_numpy(np.asarray(central[0], np.float32)[idx])
    w = cfg.warmup
    aug = torch.cat([rand_augment(src[i : i + 256], n_ops=w.augment_ops, magnitude_max=w.augment_magnitude,
                                  generator=generator)[0] for i in range(0, len(src), 256)])
    # both sets are in [0, 1]; the warm-up maps them to [-1, 1] itself
    return torch.cat([images, aug.to(images.dtype)]), torch.cat([labels, torch.from_numpy(central[1][idx]).long()])


def _frequency_warmup(cfg, data, rd, denoiser, embedding, rep, grid, mark, n_pub, central=None) -> None:
    """Aux generator fitted to the released embedding, its images (+ augmented central images, when
    configured), the denoiser trained on them."""
    from ..mechanisms.frequency import rff_frequencies
    from ..models.auxgen import AuxGenerator
    from ..viz import save_grid
    from .frequency import fit_aux_generator, frequency_warmup, generate_aux_images

    ck = rd.ckpt("after-frequency.pt")
    if ck.exists():
        denoiser.load_state_dict(load_torch(ck)["model"])
        rep.log("frequency warm-up: loaded from checkpoint")
        grid("after-frequency", denoiser)
        return
    c, h, w = data.image_shape
    f, a = cfg.frequency, cfg.auxgen
    gen_ck = rd.ckpt("auxgen.pt")
    if gen_ck.exists():
        aux = AuxGenerator(c, h, data.n_classes, z_dim=a.z_dim, width=a.width)
        aux.load_state_dict(load_torch(gen_ck)["model"])
        aux.to(next(denoiser.parameters()).device).eval()
    else:
        omega = rff_frequencies(c * h * w, f.features, f.bandwidth2, f.seed)
        iters = a.iterations_per_epoch if a.iterations_per_epoch is not None else max(1, n_pub // a.batch)
        with rep.task("aux generator", a.epochs * iters) as adv:
            aux = fit_aux_generator(embedding, omega, data.image_shape, data.n_classes, cfg, n_pub,
                                    generator=_gen(cfg.job.seed, "auxgen"), device=next(denoiser.parameters()).device,
                                    progress=lambda i, n, loss: adv(1, info=f"loss {loss:.3g}"))
        save_torch(gen_ck, {"model": aux.state_dict()})
    images, labels = generate_aux_images(aux, cfg.warmup.frequency_images, _gen(cfg.job.seed, "auxgen-images"))
    save_grid(images.numpy(), labels.numpy(), rd.root / "grids" / "auxgen-images.png", n_classes=data.n_classes,
              class_names=data.class_names, title="auxiliary generator images (post-processing of released statistics)")
    images, labels = mix_central(images, labels, central, cfg, _gen(cfg.job.seed, "freq-mix"))
    if cfg.warmup.frequency_epochs > 0 and len(labels) > 0:
        total = math.ceil(len(labels) / cfg.warmup.frequency_batch) * cfg.warmup.frequency_epochs
        with rep.task("frequency warm-up", total) as adv:
            res = frequency_warmup(denoiser, images, labels, cfg, generator=_gen(cfg.job.seed, "freq-warmup"),
                                   progress=lambda i, n, loss: adv(1, info=f"loss {loss:.3f}"))
        mark("frequency", final_loss=res.final_loss, steps=res.steps)
    save_torch(ck, {"model": denoiser.state_dict()})
    grid("after-frequency", denoiser)


def _dpsgd_stage(cfg, data, rd, ledger, plan, denoiser, gen, rep, every, kill_after, before_hook, state):
    from .dpsgd import DPSGDTrainer

    trainer = DPSGDTrainer(denoiser, cfg, plan.dpsgd_sigma, plan.dpsgd_q, gen,
                           image_shape=data.image_shape, n_classes=data.n_classes, n_public=plan.n_public)
    ck = rd.ckpt("dpsgd.pt")
    if ck.exists():
        trainer.load_state_dict(load_torch(ck))
    charged = ledger.charged("dpsgd")
    lost = charged - trainer.steps_done
    if lost > 0:
        rep.log(f"DP-SGD: resuming at step {trainer.steps_done}; {lost} step(s) charged after the last checkpoint "
                "are lost progress (not re-charged)")
        state["dpsgd_steps_lost"] = int(state.get("dpsgd_steps_lost", 0)) + lost
    remaining = plan.dpsgd_steps - charged
    x = torch.from_numpy(np.ascontiguousarray(data.images, dtype=np.float32)) * 2 - 1
    y = torch.from_numpy(np.asarray(data.labels, dtype=np.int64))
    done_here = 0

    def before(i: int) -> None:
        if before_hook is not None:
            before_hook(i)
        ledger.charge("dpsgd", 1)  # on disk before the step runs

    with rep.task("DP-SGD", plan.dpsgd_steps) as adv:
        adv(charged)

        def after(s) -> None:
            nonlocal done_here
            done_here += 1
            if trainer.steps_done % every == 0 or ledger.charged("dpsgd") == plan.dpsgd_steps:
                save_torch(ck, trainer.state_dict())
            adv(1, info=f"batch {s.batch_size} loss {s.loss:.3f} clipped {s.clipped_fraction:.0%}")
            if kill_after is not None and done_here >= kill_after:
                raise SimulatedKill(f"simulated kill after {done_here} DP-SGD steps")

        if remaining > 0:
            trainer.run(x, y, remaining, before_step=before, after_step=after)
    save_torch(ck, trainer.state_dict())
    return trainer.ema_model(), trainer.steps_done


# -- outputs ---------------------------------------------------------------------------------------


def _check_event(event: PrivacyEvent | None, planned: PrivacyEvent | None) -> None:
    if event is None or planned is None:
        return
    if (event.stage, event.steps) != (planned.stage, planned.steps) or not math.isclose(
        event.sigma, planned.sigma, rel_tol=1e-9
    ) or not math.isclose(event.q, planned.q, rel_tol=1e-9):
        raise PrivacyError(f"mechanism reported {event} but the plan charged {planned}: refusing to continue")


def _npz_bytes(**arrays: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def _sample_grid(model, cfg, data, path: Path, per_class: int, title: str | None = None) -> None:
    from ..models.sampler import generate
    from ..viz import save_grid

    images, labels = generate(model, per_class, _seed_from(cfg.job.seed, "grid"), cfg.sampler)
    save_grid(images.numpy(), labels.numpy(), path, per_class=per_class, n_classes=data.n_classes,
              class_names=data.class_names, title=title)


def _grid_title(what: str, ledger: RunLedger) -> str:
    """The grid's title: what it shows and the ε charged so far (the model has seen nothing more)."""
    from ..viz import epsilon_title

    p = ledger.cfg.privacy
    spent = epsilon(ledger.events, p.delta, p.accountant) if ledger.events else None
    label = what if what.startswith("released") else f"samples {what.replace('-', ' ')}"
    return epsilon_title(label, spent, p.delta)


def _write_synthetic(model, cfg, data, path: Path, n: int, rep: Reporter) -> None:
    from ..models.sampler import generate

    k = data.n_classes
    # Balanced: class c gets ceil or floor of n/k; interleave so a prefix is balanced too.
    labels = np.tile(np.arange(k, dtype=np.int64), math.ceil(n / k))[:n]
    out = []
    with rep.task("synthesis", n) as adv:
        for start in range(0, n, 256):
            part = labels[start:start + 256]
            imgs, _ = generate(model, part, _seed_from(cfg.job.seed, "synthetic", start), cfg.sampler)
            out.append(imgs.numpy().astype(np.float32))
            adv(len(part))
    images = np.concatenate(out) if out else np.zeros((0, *data.image_shape), np.float32)
    atomic_write_bytes(path, _npz_bytes(images=images, labels=labels, class_names=np.array(data.class_names)))


def _budget_chart(doc: dict[str, Any], path: Path) -> None:
    from .. import viz

    per = doc.get("per_stage_epsilon", {})
    if hasattr(viz, "save_budget_chart") and per:
        viz.save_budget_chart(per, path, target=doc["target_epsilon"], delta=doc["delta"])
