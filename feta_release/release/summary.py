"""What a data-protection officer reads first: the verdict, then per site the ε under the trust assumption,
the worst case and the signed caps, one line each. ``verify``, ``synthesize``, ``verify-synthetic`` and the
HTML report all read these figures from here, so the screen and the page say the same thing.

Every figure is the verified release's own: the sites' signed statements (re-composed by verify), in the unit
the site's signed caps bound (per patient at a patient-level site, else per image), beside the caps of the
policy that verify checked. A release that did not verify still gets its figures (the officer needs to see why
it failed), but a site whose policy did not verify shows no caps.

Imports neither torch nor flwr.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..accounting import events_from_list, has_secure_aggregation
from .verify import EPS_REL_TOL, VerificationResult, lifetime_of


@dataclass(frozen=True)
class Figure:
    """One ε and the signed cap it must stay under (None: not stated / no verified policy)."""

    epsilon: float | None
    cap: float | None

    def text(self) -> str:
        if self.epsilon is None:
            return "not stated"
        return (
            f"{self.epsilon:.3g} (cap {self.cap:g})"
            if self.cap is not None
            else f"{self.epsilon:.3g} (cap ?)"
        )

    def to_dict(self) -> dict[str, float | None]:
        return {"epsilon": self.epsilon, "cap": self.cap}


@dataclass(frozen=True)
class SiteSummary:
    """One site of a release: its unit of privacy, (ε, δ) this job and lifetime, worst case under secure
    aggregation, each beside its cap, and the trust assumption under which the job figure holds."""

    site_id: str
    unit: str  # "image" | "patient": what ε is per (the caps bound ε in this unit)
    delta: float
    job: Figure
    lifetime: Figure
    worst: Figure | None  # None: no secure aggregation, so no coalition changes the figure
    lifetime_worst: Figure | None
    colluders: int | None  # other sites assumed to collude with the coordinator (None: no secure aggregation)
    policy_verified: bool

    @property
    def assumption(self) -> str:
        """Under which trust assumption the job figure holds, in words."""
        if self.colluders is None:
            return "holds whoever colludes (each site adds all its noise itself)"
        if (
            self.worst is not None
            and self.worst.epsilon is not None
            and self.job.epsilon is not None
            and math.isclose(self.worst.epsilon, self.job.epsilon, rel_tol=EPS_REL_TOL, abs_tol=1e-12)
        ):
            return "holds whoever colludes (counts this site's own noise share only)"
        if self.colluders == 0:
            return "holds if no other site colludes with the coordinator"
        return f"holds if at most {self.colluders} other site(s) collude with the coordinator"

    def line(self) -> str:
        """The site in one line: id, unit, ε job / lifetime with caps, worst case with cap, assumption."""
        worst = (
            f"; worst case (all other sites collude) {self.worst.text()}, lifetime "
            f"{self.lifetime_worst.text()}"
            if self.worst is not None and self.lifetime_worst is not None
            else ""
        )
        caps = "" if self.policy_verified else " [caps NOT checked: the site's policy did not verify]"
        return (
            f"site {self.site_id}: per {self.unit}, δ = {self.delta:g}: ε this job {self.job.text()}, "
            f"lifetime {self.lifetime.text()}{worst}; {self.assumption}{caps}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "site_id": self.site_id,
            "unit": self.unit,
            "delta": self.delta,
            "job": self.job.to_dict(),
            "lifetime": self.lifetime.to_dict(),
            "worst_case": self.worst.to_dict() if self.worst else None,
            "lifetime_worst_case": self.lifetime_worst.to_dict() if self.lifetime_worst else None,
            "assumed_colluders": self.colluders,
            "assumption": self.assumption,
            "policy_verified": self.policy_verified,
        }


def _statement(site: dict[str, Any]) -> dict[str, Any]:
    return (site.get("attestation") or {}).get("statement") or {}


def _unit(site: dict[str, Any], policy: dict[str, Any] | None) -> str:
    """The verified policy's unit of privacy, else the one the site's statement states."""
    if policy is not None:
        return str((policy.get("dataset") or {}).get("privacy_unit", "image"))
    from ..accounting import unit_name
    from ..privacy_unit import statement_patient_cap

    return unit_name(statement_patient_cap(_statement(site)))


def _stated_figures(
    site: dict[str, Any], st: dict[str, Any], sa: dict[str, Any] | None
) -> tuple[float, float | None, float | None, float | None]:
    """(job, lifetime, worst case, lifetime worst case) ε as the site's statement states them, where no
    verified policy gives the unit: per patient where the statement says its unit is the patient
    (``privacy_unit.job_in_unit`` / ``lifetime_in_unit``, the worst cases by ``patient_epsilon``), never the
    smaller per-image composition of its events; else the signed per-image figures."""
    from ..accounting import patient_epsilon
    from ..privacy_unit import job_in_unit, lifetime_in_unit, statement_patient_cap

    cap = statement_patient_cap(st)
    lt = lifetime_in_unit(st) if cap is not None else lifetime_of(site)
    job = job_in_unit(st)["epsilon"] if cap is not None else float(site["epsilon"])
    figures = [
        float(sa[k]) if sa and k in sa else None
        for k in ("worst_case_epsilon", "lifetime_worst_case_epsilon")
    ]
    if cap is not None and sa:
        life = st.get("lifetime") if isinstance(st.get("lifetime"), dict) else None
        histories = [
            (site["events"], float(site["delta"])),
            (life["events"], float(life["delta"])) if life else None,
        ]
        figures = [
            None
            if f is None or h is None
            else patient_epsilon(events_from_list(h[0]), h[1], cap, site["accountant"], view="worst_case")
            for f, h in zip(figures, histories)
        ]
    return job, (lt["epsilon"] if lt else None), figures[0], figures[1]


def site_summary(site: dict[str, Any], policy: dict[str, Any] | None) -> SiteSummary:
    """``policy``: the site's policy as verify checked and passed it (None: caps unknown)."""
    st = _statement(site)
    events = events_from_list(site["events"])
    life = st.get("lifetime") if isinstance(st.get("lifetime"), dict) else None
    life_events = events_from_list(life["events"]) if life else []
    delta = float(site["delta"])
    life_delta = float(life["delta"]) if life else delta
    sa = st.get("secure_aggregation") if isinstance(st.get("secure_aggregation"), dict) else None
    secure = sa is not None or has_secure_aggregation(events)
    caps: tuple[float | None, ...]
    if policy is not None:
        from ..ledger import Budget

        b = Budget.from_policy(policy)
        spent = b.spent  # in the unit the caps bound (per patient at a patient-level site)
        caps = (b.job_epsilon, b.lifetime_epsilon, b.worst_case_epsilon, b.lifetime_worst_case_epsilon)
        job = spent(events, delta)
        lifetime = spent(life_events, life_delta) if life else None
        worst = spent(events, delta, "worst_case") if secure else None
        life_worst = spent(life_events, life_delta, "worst_case") if secure and life else None
    else:  # no verified policy: the statement's own figures in the unit it states, no caps
        caps = (None, None, None, None)
        job, lifetime, worst, life_worst = _stated_figures(site, st, sa)
    return SiteSummary(
        str(site["site_id"]),
        _unit(site, policy),
        delta,
        Figure(job, caps[0]),
        Figure(lifetime, caps[1]),
        Figure(worst, caps[2]) if secure else None,
        Figure(life_worst, caps[3]) if secure else None,
        int(sa.get("max_colluders", 0)) if secure and sa else (0 if secure else None),
        policy is not None,
    )


def site_summaries(res: VerificationResult) -> list[SiteSummary]:
    """Every site of the verified (or refused) release; a site too malformed to read is left out (its failed
    check says why)."""
    out = []
    for s in (res.manifest or {}).get("sites") or []:
        try:
            # res.policies holds only policies whose check passed (signature, site, attested hash, caps)
            out.append(site_summary(s, res.policies.get(str(s["site_id"]))))
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            continue
    return out


def counts(res: VerificationResult) -> dict[str, int]:
    """Checks by outcome: passed, warned, failed, and notes (a caveat to read, never a check that passed)."""
    out = {"passed": 0, "warned": 0, "failed": 0, "notes": 0}
    key = {"pass": "passed", "warn": "warned", "fail": "failed", "note": "notes"}
    for c in res.checks:
        out[key[c.status]] += 1
    return out


def counts_text(res: VerificationResult) -> str:
    n = counts(res)
    return f"{n['passed']} checks passed, {n['warned']} warned, {n['failed']} failed" + (
        f", {n['notes']} note(s)" if n["notes"] else ""
    )


def trust_assumption(summaries: list[SiteSummary]) -> str:
    """The release's trust assumption in one sentence, derived from its sites' statements."""
    secure = [s for s in summaries if s.colluders is not None]
    if not secure:
        return (
            "No secure aggregation: every site adds all of its noise itself before anything leaves it, so "
            "each site's ε holds whoever colludes; the coordinator is not trusted with privacy."
        )
    assumed = sorted({s.colluders for s in secure if s.colluders is not None})
    who = (
        "no other site colludes with the coordinator"
        if assumed == [0]
        else f"at most {max(assumed)} other site(s) collude with the coordinator"
    )
    return (
        f"Secure aggregation: the coordinator sees only the sum of the sites' noised updates. Each site's ε "
        f"holds if {who} (the assumption its signed policy states); if every other site colluded, the "
        "worst-case ε applies (its own noise share only), also capped by its policy."
    )


def verdict_line(res: VerificationResult, what: str = "release") -> str:
    """One line: VERIFIED or REFUSED, and why."""
    if res.ok:
        return (
            f"VERIFIED: the {what} is within every site's signed caps and may be published under the trust "
            f"assumption stated ({counts_text(res)}, against {len(res.trusted)} trusted key(s))"
        )
    first = res.failures[0] if res.failures else None
    why = f"{first.name}: {first.detail}" if first else "no checks ran"
    more = len(res.failures) - 1
    return (
        f"REFUSED: do not publish; {why}"
        + (f" (and {more} more failed check(s))" if more > 0 else "")
        + f" [{counts_text(res)}]"
    )


def summary_dict(res: VerificationResult, what: str = "release") -> dict[str, Any]:
    """The machine-readable result: verdict, counts, per-site figures, every check."""
    sites = site_summaries(res)
    return {
        "verdict": "VERIFIED" if res.ok else "REFUSED",
        "verdict_line": verdict_line(res, what),
        "counts": counts(res),
        "trust_assumption": trust_assumption(sites) if sites else None,
        "sites": [s.to_dict() for s in sites],
        **res.to_dict(),
    }
