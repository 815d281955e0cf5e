"""The computations a site runs on its own images (all noise added here), wrapped for the handlers.

The privacy event of each release is known BEFORE it runs (``feta_release.planning``), so
the ledger can refuse first; after it runs, the event the mechanism reports must equal the planned
one, or nothing leaves the site.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from feta_release.accounting import PrivacyEvent
from feta_release.config import JobConfig
from feta_release.errors import PrivacyError
from feta_release.federation.messages import round_public, split_ema, with_ema
from feta_release.mechanisms import secure_sums as ss
from feta_release.mechanisms.central import central_images
from feta_release.mechanisms.frequency import frequency_statistics
from feta_release.mechanisms.selection import check_centroids, selection_histogram
from feta_release.models import build_denoiser
from feta_release.models.lora import merge_lora
from feta_release.planning import selection_events, stage_event, warmup_events
from feta_release.privacy_unit import PatientIndex
from feta_release.signing import sha256_hex
from feta_release.stages.context import public_generator
from feta_release.training.checkpoint import atomic_write_bytes, load_torch_bytes, torch_bytes
from feta_release.training.dpsgd import DPSGDTrainer, StepStats, released_mix
from feta_release.training.padding import model_range_rows, public_rows, site_step_rows


def _planned(cfg: JobConfig, n_public: int, stage: str, what: str) -> PrivacyEvent:
    """The planner's event of a warm-up release (``feta_release.planning``), or a refusal when the job has
    none."""
    ev = stage_event(warmup_events(cfg, n_public), stage)
    if ev is None:
        raise PrivacyError(f"the job disables {what}; nothing to release")
    return ev


def _same(planned: list[PrivacyEvent], reported: list[PrivacyEvent], what: str) -> None:
    key = lambda e: (e.stage, round(e.sigma, 9), round(e.q, 12), e.steps)  # noqa: E731
    if sorted(map(key, planned)) != sorted(map(key, reported)):
        raise PrivacyError(
            f"{what}: the mechanism reported events {reported} but {planned} were checked "
            "against the policy; nothing released"
        )


def release_central(
    ds: Any,
    cfg: JobConfig,
    n_public: int,
    rng: np.random.Generator,
    prototypes: np.ndarray | None = None,
) -> tuple[dict[str, np.ndarray], list[PrivacyEvent]]:
    """Central images at Poisson rate q = batch / ``n_public`` (the policy's public size, not ``ds.n``);
    ``rng``: the request's fresh OS-seeded generator (``edge.protocol.ReleaseRng``). ``prototypes``: with
    ``[central] cell_rule = "aux"``, the public cell prototypes the coordinator sent (k-means centres of its
    aux generator's images, fitted to the released frequency statistics: post-processing), checked by the
    handler before the charge; each image's cell is then its nearest prototype of its class (a function of
    that image alone: the sensitivity stays C)."""
    c = cfg.central
    if (c.cell_rule == "aux") != (prototypes is not None):
        raise PrivacyError(
            f"central images: [central] cell_rule = {c.cell_rule!r} "
            + (
                "needs the coordinator's public cell prototypes"
                if prototypes is None
                else "takes no prototypes"
            )
            + "; nothing released"
        )
    planned = _planned(cfg, n_public, "central", "central images ([central] rounds = 0)")
    release, event = central_images(
        ds.images,
        ds.labels,
        ds.n_classes,
        kind=c.kind,
        rounds=c.rounds,
        batch=c.batch,
        sigma=c.sigma,
        clip=c.clip,
        downsample=c.downsample,
        bins=c.bins,
        n_public=n_public,
        rng=rng,
        cells=c.cells,
        prototypes=prototypes,
    )  # cells: from the signed job; event unchanged (one cell
    # per image, a function of that image alone: sensitivity C, mechanisms.central)
    _same([planned], [event], "central images")
    return {k: np.asarray(v) for k, v in release.to_arrays().items()}, [planned]


def release_frequency(
    ds: Any, cfg: JobConfig, n_public: int, rng: np.random.Generator
) -> tuple[dict[str, np.ndarray], list[PrivacyEvent]]:
    """The RFF mean embedding over the PUBLIC denominator ``n_public`` (sensitivity 1 / n_public). The random
    features come from the job's public ``[frequency] seed``; the noise only from ``rng``."""
    planned = _planned(cfg, n_public, "frequency", "the frequency release ([frequency] sigma unset)")
    f = cfg.frequency
    assert f.sigma is not None
    release, event = frequency_statistics(
        ds.images,
        ds.labels,
        ds.n_classes,
        features=f.features,
        sigma=f.sigma,
        bandwidth2=f.bandwidth2,
        seed=f.seed,
        chunk=f.chunk,
        n_public=n_public,
        rng=rng,
        patch=f.patch,
        stride=f.stride,
    )
    _same([planned], [event], "frequency statistics")
    return {k: np.asarray(v) for k, v in release.to_arrays().items()}, [planned]


def release_selection(
    ds: Any, cfg: JobConfig, centroids: np.ndarray, rng: np.random.Generator
) -> tuple[dict[str, np.ndarray], list[PrivacyEvent]]:
    """The semantic selection histogram (``mechanisms.selection``): each image votes for its nearest of the
    coordinator's ``centroids`` (means of PUBLIC thumbnails), N(0, sigma^2) per group; sensitivity 1 image
    whatever the centroids. Only the noisy histogram leaves."""
    planned = stage_event(selection_events(cfg), "selection")
    if planned is None:
        raise PrivacyError(
            "the job asks no semantic selection ([public] selection = false); nothing to release"
        )
    c = check_centroids(centroids, cfg.public.selection_groups, tuple(ds.image_shape))
    noisy, event = selection_histogram(ds.images, c, cfg.public.selection_sigma, rng)
    _same([planned], [event], "semantic selection")
    return {"histogram": noisy}, [planned]


def selection_share(
    ds: Any, cfg: JobConfig, centroids: np.ndarray, n_sites: int, rng: np.random.Generator
) -> np.ndarray:
    """A secure-aggregation job's semantic selection at this site (``mechanisms.secure_sums``): 2^10 x the
    vote counts over the coordinator's ``centroids`` plus this site's Skellam noise share, not yet reduced or
    masked (``edge.secure.masked_contribution`` does both). Only the masked vector leaves."""
    if not cfg.public.selection:
        raise PrivacyError(
            "the job asks no semantic selection ([public] selection = false); nothing to release"
        )
    c = check_centroids(centroids, cfg.public.selection_groups, tuple(ds.image_shape))
    return ss.selection_contribution(ds.images, c, sigma=cfg.public.selection_sigma, n_sites=n_sites, rng=rng)


def _refuse_non_finite(weights: dict[str, np.ndarray]) -> None:
    """Refuse NaN/inf in the coordinator's weights, in the float32 the model loads them as: a
    non-finite weight turns the local update into NaN or not depending on which images were sampled, a channel
    the DP noise does not cover."""
    bad = {}
    for k, v in weights.items():
        a = np.asarray(v)
        if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
            raise PrivacyError(f"global weights: tensor {k} has dtype {a.dtype}, not numbers; refused")
        # checked as the float32 model will hold them: 1e300 in float64 is inf there
        with np.errstate(over="ignore"):
            as_loaded = a.astype(np.float32)
        if n := int(a.size - np.count_nonzero(np.isfinite(as_loaded))):
            bad[k] = n
    if bad:
        first = sorted(bad)[0]
        raise PrivacyError(
            f"global weights from the coordinator hold {sum(bad.values())} NaN/infinite value(s) in "
            f"{len(bad)} tensor(s) (e.g. {first}); refused: only finite weights are trained on"
        )


def check_weights(cfg: JobConfig, image_shape: Any, n_classes: int, weights: dict[str, np.ndarray]) -> None:
    """Refuse global weights that do not fit the job's model (names, shapes) or are not finite numbers.

    Public input only (the coordinator's weights and the job): the node runs it before charging."""
    _fits(build_denoiser(cfg.model, image_shape, n_classes).state_dict(), weights)


def check_round(cfg: JobConfig, image_shape: Any, n_classes: int, arrays: dict[str, np.ndarray]) -> None:
    """:func:`check_weights` for a per-site round's message: its weights, and its EMA of the global model when
    it carries one (``federation.messages.with_ema``), each must fit the job's model and be finite; its public
    input (the central images of ``[dpsgd] public_batch``) must be there exactly when the job mixes them, and
    be images of the declared shape in [0, 1] with labels among the declared classes."""
    weights, ema = split_ema(arrays)
    own = build_denoiser(cfg.model, image_shape, n_classes).state_dict()
    _fits(own, weights)
    if ema:
        _fits(own, ema)
    public = round_public(arrays)
    if (public is not None) != (cfg.dpsgd.public_batch > 0):
        raise PrivacyError(
            f"round refused: the job's [dpsgd] public_batch is {cfg.dpsgd.public_batch}, but the round "
            f"{'carries' if public is not None else 'carries no'} central images to mix"
        )
    if public is not None:
        _check_public(public, tuple(image_shape), n_classes)


def _check_public(
    public: tuple[np.ndarray, np.ndarray], image_shape: tuple[int, ...], n_classes: int
) -> None:
    """Public input, refused before the charge unless it is what the job's step mixes: a few images in [0,
    1]."""
    images, labels = np.asarray(public[0]), np.asarray(public[1])
    shape_ok = (
        images.ndim == 4 and tuple(images.shape[1:]) == image_shape and labels.shape == images.shape[:1]
    )
    if not shape_ok or len(labels) == 0 or images.dtype.kind != "f" or labels.dtype.kind not in "iu":
        raise PrivacyError(
            f"round refused: its central images are {images.dtype} {images.shape} with labels "
            f"{labels.dtype} {labels.shape}, not float images (M, {', '.join(map(str, image_shape))}) "
            "and M integer labels"
        )
    with np.errstate(invalid="ignore"):
        in_range = bool(np.all((images >= 0) & (images <= 1)))  # NaN compares false: refused too
    if not in_range or not bool(np.all((labels >= 0) & (labels < n_classes))):
        raise PrivacyError(
            f"round refused: its central images must lie in [0, 1] and their labels in [0, {n_classes})"
        )


def _fits(own: dict[str, Any], weights: dict[str, np.ndarray]) -> None:
    if set(weights) != set(own):
        raise PrivacyError(
            "global weights do not match the job's [model]: "
            f"{len(set(weights) ^ set(own))} parameter name(s) differ"
        )
    bad = [k for k, v in own.items() if tuple(v.shape) != tuple(np.shape(weights[k]))]
    if bad:
        raise PrivacyError(
            f"global weights do not fit this site's model for the job's [model] ({len(bad)} tensor(s) "
            f"differ in shape, e.g. {bad[0]}): the coordinator and this site run different "
            "feta-release versions"
        )
    _refuse_non_finite(weights)


def dpsgd_round(
    ds: Any,
    cfg: JobConfig,
    weights: dict[str, np.ndarray],
    event: PrivacyEvent,
    generator: torch.Generator,
    n_public: int,
    patients: PatientIndex | None = None,
    device: torch.device | str = "cpu",
    first_step: int = 0,
    checkpoint: RoundCheckpoint | None = None,
) -> dict[str, np.ndarray]:
    """``local_steps`` DP-SGD steps (Poisson sampling at rate q on the site's data) from the global weights.
    The noisy sum is divided by the public expected batch q * ``n_public``, never by anything of ``ds.n``.
    ``patients`` (a patient-level site, events of unit "patient"): whole patients are Poisson-sampled, each
    patient's summed gradient is clipped, and the divisor is q x the policy's PUBLIC patient count.

    The EMA is per step (docs/architecture.md): the trainer's EMA starts from the message's EMA of the global
    model (the weights when it carries none), its warm-up counted from ``first_step`` (the job's steps before
    this round: round x ``local_steps``, public), and is returned beside the weights (``ema:<name>``). It is a
    function of the round's iterates, all covered by the round's composition of ``event.steps`` steps: no
    further cost. With ``[dpsgd] public_batch`` the message's central images (public input) are mixed into
    every step (``PublicMix``, from the job's public seed).

    Only the weights and their EMA are returned: the trainer's per-step statistics (loss, realised batch size,
    clipped fraction, seconds) are un-noised functions of the private batch and never leave the site.
    ``device`` (``node start --device``): where the model computes; the sampling and the noise are drawn from
    the CPU ``generator`` on any device, and the weights returned are CPU arrays. ``checkpoint``: where the
    round's trainer state is kept every ``checkpoint.every`` steps; a round killed after one goes on from
    it."""
    if (event.unit == "patient") != (patients is not None):
        raise PrivacyError(
            f"DP-SGD round planned with unit {event.unit!r} but this site "
            f"{'has' if patients is not None else 'has no'} patient index; nothing released"
        )
    public = round_public(weights)
    weights, ema = split_ema(weights)
    model = build_denoiser(cfg.model, ds.image_shape, ds.n_classes)
    _fits(model.state_dict(), weights)
    if ema:
        _fits(model.state_dict(), ema)
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in weights.items()})
    model.to(device)  # only the arithmetic moves (the trainer moves each batch to the model's device)
    trainer = _round_trainer(
        ds,
        cfg,
        model,
        event,
        generator,
        n_public,
        patients,
        released_mix(cfg, public, public_generator(cfg, _mix_stream(first_step))),
    )
    _continue_ema(trainer, ema or weights, first_step)
    saved = checkpoint.load() if checkpoint is not None else None
    # the killed round's model, EMA, Adam and noise stream: the rest is the same computation
    if saved is not None:
        trainer.load_state_dict(saved)
    # converted per indexed batch: each step's padded work, no copy of the site
    images = model_range_rows(ds.images)
    labels = torch.from_numpy(np.asarray(ds.labels, dtype=np.int64))
    trainer.run(images, labels, event.steps - trainer.steps_done, after_step=_saver(trainer, checkpoint))
    if checkpoint is not None:  # a kill from here on restarts the round (nothing of it has left the site yet)
        checkpoint.clear()
    # trainable = "lora": the round's adapters folded in, of the weights and of their EMA alike (each EMA
    # copy merged from its own averaged adapters: post-processing of the round's iterates); the plain model's
    # tensors leave, whatever was trained
    ema_model = merge_lora(trainer.ema_model())
    merge_lora(model)
    out = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    return with_ema(out, {k: v.detach().cpu().numpy() for k, v in ema_model.state_dict().items()})


def _round_trainer(
    ds: Any,
    cfg: JobConfig,
    model: torch.nn.Module,
    event: PrivacyEvent,
    generator: torch.Generator,
    n_public: int,
    patients: PatientIndex | None,
    public: Any,
) -> DPSGDTrainer:
    unit = {"n_public": n_public} if patients is None else patients.trainer_kwargs()
    # drawn from (grouped at open, not here)
    units = len(ds.images) if patients is None else patients.n_patients
    return DPSGDTrainer(
        model,
        cfg,
        event.sigma,
        event.q,
        generator,
        image_shape=ds.image_shape,
        n_classes=ds.n_classes,
        **unit,
        # public work (a site above its size: its bucket); the job rules' cost model charges the same count
        pad_to=site_step_rows(len(ds.images), n_public, event.q, cfg.dpsgd.physical_batch, patients),
        draw_rows=public_rows(units, unit["n_public"]),  # the Poisson draw's size: public too (L3)
        public=public,
    )


@dataclass(frozen=True)
class RoundCheckpoint:
    """A DP-SGD round's trainer state (model, EMA, Adam, its noise generator, steps done), every ``every``
    steps (0: never), in the node's owner-only work directory, so that a round whose process was killed is
    finished from it (``edge.protocol.release(resume=True)``). Its bytes' sha256 is bound in the site's signed
    ledger BEFORE they are written, and a resumed round loads only bytes the ledger names: a file swapped into
    the work directory would otherwise steer the released weights (or hold a known noise stream)."""

    ledger: Any
    job_id: str
    path: Path
    every: int

    def load(self) -> dict[str, Any] | None:
        if not self.path.is_file():
            return None
        data = self.path.read_bytes()
        if sha256_hex(data) not in self.ledger.checkpoint_hashes(self.job_id, self.path.name):
            raise PrivacyError(
                f"{self.path}: not a round checkpoint this site wrote (its sha256 is not in the "
                "ledger); nothing released"
            )
        return dict(load_torch_bytes(data, weights_only=True))

    def save(self, state: dict[str, Any]) -> None:
        data = torch_bytes(state)
        self.ledger.record_checkpoint(self.job_id, self.path.name, sha256_hex(data))
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write_bytes(self.path, data, private=True)

    def clear(self) -> None:
        """The round is done: its state (a noise stream of the round among it) is not kept beyond it."""
        self.path.unlink(missing_ok=True)


def round_checkpoint(
    ledger: Any, work_dir: Path, job_id: str, request_id: str, every: int
) -> RoundCheckpoint:
    """The checkpoint of request ``request_id``'s round (one file per request, named by its hash)."""
    name = f"round-{hashlib.sha256(request_id.encode()).hexdigest()[:24]}.pt"
    return RoundCheckpoint(ledger, job_id, work_dir / "rounds" / name, int(every))


def _saver(trainer: DPSGDTrainer, checkpoint: RoundCheckpoint | None) -> Any:
    if checkpoint is None or checkpoint.every < 1:
        return None

    def after(_: StepStats) -> None:
        if trainer.steps_done % checkpoint.every == 0:
            checkpoint.save(trainer.state_dict())

    return after


def _mix_stream(first_step: int) -> str:
    """The PUBLIC stream the round's mix is drawn from: ``train``'s own for the first round, one per round
    after."""
    return "dpsgd-public" if first_step == 0 else f"dpsgd-public/{first_step}"


def _continue_ema(trainer: DPSGDTrainer, ema: dict[str, np.ndarray], first_step: int) -> None:
    """The trainer's EMA continues the global one: its shadow the coordinator's, ``first_step`` updates
    done."""
    # the plain model's EMA; adapters (trainable = "lora") start at the trainer's own (zero-delta) values
    shadow = {k: v.clone() for k, v in trainer.ema.shadow.items()}
    shadow.update({k: torch.from_numpy(np.array(v)) for k, v in ema.items()})
    trainer.ema.load_state_dict(
        {"decay": trainer.ema.decay, "warmup": True, "num_updates": int(first_step), "shadow": shadow}
    )
