"""Coordinator-signed jobs: ``{"job": {job_id, coordinator, config, sites, created}, "signature": {...}}``.

A node runs a job only if it verifies against a coordinator key its own policy allows
(:func:`verify_job`); the coordinator signs with :func:`sign_job` (CLI: ``feta-release job sign``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .. import signing
from ..config import JobConfig
from ..errors import ConfigError
from . import schema
from .document import SitePolicy, format_time, parse_time, utc_now
from .envelope import KeyLike, as_public_keys, open_envelope, seal
from .errors import PolicySchemaError, PolicyViolation


@dataclass(frozen=True)
class Job:
    """A job whose signature verified. ``signer`` is the coordinator key fingerprint that signed it."""

    job_id: str
    coordinator: str
    config: JobConfig = field(repr=False)
    sites: tuple[str, ...]
    created: dt.datetime
    signer: str
    digest: str  # sha256 of the canonical job body: identifies exactly what was signed
    document: Mapping[str, Any] = field(repr=False)
    # FULL fingerprint of the signing key (the allow-list matches on this, not 64 bits)
    signer_sha256: str = ""


def sign_job(
    config: JobConfig | Mapping[str, Any],
    key: Ed25519PrivateKey,
    job_id: str,
    sites: Iterable[str],
    *,
    created: dt.datetime | str | None = None,
) -> dict[str, Any]:
    """Validate and sign a job; the config is stored as the full ``JobConfig.to_dict()``."""
    cfg = config if isinstance(config, JobConfig) else JobConfig.from_dict(dict(config))
    sites = list(sites)
    try:  # the signed document states secure aggregation explicitly (the default: on for >= 2 sites)
        cfg = cfg.with_secure_default(len(sites))
    except ConfigError as exc:
        raise PolicySchemaError(f"job {job_id}", [("config", str(exc))]) from None
    coordinator = signing.fingerprint(key)
    body = {
        "job_id": job_id,
        "coordinator": coordinator,
        "config": cfg.to_dict(),
        "sites": list(sites),
        "created": format_time(utc_now().replace(microsecond=0) if created is None else parse_time(created)),
    }
    _parse_body(body, signer=coordinator, source=f"job {job_id}")
    return seal("job", body, key)


def _parse_body(body: dict[str, Any], signer: str, source: str) -> Job:
    schema.validate(body, "job", source)
    try:
        # a job signed without an explicit value (none of ours: sign_job resolves it) reads as the default
        # would
        cfg = JobConfig.from_dict(body["config"], source=f"{source} config").with_secure_default(
            len(body["sites"])
        )
    except ConfigError as exc:
        raise PolicySchemaError(source, [("config", str(exc))]) from None
    if body["coordinator"] != signer:
        raise PolicyViolation(
            "job.coordinator", f"{source}: names coordinator {body['coordinator']} but was signed by {signer}"
        )
    return Job(
        job_id=body["job_id"],
        coordinator=body["coordinator"],
        config=cfg,
        sites=tuple(body["sites"]),
        created=parse_time(body["created"], f"{source}: created"),
        signer=signer,
        digest=signing.sha256_hex(signing.canonical_json(body)),
        document=body,
    )


def verify_job_with_keys(
    signed_job: Any, trusted_keys: Iterable[KeyLike], source: str = "<signed job>"
) -> Job:
    """Verify a signed job against explicit coordinator keys (coordinator side, CLI)."""
    keys = as_public_keys(trusted_keys)
    body, signer = open_envelope(signed_job, "job", keys, source, signer_rule="coordinators")
    # as open_envelope chose
    full = signing.full_fingerprint({signing.fingerprint(k): k for k in keys}[signer])
    return dataclasses.replace(_parse_body(body, signer, source), signer_sha256=full)


def verify_job(signed_job: Any, policy: SitePolicy, source: str = "<signed job>") -> Job:
    """Node side: accept a job only if a coordinator key allowed by ``policy`` signed it and it names this
    site.

    Coordinators listed in the policy as full PEM are used directly. One listed only by fingerprint is
    matched against the key embedded in the signature (its fingerprint must equal the listed one).
    """
    keys: list[Ed25519PublicKey] = policy.coordinator_keys()
    allowed_fps = policy.coordinator_fingerprints()
    sig = signed_job.get("signature") if isinstance(signed_job, dict) else None
    embedded = sig.get("public_key") if isinstance(sig, dict) else None
    if isinstance(embedded, str):
        try:
            k = signing.load_public_key(embedded.encode())
        except Exception:  # a malformed hint is ignored; open_envelope reports the real problem
            k = None
        if k is not None and signing.full_fingerprint(k) in allowed_fps:
            keys.append(k)
    if not allowed_fps:
        raise PolicyViolation(
            "coordinators", f"{source}: the policy of site {policy.site_id} allows no coordinator"
        )
    job = verify_job_with_keys(signed_job, keys, source)
    if policy.site_id not in job.sites:
        raise PolicyViolation(
            "job.sites",
            f"{source}: job {job.job_id} does not name site {policy.site_id} (sites: {', '.join(job.sites)})",
        )
    return job
