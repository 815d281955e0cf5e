"""A site's two epsilons for a job whose sums run through secure aggregation, under ITS signed trust
assumption.

The policy's ``secure_aggregation.max_colluders`` says how many of the other sites may collude with the
coordinator; the site computes (a) the epsilon under that assumption (noise of the honest sites' shares; its
own share only when the threshold lets a lying coordinator isolate its vector, see ``SiteEpsilons``) and (b)
the worst case (its own share alone), refuses a job whose (b) passes
``secure_aggregation.max_worst_case_epsilon`` (default: ``DEFAULT_WORST_CASE_FACTOR`` = 3 x the per-job
epsilon) or whose (a) passes its per-job budget, and states both in the certificate
(:meth:`SiteEpsilons.statement`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..accountants.skellam import SiteEpsilons, site_epsilons
from ..errors import PolicyError
from ..mechanisms.skellam import SkellamParams
from ..signing import load_public_key, public_key_pem
from .document import DEFAULT_WORST_CASE_FACTOR, SitePolicy
from .errors import PolicyViolation


def policy_site_epsilons(
    policy: SitePolicy, params: SkellamParams, q: float, steps: int, threshold: int
) -> SiteEpsilons:
    """The site's (assumed, worst-case) epsilons at its per-job delta. More colluders than there are other
    sites means all of them: the assumed epsilon is then the worst case."""
    colluders = policy.counted_colluders(params.n_sites)
    return site_epsilons(params, q, steps, policy.job_delta, threshold, colluders)


def check_secure_aggregation(policy: SitePolicy, eps: SiteEpsilons) -> None:
    """Refuse (naming the rule) when the job's epsilons pass the policy's caps; ``eps`` covers the whole
    job."""
    if eps.assumed > policy.job_epsilon:
        raise PolicyViolation(
            "budget.per_job.epsilon",
            f"epsilon {eps.assumed:.4g} under the assumption of at most "
            f"{eps.colluders} colluding site(s) exceeds the per-job cap {policy.job_epsilon:g}",
            site=policy.site_id,
        )
    cap = policy.worst_case_cap
    if eps.worst_case > cap + 1e-9:
        how = (
            ""
            if policy.max_worst_case_epsilon is not None
            else f" (the default: {DEFAULT_WORST_CASE_FACTOR:g} x budget.per_job.epsilon, as the policy sets "
            "none)"
        )
        raise PolicyViolation(
            "secure_aggregation.max_worst_case_epsilon",
            f"epsilon {eps.worst_case:.4g} if every "
            f"other site colludes (own noise share only) exceeds the cap {cap:g}{how}; add noise, "
            f"require fewer rounds or raise the site's cap",
            site=policy.site_id,
        )


def check_pinned_peers(
    policy: SitePolicy, job_sites: Iterable[str], relayed: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The keys that authenticate the other sites' key adverts: the policy's pinned
    ``secure_aggregation.peers`` (site id -> PEM). Refused, naming the rule, when the policy pins peers and
    the job names a site it does not pin, or the coordinator relays a key that differs from the pinned one.
    With no peers pinned, the relayed keys are used and :meth:`SitePolicy.counted_colluders` counts every
    other site as colluding."""
    others = [s for s in job_sites if s != policy.site_id]
    relayed = dict(relayed or {})
    if not policy.peers:
        return {s: relayed[s] for s in others if s in relayed}
    unpinned = sorted(s for s in others if s not in policy.peers)
    if unpinned:
        raise PolicyViolation(
            "secure_aggregation.peers",
            f"the job names site(s) {unpinned} whose keys this site's "
            f"policy does not pin; add them (signed by the site's admin) or leave them out of the "
            f"job",
            site=policy.site_id,
        )
    differ = sorted(s for s in others if s in relayed and _canon(relayed[s]) != _canon(policy.peers[s]))
    if differ:
        raise PolicyViolation(
            "secure_aggregation.peers",
            f"the coordinator relays key(s) for site(s) {differ} that "
            f"differ from the keys this site's policy pins; refused",
            site=policy.site_id,
        )
    return {s: policy.peers[s] for s in others}


def _canon(pem: str) -> str:
    try:
        return public_key_pem(load_public_key(pem.encode()))
    except PolicyError:
        return ""
