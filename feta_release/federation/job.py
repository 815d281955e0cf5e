"""The whole federated FETA-Pro job on a Grid: what the coordinator's ServerApp runs."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from .driver import JobDriver, JobResult, Progress


def run_job(grid: Any, signed_job: dict[str, Any], out_dir: str | Path, *, coordinator_key: Any = None,
            progress: Progress | None = None, wait_timeout: float = 300.0, poll_interval: float = 1.0) -> JobResult:
    """Run (or resume, with the same ``out_dir``) the signed job; failures are logged as an ``error`` event."""
    d = JobDriver(grid, signed_job, out_dir, coordinator_key=coordinator_key, progress=progress,
                  wait_timeout=wait_timeout, poll_interval=poll_interval)
    try:
        return _run(d, signed_job)
    except Exception as exc:
        d.emit("error", f"{type(exc).__name__}: {exc}")
        raise


def _run(d: JobDriver, signed_job: dict[str, Any]) -> JobResult:
    import torch

    from ..models import build_denoiser
    from .checkpoint_io import load_warmup, save_warmup

    t_all = time.monotonic()
    cfg = d.cfg
    d.emit("start", f"job {d.job.job_id}: sites {', '.join(d.job.sites)}")
    d.wait_for_sites()
    # Refuse BEFORE any release if the job cannot fit every site's policy.
    d.plan_sites()
    central = d.collect_central()
    freq = d.collect_frequency()

    info = next(iter(d.sites.values()))
    shape, n_classes, class_names = tuple(info.image_shape), info.n_classes, info.class_names
    torch.manual_seed(cfg.job.seed)
    model = build_denoiser(cfg.model, shape, n_classes)
    ck = load_warmup(d.state)
    t0 = time.monotonic()
    if ck is not None:
        model.load_state_dict(ck["model"])
        d.emit("warmup", "warm-up restored from checkpoint")
    else:
        from .warmup import warm_up

        warm_up(model, central, freq, cfg, {sid: s.size for sid, s in d.sites.items()}, shape, n_classes,
                lambda msg: d.emit("warmup", msg))
        save_warmup(d.state, {"model": model.state_dict()})
    d.timings["warmup"] = time.monotonic() - t0

    import copy

    ema = copy.deepcopy(model)
    rounds_done = d.rounds(model, ema, None)
    atts = d.attestations()

    final = ema if rounds_done else model
    torch.save({"model": final.state_dict(), "spec": _spec(cfg, shape, n_classes)}, d.out / "model.pt")
    histories = {sid: att["statement"]["events"] for sid, att in atts.items()}
    summary = {
        "job_id": d.job.job_id,
        "sites": sorted(d.sites),
        "class_names": class_names,
        "image_shape": list(shape),
        "rounds": rounds_done,
        "skipped": {str(k): v for k, v in d.skipped.items()},
        "site_epsilon": {sid: att["statement"]["epsilon"] for sid, att in atts.items()},
        "delta": {sid: att["statement"]["delta"] for sid, att in atts.items()},
        "histories": histories,
        "timings": {**d.timings, "total": time.monotonic() - t_all},
    }
    (d.out / "job_summary.json").write_text(json.dumps(summary, indent=2), "utf-8")
    (d.out / "signed_job.json").write_text(json.dumps(signed_job, indent=2), "utf-8")
    d.emit("done", f"job {d.job.job_id} finished: " + ", ".join(
        f"{sid} ε={e:.3f}" for sid, e in summary["site_epsilon"].items()), timings=summary["timings"])
    return JobResult(d.out, sorted(d.sites), rounds_done, d.skipped, summary["timings"], atts)


def _spec(cfg: Any, shape: tuple[int, ...], n_classes: int) -> dict[str, Any]:
    from ..models import denoiser_spec

    return denoiser_spec(cfg.model, shape, n_classes)
