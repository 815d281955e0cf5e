"""A site's signed spend statement for one job, from its OWN ledger (for the release manifest).

The events come from the ledger (what this site actually charged), ε is recomputed by
``feta_release.release.manifest.build_attestation``, and the site's key signs it: a verifier needs
no trust in the coordinator for this site's privacy figures.
"""

from __future__ import annotations

from typing import Any

from feta_release.accounting import events_from_list
from feta_release.release.manifest import build_attestation

from . import ledger_anchor


def site_attestation(site: Any, job: Any) -> dict[str, Any]:
    # Close BEFORE reading: a charge racing with this attest either committed already (and is read below)
    # or is refused by the ledger under its write lock; the statement's ``final: true`` is then true.
    site.ledger.close_job(job.job_id, job.digest)
    events = events_from_list(site.ledger.job_events(job.job_id))
    lifetime = events_from_list([e for r in site.ledger.requests() for e in r["events"]])
    pol = site.policy
    # the ledger's position after this job, signed with the spend: the coordinator keeps it per site (a later
    # job from a deleted or restored ledger is refused there) and the node keeps its own copy
    # (edge.ledger_anchor)
    anchor = ledger_anchor.record(site.ledger, site.work_dir)
    return build_attestation(
        site.site_id,
        job.job_id,
        events,
        pol.job_delta,
        pol.accountant,
        pol.digest,
        site.key,
        job_sha256=job.digest,
        lifetime_events=lifetime,
        lifetime_delta=pol.lifetime_delta,
        max_colluders=pol.counted_colluders(len(job.sites)),
        unit_policy=pol,
        ledger=anchor,
    )
