"""Write a release directory: generator.onnx + signed manifest (+ the sites' signed policies).

Two entry points:

* :func:`assemble_release` — from a denoiser (torch module or already-exported ONNX), the job, and site
  records whose attestations are already signed (a federated coordinator collects them from the nodes'
  ledgers).
* :func:`export_run` — a single-site training run directory: reads the model, takes the privacy history from
  the run's SITE LEDGER (hash-chained, head signed by the site key: never from the unsigned ``privacy.json``),
  signs the site's spend statement with the site key, and calls :func:`assemble_release`.

Both write into a hidden temporary directory beside OUT and rename it at the end: a failed export leaves
nothing that looks like a release.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..accounting import Event, PrivacyEvent, events_from_list, gaussian_only
from ..config import JobConfig, config_hash
from ..errors import PrivacyError, ReleaseError
from ..files import read_run_json
from ..ledger import Ledger, LedgerTamperedError
from ..models.edm import denoiser_from_spec
from ..models.model_file import MODEL_FILE, read_model_file
from ..planning import merged
from ..policy.document import SitePolicy, utc_stamp
from ..policy.jobs import sign_job
from ..signing import canonical_json, public_key_pem, sha256_file, sha256_hex
from .jobfiles import RELEASED_AUX, RELEASED_CENTRAL
from .manifest import (
    GENERATOR_FILE,
    POLICY_DIR,
    aux_claims,
    aux_record,
    build_attestation,
    build_manifest,
    policy_file_name,
    released_sampler,
    sign_manifest,
    site_record,
    starts_claims,
    starts_count_problem,
    starts_record,
    statement_sha256,
    write_manifest,
)
from .onnx_export import SamplerSettings, build_generator, export_denoiser
from .starts import AUX_FILE, STARTS_FILE, load_starts, starts_bytes
from .verify import policy_violations


def assemble_release(
    out: str | Path,
    *,
    denoiser: Any,
    classes: Sequence[str],
    image_shape: Sequence[int],
    sampler: SamplerSettings,
    job_id: str,
    config: dict[str, Any],
    sites: Sequence[dict[str, Any]],
    coordinator_key: Ed25519PrivateKey,
    signed_policies: Mapping[str, dict[str, Any]] | None = None,
    timestamps: dict[str, str] | None = None,
    enforce_policy: bool = True,
    signed_job: dict[str, Any] | None = None,
    starts: tuple[np.ndarray, np.ndarray] | None = None,
    aux_pool: tuple[np.ndarray, np.ndarray] | None = None,
) -> Path:
    """Build and sign a release at ``out`` (must not exist or be empty). ``sites`` are :func:`site_record` s.

    ``starts`` (images in [0, 1], labels): the RELEASED central images, shipped as ``central_images.npz`` when
    the sampler has ``start_sigma`` (SDEdit); without them such a sampler is released as the noise sampler.
    ``aux_pool`` (images in [0, 1], labels): the aux-generator pool, shipped as ``aux_images.npz`` when the
    sampler's ``start_source`` is aux or mix (required then).

    A site whose signed policy is given and whose attested spend is outside it is refused here already
    (``enforce_policy=False`` only for tests that need such a release to check that ``verify`` refuses it).
    """
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ReleaseError(f"{out}: already exists and is not empty; choose a new release directory")
    if enforce_policy:
        for s in sites:
            signed = (signed_policies or {}).get(s["site_id"])
            if signed is not None:
                st = s["attestation"]["statement"]
                over = policy_violations(dict(signed["policy"]), st, events_from_list(st["events"]))
                if over:
                    raise ReleaseError(
                        f"site {s['site_id']}'s attested spend is outside its signed policy, "
                        f"refusing to release: " + "; ".join(over)
                    )
    sampler = _start_sampler(sampler, starts, aux_pool)
    job = {"job_id": job_id, "config": config}
    # The statement is fixed first and embedded in the generator; the manifest then hashes the generator.
    stmt = statement_sha256(job, sites)
    den = denoiser if isinstance(denoiser, onnx.ModelProto) else export_denoiser(denoiser, image_shape)
    model = build_generator(den, sampler, classes, image_shape, statement_sha256=stmt)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        (tmp / GENERATOR_FILE).write_bytes(model.SerializeToString())
        for sid, signed in (signed_policies or {}).items():
            (tmp / POLICY_DIR).mkdir(exist_ok=True)
            (tmp / policy_file_name(sid)).write_text(
                json.dumps(signed, indent=2, ensure_ascii=False) + "\n", "utf-8"
            )
        record = aux_rec = None
        if sampler.start_sigma is not None and sampler.start_source != "aux" and starts is not None:
            record = _write_starts(tmp, starts, len(classes), sites, config)
        if sampler.start_source != "central" and aux_pool is not None:
            aux_rec = _write_aux(tmp, aux_pool, len(classes), image_shape, sites, config)
        manifest = build_manifest(
            tmp,
            job_id=job_id,
            config=config,
            classes=classes,
            image_shape=image_shape,
            sampler=sampler.to_dict(),
            sites=sites,
            timestamps={"exported": utc_stamp(), **(timestamps or {})},
            signed_job=signed_job,
            starts=record,
            aux_starts=aux_rec,
        )
        write_manifest(tmp, sign_manifest(manifest, coordinator_key))
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _start_sampler(
    sampler: SamplerSettings,
    starts: tuple[np.ndarray, np.ndarray] | None,
    aux_pool: tuple[np.ndarray, np.ndarray] | None,
) -> SamplerSettings:
    """The sampler as released: a central-start sampler without central images is released as the noise
    sampler (as before); aux/mix starts without the files they need are refused, never silently turned into
    noise."""
    if sampler.start_sigma is None:
        return sampler
    if sampler.start_source == "central":  # the one normalisation, which verify holds a release to
        return SamplerSettings(**released_sampler(sampler.to_dict(), starts is not None))
    if aux_pool is None:
        raise ReleaseError(
            f"[sampler] start_source = {sampler.start_source!r} but no aux-generator pool was given "
            f"({RELEASED_AUX} of the job); rerun the job with this version"
        )
    if sampler.start_source == "mix" and starts is None:
        raise ReleaseError(
            "[sampler] start_source = 'mix' but the job has no released central images for the "
            'other half; use start_source = "aux"'
        )
    return sampler


def _write_aux(
    rel: Path,
    pool: tuple[np.ndarray, np.ndarray],
    n_classes: int,
    image_shape: Sequence[int],
    sites: Sequence[dict[str, Any]],
    config: dict[str, Any],
) -> dict[str, Any]:
    """``aux_images.npz`` and its manifest record; refused unless it is the pool the signed job says (shape,
    range, per-class counts), so verify can never be handed a file export would not have written."""
    data = starts_bytes(*pool)
    images, labels = load_starts(
        data, "the aux-generator pool", tuple(int(v) for v in image_shape), n_classes, what="aux-images"
    )
    want = aux_claims(config, sites, n_classes)["per_class"]
    have = np.bincount(labels, minlength=n_classes).tolist()
    if have != want:
        raise ReleaseError(
            f"the aux-generator pool holds {have} images per class, the release format {want}: not "
            "this version's pool, refusing to ship it; rerun the job"
        )
    (rel / AUX_FILE).write_bytes(data)
    return aux_record(rel, AUX_FILE, config, sites, n_classes)


def _write_starts(
    rel: Path,
    starts: tuple[np.ndarray, np.ndarray],
    n_classes: int,
    sites: Sequence[dict[str, Any]],
    config: dict[str, Any],
) -> dict[str, Any]:
    images, labels = np.asarray(starts[0], np.float32), np.asarray(starts[1], np.int64)
    missing = sorted(set(range(n_classes)) - {int(v) for v in labels})
    if missing:
        raise ReleaseError(
            f"the released central images hold no image of class(es) {missing}: SDEdit needs one per "
            "class; leave [sampler] start_sigma out"
        )
    wrong = starts_count_problem(labels, starts_claims(config, sites, n_classes)["per_class"])
    if wrong:
        raise ReleaseError(f"{wrong}: not this job's central release, refusing to ship it")
    (rel / STARTS_FILE).write_bytes(starts_bytes(images, labels))
    return starts_record(rel, STARTS_FILE, config, sites, n_classes)


def released_central(
    job_dir: str | Path, job_id: str | None = None, name: str = RELEASED_CENTRAL, what: str = "central images"
) -> tuple[np.ndarray, np.ndarray] | None:
    """The job directory's released central images (``released/central.npz``: images in [0, 1], labels), if
    any. ``job_id``: the file must say it is that job's (the federated coordinator writes it), so a stale file
    of an earlier job in the same directory is never shipped under a new one. ``name``/``what``: another
    file of the same layout (the aux pool, :data:`RELEASED_AUX`)."""
    path = Path(job_dir) / name
    if not path.is_file():
        return None
    data = path.read_bytes()
    if job_id is not None:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            have = str(z["job_id"]) if "job_id" in z.files else None
        if have != job_id:
            raise ReleaseError(
                f"{path}: "
                + ("carries no job id" if have is None else f"is job {have!r}'s")
                + f", not job {job_id!r}'s {what} (a stale file of an earlier job?); remove "
                "it and rerun the job"
            )
    return _central_arrays(data, path, what)


def _central_arrays(data: bytes, path: Path, what: str = "central images") -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            return np.asarray(z["images"], np.float32), np.asarray(z["labels"], np.int64)
    except (OSError, ValueError, KeyError) as exc:
        raise ReleaseError(f"{path}: not a {what} file (images, labels) ({exc}); rerun the job") from None


def run_aux_pool(rd: Path, record: Mapping[str, Any], cfg: JobConfig) -> tuple[np.ndarray, np.ndarray] | None:
    """A ``train`` run's aux-generator pool (``[sampler] start_source`` aux/mix), only if
    ``released/aux_images.npz`` is byte for byte the file whose sha256 the run's closed ledger record keeps:
    the run dir is unsigned, and a swapped file (e.g. private images) must never ship as "post-processing of
    the frequency release"."""
    if not cfg.sampler.uses_aux:
        return None
    path = rd / RELEASED_AUX
    want = (record.get("output") or {}).get("aux_pool_sha256")
    if not want:
        raise ReleaseError(
            f"{rd}: the ledger's record of this job names no aux-image pool ([sampler] start_source = "
            f"{cfg.sampler.start_source!r}; a run closed before pools were recorded); train it again"
        )
    if not path.is_file():
        raise ReleaseError(
            f"{path}: missing; the run's ledger recorded an aux-image pool; export the run directory "
            "as `train` left it"
        )
    data = path.read_bytes()  # hashed and parsed from the SAME bytes
    if sha256_hex(data) != want:
        raise ReleaseError(
            f"{path}: hashes to {sha256_hex(data)[:16]}…, not the aux-image pool the site ledger "
            "recorded (edited or swapped after the run); export the run directory as `train` left it"
        )
    return _central_arrays(data, path, "aux-images")


# -- single-site run directories -------------------------------------------------------------------------


def _first(d: Mapping[str, Any], keys: Sequence[str], where: str) -> Any:
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    raise ReleaseError(f"{where}: none of {', '.join(keys)} found")


def read_run(run_dir: str | Path) -> dict[str, Any]:
    """What a release needs from a finished ``feta-release train`` run directory (layout:
    training/pipeline.py): ``model.pt`` {spec, state_dict (EMA weights), class_names}, ``job.json``,
    ``run.json`` (the run's ledger and finish time) and the ``COMPLETE`` marker. The privacy history is read
    from the ledger (:func:`ledger_history`)."""
    rd = Path(run_dir)
    if not (rd / "COMPLETE").is_file():
        raise ReleaseError(
            f"{rd}: the run is not complete (no COMPLETE marker); finish `feta-release train` first"
        )
    for name in (MODEL_FILE, "job.json", "run.json"):
        if not (rd / name).is_file():
            raise ReleaseError(f"{rd / name}: missing; is {rd} a `feta-release train` run directory?")
    ckpt = read_model_file(rd / MODEL_FILE)
    cfg = JobConfig.from_dict(read_run_json(rd / "job.json"), source=str(rd / "job.json"))
    return {"checkpoint": ckpt, "config": cfg, "run_dir": rd, "run": read_run_json(rd / "run.json")}


def ledger_history(
    rd: Path, run_info: Mapping[str, Any], site_key: Ed25519PrivateKey
) -> tuple[str, list[PrivacyEvent], list[Event], dict[str, Any], int]:
    """(the run's job id, its charged events, every event of the ledger, the job's signed record, its number
    of DP-SGD requests (rounds)) from the run's
    site ledger, whose chain and head signature are checked with ``site_key``: editing ``privacy.json`` (or
    the ledger) changes nothing that is attested."""
    rec = run_info.get("ledger")
    if not isinstance(rec, Mapping) or not rec.get("path") or not rec.get("job_id"):
        raise ReleaseError(
            f"{rd / 'run.json'}: names no site ledger (a run made before ledgers were used; its "
            "privacy.json is not signed); train it again to export it"
        )
    path = Path(str(rec["path"]))
    path = path if path.is_absolute() else rd / path
    job_id = str(rec["job_id"])
    try:
        with Ledger(path, verify_key=site_key.public_key(), deep=True) as led:
            record, rows = led.job_record(job_id) or {}, led.requests()
    except LedgerTamperedError as exc:
        raise ReleaseError(
            f"{exc}. If the run was trained with another site key, export with that one "
            "(`train --site-key`, default RUN_DIR/checkpoints/site.key)"
        ) from None
    except PrivacyError as exc:
        raise ReleaseError(f"{path}: {exc}") from None
    if not record.get("closed"):
        raise ReleaseError(
            f"{path}: job {job_id} is not closed in the ledger (the run did not finish); finish "
            "`feta-release train` first"
        )
    per_job: dict[str, list[Event]] = {}
    for r in rows:
        per_job.setdefault(r["job_id"], []).extend(events_from_list(r["events"]))
    if job_id not in per_job:
        raise ReleaseError(f"{path}: holds no charge of job {job_id}; is it this run's ledger?")
    lifetime = [e for evs in per_job.values() for e in merged(evs)]
    rounds = sum(1 for r in rows if r["job_id"] == job_id and r["mechanism"] == "dpsgd")
    return job_id, gaussian_only(merged(per_job[job_id]), f"{path}: job {job_id}"), lifetime, record, rounds


def check_run_against_ledger(
    rd: Path, record: Mapping[str, Any], ckpt: Mapping[str, Any]
) -> tuple[float, str]:
    """The run's unsigned files must be the ones the signed job record was closed with: job.json's config
    hash, model.pt's job hash and sha256. Returns (delta, accountant) as the ledger recorded them.

    Why: run.json (which job), job.json (delta) and model.pt are writable by whoever can write the run dir;
    only the ledger is signed. Pointing run.json at another closed job, editing delta, or swapping the model
    is refused."""
    where = (
        f"{rd}: the run directory does not match its site ledger's signed record of job "
        f"{record.get('job_id', '')}"
    )
    out = record.get("output")
    if not isinstance(out, Mapping) or not out.get("model_sha256"):
        raise ReleaseError(
            f"{rd}: the ledger's record of this job names no model (a run closed before the ledger "
            "recorded its model); train it again to export it"
        )
    checks = (
        ("job.json", config_hash(read_run_json(rd / "job.json")), record.get("sha256")),
        ("model.pt's job_hash", str(ckpt.get("job_hash")), record.get("sha256")),
        ("model.pt", sha256_file(rd / MODEL_FILE), out.get("model_sha256")),
    )
    for name, have, want in checks:
        if have != want:
            raise ReleaseError(
                f"{where}: {name} hashes to {str(have)[:16]}…, the ledger recorded {str(want)[:16]}… "
                "(edited or swapped after the run closed, or run.json names another job); export "
                "the run directory as `train` left it"
            )
    return float(out["delta"]), str(out["accountant"])


def denoiser_from_checkpoint(ckpt: Mapping[str, Any], where: str) -> Any:
    spec = _first(ckpt, ("spec",), where)
    # the weights to release (EMA), see models.model_file.write_model_file
    state = _first(ckpt, ("state_dict",), where)
    den = denoiser_from_spec(spec)
    den.load_state_dict(state)
    return den.eval()


def _job_id(text: str) -> str:
    """A job id the job schema accepts (letters, digits, ``._-``; at most 128 characters)."""
    out = re.sub(r"[^A-Za-z0-9._-]", "-", text).lstrip("._-")[:128]
    return out or "job"


@dataclass
class AttestedRun:
    """A finished single-site run as the coordinator of a one-site job sees it: the job signed by the
    coordinator key naming the site, the site's attestation from its ledger (signed by the site key), the
    released model."""

    signed_job: dict[str, Any]
    attestation: dict[str, Any]
    site_id: str
    signed_policy: dict[str, Any] | None
    denoiser: Any
    classes: list[str]
    config: JobConfig
    run: dict[str, Any]
    rounds: int  # DP-SGD requests charged in the ledger (the run's chunks: its "rounds")
    # the released central images, checked against the ledger
    central: tuple[np.ndarray, np.ndarray] | None = None
    # the aux-generator pool, checked against the ledger
    aux_pool: tuple[np.ndarray, np.ndarray] | None = None


def attest_run(
    run_dir: str | Path,
    *,
    coordinator_key: Ed25519PrivateKey,
    site_key: Ed25519PrivateKey,
    site_id: str | None = None,
    signed_policy: dict[str, Any] | None = None,
    job_id: str | None = None,
) -> AttestedRun:
    """Check the run against its site ledger, sign a one-site job with the coordinator key and the site's
    spend statement (the ledger's events) with the site key; refuse a run outside the site's policy."""
    run = read_run(run_dir)
    rd: Path = run["run_dir"]
    cfg, ckpt = run["config"], run["checkpoint"]
    ledger_job, events, lifetime, record, rounds = ledger_history(rd, run["run"], site_key)
    delta, accountant = check_run_against_ledger(rd, {**record, "job_id": ledger_job}, ckpt)
    den = denoiser_from_checkpoint(ckpt, str(rd / "model.pt"))
    central = run_central(rd, run["run"], ledger_job, site_key)
    aux_pool = run_aux_pool(rd, record, cfg)
    classes = [str(c) for c in _first(ckpt, ("class_names",), str(rd / "model.pt"))]
    if len(classes) != den.n_classes:
        raise ReleaseError(f"{rd / 'model.pt'}: {len(classes)} class names for a {den.n_classes}-class model")
    policy_sha, life_delta, unit_pol = None, delta, None
    if signed_policy is not None:
        # Integrity only here; `verify` checks the policy signer against the keys the reader trusts.
        pol = SitePolicy.from_document(signed_policy["policy"], None, "signed policy")
        policy_sha, life_delta, unit_pol = pol.digest, float(pol.lifetime_delta), pol
        site_id = site_id or pol.site_id
        if pol.site_id != site_id:
            raise ReleaseError(f"the policy is for site {pol.site_id!r}, the release names site {site_id!r}")
        if pol.site_key is not None and pol.site_key != public_key_pem(site_key):
            raise ReleaseError(
                f"the site key given is not the site_key that site {site_id}'s policy names; "
                "sign with the key the policy names"
            )
    site_id = site_id or "site"
    # A single-site run has no coordinator-signed job yet: the coordinator key signs one naming this site,
    # so the release carries a signed list of its sites like a federated one.
    signed_job = sign_job(cfg, coordinator_key, _job_id(job_id or ledger_job), [site_id])
    att = build_attestation(
        site_id,
        signed_job["job"]["job_id"],
        events,
        delta,
        accountant,
        policy_sha,
        site_key,
        job_sha256=sha256_hex(canonical_json(signed_job["job"])),
        lifetime_events=lifetime,
        lifetime_delta=life_delta,
        history="site-ledger",
        unit_policy=unit_pol,
    )
    if signed_policy is not None:
        over = policy_violations(dict(signed_policy["policy"]), att["statement"], events)
        if over:
            raise ReleaseError(
                f"{rd}: the run is outside site {site_id}'s policy, refusing to release it: "
                + "; ".join(over)
            )
    return AttestedRun(
        signed_job, att, site_id, signed_policy, den, classes, cfg, run["run"], rounds, central, aux_pool
    )


def run_central(
    rd: Path, run_info: Mapping[str, Any], job_id: str, site_key: Ed25519PrivateKey
) -> tuple[np.ndarray, np.ndarray] | None:
    """The run's released central images, only if ``released/central.npz`` is byte for byte the answer the
    site ledger recorded for this job's central release (so a release never ships an edited or swapped file,
    e.g. un-noised images, as "the DP release")."""
    path = rd / RELEASED_CENTRAL
    if not path.is_file():
        return None
    ledger = Path(str(run_info["ledger"]["path"]))
    ledger = ledger if ledger.is_absolute() else rd / ledger
    with Ledger(ledger, verify_key=site_key.public_key()) as led:
        recorded = [r["response_sha256"] for r in led.requests(job_id) if r["mechanism"] == "central"]
    data = path.read_bytes()  # hashed and parsed from the SAME bytes: no second read to swap in between
    have = sha256_hex(data)
    if have not in recorded:
        raise ReleaseError(
            f"{path}: hashes to {have[:16]}…, not the central release the site ledger recorded for job "
            f"{job_id} (edited or swapped after the run); export the run directory as `train` left it"
        )
    return _central_arrays(data, path)


def export_run(
    run_dir: str | Path,
    out: str | Path,
    *,
    coordinator_key: Ed25519PrivateKey,
    site_key: Ed25519PrivateKey,
    site_id: str | None = None,
    signed_policy: dict[str, Any] | None = None,
    job_id: str | None = None,
    sampler: SamplerSettings | None = None,
) -> Path:
    """Single-site release: the site key signs the run's spend statement, the coordinator key the manifest.

    ``sampler`` overrides the job's ``[sampler]`` section (sampling is post-processing: no privacy cost).
    """
    a = attest_run(
        run_dir,
        coordinator_key=coordinator_key,
        site_key=site_key,
        site_id=site_id,
        signed_policy=signed_policy,
        job_id=job_id,
    )
    return assemble_release(
        out,
        denoiser=a.denoiser,
        classes=a.classes,
        image_shape=a.denoiser.image_shape,
        sampler=sampler or SamplerSettings.from_config(a.config.sampler),
        job_id=a.signed_job["job"]["job_id"],
        config=a.signed_job["job"]["config"],
        sites=[site_record(a.attestation)],
        coordinator_key=coordinator_key,
        signed_job=a.signed_job,
        signed_policies={a.site_id: signed_policy} if signed_policy is not None else None,
        timestamps={"trained": a.run["finished"]} if isinstance(a.run.get("finished"), str) else None,
        starts=a.central,
        aux_pool=a.aux_pool,
    )
