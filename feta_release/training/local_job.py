"""The local driver's coordinator side: a finished ``feta-release train`` run directory becomes the job
directory of a one-site job (``feta_release.release.jobdir``), written by the same code as a federated
coordinator's.

Roles, as in a federation: the SITE key (the run's ledger key) signs the site's spend statement from its own
ledger; the COORDINATOR key signs the one-site job and the release manifest. The statement's events are the
ledger's (charged before every release by the same ``Ledger`` a node uses), so the release's epsilon is the
run's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..data.commitment import dataset_commitment, ensure_secret
from ..data.declared import DataDeclaration
from ..files import private_dir
from ..policy import make_policy, sign_policy, write_signed_policy
from ..policy.envelope import read_json
from ..release.export_run import attest_run
from ..release.jobdir import RELEASE, build_release, job_summary, privacy_report, sample_grid, write_job_files
from ..release.manifest import MANIFEST_FILE
from ..signing import generate_keypair, load_private_key

COORDINATOR_KEY = "checkpoints/coordinator.key"
# A run trained without --policy signs a one-site policy for itself with a run-local administrator key, so
# that its release verifies like a federated one (``verify --trusted SITE=RUN/keys/policy-admin.pub``). It
# binds what the run used (public size, class list, image shape, its budget) and is only as trustworthy as the
# run folder's owner.
RUN_POLICY = "policy.signed.json"
RUN_ADMIN_KEY = "keys/policy-admin.key"


def run_coordinator_key(run_dir: Path) -> Ed25519PrivateKey:
    """The run's own coordinator key when none is given (created once, owner-only, beside the run's site
    key)."""
    path = Path(run_dir) / COORDINATOR_KEY
    if not path.exists():
        generate_keypair(path.parent, "coordinator")
    return load_private_key(path)


def needs_site_policy(events: Sequence[Any]) -> bool:
    """A patient-level run (its DP-SGD sampled patients) has no run-local policy: the public patient count and
    cap are the administrator's to declare and sign (``train --policy``)."""
    return any(getattr(e, "unit", "image") == "patient" for e in events)


def run_policy(
    run_dir: str | Path,
    data: Any,
    *,
    site_key: Ed25519PrivateKey,
    coordinator_key: Ed25519PrivateKey,
    site_id: str | None,
    cfg: Any,
    events: Sequence[Any],
) -> dict[str, Any]:
    """The run's own signed one-site policy (``RUN_DIR/policy.signed.json``, made once): its budget the job's
    ``[privacy]`` target, its caps admitting the run's releases, its dataset the run's public size with a
    keyed commitment to ``data`` (secret ``RUN_DIR/keys/data.secret``), its declared schema the data's classes
    and shape, signed with ``RUN_DIR/keys/policy-admin.key`` (0600, made here)."""
    rd = Path(run_dir)
    path = rd / RUN_POLICY
    if path.is_file():
        return dict(read_json(path, "signed policy"))
    keys = private_dir(rd / "keys")
    if not (rd / RUN_ADMIN_KEY).exists():
        generate_keypair(keys, "policy-admin")
    secret, _ = ensure_secret(keys / "data.secret")
    run = dict(read_json(rd / "run.json", "run record"))
    doc = make_policy(
        site_id or "site",
        dataset_commitment(data, secret),
        int(run["dataset_size"]),
        [coordinator_key.public_key()],
        per_job=(float(cfg.privacy.epsilon), float(cfg.privacy.delta)),
        lifetime=(float(cfg.privacy.epsilon), float(cfg.privacy.delta)),
        accountant=cfg.privacy.accountant,
        mechanisms=_admitting(events, int(run["dataset_size"])),
        site_key=site_key.public_key(),
        declared=DataDeclaration.draft_from(data),
    )
    doc["description"] = "one-site policy of a `feta-release train` run, signed with the run's own key"
    signed = sign_policy(doc, load_private_key(rd / RUN_ADMIN_KEY))
    write_signed_policy(path, signed)
    return signed


def _admitting(events: Sequence[Any], size: int) -> dict[str, dict[str, Any]]:
    """Mechanism caps that admit the run's own releases (the research defaults, widened where the run went
    past them): the policy records the run, it does not gate it (the run was gated by its [privacy]
    budget)."""
    out: dict[str, dict[str, Any]] = {}
    for stage, cap in (("central", "max_rounds"), ("frequency", None), ("dpsgd", "max_steps")):
        evs = [e for e in events if e.stage == stage]
        if not evs:
            continue
        rule: dict[str, Any] = {
            "min_sigma": min(1.0 if stage != "dpsgd" else 0.5, *(float(e.sigma) for e in evs))
        }
        if cap is not None:
            rule[cap] = max(50 if stage == "central" else 100000, sum(int(e.steps) for e in evs))
        if stage != "frequency":
            rule["max_batch"] = max(60000, math.ceil(max(float(e.q) for e in evs) * size))
        out[stage] = rule
    return out


def release_run(
    run_dir: str | Path,
    *,
    site_key: Ed25519PrivateKey,
    coordinator_key: Ed25519PrivateKey,
    site_id: str | None = None,
    signed_policy: dict[str, Any] | None = None,
) -> Path:
    """Write the job files, privacy report, sample grid and ``RUN_DIR/release`` of a complete run; a run
    already released is left as it is (a rerun of ``train`` on a complete run changes nothing)."""
    rd = Path(run_dir)
    if (rd / RELEASE / MANIFEST_FILE).is_file():
        return rd / RELEASE
    a = attest_run(
        rd, coordinator_key=coordinator_key, site_key=site_key, site_id=site_id, signed_policy=signed_policy
    )
    sid = a.site_id
    summary = job_summary(
        a.signed_job["job"]["job_id"],
        [sid],
        a.classes,
        list(a.denoiser.image_shape),
        a.rounds,
        {},
        {sid: a.attestation},
        dict(a.run.get("stage_seconds", {})),
    )
    write_job_files(
        rd,
        signed_job=a.signed_job,
        summary=summary,
        attestations={sid: a.attestation},
        signed_policies={sid: signed_policy} if signed_policy is not None else {},
    )
    privacy_report(rd)
    # the model, central images and aux pool attest_run checked against the ledger, not a second read of the
    # files (a swap in between)
    sample_grid(rd, checked=(a.denoiser, a.central, a.aux_pool))
    return build_release(
        rd,
        coordinator_key,
        require_policies=signed_policy is not None,
        starts=a.central,
        aux_pool=a.aux_pool,
        denoiser=a.denoiser,
    )
