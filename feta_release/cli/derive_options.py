"""The derived job's options of ``train`` (``--epsilon --delta --time-budget --save-job``) and the glue from
loaded data to :mod:`feta_release.job_rules`: the job derived from the public facts, printed as TOML and
saved."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import click

from ..config import JobConfig
from ..errors import ConfigError

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(text: str, where: str = "--time-budget") -> float:
    """'900', '900s', '15m', '1.5h' -> seconds; anything else refused naming the form."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(s|m|min|h)?\s*", str(text))
    if m is None or float(m.group(1)) <= 0:
        raise ConfigError(f"{where}: {text!r} is not a duration; give seconds (900) or 900s, 15m, 1.5h")
    return float(m.group(1)) * _UNITS[m.group(2) or ""]


def derive_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--epsilon --delta --time-budget --save-job`` (the function gets ``derive: DeriveRequest``)."""
    opts = [
        click.option(
            "--epsilon",
            type=click.FloatRange(min=0, min_open=True),
            default=None,
            help="Derive the job from the data (no JOB, no --preset): the privacy budget epsilon.",
        ),
        click.option(
            "--delta",
            type=click.FloatRange(0, 1, min_open=True, max_open=True),
            default=None,
            help="Derived job: delta (default: the presets' 1e-5, below 1 / (10 N) past 10,000 images).",
        ),
        click.option(
            "--time-budget",
            default=None,
            metavar="DURATION",
            help="Derived job: training time to size the warm-up and DP-SGD steps for (900, 15m, 1h; "
            "default: 15 min for 4,000 images at 28 px on 2 CPU cores, x sqrt of pixels/784 and of "
            "N/4,000: 34 min at 64 px).",
        ),
        click.option(
            "--save-job",
            type=click.Path(dir_okay=False, path_type=Path),
            default=None,
            help="Derived job: also write it to this TOML file (then `train FILE` reruns it).",
        ),
        click.option(
            "--dpsgd",
            "dpsgd",
            type=click.Choice(["auto", "on", "off"]),
            default=None,
            help="Derived job: DP-SGD after the warm-ups: auto (default: by the rule on epsilon x "
            "N), on (steps from the time budget; with --public only the norms, attention and "
            "conditioning train) or off.",
        ),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


@dataclass(frozen=True)
class DeriveRequest:
    epsilon: float | None
    delta: float | None
    time_budget: str | None
    save_job: Path | None
    dpsgd: str | None = None  # "auto" | "on" | "off"; None: not given (auto)

    @property
    def given(self) -> bool:
        return any(
            v is not None for v in (self.epsilon, self.delta, self.time_budget, self.save_job, self.dpsgd)
        )


def base_job() -> JobConfig:
    """The job the data are loaded under before the derived one exists (the [job] defaults: refuse other
    sizes)."""
    return JobConfig.from_dict({"dpsgd": {"steps": 0}}, "derived job")


def derived_jobs(
    req: DeriveRequest,
    data: Any,
    device: str,
    public_size: int | None,
    policy: Any,
    load: Any,
    emit: Callable[[str], None],
    public: Any = None,
    patients: Any = None,
    one_each: bool = False,
    threads: int | None = None,
) -> tuple[JobConfig, Callable[[int], JobConfig] | None]:
    """(the job to run or to draw the size under, the job as a function of the drawn size or None): derived
    from the data's public facts (shape, classes) and the declared size (``public_size``, the policy's), else
    from the size the run draws; ``public`` (a loaded --public set, or None) adds its pretraining
    (``job_rules.PublicFacts``); ``patients`` (a patient-level site's ``job_rules.PatientFacts``, its DECLARED
    public patients and cap, or None) times DP-SGD as its node pads whole patients; ``one_each``: a patient
    cap of 1 without a declared patient count, where the public size is the public patient count (the cap
    leaves one image per patient), so the job is derived over P = the size the run declares or draws;
    ``threads``: the torch CPU threads the run uses (:func:`run_threads`), which its time estimates follow.
    ``emit`` gets the derived job's TOML."""
    from ..job_rules import (
        DataFacts,
        PatientFacts,
        derivation_toml,
        derive,
        facts_at,
        public_facts,
        sizing_size,
        with_physical_caps,
    )

    assert req.epsilon is not None
    c, h, w = data.image_shape
    eps, delta = float(req.epsilon), req.delta
    if policy is not None:  # the site's signed per-job budget caps what the job may spend
        eps = min(eps, float(policy.job_epsilon))
        delta = min(delta if delta is not None else 1.0, float(policy.job_delta))
    declared = (
        public_size if public_size is not None else (int(policy.dataset_size) if policy is not None else None)
    )
    facts = DataFacts(
        size=declared or 1,
        height=int(h),
        width=int(w),
        channels=int(c),
        n_classes=int(data.n_classes),
        epsilon=eps,
        delta=delta,
        device="cuda" if device == "cuda" else "cpu",
        time_budget=parse_duration(req.time_budget) if req.time_budget is not None else None,
        size_drawn=declared is None,
        memory_mb=_memory_cap(policy),
        public=public_facts(public) if public is not None else None,
        dpsgd=req.dpsgd or "auto",  # type: ignore[arg-type]  # click.Choice checked it
        class_names=tuple(data.class_names),
        patients=patients,
        threads=run_threads(threads),
    )
    if policy is not None:  # the site's resource caps bound the physical batch (a GPU's may pass them)
        facts = with_physical_caps(facts, [policy])

    def at(n: int) -> DataFacts:
        f = facts_at(facts, n)
        return replace(f, patients=PatientFacts(int(n), 1)) if one_each else f

    def job_at(n: int) -> JobConfig:
        d = derive(at(n))
        d = replace(d, cfg=_with_load(d.cfg, load))
        text = derivation_toml(d)
        emit(text)
        if req.save_job is not None:
            _save(req.save_job, text)
        return d.cfg

    if declared is not None:
        return job_at(declared), None
    return _with_load(derive(at(sizing_size(facts))).cfg, load), job_at


def run_threads(threads: int | None = None) -> int:
    """The torch CPU threads a run in this process uses: ``threads`` where given (``--threads``), else
    torch's own count (its default for this machine, OMP_NUM_THREADS, or what ``train --threads`` set)."""
    if threads is not None:
        return int(threads)
    import torch

    return int(torch.get_num_threads())


def _memory_cap(policy: Any) -> float | None:
    """The site policy's ``resources.max_worker_memory_mb`` (its default when unset), or None without a
    policy."""
    from ..policy.enforce import resource_cap

    return None if policy is None else resource_cap(policy, "max_worker_memory_mb")


def _with_load(cfg: JobConfig, load: Any) -> JobConfig:
    """The derived job with the load options the data were read with (--resize/--image-size/--window), so the
    saved job reads the same data the same way."""
    if load is None or not getattr(load, "given", None):
        return cfg
    keep = {k: getattr(load, k) for k in ("resize", "image_size", "window") if k in load.given}
    return cfg.replace(job=keep) if keep else cfg


def _save(path: Path, text: str) -> None:
    try:
        path.write_text(text, "utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write the derived job: {exc.strerror}") from None
