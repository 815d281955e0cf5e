"""Write a release directory: generator.onnx + signed manifest (+ the sites' signed policies).

:func:`assemble_release` builds it from a denoiser (torch module or already-exported ONNX), the job, and site
records whose attestations are already signed (collected from the sites' own ledgers by the coordinator's
``JobDriver``, ``train``'s included); ``release.jobdir.build_release`` calls it on a job directory. It writes
into a hidden temporary directory beside OUT and renames it at the end: a failed export leaves nothing that
looks like a release.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..accounting import events_from_list
from ..errors import ReleaseError
from ..models.edm import denoiser_from_spec
from ..policy.document import utc_stamp
from ..progress_events import EXPORT, SIGNING, Sink, timed
from .jobfiles import RELEASED_AUX, RELEASED_CENTRAL
from .manifest import (
    GENERATOR_FILE,
    POLICY_DIR,
    aux_claims,
    aux_record,
    build_manifest,
    policy_file_name,
    released_sampler,
    sign_manifest,
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
    sink: Sink | None = None,
) -> Path:
    """Build and sign a release at ``out`` (must not exist or be empty). ``sites`` are :func:`site_record` s.

    ``starts`` (images in [0, 1], labels): the RELEASED central images, shipped as ``central_images.npz`` when
    the sampler has ``start_sigma`` (SDEdit); without them such a sampler is released as the noise sampler.
    ``aux_pool`` (images in [0, 1], labels): the aux-generator pool, shipped as ``aux_images.npz`` when the
    sampler's ``start_source`` is aux or mix (required then).

    A site whose signed policy is given and whose attested spend is outside it is refused here already
    (``enforce_policy=False`` only for tests that need such a release to check that ``verify`` refuses it).
    ``sink``: the export's and the signing's start and seconds (``progress_events``).
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
    with timed(sink, EXPORT, f"the generator to ONNX ({sampler.solver} {sampler.steps} steps)"):
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
        with timed(sink, SIGNING, "the release's files hashed into its manifest, signed by the coordinator"):
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


def _first(d: Mapping[str, Any], keys: Sequence[str], where: str) -> Any:
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    raise ReleaseError(f"{where}: none of {', '.join(keys)} found")


def denoiser_from_checkpoint(ckpt: Mapping[str, Any], where: str) -> Any:
    spec = _first(ckpt, ("spec",), where)
    # the weights to release (EMA), see models.model_file.write_model_file
    state = _first(ckpt, ("state_dict",), where)
    den = denoiser_from_spec(spec)
    den.load_state_dict(state)
    return den.eval()
