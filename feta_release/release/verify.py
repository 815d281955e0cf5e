"""Offline verification of a release directory (no network, no torch).

Checks, each reported as one :class:`Check` (all are run, so a refusal lists every reason at once):

* ``manifest.json`` parses and has the expected format version;
* the coordinator's signature over ``canonical_json(manifest)`` verifies against a trusted key;
* the generator file exists, its sha256 equals the manifest's, and its metadata (classes, image shape,
  sampler, statement hash) agrees with the manifest: a generator cannot be moved under another job;
* for every site: its attestation is signed by a trusted key, the figures in the manifest equal the signed
  statement, the statement names this job, and its epsilon equals what its event history composes to
  (recomputed with :mod:`feta_release.accounting`, relative tolerance 1e-6);
* when ``policies/SITE.signed.json`` is in the release: the policy's signature, that its hash is the one
  the site attested, and that the release is within it (per-job epsilon/delta caps, accountant, allowed
  mechanisms, minimum sigma, maximum rounds/steps/batch).

The verified generator BYTES are kept on the result, so synthesis runs exactly the bytes that were hashed
(no window in which the file could be swapped between verification and use).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from ..accounting import epsilon as compose_epsilon
from ..accounting import events_from_list
from ..errors import FetaError, ReleaseError
from ..signing import canonical_json, fingerprint, sha256_hex, verify_document
from .manifest import (
    ATTESTATION_KIND,
    ATTESTED_FIELDS,
    FORMAT_VERSION,
    MANIFEST_FILE,
    policy_file_name,
    statement_sha256,
)

EPS_REL_TOL = 1e-6
STAGE_WORDS = {"central": "central images", "frequency": "frequency features", "dpsgd": "DP-SGD fine-tuning"}


@dataclass
class Check:
    name: str
    status: str  # "pass" | "fail" | "warn"
    detail: str

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail}


@dataclass
class VerificationResult:
    release_dir: str
    checks: list[Check] = field(default_factory=list)
    manifest: dict[str, Any] | None = None
    manifest_sha256: str | None = None
    generator_sha256: str | None = None
    trusted: list[str] = field(default_factory=list)
    generator_bytes: bytes | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.status != "fail" for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    def add(self, name: str, ok: bool, detail: str, warn: bool = False) -> bool:
        self.checks.append(Check(name, "pass" if ok else ("warn" if warn else "fail"), detail))
        return ok

    def reason(self) -> str:
        return "; ".join(f"{c.name}: {c.detail}" for c in self.failures)

    def to_dict(self) -> dict[str, Any]:
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


def verify_release(release_dir: str | Path, trusted: Sequence[Ed25519PublicKey]) -> VerificationResult:
    """Verify everything offline; never raises for a bad release (see ``result.ok`` / ``result.reason()``)."""
    rd = Path(release_dir)
    res = VerificationResult(release_dir=str(rd), trusted=sorted(fingerprint(k) for k in trusted))
    trusted = list(trusted)
    if not trusted:
        res.add("trusted keys", False, "no trusted public keys given (--trusted KEY.pub)")
        return res

    path = rd / MANIFEST_FILE
    try:
        raw = path.read_bytes()
    except OSError as exc:
        res.add("manifest", False, f"{path}: cannot read ({exc.strerror or exc})")
        return res
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        res.add("manifest", False, f"{path}: not valid JSON ({exc})")
        return res
    if not isinstance(doc, dict) or not isinstance(doc.get("manifest"), dict):
        res.add("manifest", False, f"{path}: expected {{\"manifest\": {{...}}, \"signature\": {{...}}}}")
        return res
    man = doc["manifest"]
    res.manifest = man
    res.manifest_sha256 = _guard(res, "manifest", lambda: sha256_hex(canonical_json(man)))
    res.add(
        "manifest format",
        man.get("format_version") == FORMAT_VERSION,
        f"format_version {man.get('format_version')!r}" + ("" if man.get("format_version") == FORMAT_VERSION
                                                          else f", expected {FORMAT_VERSION!r}"),
    )

    signer = _guard(
        res, "manifest signature",
        lambda: verify_document(man, doc.get("signature"), trusted, what=f"{path} (coordinator signature)"),
    )
    if signer:
        res.add("manifest signature", True, f"signed by trusted key {signer}")

    _guard(res, "generator", lambda: _check_generator(res, rd, man))
    sites = man.get("sites")
    if not isinstance(sites, list) or not sites:
        res.add("sites", False, "manifest lists no sites: a release needs each site's signed spend statement")
    else:
        for i, site in enumerate(sites):
            sid = site.get("site_id", f"#{i}") if isinstance(site, dict) else f"#{i}"
            _guard(res, f"site {sid}", lambda site=site: _check_site(res, rd, man, site, trusted))
    return res


def _check_generator(res: VerificationResult, rd: Path, man: dict[str, Any]) -> None:
    gen = man["generator"]
    name = gen["file"]
    if not isinstance(name, str) or "/" in name or "\\" in name or name.startswith("."):
        res.add("generator file", False, f"generator file name {name!r} must be a plain file name in the release")
        return
    gpath = rd / name
    try:
        data = gpath.read_bytes()
    except OSError as exc:
        res.add("generator file", False, f"{gpath}: missing or unreadable ({exc.strerror or exc})")
        return
    digest = sha256_hex(data)
    res.generator_sha256 = digest
    if not res.add(
        "generator hash",
        digest == gen["sha256"],
        f"{gpath}: sha256 {digest[:16]}… " + ("matches the manifest" if digest == gen["sha256"]
                                             else f"!= manifest {str(gen['sha256'])[:16]}… (file changed)"),
    ):
        return
    res.generator_bytes = data
    meta = _generator_metadata(data, gpath)
    want = {
        "feta.classes": gen["classes"],
        "feta.image_shape": gen["image_shape"],
        "feta.sampler": gen["sampler"],
        "feta.statement_sha256": statement_sha256(man["job"], man["sites"]),
    }
    bad = []
    for key, expected in want.items():
        got = meta.get(key)
        if key != "feta.statement_sha256" and got is not None:
            got = json.loads(got)
        if got != expected:
            bad.append(f"{key} is {got!r}, manifest says {expected!r}")
    res.add(
        "generator metadata",
        not bad,
        "; ".join(bad) if bad else "classes, image shape, sampler and job/privacy statement hash agree with the manifest",
    )


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
        return {p.key: p.value for p in model.metadata_props}
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    try:
        sess = ort.InferenceSession(data, sess_options=so, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception types for unreadable models
        raise ReleaseError(f"{where}: not a loadable ONNX model ({exc})") from None
    return dict(sess.get_modelmeta().custom_metadata_map)


def _check_site(
    res: VerificationResult, rd: Path, man: dict[str, Any], site: dict[str, Any], trusted: list[Ed25519PublicKey]
) -> None:
    sid = site["site_id"]
    att = site["attestation"]
    st = att["statement"]
    try:
        signer = verify_document(st, att["signature"], trusted, what=f"site {sid} attestation")
    except FetaError as exc:
        res.add(f"site {sid} attestation", False, str(exc))
        return  # figures signed by nobody we trust are not worth recomputing
    mismatched = [k for k in ATTESTED_FIELDS if site.get(k) != st.get(k)]
    problems = []
    if st.get("kind") != ATTESTATION_KIND:
        problems.append(f"statement kind {st.get('kind')!r} is not {ATTESTATION_KIND!r}")
    if mismatched:
        problems.append(f"manifest figures differ from the signed statement in: {', '.join(mismatched)}")
    if st.get("job_id") != man["job"]["job_id"]:
        problems.append(f"statement is for job {st.get('job_id')!r}, the release is job {man['job']['job_id']!r}")
    res.add(
        f"site {sid} attestation",
        not problems,
        "; ".join(problems) if problems else f"spend statement signed by trusted key {signer}",
    )

    events = events_from_list(st["events"])
    stated = float(st["epsilon"])
    recomputed = compose_epsilon(events, float(st["delta"]), st["accountant"])
    close = math.isclose(stated, recomputed, rel_tol=EPS_REL_TOL, abs_tol=1e-12)
    res.add(
        f"site {sid} epsilon",
        close,
        f"stated ε = {stated:.6g}, recomputed from {len(events)} event(s) ({st['accountant']}) = {recomputed:.6g}"
        + ("" if close else ": the stated figure is not what the history composes to"),
    )

    ppath = rd / policy_file_name(sid)
    if not ppath.is_file():
        res.add(
            f"site {sid} policy",
            False,
            f"{policy_file_name(sid)} not in the release: caps not checked (hash {str(st.get('policy_sha256'))[:16]}…)",
            warn=True,
        )
        return
    _check_policy(res, sid, ppath, st, events, trusted)


def _load_signed_policy(ppath: Path, trusted: list[Ed25519PublicKey]) -> tuple[dict[str, Any], str, str]:
    """(policy document, its sha256, signer fingerprint) of a signed policy file, checked against ``trusted``.

    Signature and schema only: a policy that has expired since the job ran still says what the job was
    allowed to spend, so the validity window is not checked here.
    """
    from ..policy import open_signed_policy
    from ..policy.envelope import read_json

    pol = open_signed_policy(read_json(ppath, "signed policy"), trusted, str(ppath))
    return dict(pol.document), pol.digest, pol.signer or ""


def _check_policy(
    res: VerificationResult, sid: str, ppath: Path, st: dict[str, Any], events: list[Any],
    trusted: list[Ed25519PublicKey],
) -> None:
    name = f"site {sid} policy"
    try:
        policy, digest, _signer = _load_signed_policy(ppath, trusted)
    except FetaError as exc:
        res.add(name, False, str(exc))
        return
    problems = policy_violations(policy, st, events)
    if digest != st.get("policy_sha256"):
        problems.insert(0, f"{ppath.name} has hash {digest[:16]}…, the site attested {str(st.get('policy_sha256'))[:16]}…")
    res.add(name, not problems, "; ".join(problems) if problems else
            f"within policy v{policy.get('version')} (per-job ε ≤ {policy['budget']['per_job']['epsilon']}, "
            f"δ ≤ {policy['budget']['per_job']['delta']}, every σ at or above its minimum)")


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
    mech = policy.get("mechanisms", {})
    steps_by_stage: dict[str, int] = {}
    for e in events:
        rules = mech.get(e.stage)
        if rules is None or not rules.get("allowed", False):
            out.append(f"stage {e.stage!r} is not allowed by the policy")
            continue
        steps_by_stage[e.stage] = steps_by_stage.get(e.stage, 0) + e.steps
        if "min_sigma" in rules and e.sigma < float(rules["min_sigma"]):
            out.append(f"{e.stage}: σ = {e.sigma:.4g} is below the policy minimum {rules['min_sigma']}")
        if "max_batch" in rules and size and e.q * size > float(rules["max_batch"]) * (1 + 1e-9):
            out.append(f"{e.stage}: expected batch q·N = {e.q * size:.1f} exceeds max_batch {rules['max_batch']}")
    limits = {"central": "max_rounds", "dpsgd": "max_steps"}
    for stage, total in steps_by_stage.items():
        key = limits.get(stage)
        if key and key in mech[stage] and total > int(mech[stage][key]):
            out.append(f"{stage}: {total} rounds/steps exceed {key} {mech[stage][key]}")
    return out


def require_valid(result: VerificationResult) -> VerificationResult:
    if not result.ok:
        raise ReleaseError(f"release {result.release_dir} refused: {result.reason()}")
    return result


# -- words for people ------------------------------------------------------------------------------------


def merged_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Repeated events of one stage at the same σ and q as one entry with their steps summed (a federated
    ledger records one event per round); in first-seen order. Words only: composition is unchanged."""
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for e in events:
        k = (e["stage"], float(e["sigma"]), float(e["q"]))
        if k in merged:
            merged[k]["steps"] += int(e["steps"])
        else:
            merged[k] = {**e, "steps": int(e["steps"])}
    return list(merged.values())


def describe_site(site: dict[str, Any]) -> str:
    """One paragraph a data-protection officer can read: the site's total (ε, δ) and what it means."""
    eps, delta = float(site["epsilon"]), float(site["delta"])
    events = merged_events(site["events"])
    stages = []
    for e in events:
        if e["steps"] == 0:
            continue
        word = STAGE_WORDS.get(e["stage"], e["stage"])
        unit = "round" if e["stage"] == "central" else "step"
        count = "once" if e["steps"] == 1 else f"{e['steps']} {unit}s"
        sampled = "every image" if e["q"] >= 1 else f"each image with probability {e['q']:.3g}"
        stages.append(f"{word} (noise σ = {e['sigma']:.3g}, {count}, {sampled})")
    n_stages = len({e["stage"] for e in events if e["steps"]})
    factor = math.exp(eps)
    return (
        f"Site {site['site_id']}: ε = {eps:.3g} at δ = {delta:g} ({site['accountant'].upper()} accountant), "
        f"the total over all {n_stages} stage(s) that touched its images: {'; '.join(stages) or 'none'}. "
        f"Meaning: whether or not any single image of this site was used, the probability of any outcome of "
        f"this release (the generator and every image generated from it) changes by at most a factor of "
        f"e^{eps:.3g} ≈ {factor:.3g}, except with probability at most {delta:g}."
    )
