"""Shared builders for the release tests: a small real UNet denoiser, keys, a signed policy, a release."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from feta_release.accounting import PrivacyEvent
from feta_release.signing import public_key_pem, sign_document

REPO = Path(__file__).resolve().parents[2]

# "torch is not installed": a meta-path finder that refuses torch and everything under it. (Setting
# sys.modules['torch'] = None instead would also break scipy, which inspects sys.modules for torch arrays.)
BLOCK_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"No module named {name!r} (blocked by the test)", name=name)
        return None
sys.meta_path.insert(0, _NoTorch())
"""


def cli_process(
    args: list[str], *, without_torch: bool = False, **run: Any
) -> subprocess.CompletedProcess[str]:
    """``feta-release ARGS`` in a fresh process of this checkout's code: its exit code and text output.
    ``without_torch``: a process where ``import torch`` fails (:data:`BLOCK_TORCH`); ``run``: more
    ``subprocess.run`` keywords (``timeout``, 120 s unless given; ``preexec_fn``)."""
    entry = (
        ["-c", BLOCK_TORCH + "from feta_release.cli import main\nmain(sys.argv[1:])\n"]
        if without_torch
        else ["-m", "feta_release"]
    )
    return subprocess.run(
        [sys.executable, *entry, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        **{"timeout": 120, **run},
    )


CLASSES = ["zero", "one", "two"]
IMAGE_SHAPE = (1, 8, 8)
EVENTS = [
    PrivacyEvent("central", 5.0, 0.1, 5),
    PrivacyEvent("frequency", 26.6, 1.0, 1),
    PrivacyEvent("dpsgd", 1.5, 0.05, 200),
]


def small_denoiser(seed: int = 0) -> Any:
    """The project's real EDM UNet at a tiny size, with weights moved off their (partly zero) init."""
    import torch

    from feta_release.config import ModelSection
    from feta_release.models.edm import build_denoiser

    torch.manual_seed(seed)
    den = build_denoiser(
        ModelSection(channels=8, channel_mult=(1, 2), num_res_blocks=1, attn_resolutions=(4,)),
        IMAGE_SHAPE,
        len(CLASSES),
    )
    with torch.no_grad():
        for p in den.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return den.eval()


@dataclass
class Keys:
    coordinator: Ed25519PrivateKey
    site: Ed25519PrivateKey
    policy: Ed25519PrivateKey

    def pub_files(self, d: Path) -> list[str]:
        """coordinator.pub, site.pub, policy.pub (the site administrator's key) in ``d``."""
        d.mkdir(parents=True, exist_ok=True)
        out = []
        for name in ("coordinator", "site", "policy"):
            p = d / f"{name}.pub"
            p.write_text(public_key_pem(getattr(self, name)))
            out.append(str(p))
        return out

    def public(self) -> list[Any]:
        return [k.public_key() for k in (self.coordinator, self.site, self.policy)]

    def trust(self, site_id: str = "a") -> dict[str, Any]:
        """The verifier's trust roots: this site's administrator (policy) key, bound to its site id."""
        return {site_id: self.policy.public_key()}

    def trusted_args(self, d: Path, site_id: str = "a") -> list[str]:
        return ["--trusted", f"{site_id}={self.pub_files(d)[2]}"]


def new_keys() -> Keys:
    return Keys(Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate())


def signed_policy(
    keys: Keys,
    site_id: str = "a",
    per_job_eps: float = 5.0,
    dpsgd_min_sigma: float = 0.5,
    coordinators: list[Any] | None = None,
) -> dict:
    from feta_release.policy import make_policy, sign_policy

    doc = make_policy(
        site_id,
        "0" * 64,
        5000,
        coordinators or [keys.coordinator.public_key()],
        per_job=(per_job_eps, 1e-5),
        lifetime=(20.0, 1e-5),
        mechanisms={"dpsgd": {"min_sigma": dpsgd_min_sigma}},
        site_key=keys.site.public_key(),
    )
    return sign_policy(doc, keys.policy)


def signed_job(
    coordinator: Ed25519PrivateKey, job_id: str, sites: list[str], sampler: dict | None = None
) -> dict:
    """The tiny preset signed for ``sites``; ``sampler``: its [sampler] overrides (a release's sampler must be
    the signed job's, ``export --solver/--steps`` aside)."""
    from feta_release.config import load_preset
    from feta_release.policy.jobs import sign_job

    cfg = load_preset("tiny")
    return sign_job(cfg.replace(sampler=sampler) if sampler else cfg, coordinator, job_id, sites)


def attest(
    keys: Keys,
    site_id: str,
    job: dict,
    policy: dict | None,
    events: list[PrivacyEvent] | None = None,
    signer: Ed25519PrivateKey | None = None,
) -> dict:
    """A final attestation for ``job`` (signed by ``signer``, default the site's own key)."""
    from feta_release.policy.document import SitePolicy
    from feta_release.release.manifest import build_attestation
    from feta_release.signing import canonical_json, sha256_hex

    pol_sha = SitePolicy.from_document(policy["policy"], None).digest if policy else None
    return build_attestation(
        site_id,
        job["job"]["job_id"],
        events or EVENTS,
        1e-5,
        "rdp",
        pol_sha,
        signer or keys.site,
        job_sha256=sha256_hex(canonical_json(job["job"])),
    )


def make_release(
    out: Path,
    den_onnx: Any,
    keys: Keys,
    *,
    policy: dict | None | bool = True,
    events: list[PrivacyEvent] | None = None,
    site_id: str = "a",
    job_id: str = "job-1",
    solver: str = "heun",
    steps: int = 6,
    start_sigma: float | None = None,
    starts: Any = None,
) -> Path:
    """A one-site release (``policy=True``: the site's default signed policy; ``None``: no policy file).
    ``start_sigma`` + ``starts`` (images, labels): an SDEdit release carrying those central images."""
    if policy is True:
        policy = signed_policy(keys, site_id)
    job = signed_job(
        keys.coordinator, job_id, [site_id], {"start_sigma": start_sigma} if start_sigma else None
    )
    att = attest(keys, site_id, job, policy or None, events)
    return assemble(
        out,
        den_onnx,
        keys.coordinator,
        job,
        [att],
        {site_id: policy} if policy else {},
        solver=solver,
        steps=steps,
        start_sigma=start_sigma,
        starts=starts,
    )


def assemble(
    out: Path,
    den_onnx: Any,
    coordinator: Ed25519PrivateKey,
    job: dict,
    attestations: list[dict],
    policies: dict[str, dict],
    *,
    solver: str = "heun",
    steps: int = 6,
    start_sigma: float | None = None,
    starts: Any = None,
) -> Path:
    from feta_release.release.export_run import assemble_release
    from feta_release.release.manifest import site_record
    from feta_release.release.onnx_export import SamplerSettings

    return assemble_release(
        out,
        denoiser=den_onnx,
        classes=CLASSES,
        image_shape=IMAGE_SHAPE,
        sampler=SamplerSettings(solver=solver, steps=steps, start_sigma=start_sigma),
        job_id=job["job"]["job_id"],
        config=job["job"]["config"],
        sites=[site_record(a) for a in attestations],
        coordinator_key=coordinator,
        signed_policies=policies or None,
        signed_job=job,
        enforce_policy=False,  # some tests need an over-policy release to show that verify refuses it
        starts=starts,
    )


def load_signed(release: Path) -> dict:
    return json.loads((release / "manifest.json").read_text())


def rehash(record: dict, path: Path) -> None:
    """Point a manifest file record at the file as it is now (sha256 and size), as a coordinator re-signing it
    would."""
    import hashlib

    data = path.read_bytes()
    record["sha256"], record["size"] = hashlib.sha256(data).hexdigest(), len(data)


def resign(release: Path, signed: dict, key: Ed25519PrivateKey) -> None:
    """Write a modified manifest signed by ``key`` (a coordinator that is trusted, or an attacker that is
    not)."""
    doc = copy.deepcopy(signed)
    doc["signature"] = sign_document(doc["manifest"], key)
    (release / "manifest.json").write_text(json.dumps(doc))


# the site's own Skellam noise share; a second honest site doubles what it counts on
SECURE_EVENTS_WORST_MU = 3e4


def secure_events(honest: int = 2) -> list[Any]:
    """A secure-aggregation history: central sums under Skellam noise (``honest`` shares counted), DP-SGD
    steps."""
    from feta_release.accounting import SkellamEvent

    mw = SECURE_EVENTS_WORST_MU
    return [
        SkellamEvent("central", 1.0, 2, l2=40.0, l1=1600.0, mu=honest * mw, mu_worst=mw),
        PrivacyEvent("dpsgd", 3.0, 0.05, 50),
    ]


def secure_release(
    out: Path, den_onnx: Any, site_ids: tuple[str, ...] = ("st-mary", "st-luke")
) -> dict[str, Keys]:
    """A signed multi-site release under secure aggregation: each site's policy pins the other sites' keys and
    assumes no other site colludes with the coordinator (max_colluders 0), so its job ε counts every site's
    noise share while the worst case (all others colluding) counts its own only. Returns each site's keys (one
    shared coordinator key)."""
    from feta_release.policy import make_policy, sign_policy

    coordinator = Ed25519PrivateKey.generate()
    keys = {
        s: Keys(coordinator, Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()) for s in site_ids
    }
    policies = {}
    for sid, k in keys.items():
        peers = {o: public_key_pem(keys[o].site) for o in site_ids if o != sid}
        doc = make_policy(
            sid,
            "0" * 64,
            5000,
            [coordinator.public_key()],
            per_job=(2.0, 1e-5),
            lifetime=(8.0, 1e-5),
            site_key=k.site.public_key(),
            secure_aggregation={"max_colluders": 0, "peers": peers, "max_worst_case_epsilon": 3.0},
        )
        policies[sid] = sign_policy(doc, k.policy)
    job = signed_job(coordinator, "job-secure", list(site_ids))
    atts = [_secure_attestation(k, sid, job, policies[sid], len(site_ids)) for sid, k in keys.items()]
    assemble(out, den_onnx, coordinator, job, atts, policies)
    return keys


def _secure_attestation(k: Keys, sid: str, job: dict, policy: dict, n_sites: int) -> dict:
    from feta_release.policy.document import SitePolicy
    from feta_release.release.manifest import build_attestation
    from feta_release.signing import canonical_json, sha256_hex

    pol_sha = SitePolicy.from_document(policy["policy"], None).digest
    return build_attestation(
        sid,
        job["job"]["job_id"],
        secure_events(n_sites),
        1e-5,
        "rdp",
        pol_sha,
        k.site,
        job_sha256=sha256_hex(canonical_json(job["job"])),
        max_colluders=0,
    )


def sdedit_central(per_class: int = 1, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Stand-ins for released central images: a bar per class (horizontal, vertical, diagonal) plus noise."""
    rng = np.random.default_rng(seed)
    imgs, labels = [], []
    for c in range(len(CLASSES)):
        for _ in range(per_class):
            x = np.zeros(IMAGE_SHAPE, np.float32)
            if c == 0:
                x[0, 3:5, 1:7] = 1.0
            elif c == 1:
                x[0, 1:7, 3:5] = 1.0
            else:
                x[0, np.arange(1, 7), np.arange(1, 7)] = 1.0
            imgs.append(np.clip(x + rng.normal(0, 0.1, x.shape), 0, 1).astype(np.float32))
            labels.append(c)
    return np.stack(imgs), np.array(labels, np.int64)


def png_hashes(out: Path) -> dict[str, str]:
    """sha256 of every PNG under ``out``, by its path relative to ``out``."""
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*.png"))
    }


def png_arrays(out: Path) -> np.ndarray:
    """The PNGs of a synthetic folder in class order, as generated, scaled to [0, 1]."""
    from PIL import Image

    files = [p for c in CLASSES for p in sorted((out / c).glob("*.png"))]  # class order, as generated
    return np.stack([np.asarray(Image.open(p), np.float32) / 255.0 for p in files])


def patient_release(
    out: Path,
    den_onnx: Any,
    keys: Keys,
    events: list[PrivacyEvent],
    lifetime_events: list[PrivacyEvent],
    *,
    start_sigma: float | None = None,
    starts: Any = None,
) -> Path:
    """A one-site release from a patient-level site (1000 public patients, at most 4 images each) whose
    statement carries ``lifetime_events`` as its spend over all its jobs (``start_sigma`` + ``starts``: an
    SDEdit release carrying those central images, as :func:`make_release`)."""
    sampler = {"start_sigma": start_sigma} if start_sigma else None
    att, job, policy = patient_attestation(keys, events, lifetime_events, sampler)
    return assemble(
        out, den_onnx, keys.coordinator, job, [att], {"a": policy}, start_sigma=start_sigma, starts=starts
    )


def patient_folders(
    root: Path,
    events: list[PrivacyEvent],
    lifetime_events: list[PrivacyEvent],
    folders: dict[str, tuple[list[int], bool]],
    seed: int = 3,
) -> tuple[Keys, Ed25519PrivateKey]:
    """A patient-level release (:func:`patient_release`, from :func:`small_denoiser`) at ``root / "release"``
    and, per name, a synthetic folder ``root / name`` drawn from it with ``(per_class, signed)``: signed by
    the returned key, or unsigned. Returns the release's keys and the folders' signer."""
    from feta_release.release.onnx_export import export_denoiser
    from feta_release.release.synthesize import synthesize

    keys, signer = new_keys(), Ed25519PrivateKey.generate()
    den = export_denoiser(small_denoiser(), IMAGE_SHAPE)
    rel = patient_release(root / "release", den, keys, events, lifetime_events)
    for name, (per_class, signed) in folders.items():
        key = signer if signed else None
        synthesize(
            rel, root / name, keys.trust(), per_class=per_class, seed=seed, progress=False, threads=1, key=key
        )
    return keys, signer


def patient_attestation(
    keys: Keys,
    events: list[PrivacyEvent],
    lifetime_events: list[PrivacyEvent],
    sampler: dict | None = None,
) -> tuple[dict, dict, dict]:
    """(signed statement, signed job, signed policy) of a patient-level site "a" (1000 public patients, at
    most 4 images each) for job "job-1" (``sampler``: its [sampler] overrides), as its node signs them
    (``build_attestation``)."""
    from feta_release.policy import make_policy, sign_policy
    from feta_release.policy.document import SitePolicy
    from feta_release.release.manifest import build_attestation
    from feta_release.signing import canonical_json, sha256_hex

    doc = make_policy(
        "a",
        "0" * 64,
        5000,
        [keys.coordinator.public_key()],
        per_job=(8.0, 1e-5),
        lifetime=(20.0, 1e-5),
        mechanisms={"dpsgd": {"min_sigma": 0.5}},
        site_key=keys.site.public_key(),
        patient_level=(1000, 4),
    )
    policy = sign_policy(doc, keys.policy)
    unit = SitePolicy.from_document(policy["policy"], None)
    job = signed_job(keys.coordinator, "job-1", ["a"], sampler)
    att = build_attestation(
        "a",
        "job-1",
        events,
        1e-5,
        "rdp",
        unit.digest,
        keys.site,
        job_sha256=sha256_hex(canonical_json(job["job"])),
        lifetime_events=lifetime_events,
        unit_policy=unit,
    )
    return att, job, policy


def report_job_dir(
    out: Path, events: list[PrivacyEvent], delta: float, unit: Any = None, per_job_cap: float = 10.0
) -> Path:
    """A job directory the privacy report reads: its summary, one site's signed statement (the signer only:
    the report reads, ``verify`` checks), with ``unit``'s part (a ``PrivacyUnit``) where given, and the site's
    policy budget (context for the chart)."""
    from feta_release.accounting import epsilon

    image_level = epsilon(events, delta)
    st: dict[str, Any] = {
        "epsilon": image_level,
        "delta": delta,
        "accountant": "rdp",
        "events": [e.to_dict() for e in events],
        "policy_sha256": "ab" * 32,
    }
    if unit is not None:
        st["privacy_unit"] = unit.statement(image_level, delta, events)
    (out / "attestations.json").write_text(
        json.dumps({"site": {"statement": st, "signature": {"signer": "cd" * 8}}})
    )
    (out / "job_summary.json").write_text(
        json.dumps({"job_id": "j", "rounds": 1, "skipped": {}, "timings": {}})
    )
    budget = {"per_job": {"epsilon": per_job_cap, "delta": delta}, "lifetime": {"epsilon": 30.0}}
    (out / "policies").mkdir()
    (out / "policies" / "site.signed.json").write_text(json.dumps({"policy": {"budget": budget}}))
    return out


def reword_certificate(folder: Path, signer: Ed25519PrivateKey, words: str, label: str | None = None) -> None:
    """The signed certificate of synthetic ``folder`` re-made in the words of certificate version ``words``
    (its privacy section and PNG text, derived by the code that writes them: ``certificate_privacy`` and
    ``png_text``), every PNG's text chunks rewritten to match and re-hashed, labelled ``label`` (default:
    ``words``) and re-signed by ``signer``: a folder as an older ``synthesize`` certified it, or (``label``
    newer than ``words``) a signer passing older words off under a newer version."""
    from PIL import Image

    from feta_release.release.certificate import certificate_privacy, files_digest, png_info, png_text

    path = folder / "certificate.json"
    doc = json.loads(path.read_text("utf-8"))
    cert, sites = doc["certificate"], doc["manifest"]["manifest"]["sites"]
    cert["privacy"] = certificate_privacy(sites, words)
    cert["png_metadata"] = png_text(cert["release"]["manifest_sha256"], sites, words)
    for rel in [r for r in doc["files"] if r.endswith(".png")]:
        with Image.open(folder / rel) as im:
            im.load()
            im.save(folder / rel, pnginfo=png_info(cert["png_metadata"]))
        doc["files"][rel] = hashlib.sha256((folder / rel).read_bytes()).hexdigest()
    cert["files"]["sha256"] = files_digest(doc["files"].items())
    cert["certificate_version"] = label or words
    doc["signature"] = sign_document(cert, signer)
    path.write_text(json.dumps(doc), "utf-8")
