"""Empirical privacy audit: measured ε LOWER bounds beside the claimed ε (see ``games`` and ``stats``).

An audit can show that a mechanism leaks MORE than it claims (a privacy bug); it never proves that it leaks less.
The proof is the accounting; the audit is a check on the implementation of that accounting's assumptions.
"""

from __future__ import annotations

from typing import Any

from ..errors import PrivacyError

CAVEAT = ("An empirical audit gives a LOWER bound on ε with 95 % confidence: it can show that a mechanism leaks MORE "
          "than claimed (a bug), never that it leaks less. It does not prove privacy; the accounting does.")
AUDIT_KIND = "feta-release/audit/1"
SCOPE = ("Scope of a \"consistent\" result: each row audits ONE release of one mechanism alone, on canary data - "
         "a single unsampled Gaussian release (central images, frequency statistics: q = 1, one step, a worst-case "
         "neighbouring pair) or one run of DP-SGD (the one-run audit with white-box gradient canaries). It says "
         "nothing about secure sums (Skellam noise shares, secure aggregation), FedSGD rounds, patient-level "
         "clipping (per-patient DP-SGD, group privacy over a patient cap), Poisson sampling of the one-shot "
         "releases, or the composition of a job's releases into its total epsilon: those rest on the accounting "
         "alone.")


def not_audited(cfg: Any) -> list[str]:
    """What this job releases that no row of its audit covers (on top of the composition of its releases, which
    an audit of single releases never covers)."""
    fed = cfg.federation
    out = []
    if fed.secure_aggregation or (fed.secure_aggregation is None and len(fed.sites) >= 2):
        out.append("its secure sums (Skellam noise shares under secure aggregation)")
    if fed.fedsgd:
        out.append("its FedSGD rounds")
    out.append("the composition of its releases into the job's total epsilon")
    return out


def run_audit(cfg: Any, n: int, *, trials: int = 20000, canaries: int = 1000, seed: int = 0,
              progress: Any = None) -> dict[str, Any]:
    """Audit every enabled mechanism of the job ``cfg`` (a ``JobConfig``) for a site of PUBLIC size ``n``.

    Canary data only: nothing here reads a site's images, so the result is not a release.
    """
    from ..planning import plan as plan_job_privacy
    from .games import audit_dpsgd_one_run, audit_one_shot

    say = progress or (lambda msg: None)
    p = cfg.privacy
    results = []
    if cfg.central.rounds > 0:
        name = f"central {cfg.central.kind}"
        say(f"{name}: {trials} runs per neighbour at σ = {cfg.central.sigma:g}")
        results.append(audit_one_shot(name, cfg.central.sigma, trials=trials, delta=p.delta, accountant=p.accountant,
                                      seed=seed))
    if cfg.frequency.sigma is not None:
        # 100 independent class columns per call of the mechanism: as cheap per run as the central audit now
        say(f"frequency: {trials} runs per neighbour at σ = {cfg.frequency.sigma:g}")
        results.append(audit_one_shot("frequency", cfg.frequency.sigma, trials=trials, delta=p.delta,
                                      accountant=p.accountant, seed=seed))
    privacy_plan = plan_job_privacy(cfg, n)
    sgd = next((s for s in privacy_plan.stages if s.stage == "dpsgd" and s.enabled and s.steps > 0), None)
    if sgd is not None:
        if sgd.sigma is None or sgd.q is None:  # an enabled stage always carries its event's sigma and q
            raise PrivacyError(f"job {cfg.job.name!r}: the DP-SGD stage of its plan has no sigma/q, so it cannot be "
                               "audited; this is a bug in planning.plan, please report it")
        say(f"DP-SGD: one run, {canaries} canaries, σ = {sgd.sigma:.4g}, q = {sgd.q:.4g}, {sgd.steps} steps")
        results.append(audit_dpsgd_one_run(float(sgd.sigma), float(sgd.q), sgd.steps, canaries=canaries,
                                           delta=p.delta, accountant=p.accountant, seed=seed, clip=cfg.dpsgd.clip))
    return {
        "kind": AUDIT_KIND,
        "job": cfg.job.name,
        "dataset_size": n,
        "note": CAVEAT,
        "scope": SCOPE,
        "not_audited": not_audited(cfg),
        "audits": [r.to_dict() for r in results],
    }
