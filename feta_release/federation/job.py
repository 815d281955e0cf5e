"""The whole federated FETA-Pro job on a Grid: what the coordinator's ServerApp runs."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..accounting import site_epsilon_words
from ..data.loading import LoadOptions
from ..data.public import read_public
from ..errors import ConfigError, DataError
from ..files import atomic_write_bytes, atomic_write_json
from ..models import denoiser_spec
from ..models.auxgen import AuxModel
from ..models.model_file import MODEL_FILE, write_model_file
from ..release.jobfiles import RELEASED_AUX, RELEASED_CENTRAL, job_summary, write_job_files
from ..stages.context import initial_denoiser
from ..stages.freq_warmup import aux_pool
from ..stages.pretrain import (
    PRETRAINED_FILE,
    PublicInputs,
    public_start,
    selected,
    selection_groups,
    with_public,
)
from ..stages.prototypes import cell_prototypes
from ..training.checkpoint import npz_bytes
from ..training.device import resolve_device
from ..training.warmup_loop import Progress as StepProgress
from . import checkpoint_io
from .anchors import AnchorStore
from .driver import JobDriver, JobResult, Progress, global_ema
from .warmup import Observer, fitted_aux, pooled_central, warm_up

# ``coordinator run --device``, for the ServerApp: the SuperLink starts that process with the FAB's run config
# only, and a new run-config key would change the FAB's hash that every site's signed policy lists
# (app_bundles)
DEVICE_FILE = "coordinator_device.json"
# ``coordinator run --public/--pretrained``, for the ServerApp likewise: where the public inputs are and how
# they are read. Only the coordinator reads them; the signed job's [public] names them by hash (checked before
# any release).
PUBLIC_FILE = "coordinator_public.json"


def save_device(out_dir: str | Path, device: str) -> None:
    """Where the ServerApp of the job in ``out_dir`` computes (written by ``coordinator run`` before each
    submit, so a resume with another ``--device`` uses that one). Not part of the signed job: it changes no
    release."""
    atomic_write_json(Path(out_dir) / DEVICE_FILE, {"device": device})


def saved_device(out_dir: str | Path) -> str:
    """The device :func:`save_device` left in ``out_dir``; ``cpu`` when there is none (a run submitted
    otherwise). An unreadable file is a ConfigError naming it (``run_job`` logs it as the job's ``error``
    event)."""
    p = Path(out_dir) / DEVICE_FILE
    if not p.is_file():
        return "cpu"
    try:
        doc = json.loads(p.read_text("utf-8"))
        return str(doc["device"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{p}: not a device file written by `coordinator run` ({type(exc).__name__}); delete it "
            "and run `coordinator run --device ...` again"
        ) from None


def save_public(
    out_dir: str | Path, path: str | None, description: str, pretrained: Path | None, load: LoadOptions
) -> None:
    """Where the ServerApp of the job in ``out_dir`` finds its public inputs (written by ``coordinator run``
    before each submit; removed when none is given, so a stale file never stands in for a missing option)."""
    file = Path(out_dir) / PUBLIC_FILE
    if path is None and pretrained is None:
        file.unlink(missing_ok=True)
        return
    atomic_write_json(
        file,
        {
            "path": None if path is None else str(Path(path).resolve()),
            "description": description,
            "pretrained": None if pretrained is None else str(Path(pretrained).resolve()),
            "load": {k: v for k, v in load.kwargs().items() if k != "patient_cap"},
        },
    )


def public_inputs(
    path: str | None, description: str, pretrained: Path | None, load: LoadOptions
) -> PublicInputs | None:
    """``--public PATH`` / ``--pretrained FILE`` of a coordinator as ``PublicInputs``, the set read by the
    private data's loader and checks (``data.public.read_public``) at the job's [job] resize, image_size and
    window."""
    if path is None and pretrained is None:
        if description:
            raise ConfigError("--public-description describes a --public set: give --public PATH too")
        return None
    data = read_public(path, load, load.image_size) if path is not None else None
    return PublicInputs(data, description, pretrained)


def saved_public(out_dir: str | Path) -> PublicInputs | None:
    """The public inputs :func:`save_public` left in ``out_dir`` (None: none)."""
    p = Path(out_dir) / PUBLIC_FILE
    if not p.is_file():
        return None
    try:
        doc = json.loads(p.read_text("utf-8"))
        load = LoadOptions(**doc["load"])
        pretrained = Path(doc["pretrained"]) if doc["pretrained"] else None
        return public_inputs(doc["path"], str(doc["description"]), pretrained, load)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{p}: not a public-inputs file written by `coordinator run` "
            f"({type(exc).__name__}); delete it and run `coordinator run --public ...` again"
        ) from None


def run_job(
    grid: Any,
    signed_job: dict[str, Any],
    out_dir: str | Path,
    *,
    coordinator_key: Any = None,
    progress: Progress | None = None,
    wait_timeout: float = 300.0,
    poll_interval: float = 1.0,
    device: str | None = None,
    anchors: str | Path | None = None,
    public: PublicInputs | None = None,
    observe: Observer | None = None,
) -> JobResult:
    """Run (or resume, with the same ``out_dir``) the signed job; failures are logged as an ``error`` event.

    ``device``: ``auto``/``cpu``/``cuda`` (``feta_release.training.device``): where the coordinator's warm-up,
    its FedAvg / FedSGD steps and its EMA run; the weights sent to the sites and everything written are CPU
    values. None (the ServerApp): the one ``coordinator run`` saved in ``out_dir`` (:func:`saved_device`),
    read here so that a bad file too ends as the job's ``error`` event. ``anchors``: the coordinator's
    ``ledger-anchors.json`` (``federation.anchors``): a site whose ledger does not extend its last attested
    one is refused at its hello. ``public``: the public set / pretrained file the signed job's ``[public]``
    names (``stages.pretrain``): only the coordinator reads it; the sites get the job (hashes only) and, in
    DP-SGD rounds, the weights trained from it. None: the ones ``coordinator run --public`` left in
    ``out_dir`` (:func:`saved_public`), if any. ``observe``: called at each stage boundary with the stage's
    name and the released central images or the model after it (``train``'s sample grids)."""
    d = JobDriver(
        grid,
        signed_job,
        out_dir,
        coordinator_key=coordinator_key,
        progress=progress,
        wait_timeout=wait_timeout,
        poll_interval=poll_interval,
        anchors=AnchorStore(anchors) if anchors is not None else None,
    )
    try:
        # resolved again in the ServerApp's own process (`coordinator run` resolved it first): a GPU it cannot
        # see is then an `error` event in progress.jsonl, which `coordinator run` prints, before any site is
        # asked
        dev = resolve_device(saved_device(out_dir) if device is None else device)
        d.observe = observe or (lambda stage, what: None)
        return _run(d, signed_job, dev, public if public is not None else saved_public(out_dir))
    except Exception as exc:
        d.emit("error", f"{type(exc).__name__}: {exc}")
        raise


def _run(
    d: JobDriver, signed_job: dict[str, Any], device: torch.device, public: PublicInputs | None
) -> JobResult:
    t_all = time.monotonic()
    cfg = d.cfg
    d.emit("start", f"job {d.job.job_id}: sites {', '.join(d.job.sites)}")
    d.wait_for_sites()
    _check_public(d, public)  # before any release: a job pretrained on other data than it names never starts
    # Refuse BEFORE any release if the job cannot fit every site's policy.
    d.plan_sites()
    public = _select_public(d, public)
    central, freq, aux = _releases(d, device)
    _save_central(d, central)
    model = _warm_model(d, central, freq, device, public, aux)
    ema = global_ema(model, cfg)
    rounds_done = d.rounds(model, ema)
    atts = d.attestations()
    if rounds_done:
        ema.copy_to(model)  # the released weights are the EMA of the global model
        d.observe("after-dpsgd", model)
    info = next(iter(d.sites.values()))
    write_model_file(
        d.out / MODEL_FILE,
        spec=denoiser_spec(cfg.model, info.image_shape, info.n_classes),
        state_dict=model.state_dict(),
        class_names=info.class_names,
    )
    summary = job_summary(
        d.job.job_id,
        list(d.sites),
        info.class_names,
        list(info.image_shape),
        rounds_done,
        {str(k): v for k, v in d.skipped.items()},
        atts,
        {**d.timings, "total": time.monotonic() - t_all},
    )
    write_job_files(
        d.out,
        signed_job=signed_job,
        summary=summary,
        attestations=atts,
        signed_policies={sid: s.signed_policy for sid, s in d.sites.items()},
    )
    d.emit(
        "done",
        f"job {d.job.job_id} finished: "
        + ", ".join(
            site_epsilon_words(sid, e, summary["site_unit"][sid])
            for sid, e in summary["site_epsilon"].items()
        ),
        timings=summary["timings"],
    )
    return JobResult(d.out, sorted(d.sites), rounds_done, d.skipped, summary["timings"], atts)


def _releases(d: JobDriver, device: torch.device) -> tuple[dict[str, Any], dict[str, Any], AuxModel | None]:
    """(central, frequency releases of the sites, the aux generator when fitted already). With ``[central]
    cell_rule = "aux"`` the frequency releases come first: the aux generator fitted to them gives the public
    cell prototypes (``stages.prototypes.cell_prototypes``) sent with the central request."""
    if d.cfg.central.cell_rule != "aux" or d.cfg.central.rounds <= 0:
        central = d.collect_central()
        return central, d.collect_frequency(), None
    freq = d.collect_frequency()
    info = next(iter(d.sites.values()))
    sizes = {sid: s.size for sid, s in d.sites.items()}
    aux = fitted_aux(freq, sizes, d.cfg, info.image_shape, info.n_classes, device, d.sink("central"))
    return d.collect_central(cell_prototypes(aux, d.cfg, d.sink("central"))), freq, aux


def _select_public(d: JobDriver, public: PublicInputs | None) -> PublicInputs | None:
    """``[public] selection``: the sites' summed noisy histogram over the public groups (k-means of the public
    set, the same as ``train``'s: ``stages.pretrain.selection_groups``) cuts the public set before
    pretraining. Only the centroids go to the sites; what is kept is post-processing of the released
    histograms."""
    if public is None or not d.cfg.public.selection:
        return public
    centroids, groups = selection_groups(public, d.cfg)
    histogram = d.collect_selection(centroids)
    assert histogram is not None
    out = selected(public, d.cfg, histogram, groups)
    atomic_write_json(
        d.out / "selection.json",
        {
            "histogram": [float(v) for v in histogram],
            "kept": int(out.data.n if out.data else 0),
            "of": int(public.data.n if public.data else 0),
        },
    )
    d.emit(
        "selection",
        f"semantic selection: pretraining on {out.data.n if out.data else 0} of "
        f"{public.data.n if public.data else 0} public images",
    )
    return out


def _save_central(d: JobDriver, central: dict[str, Any]) -> None:
    """The combined central images the warm-up uses, kept in the job directory: the release ships them for
    SDEdit (``[sampler] start_sigma``) and, with ``[dpsgd] public_batch``, every per-site round carries them
    (post-processing of the sites' releases)."""
    if central:
        images, labels = pooled_central(central, {sid: s.size for sid, s in d.sites.items()}, d.cfg)
        d.public_central = (images, labels)  # the rounds' public input with [dpsgd] public_batch
        d.observe("central-images", (images, labels))
        # bound to the job: build_release refuses a file of another job (a stale one in a reused --out)
        atomic_write_bytes(
            d.out / RELEASED_CENTRAL, npz_bytes(images=images, labels=labels, job_id=np.array(d.job.job_id))
        )


def _save_aux_pool(d: JobDriver, aux: AuxModel | None) -> None:
    """``[sampler] start_source`` aux/mix: the pool of the aux generator's images the release ships (the same
    public draw as a ``train`` run's, ``stages.freq_warmup.aux_pool``), bound to the job like the central
    images. Privacy: the generator was fitted to the sites' combined NOISED frequency releases:
    post-processing."""
    if not d.cfg.sampler.uses_aux:
        return
    if aux is None:
        raise DataError(
            f"job {d.job.job_id}: [sampler] start_source = {d.cfg.sampler.start_source!r} but no site "
            'sent a frequency release to fit the aux generator to; set start_source = "central"'
        )
    images, labels = aux_pool(aux, d.cfg)
    atomic_write_bytes(
        d.out / RELEASED_AUX, npz_bytes(images=images, labels=labels, job_id=np.array(d.job.job_id))
    )


def _check_public(d: JobDriver, public: PublicInputs | None) -> None:
    """The public inputs are exactly what the SIGNED job's ``[public]`` names (the coordinator cannot add or
    change them after the sites agreed to the job)."""
    info = next(iter(d.sites.values()))
    if with_public(d.cfg, public, info.image_shape) != d.cfg:
        raise ConfigError(
            f"job {d.job.job_id}: the public inputs given are not the ones the signed job's [public] "
            "names; sign the job with them ([public] sha256, pretrained_sha256)"
        )


def _pretrain_progress(d: JobDriver, public: PublicInputs) -> StepProgress:
    """The pretraining's ``pretrain`` events, as the spatial warm-up reports itself: what it trains on, then
    the step and loss at every tenth of its steps (``progress.jsonl``; ``train``'s progress lines, the demo's
    status line). Public values only: the step count and the loss on public images."""
    pb = d.cfg.public
    if public.data is not None and pb.pretrain_iterations > 0:
        d.emit(
            "pretrain",
            f"public pretraining on {public.data.n} public images, {pb.pretrain_iterations} steps of "
            f"{min(pb.pretrain_batch, public.data.n)}",
        )
    every = max(1, pb.pretrain_iterations // 10)

    def progress(step: int, total: int, loss: float) -> None:
        if step % every == 0:
            d.emit("pretrain", f"pretrain {step}/{total} loss {loss:.4f}")

    return progress


def _save_public_model(d: JobDriver, model: nn.Module) -> None:
    """``pretrained.pt``: the model after public pretraining, reusable by ``--pretrained`` (named by its
    sha256 in the next job). Only when nothing private chose its data: with ``[public] selection`` the kept
    part is a function of the sites' charged histograms, so those weights are not offered as public."""
    if d.cfg.public.selection:
        return
    info = next(iter(d.sites.values()))
    write_model_file(
        d.out / PRETRAINED_FILE,
        spec=denoiser_spec(d.cfg.model, info.image_shape, info.n_classes),
        state_dict={k: v.detach().cpu() for k, v in model.state_dict().items()},
        class_names=info.class_names,
        public=dict(d.cfg.to_dict()["public"]),
    )


def _warm_model(
    d: JobDriver,
    central: dict[str, Any],
    freq: dict[str, Any],
    device: torch.device,
    public: PublicInputs | None = None,
    aux: AuxModel | None = None,
) -> nn.Module:
    """The global model on ``device`` after the warm-up stages (on released statistics only), restored from
    its checkpoint when a restarted coordinator already has it (checkpoints load to the CPU, then onto
    ``device``)."""
    info = next(iter(d.sites.values()))
    # the public init (one seed rule), made on the CPU and then moved: the same weights on any device
    model = initial_denoiser(d.cfg, info.image_shape, info.n_classes).to(device)
    ck = checkpoint_io.load_warmup(d.state)
    t0 = time.monotonic()
    if ck is not None:
        model.load_state_dict(ck["model"])
        d.emit("warmup", "warm-up restored from checkpoint")
    else:
        if public is not None:  # public pretraining first, before any private release is used
            progress = _pretrain_progress(d, public)
            info_pre = public_start(model, public, d.cfg, info.image_shape, tuple(info.class_names), progress)
            d.emit("pretrain", f"public pretraining: {info_pre.get('steps', 0)} steps")
            _save_public_model(d, model)
            d.observe("after-pretrain", model)
        aux = warm_up(
            model,
            central,
            freq,
            d.cfg,
            {sid: s.size for sid, s in d.sites.items()},
            d.sink("warmup"),
            d.observe,
            aux,
        )
        _save_aux_pool(d, aux)  # before the checkpoint: a restarted coordinator that skips the warm-up has it
        checkpoint_io.save_warmup(d.state, {"model": model.state_dict()})
    d.timings["warmup"] = time.monotonic() - t0
    return model
