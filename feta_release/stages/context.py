"""What the stages of a run share: the typed context a driver builds and every stage reads and fills.

Randomness (one seeding rule): the public ``[job] seed`` drives model init, warm-up training and
synthesis (:meth:`RunContext.public_gen`); everything that touches private data (mechanism noise, Poisson
sampling, DP-SGD noise) draws from the run's secret (256 OS bits kept in ``checkpoints/noise_seed.txt``, so
a resumed run continues the same streams; a public seed would let anyone subtract the noise).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import JobConfig
from ..data import ImageDataset
from ..files import atomic_write_bytes, atomic_write_json, private_dir
from ..models.auxgen import AuxModel
from ..models.edm import EDMDenoiser, build_denoiser
from ..planning import PrivacyPlan
from ..privacy_unit import PatientIndex
from ..randomness import numpy_generator_from, torch_generator_from
from ..training.checkpoint import load_torch_bytes, torch_bytes
from ..training.progress import Reporter
from .account import RunAccount


def seed_from(*parts: Any) -> int:
    h = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def private_key(secret: int, stage: str) -> bytes:
    """The key of ``stage``'s private stream, from the run's secret (one stream per stage)."""
    return hashlib.sha256(f"{secret}/{stage}".encode()).digest()


def public_generator(cfg: JobConfig, name: str) -> torch.Generator:
    """PUBLIC randomness of one named use (model init, warm-ups, sampling), from ``[job] seed``: the one
    seeding rule of both drivers, so the coordinator's warm-up draws what a single-site run draws."""
    return torch.Generator().manual_seed(seed_from(cfg.job.seed, name))


def initial_denoiser(cfg: JobConfig, image_shape: tuple[int, int, int], n_classes: int) -> EDMDenoiser:
    """The denoiser before any stage (its weights from the public seed), in both drivers."""
    torch.manual_seed(seed_from(cfg.job.seed, "init"))
    return build_denoiser(cfg.model, image_shape, n_classes)


def save_checkpoint(ctx: Any, name: str, obj: Any) -> None:
    """``checkpoints/NAME``, its bytes' sha256 bound in the run's signed ledger FIRST (``ctx.account``): the
    run dir is writable by local users, so a resume loads only bytes this run wrote
    (:func:`load_checkpoint`)."""
    data = torch_bytes(obj)
    ctx.account.bind_checkpoint(name, data)
    private_dir(ctx.rd.ckpt(name).parent)
    atomic_write_bytes(ctx.rd.ckpt(name), data, private=True)


def load_checkpoint(ctx: Any, name: str) -> Any | None:
    """A checkpoint :func:`save_checkpoint` wrote (None: there is none), refused before unpickling unless its
    bytes hash to the ledger's record (``RunAccount.saved_checkpoint``)."""
    path = ctx.rd.ckpt(name)
    if not path.exists():
        return None
    return load_torch_bytes(ctx.account.saved_checkpoint(path))


def resume_denoiser(ctx: Any, stage: str, what: str) -> bool:
    """True when a warm-up stage already ran: its checkpoint ``after-STAGE.pt`` (:func:`save_denoiser`) is
    loaded into ``ctx.denoiser`` in place of running it again."""
    saved = load_checkpoint(ctx, f"after-{stage}.pt")
    if saved is None:
        return False
    ctx.denoiser.load_state_dict(saved["model"])
    ctx.rep.log(f"{what}: loaded from checkpoint")
    return True


def save_denoiser(ctx: Any, stage: str) -> None:
    """The denoiser after a warm-up stage, for :func:`resume_denoiser`."""
    save_checkpoint(ctx, f"after-{stage}.pt", {"model": ctx.denoiser.state_dict()})


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


@dataclass
class RunContext:
    """One run's inputs (fixed) and the stages' products (filled in stage order)."""

    cfg: JobConfig
    data: ImageDataset
    rd: RunDir
    account: RunAccount
    plan: PrivacyPlan
    state: dict[str, Any]  # run.json
    secret: int
    rep: Reporter
    denoiser: EDMDenoiser
    n_public: int
    checkpoint_every: int = 10
    grid_per_class: int = 8
    n_synthetic: int | None = None
    kill_after_steps: int | None = None  # test hook: SimulatedKill after that many DP-SGD steps
    # patient-level DP-SGD (private ids, public count and cap); None: images
    patients: PatientIndex | None = None
    # stages.pretrain.PublicInputs: the public set / pretrained model ([public]); None: none
    public: Any = None
    # products of the stages
    # released central images (post-processed) and labels
    central: tuple[np.ndarray, np.ndarray] | None = None
    embedding: np.ndarray | None = None  # released frequency statistics
    # the aux generator fitted to them (post-processing; see freq_warmup.trained_aux)
    aux: AuxModel | None = None
    final_model: EDMDenoiser | None = None  # EMA model after DP-SGD (else the warmed-up denoiser)
    # sha256 of the aux pool's bytes as Synthesis wrote them: the ledger is closed with THIS, never a re-read
    # of the file (a local user could swap the file between the write and the close)
    aux_pool_sha256: str | None = None
    dpsgd_trained: int = 0
    grid_index: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    stage_cpu: dict[str, float] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return next(self.denoiser.parameters()).device

    def public_gen(self, name: str) -> torch.Generator:
        """PUBLIC randomness (model init, post-processing of released values, sampling)."""
        return public_generator(self.cfg, name)

    def _private_key(self, stage: str) -> bytes:
        return private_key(self.secret, stage)

    def private_rng(self, stage: str) -> np.random.Generator:
        return numpy_generator_from(self._private_key(stage))

    def private_gen(self, stage: str) -> torch.Generator:
        return torch_generator_from(self._private_key(stage))

    def mark(self, stage: str, **info: Any) -> None:
        self.state["stages"][stage] = {"done": True, **info}
        atomic_write_json(self.rd.run_json, self.state)

    def next_grid(self, stage: str) -> Path:
        self.grid_index += 1
        return self.rd.grid(self.grid_index, stage)

    def lap(self, stage: str, t0: tuple[float, float]) -> None:
        self.stage_seconds[stage] = time.perf_counter() - t0[0]
        self.stage_cpu[stage] = time.process_time() - t0[1]
