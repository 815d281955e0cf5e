"""Empirical privacy audit: measured ε LOWER bounds beside the claimed ε (see ``games`` and ``stats``).

An audit can show that a mechanism leaks MORE than it claims (a privacy bug); it never proves that it leaks
less. The proof is the accounting; the audit is a check on the implementation of that accounting's
assumptions.

This package's own module holds only the words of the audit (the release report quotes them without the
training stack); ``run.run_audit`` runs the games.
"""

from __future__ import annotations

from typing import Any

CAVEAT = (
    "An empirical audit gives a LOWER bound on ε with 95 % confidence: it can show that a mechanism leaks "
    "MORE than claimed (a bug), never that it leaks less. It does not prove privacy; the accounting does."
)
AUDIT_KIND = "feta-release/audit/1"
SCOPE = (
    'Scope of a "consistent" result: each row audits ONE release of one mechanism alone, on canary data - '
    "a single unsampled Gaussian release (central images, frequency statistics: q = 1, one step, a "
    "worst-case neighbouring pair) or one run of DP-SGD (the one-run audit with white-box gradient "
    "canaries). It says nothing about secure sums (Skellam noise shares, secure aggregation), FedSGD rounds, "
    "patient-level clipping (per-patient DP-SGD, group privacy over a patient cap), Poisson sampling of the "
    "one-shot releases, or the composition of a job's releases into its total epsilon: those rest on the "
    "accounting alone."
)


def not_audited(cfg: Any) -> list[str]:
    """What this job releases that no row of its audit covers (on top of the composition of its releases,
    which an audit of single releases never covers)."""
    fed = cfg.federation
    out = []
    if fed.secure_aggregation or (fed.secure_aggregation is None and len(fed.sites) >= 2):
        out.append("its secure sums (Skellam noise shares under secure aggregation)")
    if fed.fedsgd:
        out.append("its FedSGD rounds")
    out.append("the composition of its releases into the job's total epsilon")
    return out
