"""Offline verification of a release directory (no network, no torch).

Keys are bound to roles. The verifier trusts only each site's ADMINISTRATOR key (``--trusted SITE=KEY.pub``);
everything else follows from the documents those keys signed. Checks, each reported as one :class:`Check`
(all are run, so a refusal lists every reason at once):

* ``manifest.json`` parses (duplicate keys refused) and has the expected format version;
* the generator file exists, its sha256 equals the manifest's, and its metadata (classes, image shape,
  sampler, statement hash) agrees with the manifest: a generator cannot be moved under another job;
* ``central_images.npz`` (a release whose sampler has ``start_sigma``): present, its sha256 equals the
  manifest's ``starts`` record, and it parses as images of the generator's shape with labels of its classes;
* ``aux_images.npz`` (a sampler whose ``start_source`` is aux or mix, manifest format 3): the same checks
  against the ``aux_starts`` record, whose claims are recomputed from the signed job (and every site's history
  must hold the frequency release the aux generator is fitted to);
* the manifest carries the coordinator-signed job; every site the job lists has a record, no other site does,
  and every site id is a plain name;
* the released sampler is the signed job's ``[sampler]`` as export releases it (``manifest.released_sampler``;
  only the ``export --solver/--steps`` overrides may differ);
* for every site: ``policies/SITE.signed.json`` is present and signed by THAT site's administrator key; the
  attestation is signed by the ``site_key`` that policy names, is final, names this job and its signed-job
  hash, its figures equal the manifest's, its epsilon (job and lifetime) equals what its event history
  composes to (relative tolerance 1e-6), and the spend is within the policy's caps;
* the manifest and the job are signed by one coordinator key that EVERY site's policy allows (by full key);
* a site's lifetime spend (every job on its data) is within its policy's ``budget.lifetime``
  (``lifetime_violations``).

Order of reading: ``manifest.json`` and the sites' signed policies (they name the keys that may sign it) are
read capped; the files the manifest names (generator, central images, aux images) only after its signature
verified (``_check_release_files``). Every file is read by ``files.read_regular``: a regular file reached
through no symbolic link, of the ``size`` its signed record states and under a hard cap, checked before a byte
is read; ``.npz`` files by ``files.read_npz``, never inflated past the images the signed record releases.

The verified generator BYTES are kept on the result, so synthesis runs exactly the bytes that were hashed
(no window in which the file could be swapped between verification and use).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from ..accounting import (
    SkellamEvent,
    events_from_list,
    has_secure_aggregation,
    patient_epsilon,
    worst_case_epsilon,
    worst_case_epsilon_cap,
)
from ..accounting import epsilon as compose_epsilon
from ..errors import FetaError, ReleaseError
from ..files import read_regular
from ..mechanisms.count import PATIENTS_STAGE, SIZE_STAGE
from ..policy.enforce import skellam_own_sigma
from ..privacy_unit import job_in_unit, lifetime_in_unit, statement_patient_cap
from ..signing import (
    canonical_json,
    fingerprint,
    full_fingerprint,
    load_public_key,
    loads_strict,
    sha256_hex,
    verify_document,
)
from .manifest import (
    ATTESTATION_KIND,
    ATTESTED_FIELDS,
    EXPORT_SAMPLER_OVERRIDES,
    FORMAT_VERSION_PATIENT,
    GENERATOR_FORMATS,
    MANIFEST_FILE,
    MAX_GENERATOR_BYTES,
    MAX_IMAGES_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_POLICY_BYTES,
    TAKE_AS_PUBLISHED,
    aux_claims,
    manifest_format,
    patient_figures,
    patient_words,
    policy_file_name,
    sampler_problem,
    starts_claims,
    starts_count_problem,
    statement_sha256,
)

__all__ = [
    "Check",
    "TrustRoots",
    "VerificationResult",
    "describe_site",
    "require_valid",
    "verify_release",
]

EPS_REL_TOL = 1e-6
STAGE_WORDS = {
    "size": "public size (noisy image count)",
    "selection": "semantic selection of the public set (noisy histogram)",
    "central": "central images",
    "frequency": "frequency features",
    "dpsgd": "DP-SGD fine-tuning",
}


@dataclass
class Check:
    """One verification check: its name, ``pass`` / ``fail`` / ``warn`` / ``note`` and what it found."""

    name: str
    status: str  # "pass" | "fail" | "warn" | "note" (a caveat to read: never counted as a check that passed)
    detail: str

    def to_dict(self) -> dict[str, str]:
        """The check as JSON-ready fields."""
        return {"name": self.name, "status": self.status, "detail": self.detail}


@dataclass
class VerificationResult:
    """Every check of one release, the manifest and the verified bytes the checks read."""

    release_dir: str
    checks: list[Check] = field(default_factory=list)
    manifest: dict[str, Any] | None = None
    manifest_sha256: str | None = None
    generator_sha256: str | None = None
    trusted: list[str] = field(default_factory=list)
    generator_bytes: bytes | None = field(default=None, repr=False)
    # the verified central images (SDEdit starts)
    starts_bytes: bytes | None = field(default=None, repr=False)
    starts_claims: dict[str, Any] | None = None  # the starts record's claims as RECOMPUTED from signed inputs
    # the verified aux-generator pool (start_source aux/mix)
    aux_bytes: bytes | None = field(default=None, repr=False)
    # the aux_starts record's claims as RECOMPUTED from signed inputs
    aux_claims: dict[str, Any] | None = None
    # site -> the policy verify checked and passed
    policies: dict[str, dict[str, Any]] = field(default_factory=dict)
    # False: a format 2/3 manifest of a release with a patient-level site, exported before its start-image
    # records gave figures per patient (manifest.FORMAT_VERSION_PATIENT): checked as signed, per image
    per_patient_claims: bool = True

    @property
    def ok(self) -> bool:
        """True when at least one check ran and none failed."""
        return bool(self.checks) and all(c.status != "fail" for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        """The checks that failed, in order."""
        return [c for c in self.checks if c.status == "fail"]

    def add(self, name: str, ok: bool, detail: str, warn: bool = False) -> bool:
        """Record a check (a failure, or a warning with ``warn``); returns ``ok``."""
        self.checks.append(Check(name, "pass" if ok else ("warn" if warn else "fail"), detail))
        return ok

    def note(self, name: str, detail: str) -> None:
        """A caveat the reader must see (a trust assumption): neither a pass nor a failure."""
        self.checks.append(Check(name, "note", detail))

    def reason(self) -> str:
        """The failed checks in one line: what a refusal prints."""
        return "; ".join(f"{c.name}: {c.detail}" for c in self.failures)

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON-ready fields (``verify --json``)."""
        return {
            "release_dir": self.release_dir,
            "ok": self.ok,
            "manifest_sha256": self.manifest_sha256,
            "generator_sha256": self.generator_sha256,
            "trusted_keys": self.trusted,
            "checks": [c.to_dict() for c in self.checks],
        }


def _guard(result: VerificationResult, name: str, fn: Callable[[], Any]) -> Any:
    """Run one check; a malformed (tampered) document fails that check instead of crashing verify."""
    try:
        return fn()
    except FetaError as exc:
        result.add(name, False, str(exc))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        result.add(name, False, f"malformed release document ({type(exc).__name__}: {exc})")
    return None


# The policy schema's site id: a plain file-name-safe word (never "", ".", "..", a path or a control char),
# because it names files (policies/SITE.signed.json) and keys in the verifier's trust roots.
SITE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class TrustRoots:
    """Whom the verifier trusts, and for WHAT: keys are bound to roles.

    ``site_admins``: per site id, the administrator key(s) that sign that site's policy. Everything else
    follows from the signed policies: a site's attestation must be signed by the ``site_key`` its own
    policy names, and the manifest (and the job) by a coordinator key that EVERY site's policy allows.
    ``coordinators``: optional extra pin; the manifest signer must also be one of these.
    """

    site_admins: Mapping[str, tuple[Ed25519PublicKey, ...]]
    coordinators: tuple[Ed25519PublicKey, ...] = ()

    @classmethod
    def of(
        cls, trust: TrustRoots | Mapping[str, Any], coordinators: Sequence[Ed25519PublicKey] = ()
    ) -> TrustRoots:
        """Trust roots from ``{site_id: admin key(s)}`` (or as given) and optional coordinator pins."""
        if isinstance(trust, TrustRoots):
            return trust
        admins = {str(k): tuple(v) if isinstance(v, (list, tuple)) else (v,) for k, v in trust.items()}
        return cls(admins, tuple(coordinators))

    def describe(self) -> list[str]:
        """One line per trusted key: its role and fingerprint."""
        out = [
            f"site {sid} administrator {fingerprint(k)}"
            for sid, ks in sorted(self.site_admins.items())
            for k in ks
        ]
        return out + [f"coordinator {fingerprint(k)}" for k in self.coordinators]


def role_bound_roots(res: VerificationResult, trust: Any, refusal: str) -> TrustRoots | None:
    """``trust`` as :class:`TrustRoots`; a flat list of keys (one key trusted for every role) fails the check
    "trusted keys" with ``refusal``, the line that tells how to bind them."""
    if isinstance(trust, (TrustRoots, Mapping)):
        return TrustRoots.of(trust)
    res.add("trusted keys", False, refusal)
    return None


def verify_release(
    release_dir: str | Path, trust: TrustRoots | Mapping[str, Any], public: str | Path | None = None
) -> VerificationResult:
    """Verify everything offline; never raises for a bad release (see ``result.ok`` / ``result.reason()``).

    ``public``: the path of the job's public pretraining set (``verify --public PATH``), loaded as ``train
    --public`` loads it (the signed job's ``[job]`` load options, its ``[public]`` shape): it must hash to the
    signed job's ``[public] sha256``. Without it a job's public set is shown, not checked.

    ``trust``: :class:`TrustRoots` or ``{site_id: admin public key(s)}``. A flat list of keys is refused: a
    key trusted for everything lets a coordinator sign a site's spend or one site sign for another.
    """
    rd = Path(release_dir)
    res = VerificationResult(release_dir=str(rd))
    roots = role_bound_roots(
        res,
        trust,
        "trusted keys must be bound to roles: give each site's administrator key "
        "as SITE_ID=KEY.pub (the coordinator key then comes from the sites' signed policies)",
    )
    if roots is None:
        return res
    res.trusted = roots.describe()
    if not roots.site_admins:
        res.add("trusted keys", False, "no site administrator keys given (--trusted SITE_ID=ADMIN_KEY.pub)")
        return res
    doc = _read_manifest_doc(res, rd / MANIFEST_FILE)
    if doc is None:
        return res
    man = doc["manifest"]
    res.manifest = man
    res.manifest_sha256 = _guard(res, "manifest", lambda: sha256_hex(canonical_json(man)))
    listed = man.get("sites") if isinstance(man.get("sites"), list) else []

    def format_of(sites: list[Any]) -> str:
        return manifest_format(man["generator"]["sampler"], man.get("starts"), man.get("aux_starts"), sites)

    fmt = _guard(res, "manifest format", lambda: format_of(listed))
    # the format of the same release before its start-image records gave figures per patient: such a release
    # still verifies, against the words it signed (warned at its records)
    before = _guard(res, "manifest format", lambda: format_of([])) if fmt is not None else None
    res.per_patient_claims = not (fmt == FORMAT_VERSION_PATIENT and man.get("format_version") == before)
    res.add(
        "manifest format",
        man.get("format_version") == fmt or not res.per_patient_claims,
        f"format_version {man.get('format_version')!r}"
        + (
            ""
            if man.get("format_version") in (fmt, before)
            else f", expected {fmt!r} for this sampler/starts"
        ),
    )
    job = _guard(res, "job", lambda: _job_of(res, man))
    if job is not None:
        _guard(res, "sampler", lambda: _check_sampler(res, rd, man, job))
        _guard(res, "public data", lambda: check_public(res, job.body.get("config") or {}, public))
    sites = man.get("sites")
    if not isinstance(sites, list) or not sites:
        res.add("sites", False, "manifest lists no sites: a release needs each site's signed spend statement")
        return res
    allowed: list[dict[str, Any]] = []
    for sid, site in _sites_against_job(res, sites, job):
        keys = _guard(res, f"site {sid}", functools.partial(_check_site, res, rd, man, sid, site, roots, job))
        allowed.append(keys or {})
    _guard(res, "manifest signature", lambda: _check_coordinator(res, rd, doc, job, allowed, roots))
    _check_release_files(res, rd, man)
    return res


def _check_release_files(res: VerificationResult, rd: Path, man: dict[str, Any]) -> None:
    """The files the manifest names, read only once its signature verified (before, an unsigned manifest's
    hash of a decompression bomb or a link to /dev/zero would have been read), each a regular file of the size
    its signed record states (``files.read_regular``)."""
    signature = [c.status for c in res.checks if c.name == "manifest signature"]
    if "pass" not in signature or "fail" in signature:
        # noted, not failed again: the failed signature already refuses the release (a fail, should none be
        # there)
        res.add(
            "release files",
            False,
            "not read: the manifest's signature did not verify, so nothing it names "
            "(generator, central images, aux images) is read or hashed",
            warn=not res.ok,
        )
        return
    _guard(res, "generator", lambda: _check_generator(res, rd, man))
    _guard(res, "central images", lambda: _check_starts(res, rd, man))
    _guard(res, "aux images", lambda: _check_aux_starts(res, rd, man))


def _read_manifest_doc(res: VerificationResult, path: Path) -> dict[str, Any] | None:
    try:
        raw = read_regular(
            path, limit=MAX_MANIFEST_BYTES, error=ReleaseError, what="manifest", fix=TAKE_AS_PUBLISHED
        )
    except ReleaseError as exc:
        res.add("manifest", False, str(exc))
        return None
    try:
        doc = loads_strict(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        res.add("manifest", False, f"{path}: not valid JSON ({exc})")
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("manifest"), dict):
        res.add("manifest", False, f'{path}: expected {{"manifest": {{...}}, "signature": {{...}}}}')
        return None
    return doc


@dataclass(frozen=True)
class _Job:
    body: dict[str, Any]
    envelope: dict[str, Any]
    digest: str
    sites: tuple[str, ...]


def _job_of(res: VerificationResult, man: dict[str, Any]) -> _Job | None:
    """The coordinator-signed job inside the manifest (its signer is checked with the manifest's)."""
    mj = man["job"]
    env = mj.get("signed")
    if not isinstance(env, dict) or not isinstance(env.get("job"), dict):
        res.add(
            "job",
            False,
            "the manifest carries no signed job (job.signed): the list of sites the release "
            "must account for is unknown",
        )
        return None
    body = env["job"]
    problems = []
    if body.get("job_id") != mj.get("job_id"):
        problems.append(f"signed job is {body.get('job_id')!r}, the manifest says {mj.get('job_id')!r}")
    if body.get("config") != mj.get("config"):
        problems.append("the manifest's job config differs from the signed job's")
    if list(body.get("sites") or []) != list(mj.get("sites") or []):
        problems.append(f"the manifest lists sites {mj.get('sites')}, the signed job {body.get('sites')}")
    job = _Job(body, env, sha256_hex(canonical_json(body)), tuple(str(s) for s in body.get("sites") or ()))
    res.add(
        "job",
        not problems,
        "; ".join(problems)
        if problems
        else f"job {body.get('job_id')} for site(s) {', '.join(job.sites)} (sha256 {job.digest[:16]}…)",
    )
    return job if not problems else None


def public_words(section: Mapping[str, Any]) -> str:
    """One line on what the model saw before any private image (a signed job's ``[public]``)."""
    parts = []
    if section.get("sha256"):
        shape = "x".join(str(v) for v in section.get("shape") or [])
        desc = f" ({section['description']})" if section.get("description") else ""
        parts.append(
            f"public set of {section.get('count')} images {shape}{desc}, sha256 {section['sha256'][:16]}…"
        )
    if section.get("pretrained_sha256"):
        parts.append(f"pretrained model file sha256 {section['pretrained_sha256'][:16]}…")
    return "pretrained before any private image on a " + " and a ".join(parts) + " (public: no privacy cost)"


def check_public(res: VerificationResult, config: Mapping[str, Any], public: str | Path | None) -> None:
    """Show the signed job's public pretraining (a pass: it costs no epsilon); with ``public`` (a path) given,
    the set there must be the one the job names (its canonical hash, count and shape)."""
    section = config.get("public")
    if not isinstance(section, Mapping):
        if public is not None:
            res.add(
                "public data", False, "the signed job names no public pretraining set, but --public was given"
            )
        return
    words = public_words(section)
    if public is None:
        res.add(
            "public data",
            True,
            words + ("; give --public PATH to check the set's hash" if section.get("sha256") else ""),
        )
        return
    if not section.get("sha256"):
        res.add(
            "public data", False, f"{public}: the signed job names a pretrained model file, no public set"
        )
        return
    from ..data.loading import LoadOptions
    from ..data.public import load_public, public_problem

    job = config.get("job") or {}
    opts = LoadOptions(
        resize=job.get("resize", "refuse"), image_size=job.get("image_size"), window=job.get("window", "auto")
    )
    try:
        ds = load_public(public, opts, tuple(int(v) for v in section.get("shape") or ()))  # type: ignore[arg-type]
    except FetaError as exc:
        res.add("public data", False, str(exc))
        return
    problem = public_problem(dict(section), ds)
    res.add("public data", problem is None, f"{public}: {problem}" if problem else words + "; hash checked")


def _check_sampler(res: VerificationResult, rd: Path, man: dict[str, Any], job: _Job) -> None:
    """The released sampler is the signed job's ``[sampler]`` as export releases it
    (``manifest.released_sampler``; only ``export --solver/--steps`` may differ): the sites ran a job whose
    sampler says which start files (central images, aux pool) the release may ship and how the generator
    samples."""
    sampler = man["generator"]["sampler"]
    bad = sampler_problem(sampler, job.body.get("config") or {}, central_images=man.get("starts") is not None)
    res.add(
        "sampler",
        bad is None,
        f"{rd / MANIFEST_FILE}: {bad}; the release's sampler is not the signed job's, "
        "do not use it (export the release again from the job; only --solver/--steps may differ)"
        if bad
        else f"the signed job's [sampler] ({', '.join(EXPORT_SAMPLER_OVERRIDES)} may be set at export)",
    )


def _sites_against_job(
    res: VerificationResult, sites: list[Any], job: _Job | None
) -> list[tuple[str, dict[str, Any]]]:
    """(site id, record) for each site to check; every site the signed job lists must be present."""
    out: list[tuple[str, dict[str, Any]]] = []
    seen: set[str] = set()
    for i, site in enumerate(sites):
        sid = site.get("site_id") if isinstance(site, dict) else None
        if not isinstance(sid, str) or not SITE_ID_RE.fullmatch(sid):
            res.add(
                f"site #{i}",
                False,
                f"site id {sid!r} is not a plain name (a letter or digit, then up to 63 of "
                "letters, digits, '.', '_', '-')",
            )
            continue
        if sid in seen:
            res.add(f"site {sid}", False, "listed twice in the manifest")
            continue
        seen.add(sid)
        out.append((sid, site))
    if job is not None:
        for sid in job.sites:
            if sid not in seen:
                res.add(
                    f"site {sid}",
                    False,
                    f"the signed job lists site {sid} but the release has no final "
                    "attestation from it (a release cannot leave a site out)",
                )
        extra = sorted(seen - set(job.sites))
        if extra:
            res.add("sites", False, f"site(s) {', '.join(extra)} are not in the signed job")
    return out


def _check_coordinator(
    res: VerificationResult,
    rd: Path,
    doc: dict[str, Any],
    job: _Job | None,
    allowed: list[dict[str, Any]],
    roots: TrustRoots,
) -> None:
    """The manifest and the job must be signed by ONE coordinator key that every site's policy allows."""
    name = "manifest signature"
    if not allowed or any(not a for a in allowed):
        res.add(
            name,
            False,
            "not every site's signed policy could be read, so no coordinator key is allowed by "
            "all of them; the manifest signer cannot be trusted",
        )
        return
    common = set(allowed[0]).intersection(*allowed[1:])
    if roots.coordinators:
        common &= {full_fingerprint(k) for k in roots.coordinators}
    keys = [k for k in (_allowed_key(fp, allowed, doc) for fp in sorted(common)) if k is not None]
    if not keys:
        res.add(
            name,
            False,
            "no coordinator key is allowed by every site's policy"
            + (" and pinned with --coordinator" if roots.coordinators else ""),
        )
        return
    path = rd / MANIFEST_FILE
    try:
        signer = verify_document(
            doc["manifest"], doc.get("signature"), keys, what=f"{path} (coordinator signature)"
        )
    except FetaError as exc:
        res.add(
            name,
            False,
            f"{exc} (the manifest must be signed by a coordinator key that every site's policy allows)",
        )
        return
    res.add(name, True, f"signed by coordinator key {signer}, allowed by every site's policy")
    if job is not None:
        from ..policy.envelope import open_envelope

        open_envelope(
            job.envelope, "job", [k for k in keys if fingerprint(k) == signer], "signed job in manifest"
        )
        res.add("job signature", True, f"the job is signed by the same coordinator key {signer}")


def _read_release_file(
    res: VerificationResult, rd: Path, name: Any, check: str, what: str, *, limit: int, size: Any = None
) -> tuple[Path, bytes] | None:
    """The bytes of a file the manifest names, which must be a plain file name inside the release directory (a
    signed manifest still must not point outside it), a regular file reached through no link, of the ``size``
    its signed record states (records written before sizes were signed: ``limit`` alone); a failed check is
    recorded under ``check``."""
    if not isinstance(name, str) or "/" in name or "\\" in name or name.startswith("."):
        res.add(check, False, f"{what} name {name!r} must be a plain file name in the release")
        return None
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        res.add(check, False, f"{what} size {size!r} in the manifest is not a byte count")
        return None
    path = rd / name
    try:
        return path, read_regular(
            path, limit=limit, size=size, root=rd, error=ReleaseError, what=what, fix=TAKE_AS_PUBLISHED
        )
    except ReleaseError as exc:
        res.add(check, False, str(exc))
        return None


def _hash_agrees(res: VerificationResult, check: str, path: Path, digest: str, signed: Any) -> bool:
    """The file's sha256 is the one its signed record states; a changed file fails ``check``."""
    if digest == signed:
        return True
    res.add(
        check,
        False,
        f"{path}: sha256 {digest[:16]}… != manifest {str(signed)[:16]}… "
        "(file changed); take the release as it was published",
    )
    return False


def _read_signed_file(
    res: VerificationResult, rd: Path, rec: dict[str, Any], check: str, what: str, *, limit: int
) -> tuple[Path, bytes] | None:
    """The bytes of the file a manifest record (``file``, ``size``, ``sha256``) names, read as
    :func:`_read_release_file` reads them and of the signed hash; a failure is recorded under ``check``."""
    read = _read_release_file(res, rd, rec.get("file"), check, what, limit=limit, size=rec.get("size"))
    if read is None or not _hash_agrees(res, check, read[0], sha256_hex(read[1]), rec.get("sha256")):
        return None
    return read


def _check_generator(res: VerificationResult, rd: Path, man: dict[str, Any]) -> None:
    gen = man["generator"]
    read = _read_release_file(
        res,
        rd,
        gen["file"],
        "generator file",
        "generator file",
        limit=MAX_GENERATOR_BYTES,
        size=gen.get("size"),
    )
    if read is None:
        return
    gpath, data = read
    digest = sha256_hex(data)
    res.generator_sha256 = digest
    if not _hash_agrees(res, "generator hash", gpath, digest, gen["sha256"]):
        return
    res.add("generator hash", True, f"{gpath}: sha256 {digest[:16]}… matches the manifest")
    res.generator_bytes = data
    meta = _generator_metadata(data, gpath)
    want = {
        "feta.classes": gen["classes"],
        "feta.image_shape": gen["image_shape"],
        "feta.sampler": gen["sampler"],
        "feta.format": GENERATOR_FORMATS["start_sigma" in gen["sampler"]],
        "feta.statement_sha256": statement_sha256(man["job"], man["sites"]),
    }
    bad = []
    for key, expected in want.items():
        got = meta.get(key)
        if key not in ("feta.statement_sha256", "feta.format") and got is not None:
            got = json.loads(got)
        if got != expected:
            bad.append(f"{key} is {got!r}, manifest says {expected!r}")
    res.add(
        "generator metadata",
        not bad,
        "; ".join(bad)
        if bad
        else "classes, image shape, sampler and job/privacy statement hash agree with the manifest",
    )


def _check_starts(res: VerificationResult, rd: Path, man: dict[str, Any]) -> None:
    """The released central images the SDEdit sampler starts from: hashed in the signed manifest."""
    from .starts import load_starts

    sampler = man["generator"]["sampler"]
    # start_source "aux" starts from the aux pool only: it needs (and ships) no central images
    rec, sdedit = (
        man.get("starts"),
        "start_sigma" in sampler and sampler.get("start_source", "central") != "aux",
    )
    if rec is None:
        if sdedit:
            res.add(
                "central images",
                False,
                "the sampler has start_sigma but the manifest names no central images "
                "(starts): the release is incomplete",
            )
        return
    read = _read_signed_file(res, rd, rec, "central images", "central images file", limit=MAX_IMAGES_BYTES)
    if read is None:
        return
    path, data = read
    gen = man["generator"]
    claims = _starts_claims_match(res, man, rec)  # first: its count bounds what the file may inflate to
    if claims is None:
        return
    images, labels = load_starts(
        data, str(path), tuple(gen["image_shape"]), len(gen["classes"]), count=int(claims["images"])
    )
    wrong = starts_count_problem(labels, claims["per_class"])
    if wrong:
        res.add("central images", False, f"{path}: {wrong}; not this job's central release")
        return
    res.starts_bytes, res.starts_claims = data, claims
    res.add(
        "central images",
        sdedit,
        f"{path}: {len(images)} released central images, sha256 matches the manifest"
        + ("" if sdedit else "; but the sampler has no start_sigma or starts from aux images only"),
    )
    _warn_per_image_only(res, man, "central images", "central")


def _warn_per_image_only(res: VerificationResult, man: dict[str, Any], name: str, stage: str) -> None:
    """A format 2/3 record of a release with a patient-level site (exported before the per-patient figures)
    states its stage per image only: it verified as signed; the warning gives the figures per patient that
    the site's caps bound, from its signed history, so that no reader takes the per-image one for the
    patient's."""
    if res.per_patient_claims:
        return
    figures = patient_figures([s["attestation"]["statement"] for s in man["sites"]], stage)
    if figures is None:
        return
    # the words a format 4 record gives them in, the worst case under secure aggregation included
    res.add(
        name,
        False,
        f"format_version {man.get('format_version')!r}, exported before its record gave figures per patient, "
        f"states the {stage} stage per IMAGE only.{patient_words(figures)}",
        warn=True,
    )


def _check_aux_starts(res: VerificationResult, rd: Path, man: dict[str, Any]) -> None:
    """The aux-generator pool a ``start_source`` aux/mix sampler starts from: present exactly when the sampler
    says so, hashed in the signed manifest, of the generator's shape and classes, its record recomputed from
    signed inputs (:func:`aux_claims`): missing, changed or reshaped is one clear line."""
    from .starts import load_starts

    rec, src = man.get("aux_starts"), man["generator"]["sampler"].get("start_source", "central")
    needed = "start_sigma" in man["generator"]["sampler"] and src in ("aux", "mix")
    if rec is None:
        if needed or src != "central":
            res.add(
                "aux images",
                False,
                f"the sampler's start_source is {src!r} but the manifest names no aux-generator "
                "images (aux_starts): the release is incomplete; take the release as it was published",
            )
        return
    if not needed:
        res.add(
            "aux images",
            False,
            f"the manifest names aux-generator images but the sampler's start_source is "
            f"{src!r}: the release is inconsistent; do not use it",
        )
        return
    read = _read_signed_file(res, rd, rec, "aux images", "aux-generator images file", limit=MAX_IMAGES_BYTES)
    if read is None:
        return
    path, data = read
    gen = man["generator"]
    statements = [s["attestation"]["statement"] for s in man["sites"]]
    want = aux_claims(
        man["job"]["config"], statements, len(gen["classes"]), per_patient=res.per_patient_claims
    )
    _, labels = load_starts(
        data,
        str(path),
        tuple(gen["image_shape"]),
        len(gen["classes"]),
        what="aux-images",
        count=int(want["images"]),
    )
    bad = _claim_problems("aux_starts", rec, want, "frequency_epsilon")
    have = [int((labels == c).sum()) for c in range(len(gen["classes"]))]
    if have != want["per_class"]:
        bad.append(f"{path} holds {have} images per class, the record {want['per_class']}")
    if bad:
        res.add(
            "aux images", False, "; ".join(bad) + " (not the pool this job's release ships; do not use it)"
        )
        return
    res.aux_bytes, res.aux_claims = data, want
    res.add("aux images", True, f"{path}: {len(labels)} aux-generator images, sha256 matches the manifest")
    _warn_per_image_only(res, man, "aux images", "frequency")


def _starts_claims_match(
    res: VerificationResult, man: dict[str, Any], rec: dict[str, Any]
) -> dict[str, Any] | None:
    """The record's claims recomputed from the signed job config and the sites' SIGNED statements (the same
    figures the certificate uses); a field that differs fails the check, named."""
    statements = [s["attestation"]["statement"] for s in man["sites"]]
    want = starts_claims(
        man["job"]["config"],
        statements,
        len(man["generator"]["classes"]),
        per_patient=res.per_patient_claims,
    )
    bad = _claim_problems("starts", rec, want, "central_epsilon")
    if bad:
        res.add(
            "central images",
            False,
            "; ".join(bad) + " (the coordinator's record of the central images is not "
            "what the signed inputs say; do not use this release)",
        )
        return None
    return want


def _claim_problems(name: str, rec: dict[str, Any], want: dict[str, Any], figures: str) -> list[str]:
    """Each field of a start-image record (``starts`` / ``aux_starts``) that is not what the signed job and
    site histories make it, named; the per-site ε maps (keys starting with ``figures``) compared to the
    tolerance the site figures are checked to, everything else exactly. A field the record should not have is
    named too."""
    bad = [
        f"{name}.{k} is not part of the record"
        for k in sorted(set(rec) - set(want) - {"file", "sha256", "size"})
    ]
    for k, v in want.items():
        got = rec.get(k)
        same = (
            (isinstance(got, dict) and set(got) == set(v) and all(_close(got[s], e) for s, e in v.items()))
            if k.startswith(figures)
            else got == v
        )
        if not same:
            bad.append(
                f"{name}.{k} is {_short(got)}, recomputed from the signed job and site histories {_short(v)}"
            )
    return bad


def _close(got: Any, want: float) -> bool:
    return (
        isinstance(got, (int, float))
        and not isinstance(got, bool)
        and math.isclose(float(got), want, rel_tol=EPS_REL_TOL, abs_tol=1e-12)
    )


def _short(v: Any) -> str:
    text = json.dumps(v, ensure_ascii=False, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _generator_metadata(data: bytes, where: Path) -> dict[str, str]:
    """The model's metadata_props. Parsed with the onnx package (protobuf only, milliseconds) when it is
    installed; otherwise onnxruntime opens the model (a synthesis-only install needs nothing else)."""
    try:
        import onnx
    except ImportError:
        onnx = None  # type: ignore[assignment]
    if onnx is not None:
        try:
            model = onnx.load_model_from_string(data)
        except Exception as exc:  # protobuf's DecodeError and friends
            raise ReleaseError(f"{where}: not a readable ONNX model ({exc})") from None
        refuse_external_data(model, where)
        return {p.key: p.value for p in model.metadata_props}
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    try:  # without onnx: a model that names external data fails to load in the sealed session
        sess = sealed_session(data, so)
    except Exception as exc:  # onnxruntime raises its own exception types for unreadable models
        raise ReleaseError(f"{where}: not a loadable ONNX model ({exc})") from None
    return dict(sess.get_modelmeta().custom_metadata_map)


def _graph_tensors(graph: Any) -> Any:
    """Every tensor of ``graph`` and of its subgraphs (a Loop's body, an If's branches): initializers, sparse
    initializers and tensor-valued node attributes (a Constant's value)."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    yield from _node_tensors(graph.node)


def _node_tensors(nodes: Any) -> Any:
    """The tensors in the attributes of ``nodes`` (a graph's, or a model-local function's), subgraphs
    included."""
    for node in nodes:
        for attr in node.attribute:
            yield from ([attr.t] if attr.HasField("t") else [])
            yield from attr.tensors
            for sparse in ([attr.sparse_tensor] if attr.HasField("sparse_tensor") else []) + list(
                attr.sparse_tensors
            ):
                yield from (sparse.values, sparse.indices)
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _graph_tensors(sub)


def refuse_external_data(model: Any, where: Any) -> None:
    """Refuse a generator with a tensor stored outside the file: onnxruntime would read it from the
    current directory of whoever runs synthesize (a key, patient files) into the images the certificate calls
    differentially private. A released generator holds every weight in its own (hashed) bytes."""
    tensors = [*_graph_tensors(model.graph), *(t for f in model.functions for t in _node_tensors(f.node))]
    named = [t.name or "?" for t in tensors if t.data_location == 1]  # TensorProto.EXTERNAL
    if named:
        raise ReleaseError(
            f"{where}: tensor(s) {', '.join(named[:5])} name external data files; a release's generator "
            "must hold all its weights (an external file is read from wherever synthesize runs, not "
            "hashed in the manifest): export it again as one file"
        )


def sealed_session(model: bytes, so: Any) -> Any:
    """An onnxruntime CPU session of ``model``'s bytes that can read no file: external data (resolved from the
    current directory for a model given as bytes) is pointed at an empty folder made for this load only."""
    import tempfile

    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="feta-onnx-sealed-") as empty:
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", empty)
        return ort.InferenceSession(model, sess_options=so, providers=["CPUExecutionProvider"])


def _check_site(
    res: VerificationResult,
    rd: Path,
    man: dict[str, Any],
    sid: str,
    site: dict[str, Any],
    roots: TrustRoots,
    job: _Job | None,
) -> dict[str, Any] | None:
    """Check one site; return the coordinators its signed policy allows (full fingerprint → key or None)."""
    admins = roots.site_admins.get(sid)
    if not admins:
        res.add(
            f"site {sid} policy",
            False,
            f"no administrator key given for site {sid} "
            f"(--trusted {sid}=ADMIN_KEY.pub): its policy, and so its site key, cannot be trusted",
        )
        return None
    ppath = rd / policy_file_name(sid)
    if not ppath.exists() and not ppath.is_symlink():
        res.add(
            f"site {sid} policy",
            False,
            f"{policy_file_name(sid)} not in the release: without the site's "
            "signed policy neither its key nor its caps can be checked",
        )
        return None
    try:
        policy, digest, admin = _load_signed_policy(ppath, list(admins), rd)
    except FetaError as exc:
        res.add(
            f"site {sid} policy", False, f"{exc} (a site's policy must be signed by its administrator key)"
        )
        return None
    if policy.get("site_id") != sid:
        res.add(f"site {sid} policy", False, f"{ppath.name} is the policy of site {policy.get('site_id')!r}")
        return None
    coordinators = _policy_coordinators(policy)
    if not _check_attestation(res, man, sid, site, policy, job):
        return coordinators  # figures signed by the wrong key are not worth recomputing
    st = site["attestation"]["statement"]
    events = events_from_list(st["events"])
    _check_epsilon(res, sid, st, events)
    problems = policy_violations(policy, st, events)
    if job is not None:
        problems += secure_assumption_violations(policy, st, events, job.sites, job.body.get("config") or {})
    if digest != st.get("policy_sha256"):
        problems.insert(
            0, f"{ppath.name} has hash {digest[:16]}…, the site attested {str(st.get('policy_sha256'))[:16]}…"
        )
    if not problems:  # what the report shows: these bytes, never the file read again
        res.policies[sid] = policy
    res.add(
        f"site {sid} policy",
        not problems,
        "; ".join(problems)
        if problems
        else f"signed by site administrator {admin}; within policy v{policy.get('version')} (per-job ε ≤ "
        f"{policy['budget']['per_job']['epsilon']}, δ ≤ {policy['budget']['per_job']['delta']}, every σ at "
        "or above its minimum)",
    )
    return coordinators


def _policy_coordinators(policy: dict[str, Any]) -> dict[str, Ed25519PublicKey | None]:
    """Allowed coordinators by FULL key fingerprint (sha256 of the raw key): a PEM entry gives the key, a
    64-hex entry only its hash (None). A 64-bit short fingerprint is not a key and allows nothing."""
    out: dict[str, Ed25519PublicKey | None] = {}
    for c in policy.get("coordinators", []):
        if isinstance(c, str) and c.lstrip().startswith("-----BEGIN"):
            k = load_public_key(c.encode())
            out[full_fingerprint(k)] = k
        elif isinstance(c, str) and re.fullmatch(r"[0-9a-f]{64}", c):
            out.setdefault(c, None)
    return out


def _allowed_key(fp: str, allowed: list[dict[str, Any]], doc: dict[str, Any]) -> Ed25519PublicKey | None:
    """The key with full fingerprint ``fp``: from a policy that names it in PEM, else the manifest signature's
    embedded key when its FULL hash is ``fp`` (a preimage of all 256 bits, not 64)."""
    for a in allowed:
        if a.get(fp) is not None:
            return a[fp]
    sig = doc.get("signature")
    pem = sig.get("public_key") if isinstance(sig, dict) else None
    if isinstance(pem, str):
        k = load_public_key(pem.encode())
        if full_fingerprint(k) == fp:
            return k
    return None


def _check_attestation(
    res: VerificationResult,
    man: dict[str, Any],
    sid: str,
    site: dict[str, Any],
    policy: dict[str, Any],
    job: _Job | None,
) -> bool:
    name = f"site {sid} attestation"
    att = site["attestation"]
    st = att["statement"]
    pem = policy.get("site_key")
    if not isinstance(pem, str):
        res.add(name, False, f"site {sid}'s signed policy names no site_key, so no key may sign its spend")
        return False
    site_key = load_public_key(pem.encode())
    try:
        signer = verify_document(st, att["signature"], [site_key], what=f"site {sid} attestation")
    except FetaError as exc:
        res.add(
            name,
            False,
            f"{exc}: only the site key that site {sid}'s own signed policy names "
            f"({fingerprint(site_key)}) may sign its spend statement",
        )
        return False
    problems = []
    if st.get("kind") != ATTESTATION_KIND:
        problems.append(f"statement kind {st.get('kind')!r} is not {ATTESTATION_KIND!r}")
    if st.get("site_id") != sid:
        problems.append(f"statement is for site {st.get('site_id')!r}")
    mismatched = [k for k in ATTESTED_FIELDS if site.get(k) != st.get(k)]
    if site.get("lifetime_epsilon") != (st.get("lifetime") or {}).get("epsilon"):
        mismatched.append("lifetime_epsilon")
    if mismatched:
        problems.append(f"manifest figures differ from the signed statement in: {', '.join(mismatched)}")
    if st.get("job_id") != man["job"]["job_id"]:
        problems.append(
            f"statement is for job {st.get('job_id')!r}, the release is job {man['job']['job_id']!r}"
        )
    if st.get("final") is not True:
        problems.append(
            "the statement is not final: the job could still spend at the site after it was signed"
        )
    if job is not None and st.get("job_sha256") != job.digest:
        problems.append(
            f"statement is for signed job {str(st.get('job_sha256'))[:16]}…, the release's job is "
            f"{job.digest[:16]}…"
        )
    res.add(
        name,
        not problems,
        "; ".join(problems)
        if problems
        else f"final spend statement signed by the site key {signer} that its policy names",
    )
    if not problems and st.get("history") != "site-ledger":
        res.add(
            f"site {sid} history",
            False,
            f"the events come from {st.get('history') or 'an unnamed source'}, not "
            "from the site's ledger: a single-site run directory is not signed, so the figures are only as "
            "good as whoever could write it",
            warn=True,
        )
    return not problems


def _check_epsilon(res: VerificationResult, sid: str, st: dict[str, Any], events: list[Any]) -> None:
    stated = float(st["epsilon"])
    recomputed = compose_epsilon(events, float(st["delta"]), st["accountant"])
    close = math.isclose(stated, recomputed, rel_tol=EPS_REL_TOL, abs_tol=1e-12)
    res.add(
        f"site {sid} epsilon",
        close,
        f"stated ε = {stated:.6g}, recomputed from {len(events)} event(s) ({st['accountant']}) = "
        f"{recomputed:.6g}"
        + ("" if close else ": the stated figure is not what the history composes to")
        + _per_image_words(st, job_in_unit),
    )
    _check_stated_worst_case(res, sid, st, events)
    life = st.get("lifetime")
    if not isinstance(life, dict):
        res.add(f"site {sid} lifetime", False, "the statement gives no lifetime spend for this dataset")
        return
    life_events = events_from_list(life["events"])
    life_eps = compose_epsilon(life_events, float(life["delta"]), st["accountant"])
    ok = math.isclose(float(life["epsilon"]), life_eps, rel_tol=EPS_REL_TOL, abs_tol=1e-12)
    contains = _contains(life["events"], st["events"])
    res.add(
        f"site {sid} lifetime",
        ok and contains,
        f"lifetime ε = {float(life['epsilon']):.6g} over {len(life_events)} event(s), recomputed "
        f"{life_eps:.6g}"
        + ("" if ok else ": the stated figure is not what the history composes to")
        + ("" if contains else "; the lifetime history does not contain this job's events")
        + _per_image_words(st, lifetime_in_unit),
    )
    _check_lifetime_worst_case(res, sid, st, life_events)


def _per_image_words(st: dict[str, Any], in_unit: Any) -> str:
    """At a patient-level site, that the signed figure a check recomputes composes the events as if each
    protected one image, beside the figure per patient its caps bound (``in_unit``: ``job_in_unit`` or
    ``lifetime_in_unit``); nothing at an image-level site."""
    if statement_patient_cap(st) is None:
        return ""
    fig = in_unit(st)
    return (
        " (per image: the events composed as if each protected one image; the site's unit is the patient: "
        f"ε per patient = {float(fig['epsilon']):.6g})"
        if fig
        else ""
    )


def _check_lifetime_worst_case(
    res: VerificationResult, sid: str, st: dict[str, Any], life_events: list[Any]
) -> None:
    """Secure aggregation over the site's lifetime: the stated ``lifetime_worst_case_epsilon`` (every other
    site colluding in every job) is what the lifetime history composes to at the lifetime δ; a signed figure
    that its history does not support is refused like any other. The cap it must meet,
    ``secure_aggregation.max_lifetime_worst_case_epsilon``, is checked by ``unit_budget_violations``."""
    sa = st.get("secure_aggregation")
    stated = sa.get("lifetime_worst_case_epsilon") if isinstance(sa, dict) else None
    if stated is None and not has_secure_aggregation(life_events):
        return
    name = f"site {sid} lifetime secure aggregation"
    if stated is None:
        res.add(
            name,
            False,
            "the lifetime history has secure-aggregation releases but the statement gives no "
            "lifetime worst-case epsilon (secure_aggregation.lifetime_worst_case_epsilon)",
        )
        return
    worst = worst_case_epsilon(life_events, float(st["lifetime"]["delta"]))
    ok = math.isclose(float(stated), worst, rel_tol=EPS_REL_TOL, abs_tol=1e-12)
    res.add(
        name,
        ok,
        f"lifetime ε if every other site colluded in every job = {float(stated):.6g}, recomputed "
        f"{worst:.6g}" + ("" if ok else ": the stated figure is not what the lifetime history composes to"),
    )


def _check_stated_worst_case(
    res: VerificationResult, sid: str, st: dict[str, Any], events: list[Any]
) -> None:
    """Secure aggregation: the worst case (every other site colludes) recomputed, stated in plain words."""
    sa = st.get("secure_aggregation")
    if not has_secure_aggregation(events) and sa is None:
        return
    if not isinstance(sa, dict):
        res.add(
            f"site {sid} secure aggregation",
            False,
            "the history has secure-aggregation releases but the statement gives no worst-case epsilon",
        )
        return
    worst = worst_case_epsilon(events, float(st["delta"]))
    ok = math.isclose(float(sa["worst_case_epsilon"]), worst, rel_tol=EPS_REL_TOL, abs_tol=1e-12)
    res.add(
        f"site {sid} secure aggregation",
        ok,
        f"ε if every other site colluded = {float(sa['worst_case_epsilon']):.6g}"
        f", recomputed {worst:.6g}"
        + ("" if ok else ": the stated figure is not what the history composes to"),
    )
    if ok:  # the figure is right; what it rests on is a caveat to read, not a check that passed
        eps, worst, what = secure_figures(st, events, float(st["delta"]), worst)
        res.note(
            f"site {sid} trust assumption",
            secure_words(eps, worst, float(st["delta"]), int(sa.get("max_colluders", 0)), what),
        )


def secure_figures(
    st: dict[str, Any], events: Sequence[Any], delta: float, worst: float
) -> tuple[float, float, str]:
    """(ε assumed, ε if every other site colluded, their unit) of a site's statement under secure
    aggregation: per patient at a patient-level site (``patient_epsilon`` over its signed cap, as its ledger
    caps it), else the statement's image-level figure and ``worst`` (its recomputed worst case)."""
    cap = statement_patient_cap(st)
    if cap is None:
        return float(st["epsilon"]), worst, "ε"
    acc = st.get("accountant", "rdp")
    per, worst_p = (patient_epsilon(list(events), delta, cap, acc, view=v) for v in ("assumed", "worst_case"))
    return per, worst_p, "ε per patient"


def secure_words(eps: float, worst: float, delta: float, colluders: int, what: str = "ε") -> str:
    """The two epsilons of a site under secure aggregation, in plain words (``what``: the ε's unit)."""
    if math.isclose(float(eps), worst, rel_tol=EPS_REL_TOL, abs_tol=1e-12):
        return (
            f"secure aggregation: {what} = {float(eps):.3g} (δ = {delta:g}) counts this site's own noise "
            "share only (its policy pins no other site's key under secure_aggregation.peers, or assumes "
            "every other site may collude with the coordinator), so it holds whoever colludes"
        )
    who = "no other site colludes" if colluders == 0 else f"at most {colluders} other site(s) collude"
    return (
        f"secure aggregation: {what} = {float(eps):.3g} (δ = {delta:g}) holds if {who} with the coordinator "
        f"(the noise shares of the honest sites protect this site's images); if every other site colluded, "
        f"{what} would be {worst:.3g} (this site's own noise share only)"
    )


def _contains(life: list[Any], job: list[Any]) -> bool:
    pool = [canonical_json(e) for e in life]
    for e in job:
        c = canonical_json(e)
        if c not in pool:
            return False
        pool.remove(c)
    return True


def _load_signed_policy(
    ppath: Path, trusted: list[Ed25519PublicKey], rd: Path
) -> tuple[dict[str, Any], str, str]:
    """(policy document, its sha256, signer fingerprint) of a signed policy file, checked against ``trusted``.

    Signature and schema only: a policy that has expired since the job ran still says what the job was
    allowed to spend, so the validity window is not checked here. Read before the manifest's signature is
    checked (the policies name the coordinator keys that may sign it), so as a regular file below ``rd``
    through no link, of at most ``MAX_POLICY_BYTES``.
    """
    from ..policy import open_signed_policy
    from ..signing import DuplicateKeyError

    raw = read_regular(
        ppath,
        limit=MAX_POLICY_BYTES,
        error=ReleaseError,
        what="signed policy",
        root=rd,
        fix=TAKE_AS_PUBLISHED,
    )
    try:
        envelope = loads_strict(raw.decode("utf-8"))
    except DuplicateKeyError as exc:
        raise ReleaseError(
            f"{ppath}: signed policy refused: {exc}; a signed document names each key once"
        ) from None
    except ValueError as exc:  # also UnicodeDecodeError
        raise ReleaseError(f"{ppath}: signed policy is not JSON ({exc}); signed documents are JSON") from None
    pol = open_signed_policy(envelope, trusted, str(ppath))
    return dict(pol.document), pol.digest, pol.signer or ""


COUNT_STAGES = (SIZE_STAGE, PATIENTS_STAGE)


def policy_violations(policy: dict[str, Any], st: dict[str, Any], events: list[Any]) -> list[str]:
    """Every way the attested spend exceeds the site's policy (empty list: within it)."""
    out: list[str] = []
    if policy.get("site_id") != st.get("site_id"):
        out.append(f"policy is for site {policy.get('site_id')!r}, not {st.get('site_id')!r}")
    cap = policy["budget"]["per_job"]
    eps, delta = float(st["epsilon"]), float(st["delta"])
    if eps > float(cap["epsilon"]) * (1 + EPS_REL_TOL):
        out.append(f"ε = {eps:.4g} exceeds the per-job cap {cap['epsilon']}")
    if delta > float(cap["delta"]):
        out.append(f"δ = {delta:g} exceeds the per-job cap {cap['delta']}")
    if policy.get("accountant") and policy["accountant"] != st.get("accountant"):
        out.append(f"accountant {st.get('accountant')!r} differs from the policy's {policy['accountant']!r}")
    size = policy.get("dataset", {}).get("size")
    out += lifetime_violations(policy, st)
    out += unit_violations(policy, st, events)
    out += unit_budget_violations(policy, st, events)
    patients = policy.get("dataset", {}).get("patients") if _unit_of(policy) == "patient" else None
    mech = policy.get("mechanisms", {})
    steps_by_stage: dict[str, int] = {}
    for e in events:
        # a noisy count of the site's own size (sensitivity 1): no mechanism rule bounds
        if e.stage in COUNT_STAGES:
            continue  # it; its epsilon is in the composed totals checked against the caps above
        rules = mech.get(e.stage)
        if rules is None or not rules.get("allowed", False):
            out.append(f"stage {e.stage!r} is not allowed by the policy")
            continue
        steps_by_stage[e.stage] = steps_by_stage.get(e.stage, 0) + e.steps
        # a Skellam event: min_sigma bounds the site's OWN noise share (sqrt(mu_worst) / l2), not the pooled
        # sum's
        sigma = skellam_own_sigma(e) if isinstance(e, SkellamEvent) else getattr(e, "sigma", None)
        if "min_sigma" in rules and sigma is not None and sigma < float(rules["min_sigma"]) * (1 - 1e-12):
            out.append(
                f"{e.stage}: σ = {sigma:.4g} (own noise share) is below the policy minimum "
                f"{rules['min_sigma']}"
                if isinstance(e, SkellamEvent)
                else f"{e.stage}: σ = {sigma:.4g} is below the policy minimum {rules['min_sigma']}"
            )
        # patient-level DP-SGD samples the public patients
        n = patients if e.stage == "dpsgd" and patients else size
        if "max_batch" in rules and n and e.q * n > float(rules["max_batch"]) * (1 + 1e-9):
            out.append(
                f"{e.stage}: expected batch q·N = {e.q * n:.1f} exceeds max_batch {rules['max_batch']}"
            )
    if has_secure_aggregation(events):
        sa = policy.get("secure_aggregation", {})
        cap_w = worst_case_epsilon_cap(sa.get("max_worst_case_epsilon"), cap["epsilon"])
        worst = worst_case_epsilon(events, delta)
        if worst > float(cap_w) * (1 + EPS_REL_TOL):
            out.append(
                f"worst-case ε = {worst:.4g} (every other site colluding) exceeds "
                f"secure_aggregation.max_worst_case_epsilon {float(cap_w):g}"
            )
    limits = {"central": "max_rounds", "dpsgd": "max_steps"}
    for stage, total in steps_by_stage.items():
        key = limits.get(stage)
        if key and key in mech[stage] and total > int(mech[stage][key]):
            out.append(f"{stage}: {total} rounds/steps exceed {key} {mech[stage][key]}")
    return out


def unit_budget_violations(policy: dict[str, Any], st: dict[str, Any], events: list[Any]) -> list[str]:
    """The attested histories against the signed caps IN THE UNIT THE CAPS BOUND, recomputed as the site's
    ledger holds them (``ledger.Budget.from_policy``, ``check_spend``) at the caps' own δ.

    - a patient-level policy (``dataset.privacy_unit = "patient"``): ε PER PATIENT
      (``accounting.patient_epsilon``: patient-level DP-SGD as it is, the image-level releases by group
      privacy over ``dataset.patient_cap``) of the job's history against ``budget.per_job`` and
      ``secure_aggregation.max_worst_case_epsilon``, of the lifetime history against ``budget.lifetime``; the
      per-image figures the statement gives do not bound a patient;
    - every policy: the lifetime worst case (every secure-aggregation release of every job seen by a coalition
      of all other sites) against ``secure_aggregation.max_lifetime_worst_case_epsilon`` (default 3 x the
      lifetime ε).
    """
    from ..ledger import Budget

    b = Budget.from_policy(policy)
    life = st.get("lifetime")
    life_events = events_from_list(life["events"]) if isinstance(life, dict) else []
    checks: list[tuple[str, list[Any], float, str, float | None, str]] = [
        (
            "lifetime worst-case ε",
            life_events,
            b.life_delta,
            "worst_case",
            b.lifetime_worst_case_epsilon,
            "secure_aggregation.max_lifetime_worst_case_epsilon",
        )
    ]
    if b.patient_cap is not None:
        checks += [
            (
                "ε per patient of this job",
                events,
                b.delta,
                "assumed",
                b.job_epsilon,
                "budget.per_job.epsilon",
            ),
            (
                "lifetime ε per patient",
                life_events,
                b.life_delta,
                "assumed",
                b.lifetime_epsilon,
                "budget.lifetime.epsilon",
            ),
            (
                "worst-case ε per patient of this job",
                events,
                b.delta,
                "worst_case",
                b.worst_case_epsilon,
                "secure_aggregation.max_worst_case_epsilon",
            ),
        ]
    out = []
    for what, evs, delta, view, cap, rule in checks:
        if cap is None or not evs or (view == "worst_case" and not has_secure_aggregation(evs)):
            continue
        eps = b.spent(evs, delta, view)
        if eps > cap * (1 + EPS_REL_TOL):
            per = f" ({b.per})" if b.per else ""
            out.append(f"{what} = {eps:.4g} at δ = {delta:g}{per} exceeds {rule} {cap:g}")
    return out


def lifetime_violations(policy: dict[str, Any], st: dict[str, Any]) -> list[str]:
    """The site's signed LIFETIME spend (every job on this data) against its signed policy's
    ``budget.lifetime``, as the node's ledger holds it (``ledger.check_spend``): ε of the lifetime history
    recomputed at the CAP's δ with the policy's accountant, so neither a stated figure nor a larger stated δ
    can move it under the cap. A statement without a lifetime is refused by the lifetime check
    (``_check_epsilon``)."""
    life, cap = st.get("lifetime"), (policy.get("budget") or {}).get("lifetime")
    if not isinstance(life, dict) or not isinstance(cap, dict):
        return []
    accountant: Any = policy.get("accountant") or st.get("accountant") or "rdp"
    eps = compose_epsilon(events_from_list(life["events"]), float(cap["delta"]), accountant)
    out = []
    if eps > float(cap["epsilon"]) * (1 + EPS_REL_TOL):
        out.append(
            f"lifetime ε = {eps:.4g} (all of the site's jobs on this data, at δ = {float(cap['delta']):g}) "
            f"exceeds the lifetime cap budget.lifetime.epsilon {cap['epsilon']}"
        )
    if float(life["delta"]) > float(cap["delta"]):
        out.append(
            f"lifetime δ = {float(life['delta']):g} exceeds the lifetime cap budget.lifetime.delta "
            f"{cap['delta']}"
        )
    return out


def _unit_of(policy: dict[str, Any]) -> str:
    return str((policy.get("dataset") or {}).get("privacy_unit", "image"))


def unit_violations(policy: dict[str, Any], st: dict[str, Any], events: list[Any]) -> list[str]:
    """The attested unit of privacy against the site's signed policy: a patient-level policy's DP-SGD events
    are patient-level (and an image-level policy's are not), and a stated ``privacy_unit`` is the one
    recomputed from the policy and the events."""
    from types import SimpleNamespace

    from ..privacy_unit import site_unit_statement

    unit, out = _unit_of(policy), []
    wrong = sorted({e.stage for e in events if e.stage == "dpsgd" and getattr(e, "unit", "image") != unit})
    if wrong:
        out.append(
            f"dpsgd: events are not of the policy's unit {unit!r} (dataset.privacy_unit): the site's DP-SGD "
            "did not run at the unit its policy declares"
        )
    stated = st.get("privacy_unit")
    if stated is None:
        return out + (
            [f"the statement does not say its unit of privacy, the policy makes it the {unit}"]
            if unit == "patient"
            else []
        )
    d = policy.get("dataset") or {}
    want = site_unit_statement(
        SimpleNamespace(privacy_unit=unit, patients=d.get("patients"), patient_cap=d.get("patient_cap")),
        float(st["epsilon"]),
        float(st["delta"]),
        events,
        str(st.get("accountant")),
    )
    same = set(stated) == set(want) and all(
        math.isclose(float(stated[k]), float(v), rel_tol=EPS_REL_TOL, abs_tol=1e-12)
        if isinstance(v, float)
        else stated[k] == v
        for k, v in want.items()
    )
    if not same:
        out.append(
            f"the stated unit of privacy {stated.get('unit')!r} (ε per unit) is not what the policy's "
            f"dataset.privacy_unit = {unit!r} and the events give"
        )
    return out


def secure_assumption_violations(
    policy: dict[str, Any],
    st: dict[str, Any],
    events: list[Any],
    sites: Sequence[str],
    config: dict[str, Any],
) -> list[str]:
    """The attested trust assumption against the signed policy and job: ``max_colluders`` is the policy's (all
    other sites when it pins no peer keys), and each Skellam event counts ``honest_shares(n, t, colluders)``
    shares (mu / mu_worst), with n and the threshold t from the signed job."""
    if not has_secure_aggregation(events):
        return []
    from ..accountants.skellam import honest_shares
    from ..mechanisms.secure_sums import secagg_threshold

    n = len(sites)
    pol_sa = policy.get("secure_aggregation") or {}
    colluders = min(int(pol_sa.get("max_colluders", 0)), n - 1) if pol_sa.get("peers") else n - 1
    attested = (st.get("secure_aggregation") or {}).get("max_colluders")
    out: list[str] = []
    if attested != colluders:
        out.append(
            f"the statement assumes {attested!r} colluding site(s), the policy {colluders} (of the {n - 1} "
            f"other sites; all of them when it pins no peers)"
        )
    try:
        t = secagg_threshold((config.get("federation") or {}).get("secagg_threshold"), n)
    except FetaError as exc:
        return out + [f"the signed job's secure-aggregation threshold: {exc}"]
    h = honest_shares(n, t, colluders)
    for e in events:
        if isinstance(e, SkellamEvent) and not math.isclose(e.mu, h * e.worst_mu, rel_tol=1e-9):
            out.append(
                f"{e.stage}: the Skellam event counts {e.mu / e.worst_mu:.4g} noise shares; threshold {t} "
                f"of {n} sites with {colluders} colluder(s) allows {h}"
            )
    return out


def require_valid(result: VerificationResult) -> VerificationResult:
    """``result`` when the release verified; otherwise ReleaseError naming every failed check."""
    if not result.ok:
        raise ReleaseError(f"release {result.release_dir} refused: {result.reason()}")
    return result


# -- words for people ------------------------------------------------------------------------------------


def merged_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Repeated events of one stage at the same σ and q as one entry with their steps summed (a federated
    ledger records one event per round); in first-seen order. Words only: composition is unchanged."""
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for e in events:
        k = (
            (e["stage"], float(e["sigma"]), float(e["q"]))
            if "sigma" in e
            else (e["stage"], "skellam", float(e["q"]), float(e["mu"]), float(e["l2"]))
        )
        if k in merged:
            merged[k]["steps"] += int(e["steps"])
        else:
            merged[k] = {**e, "steps": int(e["steps"])}
    return list(merged.values())


def describe_site(
    site: dict[str, Any], *, per_image_spend: bool = False, per_image_lead: bool = False
) -> str:
    """One paragraph a data-protection officer can read: the site's total (ε, δ) and what it means. At a
    patient-level site it opens with ε PER PATIENT (the figure its ledger caps), says patients are sampled
    where they are, and gives the per-image figure only as a labelled secondary line; its lifetime and
    secure-aggregation sentences are per patient too.

    The words are signed inside certificates, so older versions' words stay derivable: ``per_image_lead``:
    the paragraph as certificates of versions 2 to 4 signed it (opening with the per-image ε, every stage
    sampling images, the patient figure after); ``per_image_spend``: also the lifetime and secure-aggregation
    sentences per image, as version 2 signed them."""
    eps, delta = float(site["epsilon"]), float(site["delta"])
    st = (site.get("attestation") or {}).get("statement") or {}
    if not per_image_lead and statement_patient_cap(st) is not None:
        return _describe_patient_site(site, st)
    stages, n_stages = _stage_words(site["events"], by_patient=False)
    factor = math.exp(eps)
    return (
        f"Site {site['site_id']}: ε = {eps:.3g} at δ = {delta:g} ({site['accountant'].upper()} accountant), "
        f"the total over all {n_stages} stage(s) that touched its images: {stages}. "
        f"Meaning: whether or not any single image of this site was used, the probability of any outcome of "
        f"this release (the generator and every image generated from it) changes by at most a factor of "
        f"e^{eps:.3g} ≈ {factor:.3g}, except with probability at most {delta:g}."
        + _unit_words(site)
        + _secure_site_words(site, eps, delta, per_image_spend)
        + (_image_lifetime_words(site, eps) if per_image_spend else _lifetime_words(site, eps))
    )


def _stage_words(events: list[dict[str, Any]], *, by_patient: bool) -> tuple[str, int]:
    """(each stage that ran, in words; how many stages). ``by_patient``: patient-level events say that
    PATIENTS are sampled (older certificates signed "image" for every stage)."""
    merged = merged_events(events)
    stages = []
    for e in merged:
        if e["steps"] == 0:
            continue
        word = STAGE_WORDS.get(e["stage"], e["stage"])
        unit = "round" if e["stage"] == "central" else "step"
        count = "once" if e["steps"] == 1 else f"{e['steps']} {unit}s"
        who = "patient" if by_patient and e.get("unit") == "patient" else "image"
        sampled = f"every {who}" if e["q"] >= 1 else f"each {who} with probability {e['q']:.3g}"
        noise = (
            f"noise σ = {e['sigma']:.3g}"
            if "sigma" in e
            else "summed with the other sites by secure aggregation, this site adding its share of the noise"
        )
        stages.append(f"{word} ({noise}, {count}, {sampled})")
    return "; ".join(stages) or "none", len({e["stage"] for e in merged if e["steps"]})


def _describe_patient_site(site: dict[str, Any], st: dict[str, Any]) -> str:
    """A patient-level site's paragraph: ε per patient first (the statement's ``privacy_unit``, which verify
    recomputes from the signed policy and events), the per-image figure as a labelled secondary line."""
    eps, delta = float(site["epsilon"]), float(site["delta"])
    u = st["privacy_unit"]
    pe, pd = float(u["epsilon_per_patient"]), float(u["delta_per_patient"])
    stages, n_stages = _stage_words(site["events"], by_patient=True)
    return (
        f"Site {site['site_id']}: ε per PATIENT = {pe:.3g} at δ = {pd:g} ({site['accountant'].upper()} "
        f"accountant), the total over all {n_stages} stage(s) that touched its patients' images: {stages}. "
        f"Unit of privacy at this site: the PATIENT (at most {u.get('images_per_patient_cap')} image(s) of "
        f"each of about {u.get('public_patients')} patients used). Meaning: whether or not any single "
        "patient's images were used, the probability of any outcome of this release (the generator and every "
        f"image generated from it) changes by at most a factor of e^{pe:.3g} ≈ "
        f"{math.exp(min(pe, 700.0)):.3g}, except with probability at most {pd:g} ({u.get('how', '')}). "
        "Per image (secondary, not the site's unit): "
        f"ε = {eps:.3g} at δ = {delta:g}, the events composed as if each protected one image, less "
        "than one patient can lose." + _secure_site_words(site, eps, delta) + _lifetime_words(site, eps)
    )


def _unit_words(site: dict[str, Any]) -> str:
    """The site's signed unit of privacy, in words (each site of a federation states its own)."""
    u = ((site.get("attestation") or {}).get("statement") or {}).get("privacy_unit")
    if not isinstance(u, dict):
        return ""
    if u.get("unit") == "patient":
        pe, pd = float(u["epsilon_per_patient"]), float(u["delta_per_patient"])
        return (
            f" Unit of privacy at this site: the PATIENT (at most {u.get('images_per_patient_cap')} image(s) "
            f"of each of about {u.get('public_patients')} patients used): whether or not any single patient, "
            "with all of their images, took part, the probability of any outcome changes by at most "
            f"e^{pe:.3g} ≈ {math.exp(min(pe, 700.0)):.3g}, except with probability at most {pd:.3g} (ε per "
            f"patient {pe:.3g}; {u.get('how', '')})."
        )
    return (
        " Unit of privacy at this site: one image (the site declares no patient ids); a person with k images "
        "here is protected only by group privacy, (k·ε, k·e^((k-1)ε)·δ)."
    )


def _secure_site_words(site: dict[str, Any], eps: float, delta: float, per_image: bool = False) -> str:
    """Both figures under secure aggregation; per patient at a patient-level site (``per_image``: as
    version 2 certificates worded them)."""
    events = events_from_list(site["events"])
    if not has_secure_aggregation(events):
        return ""
    st = (site.get("attestation") or {}).get("statement") or {}
    sa = st.get("secure_aggregation") or {}
    colluders = int(sa.get("max_colluders", 0))
    worst = worst_case_epsilon(events, delta)
    if per_image:
        return f" Under {secure_words(eps, worst, delta, colluders)}."
    mine, worst, what = secure_figures(
        {**st, "epsilon": eps, "accountant": site["accountant"]}, events, delta, worst
    )
    return f" Under {secure_words(mine, worst, delta, colluders, what)}."


def lifetime_of(site: dict[str, Any]) -> dict[str, float] | None:
    """The site's signed lifetime spend on this dataset (all its jobs), or None for a statement without
    one."""
    life = ((site.get("attestation") or {}).get("statement") or {}).get("lifetime")
    if not isinstance(life, dict):
        return None
    return {"epsilon": float(life["epsilon"]), "delta": float(life["delta"])}


def _lifetime_words(site: dict[str, Any], job_eps: float) -> str:
    """The lifetime sentence in the site's unit (``privacy_unit.lifetime_in_unit``, as its ledger caps it):
    per patient at a patient-level site, beside this job's ε per patient."""
    st = (site.get("attestation") or {}).get("statement") or {}
    life = lifetime_in_unit(st)
    if life is None or life.get("unit") != "patient":
        return _image_lifetime_words(site, job_eps)
    job = float(st["privacy_unit"]["epsilon_per_patient"])
    return (
        f" Lifetime: this site has spent ε per PATIENT = {life['epsilon']:.3g} at δ = {life['delta']:g} on "
        f"the same patients over all its jobs (this job: ε per patient = {job:.3g}); a release built on an "
        "earlier job's model depends on both, so the lifetime figure is the one that bounds it."
    )


def _image_lifetime_words(site: dict[str, Any], job_eps: float) -> str:
    life = lifetime_of(site)
    if life is None:
        return " The site states no lifetime spend for its data."
    return (
        f" Lifetime: this site has spent ε = {life['epsilon']:.3g} at δ = {life['delta']:g} on the same "
        f"images over all its jobs (this job: ε = {job_eps:.3g}); a release built on an earlier job's model "
        "depends on both, so the lifetime figure is the one that bounds it."
    )
