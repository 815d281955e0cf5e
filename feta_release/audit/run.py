"""Run the audit of a job: each enabled mechanism's game on canary data, the measured ε beside the claimed
one."""

from __future__ import annotations

from typing import Any

from ..errors import PrivacyError
from ..planning import plan as plan_job_privacy
from . import AUDIT_KIND, CAVEAT, SCOPE, not_audited
from .games import audit_dpsgd_one_run, audit_one_shot


def run_audit(
    cfg: Any, n: int, *, trials: int = 20000, canaries: int = 1000, seed: int = 0, progress: Any = None
) -> dict[str, Any]:
    """Audit every enabled mechanism of the job ``cfg`` (a ``JobConfig``) for a site of PUBLIC size ``n``.

    Canary data only: nothing here reads a site's images, so the result is not a release.
    """
    say = progress or (lambda msg: None)
    p = cfg.privacy
    results = []
    if cfg.central.rounds > 0:
        name = f"central {cfg.central.kind}"
        say(f"{name}: {trials} runs per neighbour at σ = {cfg.central.sigma:g}")
        results.append(
            audit_one_shot(
                name, cfg.central.sigma, trials=trials, delta=p.delta, accountant=p.accountant, seed=seed
            )
        )
    if cfg.frequency.sigma is not None:
        # 100 independent class columns per call of the mechanism: as cheap per run as the central audit now
        say(f"frequency: {trials} runs per neighbour at σ = {cfg.frequency.sigma:g}")
        results.append(
            audit_one_shot(
                "frequency",
                cfg.frequency.sigma,
                trials=trials,
                delta=p.delta,
                accountant=p.accountant,
                seed=seed,
            )
        )
    privacy_plan = plan_job_privacy(cfg, n)
    sgd = next((s for s in privacy_plan.stages if s.stage == "dpsgd" and s.enabled and s.steps > 0), None)
    if sgd is not None:
        if sgd.sigma is None or sgd.q is None:  # an enabled stage always carries its event's sigma and q
            raise PrivacyError(
                f"job {cfg.job.name!r}: the DP-SGD stage of its plan has no sigma/q, so it cannot be "
                "audited; this is a bug in planning.plan, please report it"
            )
        say(f"DP-SGD: one run, {canaries} canaries, σ = {sgd.sigma:.4g}, q = {sgd.q:.4g}, {sgd.steps} steps")
        results.append(
            audit_dpsgd_one_run(
                float(sgd.sigma),
                float(sgd.q),
                sgd.steps,
                canaries=canaries,
                delta=p.delta,
                accountant=p.accountant,
                seed=seed,
                clip=cfg.dpsgd.clip,
            )
        )
    return {
        "kind": AUDIT_KIND,
        "job": cfg.job.name,
        "dataset_size": n,
        "note": CAVEAT,
        "scope": SCOPE,
        "not_audited": not_audited(cfg),
        "audits": [r.to_dict() for r in results],
    }
