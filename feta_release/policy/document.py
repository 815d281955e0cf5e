"""Site policy documents: read (TOML or JSON), validate, sign, and load a signed one for a node.

A policy says what one site allows: its data (keyed commitment + public nominal size), its ε/δ budget for its
lifetime and per job, the mechanisms with their minimum noise and caps, which coordinators may send jobs,
which app bundles may run, and the validity window. The site's policy key signs it (``{"policy": ...,
"signature":
...}``); a node loads it with :func:`load_site_policy`, which refuses anything it cannot trust.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .. import signing
from ..accounting import (
    DEFAULT_WORST_CASE_FACTOR,  # noqa: F401 - re-exported (policy.secure_aggregation)
    worst_case_epsilon_cap,
)
from ..data.declared import DataDeclaration
from ..errors import PolicyError
from . import schema
from .envelope import KeyLike, as_public_keys, open_envelope, read_json, read_text, seal, write_json
from .errors import PolicySchemaError, PolicyViolation

MECHANISMS = ("central", "frequency", "dpsgd", "selection")
# Mechanisms a policy may leave out: absent means not allowed (a policy signed before the mechanism existed
# allows nothing new). ``selection``: the semantic selection query of public pretraining.
OPTIONAL_MECHANISMS = ("selection",)


# -- time ------------------------------------------------------------------------------------------


def parse_time(value: str | dt.datetime, where: str = "time") -> dt.datetime:
    """An aware UTC datetime from ISO 8601 text (``Z`` or an explicit offset is required)."""
    if isinstance(value, dt.datetime):
        t = value
    else:
        try:
            t = dt.datetime.fromisoformat(str(value))
        except ValueError:
            raise PolicyError(f"{where}: {value!r} is not an ISO 8601 date-time") from None
    if t.tzinfo is None:
        raise PolicyError(f"{where}: {value!r} has no UTC offset; write e.g. 2026-01-01T00:00:00Z")
    return t.astimezone(dt.UTC)


def format_time(t: dt.datetime) -> str:
    return parse_time(t).isoformat().replace("+00:00", "Z")


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def utc_stamp(t: float | None = None) -> str:
    """UTC time ``t`` (seconds since the epoch; default now) as ``YYYY-MM-DDTHH:MM:SSZ``: the one timestamp of
    manifests, certificates and the node's state."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if t is None else t))


# -- the parsed policy -----------------------------------------------------------------------------


@dataclass(frozen=True)
class MechanismRule:
    name: str
    allowed: bool
    min_sigma: float | None
    caps: Mapping[str, float]  # e.g. {"max_steps": 2000, "max_batch": 4096}


@dataclass(frozen=True)
class SitePolicy:
    """A verified policy. ``document`` is the signed body; ``digest`` the sha256 of its canonical JSON."""

    version: int
    site_id: str
    dataset_commitment: str  # HMAC-SHA256 under the site's secret (feta_release.data.commitment)
    dataset_size: int  # PUBLIC nominal size: every rate and denominator that leaves the site uses it
    lifetime_epsilon: float
    lifetime_delta: float
    job_epsilon: float
    job_delta: float
    accountant: str
    mechanisms: Mapping[str, MechanismRule]
    coordinators: tuple[str, ...]  # as written: PEM or fingerprint
    app_bundles: tuple[str, ...]
    # PEM of the key that signs this site's attestations (None: an old policy names none)
    site_key: str | None
    not_before: dt.datetime
    expires: dt.datetime
    signer: str | None  # fingerprint of the key that signed it (None: read unsigned, e.g. before signing)
    digest: str
    document: Mapping[str, Any] = field(repr=False)
    # secure aggregation trust assumption: other sites that may collude with the coordinator, and the cap on
    # the epsilon when all of them do (None: not capped)
    max_colluders: int = 0
    max_worst_case_epsilon: float | None = None
    max_lifetime_worst_case_epsilon: float | None = None
    # the other sites' pinned Ed25519 keys (PEM) by site id: key adverts are checked against these, not
    # against keys the coordinator relays (empty: none pinned, so no other site's noise share is counted)
    peers: Mapping[str, str] = field(default_factory=dict)
    # the unit of privacy (dataset.privacy_unit): "patient" declares the PUBLIC patient count and the
    # per-patient image cap, and DP-SGD samples and clips whole patients (None for an image-level policy)
    privacy_unit: str = "image"
    patients: int | None = None
    patient_cap: int | None = None
    # the PUBLIC schema of the data (dataset.classes, dataset.image_shape): a DataDeclaration, None for a
    # policy signed before both fields existed (a node refuses it: edge/site.py)
    declared: Any = None
    # what one job may make the node allocate (``resources``; absent fields: enforce.DEFAULT_RESOURCES)
    resources: Mapping[str, float] = field(default_factory=dict)
    # the signed envelope (``{"policy", "signature"}``) this was verified from by :func:`load_site_policy`
    # (None otherwise): what a node shows the coordinator of the policy it runs under, never the file read
    # again (it may have been replaced since)
    signed: Mapping[str, Any] | None = field(default=None, repr=False, compare=False)

    @property
    def dpsgd_population(self) -> int:
        """The PUBLIC count DP-SGD samples from: patients for a patient-level policy, else the nominal image
        count."""
        return (
            int(self.patients) if self.privacy_unit == "patient" and self.patients else int(self.dataset_size)
        )

    def counted_colluders(self, n_sites: int) -> int:
        """Other sites counted as colluding: ``max_colluders``, or all of them when no peer key is pinned (the
        coordinator could then put its own keys under other sites' ids, so no other share can be trusted)."""
        others = max(int(n_sites) - 1, 0)
        return min(self.max_colluders, others) if self.peers else others

    @property
    def worst_case_cap(self) -> float:
        """The per-job cap on the worst-case (every other site colludes) epsilon: the policy's
        ``secure_aggregation.max_worst_case_epsilon``, or DEFAULT_WORST_CASE_FACTOR x the per-job epsilon."""
        return worst_case_epsilon_cap(self.max_worst_case_epsilon, self.job_epsilon)

    @property
    def lifetime_worst_case_cap(self) -> float:
        """The cap on the LIFETIME worst-case epsilon (every secure-aggregation release of every job seen by a
        coalition of all other sites with the coordinator):
        ``secure_aggregation.max_lifetime_worst_case_epsilon``, or DEFAULT_WORST_CASE_FACTOR x the lifetime
        epsilon."""
        return worst_case_epsilon_cap(self.max_lifetime_worst_case_epsilon, self.lifetime_epsilon)

    @property
    def unit_cap(self) -> int | None:
        """The group size every budget of this site is counted over: the patient cap of a patient-level policy
        (epsilon PER PATIENT), None for an image-level one (epsilon per image)."""
        return int(self.patient_cap) if self.privacy_unit == "patient" and self.patient_cap else None

    @classmethod
    def from_document(cls, doc: dict[str, Any], signer: str | None, source: str = "<policy>") -> SitePolicy:
        validate_policy(doc, source)
        mechs = {}
        for name in MECHANISMS:
            m = (
                doc["mechanisms"].get(name, {"allowed": False})
                if name in OPTIONAL_MECHANISMS
                else doc["mechanisms"][name]
            )
            caps = {k: v for k, v in m.items() if k.startswith("max_")}
            mechs[name] = MechanismRule(name, bool(m["allowed"]), m.get("min_sigma"), caps)
        return cls(
            version=doc["version"],
            site_id=doc["site_id"],
            dataset_commitment=doc["dataset"]["commitment"],
            dataset_size=doc["dataset"]["size"],
            lifetime_epsilon=float(doc["budget"]["lifetime"]["epsilon"]),
            lifetime_delta=float(doc["budget"]["lifetime"]["delta"]),
            job_epsilon=float(doc["budget"]["per_job"]["epsilon"]),
            job_delta=float(doc["budget"]["per_job"]["delta"]),
            accountant=doc["accountant"],
            mechanisms=mechs,
            coordinators=tuple(doc["coordinators"]),
            app_bundles=tuple(doc["app_bundles"]),
            site_key=doc.get("site_key"),
            not_before=parse_time(doc["not_before"], f"{source}: not_before"),
            expires=parse_time(doc["expires"], f"{source}: expires"),
            signer=signer,
            digest=signing.sha256_hex(signing.canonical_json(doc)),
            document=doc,
            max_colluders=int(doc.get("secure_aggregation", {}).get("max_colluders", 0)),
            max_worst_case_epsilon=doc.get("secure_aggregation", {}).get("max_worst_case_epsilon"),
            max_lifetime_worst_case_epsilon=doc.get("secure_aggregation", {}).get(
                "max_lifetime_worst_case_epsilon"
            ),
            peers=dict(doc.get("secure_aggregation", {}).get("peers", {})),
            privacy_unit=str(doc["dataset"].get("privacy_unit", "image")),
            patients=doc["dataset"].get("patients"),
            patient_cap=doc["dataset"].get("patient_cap"),
            declared=DataDeclaration.from_dataset_table(doc["dataset"]),
            resources=dict(doc.get("resources", {})),
        )

    def coordinator_fingerprints(self) -> set[str]:
        """FULL key fingerprints (sha256 of the raw public key, 64 hex) of the allowed coordinators."""
        return {_coordinator_fingerprint(c) for c in self.coordinators}

    def coordinator_keys(self) -> list[Ed25519PublicKey]:
        """The coordinators given as full PEM (fingerprint-only entries have no key to return)."""
        return [
            signing.load_public_key(c.encode())
            for c in self.coordinators
            if c.lstrip().startswith("-----BEGIN")
        ]


def _coordinator_fingerprint(entry: str) -> str:
    if entry.lstrip().startswith("-----BEGIN"):
        return signing.full_fingerprint(signing.load_public_key(entry.encode()))
    return entry


# -- reading and validating ------------------------------------------------------------------------


def _normalize(obj: Any) -> Any:
    """TOML dates become ISO text; everything else must already be JSON."""
    if isinstance(obj, dict):
        return {k: _normalize(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_normalize(v) for v in obj]
    if isinstance(obj, dt.datetime):
        if obj.tzinfo is None:
            raise PolicyError(
                f"date-time {obj.isoformat()} has no UTC offset; write e.g. 2026-01-01T00:00:00Z"
            )
        return format_time(obj)
    if isinstance(obj, (dt.date, dt.time)):
        raise PolicyError(
            f"{obj.isoformat()}: give a full date-time with UTC offset, e.g. 2026-01-01T00:00:00Z"
        )
    return obj


def validate_policy(doc: Any, source: str = "<policy>") -> None:
    """Schema check (errors name the field path) and the rules a schema cannot say."""
    schema.validate(doc, "policy", source)
    problems: list[tuple[str, str]] = []
    for f in ("not_before", "expires"):
        try:
            parse_time(doc[f], f)
        except PolicyError as exc:
            problems.append((f, str(exc)))
    if not problems and parse_time(doc["not_before"]) >= parse_time(doc["expires"]):
        problems.append(("expires", f"must be after not_before ({doc['not_before']})"))
    b = doc["budget"]
    for k in ("epsilon", "delta"):
        if b["per_job"][k] > b["lifetime"][k]:
            problems.append(
                (f"budget.per_job.{k}", f"{b['per_job'][k]} exceeds budget.lifetime.{k} {b['lifetime'][k]}")
            )
    problems += _unit_problems(doc["dataset"])
    try:
        DataDeclaration.from_dataset_table(doc["dataset"])
    except PolicyError as exc:
        problems.append(("dataset.classes", str(exc)))
    if "site_key" in doc:
        try:
            signing.load_public_key(doc["site_key"].encode())
        except PolicyError as exc:
            problems.append(("site_key", str(exc)))
    for sid, pem in doc.get("secure_aggregation", {}).get("peers", {}).items():
        try:
            signing.load_public_key(pem.encode())
        except PolicyError as exc:
            problems.append((f"secure_aggregation.peers.{sid}", str(exc)))
    for i, c in enumerate(doc["coordinators"]):
        if c.lstrip().startswith("-----BEGIN"):
            try:
                signing.load_public_key(c.encode())
            except PolicyError as exc:
                problems.append((f"coordinators[{i}]", str(exc)))
    if problems:
        raise PolicySchemaError(source, problems)


def _unit_problems(ds: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The unit of privacy's fields, each problem with its fix (a patient-level policy needs both public
    counts)."""
    if ds.get("privacy_unit", "image") != "patient":
        return [
            (
                f"dataset.{k}",
                f'only with dataset.privacy_unit = "patient" (the unit is one image here); add '
                f'privacy_unit = "patient" to [dataset] or remove {k}',
            )
            for k in ("patients", "patient_cap")
            if k in ds
        ]
    out = [
        (f"dataset.{k}", f'required with privacy_unit = "patient": {why}')
        for k, why in (
            (
                "patients",
                "the PUBLIC nominal number of patients, e.g. the count rounded to 2 significant digits "
                "(`feta-release data inspect` prints it)",
            ),
            ("patient_cap", "at most this many images per patient are used, e.g. patient_cap = 5"),
        )
        if k not in ds
    ]
    if not out and ds["patients"] > ds["size"]:
        out.append(
            (
                "dataset.patients",
                f"{ds['patients']} patients > dataset.size {ds['size']} images: every patient "
                "has at least one image; give the public patient count, at most the public image count",
            )
        )
    return out


def read_policy_document(path: str | Path) -> dict[str, Any]:
    """Read an UNSIGNED policy (``.toml`` or ``.json``), normalized and validated."""
    p = Path(path)
    text = read_text(p, "policy")
    try:
        if p.suffix.lower() == ".toml":
            doc = tomllib.loads(text)
        else:
            doc = signing.loads_strict(text)  # a duplicated key would be signed as one reader sees it
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        raise PolicyError(
            f"{p}: not valid {'TOML' if p.suffix.lower() == '.toml' else 'JSON'}: {exc}"
        ) from None
    if isinstance(doc, dict) and set(doc) == {"policy", "signature"}:
        raise PolicyError(f"{p}: already a signed policy; sign the plain policy document instead")
    try:
        doc = _normalize(doc)
    except PolicyError as exc:
        raise PolicyError(f"{p}: {exc}") from None
    validate_policy(doc, str(p))
    return doc


def sign_policy(doc: dict[str, Any], key: Ed25519PrivateKey) -> dict[str, Any]:
    """The enveloped signed policy ``{"policy": doc, "signature": {...}}`` (doc validated first)."""
    validate_policy(doc)
    return seal("policy", doc, key)


def write_signed_policy(path: str | Path, signed: dict[str, Any]) -> Path:
    return write_json(path, signed)


# -- loading a signed policy (node side) -----------------------------------------------------------


def open_signed_policy(
    signed: Any, trusted_keys: Iterable[KeyLike], source: str = "<signed policy>"
) -> SitePolicy:
    """Signature + schema only (no clock, data or version checks): see :func:`load_site_policy`."""
    body, signer = open_envelope(signed, "policy", as_public_keys(trusted_keys), source)
    return SitePolicy.from_document(body, signer, source)


def read_signed_policy_unverified(path: str | Path) -> tuple[SitePolicy, dict[str, Any]]:
    """For display only: parse a signed policy WITHOUT trusting it (the signer is checked against the
    key embedded in the signature, which proves integrity but not who that key belongs to)."""
    signed = read_json(path, "signed policy")
    from .envelope import signer_of

    embedded = (signed.get("signature") or {}).get("public_key") if isinstance(signed, dict) else None
    if not embedded or not signer_of(signed):
        raise PolicyViolation("signature.required", f"{path}: unsigned policy (no signature envelope)")
    pol = open_signed_policy(signed, [embedded], str(path))
    return pol, signed


def check_validity(policy: SitePolicy, now: dt.datetime | str | None = None, source: str = "policy") -> None:
    t = utc_now() if now is None else parse_time(now, "now")
    if t < policy.not_before:
        raise PolicyViolation(
            "not_before",
            f"{source} (site {policy.site_id}, version {policy.version}) is not valid "
            f"before {format_time(policy.not_before)}; it is now {format_time(t)}",
        )
    if t >= policy.expires:
        raise PolicyViolation(
            "expires",
            f"{source} (site {policy.site_id}, version {policy.version}) expired at "
            f"{format_time(policy.expires)}; it is now {format_time(t)}; sign a new version",
        )


def check_version(
    pol: SitePolicy, path: str | Path, last_seen_version: int | None, last_seen_digest: str | None = None
) -> None:
    """Refuse a policy older than a version already seen at the site (``version``: a replayed policy); with
    ``last_seen_digest``, also the same version number re-signed with different content. A node runs it once
    its ledger (which keeps the versions seen) is open, after every check that needs no ledger."""
    if last_seen_version is not None and pol.version < last_seen_version:
        raise PolicyViolation(
            "version",
            f"{path}: policy version {pol.version} is older than version "
            f"{last_seen_version} already seen at this site (a replayed old policy); "
            f"versions only go up",
        )
    if (
        last_seen_digest is not None
        and last_seen_version is not None
        and pol.version == last_seen_version
        and pol.digest != last_seen_digest
    ):
        raise PolicyViolation(
            "version",
            f"{path}: policy version {pol.version} differs from the version {pol.version} "
            f"already seen at this site (digest {pol.digest[:16]} != {last_seen_digest[:16]}); "
            f"a changed policy needs a higher version number",
        )


def load_site_policy(
    path: str | Path,
    trusted_keys: Iterable[KeyLike],
    *,
    now: dt.datetime | str | None = None,
    dataset_commitment: str | None = None,
    last_seen_version: int | None = None,
    last_seen_digest: str | None = None,
) -> SitePolicy:
    """Load the signed policy a node runs under, or refuse (:class:`PolicyViolation` naming the rule):

    unsigned (``signature.required``), malformed envelope (``signature.envelope``), unknown signer
    (``signature.signer``), bad signature (``signature.valid``), malformed body (schema error naming the
    field), not yet valid (``not_before``), expired (``expires``), older than a version already seen
    (``version``: a replayed policy; with ``last_seen_digest``, also the same version number re-signed
    with different content), data changed since signing (``dataset.commitment``, recomputed by the node with
    its secret).
    """
    p = Path(path)
    if p.suffix.lower() == ".toml":
        raise PolicyViolation(
            "signature.required",
            f"{p}: unsigned policy (TOML); sign it with "
            f"`feta-release policy sign {p} --key KEY` and load the signed JSON",
        )
    signed = read_json(p, "signed policy")
    pol = dataclasses.replace(open_signed_policy(signed, trusted_keys, str(p)), signed=signed)
    check_validity(pol, now, str(p))
    check_version(pol, p, last_seen_version, last_seen_digest)
    if dataset_commitment is not None:
        check_commitment(pol, p, dataset_commitment)
    return pol


def check_commitment(pol: SitePolicy, path: str | Path, dataset_commitment: str) -> None:
    """Refuse a verified policy whose keyed data commitment is not ``dataset_commitment`` (recomputed by the
    node over its data with its secret): ``dataset.commitment``, the data changed since signing. Runs on the
    policy object a node verified once, so the data are checked against the very policy it runs under, never
    against the file read a second time (which may have changed in between)."""
    from ..data.commitment import same_commitment

    if not same_commitment(dataset_commitment, pol.dataset_commitment):
        # neither value is printed in full: they are keyed, but there is no reason to spread them
        raise PolicyViolation(
            "dataset.commitment",
            f"{path}: the data (or the data secret) changed since the "
            f"policy was signed: the data's keyed commitment {dataset_commitment[:12]}… != "
            f"policy's {pol.dataset_commitment[:12]}…; if the change is meant, recompute the "
            "commitment with `feta-release policy data-commitment DATA --secret SECRET` (the "
            "node's data and secret), put it into the policy's [dataset], raise version and "
            "re-sign with `feta-release policy sign`",
        )


def make_policy(
    site_id: str,
    dataset_commitment: str,
    dataset_size: int,
    coordinators: Iterable[str | Ed25519PublicKey],
    *,
    version: int = 1,
    app_bundles: Iterable[str] = (),
    lifetime: tuple[float, float] = (4.0, 1e-5),
    per_job: tuple[float, float] = (1.0, 1e-5),
    accountant: str = "rdp",
    mechanisms: Mapping[str, Mapping[str, Any]] | None = None,
    not_before: dt.datetime | str | None = None,
    valid_days: float = 365.0,
    site_key: str | Ed25519PublicKey | None = None,
    secure_aggregation: Mapping[str, Any] | None = None,
    patient_level: tuple[int, int] | None = None,
    declared: DataDeclaration | None = None,
    resources: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """A validated policy document with the research defaults of ``policies/research.toml`` (for demos
    and tests; a real site writes its policy file by hand). Coordinators may be keys or PEM text.
    ``patient_level``: (public patients, patient cap) for a policy whose unit of privacy is the patient.
    ``declared``: the public class list and image shape (``DataDeclaration``); a node refuses a policy
    without. ``resources``: the policy's resource caps (absent: ``enforce.DEFAULT_RESOURCES``)."""
    start = (
        utc_now().replace(microsecond=0) - dt.timedelta(minutes=5)
        if not_before is None
        else parse_time(not_before)
    )
    default_mechs: dict[str, dict[str, Any]] = {
        "central": {"allowed": True, "min_sigma": 1.0, "max_rounds": 50, "max_batch": 60000},
        "frequency": {"allowed": True, "min_sigma": 1.0, "max_features": 20000},
        "dpsgd": {"allowed": True, "min_sigma": 0.5, "max_steps": 100000, "max_batch": 60000},
        "selection": {"allowed": True, "min_sigma": 5.0},
    }
    for name, over in (mechanisms or {}).items():
        default_mechs[name] = {**default_mechs.get(name, {}), **over}
    doc = {
        "version": version,
        "site_id": site_id,
        "dataset": {
            "commitment": dataset_commitment,
            "size": int(dataset_size),
            **(
                {}
                if patient_level is None
                else {
                    "privacy_unit": "patient",
                    "patients": int(patient_level[0]),
                    "patient_cap": int(patient_level[1]),
                }
            ),
            **({} if declared is None else declared.policy_fields()),
        },
        "budget": {
            "lifetime": {"epsilon": lifetime[0], "delta": lifetime[1]},
            "per_job": {"epsilon": per_job[0], "delta": per_job[1]},
        },
        "accountant": accountant,
        "mechanisms": default_mechs,
        "coordinators": [c if isinstance(c, str) else signing.public_key_pem(c) for c in coordinators],
        "app_bundles": list(app_bundles),
        **(
            {}
            if site_key is None
            else {"site_key": site_key if isinstance(site_key, str) else signing.public_key_pem(site_key)}
        ),
        "not_before": format_time(start),
        "expires": format_time(start + dt.timedelta(days=valid_days)),
        **({} if secure_aggregation is None else {"secure_aggregation": dict(secure_aggregation)}),
        **({} if resources is None else {"resources": dict(resources)}),
    }
    validate_policy(doc, f"policy for {site_id}")
    return doc
