"""The local driver's coordinator side: a finished ``feta-release train`` run directory becomes the job directory
of a one-site job (``feta_release.release.jobdir``), written by the same code as a federated coordinator's.

Roles, as in a federation: the SITE key (the run's ledger key) signs the site's spend statement from its own
ledger; the COORDINATOR key signs the one-site job and the release manifest. The statement's events are the ledger's
(charged before every release by the same ``Ledger`` a node uses), so the release's epsilon is the run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..release.export_run import attest_run
from ..release.jobdir import RELEASE, build_release, job_summary, privacy_report, sample_grid, write_job_files
from ..release.manifest import MANIFEST_FILE
from ..signing import generate_keypair, load_private_key

COORDINATOR_KEY = "checkpoints/coordinator.key"


def run_coordinator_key(run_dir: Path) -> Ed25519PrivateKey:
    """The run's own coordinator key when none is given (created once, owner-only, beside the run's site key)."""
    path = Path(run_dir) / COORDINATOR_KEY
    if not path.exists():
        generate_keypair(path.parent, "coordinator")
    return load_private_key(path)


def release_run(run_dir: str | Path, *, site_key: Ed25519PrivateKey, coordinator_key: Ed25519PrivateKey,
                site_id: str | None = None, signed_policy: dict[str, Any] | None = None) -> Path:
    """Write the job files, privacy report, sample grid and ``RUN_DIR/release`` of a complete run; a run already
    released is left as it is (a rerun of ``train`` on a complete run changes nothing)."""
    rd = Path(run_dir)
    if (rd / RELEASE / MANIFEST_FILE).is_file():
        return rd / RELEASE
    a = attest_run(rd, coordinator_key=coordinator_key, site_key=site_key, site_id=site_id,
                   signed_policy=signed_policy)
    sid = a.site_id
    summary = job_summary(a.signed_job["job"]["job_id"], [sid], a.classes, list(a.denoiser.image_shape), a.rounds, {},
                          {sid: a.attestation}, dict(a.run.get("stage_seconds", {})))
    write_job_files(rd, signed_job=a.signed_job, summary=summary, attestations={sid: a.attestation},
                    signed_policies={sid: signed_policy} if signed_policy is not None else {})
    privacy_report(rd)
    # the model, central images and aux pool attest_run checked against the ledger, not a second read of the files
    # (a swap in between)
    sample_grid(rd, checked=(a.denoiser, a.central, a.aux_pool))
    return build_release(rd, coordinator_key, require_policies=signed_policy is not None, starts=a.central,
                         aux_pool=a.aux_pool, denoiser=a.denoiser)
