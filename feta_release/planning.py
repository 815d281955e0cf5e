"""Privacy planning: from a job file and a PUBLIC dataset size to per-stage parameters and the total epsilon.

A plan is made before any data is touched.  The stages of a FETA-Pro job are, in order: central images
(DP-FETA warm-up), frequency statistics (FETA-Pro warm-up), DP-SGD fine-tuning.  The warm-up stages have fixed
noise; the DP-SGD noise multiplier is calibrated so that the WHOLE history meets the target (epsilon, delta)
(or, when the job fixes ``[dpsgd] noise_multiplier``, that value is checked against the budget).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sequence

from .accounting import (
    MAX_NOISE_MULTIPLIER,
    PrivacyEvent,
    calibrate_noise_multiplier,
    epsilon,
)
from .config import JobConfig
from .errors import PrivacyError

# The embedded data's training split (5,000 MNIST digits, 20 % held out): the size assumed when none is given.
DEFAULT_DATASET_SIZE = 4000


@dataclass(frozen=True)
class StagePlan:
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
        return {
            "stage": self.stage, "enabled": self.enabled, "sigma": self.sigma, "q": self.q, "steps": self.steps,
            "epsilon": self.epsilon, "share": self.share, "note": self.note,
            "noise_to_signal": self.noise_to_signal, "noise_note": self.noise_note,
        }


@dataclass(frozen=True)
class PrivacyPlan:
    dataset_size: int
    target_epsilon: float
    delta: float
    accountant: str
    epsilon: float  # total over the whole history (all stages composed)
    noise_multiplier: float | None  # DP-SGD sigma (calibrated or configured); None when DP-SGD has 0 steps
    calibrated: bool
    stages: tuple[StagePlan, ...]
    history: tuple[PrivacyEvent, ...]
    prior: tuple[PrivacyEvent, ...] = field(default=())
    warnings: tuple[str, ...] = field(default=())

    def stage(self, name: str) -> StagePlan:
        for s in self.stages:
            if s.stage == name:
                return s
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
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
        }


# A release whose noise-to-signal figure is above this is mostly noise (the plan warns).
MOSTLY_NOISE = 0.5
_FIXES = {
    "central": "lower [central] sigma or rounds, raise [central] rate, or use more data",
    "frequency": "lower [frequency] sigma or features, or use more data",
}


def stage_noise(cfg: JobConfig, stage: str, n: int, image_shape: tuple[int, int, int] = (1, 28, 28),
                n_classes: int = 10, sgd_sigma: float | None = None) -> tuple[float | None, str]:
    """A noise-to-signal figure a user can judge, per stage, from PUBLIC values only.

    central (mean): noise std per pixel of a released class-mean image, sigma * C / (batch / n_classes), against
    the pixel scale 1 (pixels in [0, 1]).  central (mode): per-bin noise std sigma * sqrt(d) against the expected
    per-class batch.  frequency: norm of a class column's noise, sigma * sqrt(features) / n, against the column's
    largest possible norm 1 / n_classes (||phi|| = 1, balanced classes): a lower bound on the true ratio.
    dpsgd: norm of the noise on the mean clipped gradient of ONE step, sigma * C * sqrt(params) / batch, against
    its largest possible norm C; steps average it down, so it is reported, not warned about.
    """
    c_, h, w = image_shape
    if stage == "central" and cfg.central.rounds > 0:
        c = cfg.central
        d = c_ * max(1, int(h * c.downsample)) * max(1, int(w * c.downsample))
        per_class = c.batch / n_classes
        if c.kind == "mode":
            r = c.sigma * math.sqrt(d) / per_class
            return r, f"per-bin noise {r:.2f} x the per-class batch {per_class:.0f}"
        clip = c.clip if c.clip is not None else math.sqrt(d)
        r = c.sigma * min(clip, math.sqrt(d)) / per_class
        return r, f"noise std {r:.3f} per pixel (pixels in [0, 1]), per-class batch {per_class:.0f}"
    if stage == "frequency" and cfg.frequency.sigma is not None:
        f = cfg.frequency
        r = f.sigma * math.sqrt(f.features) / n * n_classes
        return r, f"noise norm >= {r:.2f} x a class column's signal"
    if stage == "dpsgd" and sgd_sigma is not None:
        params = _param_count(cfg, image_shape, n_classes)
        if params is None:
            return None, ""
        r = sgd_sigma * math.sqrt(params) / cfg.dpsgd.batch
        return r, (f"one step's noise norm {r:.2f} x the largest mean clipped gradient ({params:,} parameters, "
                   f"batch {cfg.dpsgd.batch}); a larger batch at the same epsilon lowers it")
    return None, ""


def _param_count(cfg: JobConfig, image_shape: tuple[int, int, int], n_classes: int) -> int | None:
    from .errors import FetaError
    from .models.edm import build_denoiser

    try:
        return sum(p.numel() for p in build_denoiser(cfg.model, image_shape, n_classes).parameters())
    except FetaError:
        return None  # a model that cannot be built is reported by training, not by the plan


def _rate(batch: int, n: int, section: str) -> float:
    if batch > n:
        raise PrivacyError(
            f"[{section}] batch {batch} exceeds the dataset size {n} (sampling rate would be {batch / n:.3g} > 1): "
            f"shrink [{section}] batch to at most {n}"
        )
    return batch / n


def plan_job(
    cfg: JobConfig,
    n: int,
    *,
    dpsgd_steps: int | None = None,
    target_epsilon: float | None = None,
    delta: float | None = None,
    prior_events: Sequence[PrivacyEvent] = (),
    image_shape: tuple[int, int, int] = (1, 28, 28),
    n_classes: int = 10,
) -> PrivacyPlan:
    """Plan a job on a dataset of PUBLIC size ``n``.

    ``image_shape``/``n_classes`` (public) only feed the noise-to-signal figures (default: the embedded data).

    ``dpsgd_steps`` overrides the job's steps/epochs (the federated plan passes rounds x local steps);
    ``target_epsilon``/``delta`` override ``[privacy]`` (a site's own budget); ``prior_events`` are events
    already spent on the same data (a site ledger), composed into the history before calibration.
    Raises PrivacyError naming the stage to shrink when the plan cannot meet the budget.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PrivacyError(f"dataset size must be a positive integer, got {n!r}")
    cfg = cfg.for_size(n)  # [central]/[dpsgd] rate -> batch for this public size
    eps_target = cfg.privacy.epsilon if target_epsilon is None else float(target_epsilon)
    dlt = cfg.privacy.delta if delta is None else float(delta)
    acc = cfg.privacy.accountant
    prior = list(prior_events)
    warm: list[PrivacyEvent] = []
    c, f, d = cfg.central, cfg.frequency, cfg.dpsgd

    central_ev = None
    if c.rounds > 0:
        central_ev = PrivacyEvent("central", c.sigma, _rate(c.batch, n, "central"), c.rounds)
        warm.append(central_ev)
    freq_ev = None
    if f.sigma is not None:
        freq_ev = PrivacyEvent("frequency", f.sigma, 1.0, 1)
        warm.append(freq_ev)

    steps = cfg.dpsgd_steps(n) if dpsgd_steps is None else int(dpsgd_steps)
    q_sgd = _rate(d.batch, n, "dpsgd")
    warm_eps = epsilon(prior + warm, dlt, acc)
    if warm_eps >= eps_target:
        biggest = max(warm, key=lambda e: epsilon([e], dlt, acc)).stage if warm else "prior"
        raise PrivacyError(
            f"the warm-up alone spends epsilon {warm_eps:.3f} >= the budget {eps_target}: shrink [{biggest}] "
            f"(fewer rounds / larger sigma), drop a warm-up stage, or raise [privacy] epsilon"
        )

    sgd_ev = None
    sigma_sgd: float | None = None
    calibrated = False
    if steps > 0:
        if d.noise_multiplier is not None:
            sigma_sgd = d.noise_multiplier
        else:
            try:
                sigma_sgd = calibrate_noise_multiplier(prior + warm, q_sgd, steps, eps_target, dlt, acc,
                                                       max_sigma=MAX_NOISE_MULTIPLIER)
            except PrivacyError:
                raise PrivacyError(
                    f"[dpsgd] cannot meet epsilon {eps_target} at delta {dlt}: even noise multiplier "
                    f"{MAX_NOISE_MULTIPLIER:g} is not enough for {steps} steps at q = {q_sgd:.4g} after the warm-up's "
                    f"epsilon {warm_eps:.3f}. Shrink [dpsgd] (fewer steps/epochs, smaller batch), or the warm-up "
                    f"([central] rounds, [frequency] sigma), or raise [privacy] epsilon"
                ) from None
            calibrated = True
        sgd_ev = PrivacyEvent("dpsgd", sigma_sgd, q_sgd, steps)

    history = prior + warm + ([sgd_ev] if sgd_ev else [])
    total = epsilon(history, dlt, acc)
    if total > eps_target + 1e-9:
        raise PrivacyError(
            f"[dpsgd] noise_multiplier {sigma_sgd} gives a total epsilon {total:.3f} above the budget {eps_target}: "
            f"raise [dpsgd] noise_multiplier (or remove it to calibrate), or use fewer steps than {steps}"
        )

    rows: list[tuple[str, PrivacyEvent | None, str]] = [
        ("central", central_ev, f"{c.kind} images, {c.rounds} round(s)" if central_ev else "disabled (rounds = 0)"),
        ("frequency", freq_ev, f"{f.features} random Fourier features" if freq_ev else "disabled (no sigma)"),
        ("dpsgd", sgd_ev, ("calibrated" if calibrated else "configured") if sgd_ev else "disabled (0 steps)"),
    ]
    if prior:
        rows.insert(0, ("prior", None, f"{len(prior)} event(s) already spent"))
    alone = {name: (epsilon([ev], dlt, acc) if ev else 0.0) for name, ev, _ in rows}
    if prior:
        alone["prior"] = epsilon(prior, dlt, acc)
    summed = sum(alone.values()) or 1.0
    noise = {name: stage_noise(cfg, name, n, image_shape, n_classes, sigma_sgd) for name, _, _ in rows}
    stages = tuple(
        StagePlan(
            stage=name, enabled=ev is not None or name == "prior",
            sigma=ev.sigma if ev else None, q=ev.q if ev else None,
            steps=ev.steps if ev else (sum(e.steps for e in prior) if name == "prior" else 0),
            epsilon=alone[name], share=alone[name] / summed, note=note,
            noise_to_signal=noise[name][0], noise_note=noise[name][1],
        )
        for name, ev, note in rows
    )
    warnings = tuple(
        f"[{s.stage}] at N = {n}: {s.noise_note}: the release would be mostly noise (noise-to-signal "
        f"{s.noise_to_signal:.2f} > {MOSTLY_NOISE}); {_FIXES.get(s.stage, 'spend more epsilon on it')}"
        for s in stages
        # DP-SGD's per-step figure is averaged down by the steps: reported, not warned about
        if s.stage != "dpsgd" and s.noise_to_signal is not None and s.noise_to_signal > MOSTLY_NOISE
    )
    return PrivacyPlan(
        dataset_size=n, target_epsilon=eps_target, delta=dlt, accountant=acc, epsilon=total,
        noise_multiplier=sigma_sgd, calibrated=calibrated, stages=stages, history=tuple(history),
        prior=tuple(prior), warnings=warnings,
    )


def plan_site(
    cfg: JobConfig,
    n: int,
    *,
    target_epsilon: float | None = None,
    delta: float | None = None,
    prior_events: Sequence[PrivacyEvent] = (),
    dpsgd_steps: int | None = None,
) -> PrivacyPlan:
    """Plan for ONE federated site with its own public size ``n`` and budget.

    DP-SGD steps default to ``[federation] rounds x local_steps`` (each site takes that many subsampled-Gaussian
    steps on its own data); the site's sigma is calibrated for its own size, budget and prior spending.
    """
    steps = cfg.federation.rounds * cfg.federation.local_steps if dpsgd_steps is None else dpsgd_steps
    return plan_job(cfg, n, dpsgd_steps=steps, target_epsilon=target_epsilon, delta=delta, prior_events=prior_events)
