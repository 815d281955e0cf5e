"""Torch-free synthesis from a verified release: onnxruntime + numpy + Pillow only.

Order of work, so that a refusal leaves nothing behind and a crash never leaves a half output that looks
complete: verify the release (refuse with every reason) -> generate into a hidden temporary directory beside
OUT -> write ``certificate.json`` last -> rename the directory to OUT in one step. Streaming: one batch of
noise and images exists at a time; per-file hashes go to a scratch file, not to memory, so memory is flat in
N.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..errors import ConfigError, ReleaseError
from ..policy.document import utc_stamp
from .certificate import (
    CERTIFICATE_FILE,
    certificate_privacy,
    png_info,
    png_text,
    relative_release_path,
    write_certificate,
)
from .manifest import (
    MANIFEST_FILE,
    PatientFigures,
    patient_fields,
    patient_figures,
    patient_words,
    read_manifest,
)
from .starts import load_starts, mixed_start_images
from .verify import VerificationResult, require_valid, sealed_session, verify_release


def available_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def make_session(model: bytes, threads: int | None = None, optimize: bool = True) -> Any:
    """An onnxruntime CPU session: all graph optimizations, intra-op threads = available cores; it reads no
    file (``sealed_session``: a generator's external data would come from the current directory)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    so.intra_op_num_threads = threads or available_cores()
    so.inter_op_num_threads = 1  # the generator is one sequential Loop: no parallel branches to feed
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    return sealed_session(model, so)


def class_counts(num: int | None, n_classes: int, per_class: Sequence[int] | None) -> list[int]:
    """Images per class: ``per_class`` as given, else ``num`` split evenly (remainder to the first
    classes)."""
    if per_class is not None:
        counts = [int(c) for c in per_class]
        if len(counts) != n_classes:
            raise ConfigError(
                f"--per-class gives {len(counts)} counts but the release has {n_classes} classes"
            )
        if any(c < 0 for c in counts):
            raise ConfigError(f"--per-class counts must be >= 0, got {counts}")
        if num is not None and num != sum(counts):
            raise ConfigError(f"--num {num} disagrees with --per-class (sum {sum(counts)}); give one of them")
        if sum(counts) == 0:
            raise ConfigError("--per-class asks for no images")
        return counts
    if num is None or num < 1:
        raise ConfigError(f"--num must be >= 1 (or give --per-class), got {num}")
    base, extra = divmod(num, n_classes)
    return [base + (1 if i < extra else 0) for i in range(n_classes)]


def class_dirs(classes: Sequence[str]) -> list[str]:
    """Safe, unique folder names from the manifest's class names (never a path outside OUT)."""
    out: list[str] = []
    for i, name in enumerate(classes):
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", str(name)).strip("._") or f"class_{i}"
        if safe in out:
            safe = f"{safe}_{i}"
        out.append(safe)
    return out


def _to_png(img: np.ndarray, info: Any = None) -> bytes:
    """8-bit PNG; ``info`` (a ``PngInfo``) carries the synthetic marker and provenance as text chunks."""
    from PIL import Image

    arr = np.clip(np.rint(img * 255.0), 0, 255).astype(np.uint8)
    if arr.shape[0] == 1:
        pil = Image.fromarray(arr[0], mode="L")
    elif arr.shape[0] == 3:
        pil = Image.fromarray(np.transpose(arr, (1, 2, 0)), mode="RGB")
    else:
        raise ReleaseError(f"cannot write {arr.shape[0]}-channel images as PNG (need 1 or 3 channels)")
    buf = io.BytesIO()
    pil.save(buf, format="PNG", pnginfo=info)
    return buf.getvalue()


def label_batches(counts: Sequence[int], batch: int) -> Iterator[np.ndarray]:
    """Labels in class order, ``batch`` at a time, without materialising all N labels."""
    pending: list[np.ndarray] = []
    size = 0
    for cls, n in enumerate(counts):
        left = n
        while left > 0:
            take = min(left, batch - size)
            pending.append(np.full(take, cls, dtype=np.int64))
            size += take
            left -= take
            if size == batch:
                yield np.concatenate(pending)
                pending, size = [], 0
    if size:
        yield np.concatenate(pending)


@dataclass
class Starts:
    """SDEdit from the release's shipped images: the verified central images and/or aux-generator pool (as the
    sampler's ``start_source`` says), the augmentation and its own random stream."""

    central: tuple[np.ndarray, np.ndarray] | None
    n_ops: int
    magnitude_max: int
    rng: np.random.Generator
    aux: tuple[np.ndarray, np.ndarray] | None = None
    source: str = "central"  # the sampler's start_source: central | aux | mix


def _sampler_source(res: VerificationResult) -> str:
    return (
        str(res.manifest["generator"]["sampler"].get("start_source", "central"))
        if res.manifest
        else "central"
    )


def start_source(requested: str | None, res: VerificationResult) -> str:
    """``noise`` or ``release``: as asked, else what the signed release says (``start_sigma`` in its
    sampler)."""
    assert res.manifest is not None
    sdedit = "start_sigma" in res.manifest["generator"]["sampler"]
    source = requested or ("release" if sdedit else "noise")
    if source not in ("noise", "release"):
        raise ConfigError(f"--from must be 'noise' or 'release', got {source!r}")
    src = _sampler_source(res)
    if source == "release" and (
        not sdedit
        or (src != "aux" and res.starts_bytes is None)
        or (src != "central" and res.aux_bytes is None)
    ):
        raise ConfigError(
            f"release {res.release_dir} carries no verified start images (its sampler has no "
            "start_sigma), so it can only sample from noise; use --from noise"
        )
    return source


def release_starts(res: VerificationResult, seed: int) -> Starts:
    """The verified start images of the sampler's ``start_source`` (central images, aux pool, or both)."""
    assert res.manifest is not None
    man, src = res.manifest, _sampler_source(res)
    shape, k = tuple(man["generator"]["image_shape"]), len(man["generator"]["classes"])
    central = aux = None
    if src != "aux":
        assert res.starts_bytes is not None and res.starts_claims is not None
        central = load_starts(res.starts_bytes, f"{res.release_dir}/{man['starts']['file']}", shape, k)
    if src != "central":
        assert res.aux_bytes is not None and res.aux_claims is not None
        aux = load_starts(
            res.aux_bytes, f"{res.release_dir}/{man['aux_starts']['file']}", shape, k, what="aux-images"
        )
    # recomputed by verify from the signed job (== the record); both records carry the job's one augmentation
    claims = res.starts_claims if central is not None else res.aux_claims
    assert claims is not None  # checked above for the source in use
    aug = claims["augmentation"]
    # Its own stream (not the noise's): the noise of image k is the same whichever start it is paired with.
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(int(seed), spawn_key=(1,))))
    return Starts(central, int(aug["ops"]), int(aug["magnitude_max"]), rng, aux, src)


@dataclass
class SynthesisReport:
    out_dir: Path
    n_images: int
    counts: dict[str, int]
    certificate: Path
    seconds: float
    threads: int
    source: str = "noise"


def _prepare_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ReleaseError(f"{out}: already exists and is not empty; choose a new --out directory")
    if not out.parent.exists():
        raise ReleaseError(f"{out.parent}: parent directory of --out does not exist")


def generator_feed(
    sess: Any, noise: np.ndarray, labels: np.ndarray, first: np.ndarray, starts: Starts | None
) -> dict[str, Any]:
    """The generator's inputs: a format-2 (SDEdit) graph also takes ``start`` and ``from_release``."""
    feed: dict[str, Any] = {"noise": noise, "labels": labels}
    if "from_release" in {i.name for i in sess.get_inputs()}:
        if starts is None:
            feed["start"] = np.zeros_like(noise)
        else:
            feed["start"] = mixed_start_images(
                starts.central,
                starts.aux,
                starts.source,
                labels,
                first,
                starts.rng,
                n_ops=starts.n_ops,
                magnitude_max=starts.magnitude_max,
            )
        feed["from_release"] = np.array(starts is not None)
    return feed


def _write_pngs(
    sess: Any,
    rng: np.random.Generator,
    counts: Sequence[int],
    batch: int,
    dirs: Sequence[str],
    shape: tuple[int, int, int],
    info: Any,
    tmp: Path,
    hashes_path: Path,
    progress: bool,
    starts: Starts | None = None,
) -> None:
    """Run the generator batch by batch and write each image as a PNG (with its provenance text) and its
    hash."""
    for d in dirs:
        (tmp / d).mkdir()
    per_class_written = [0] * len(dirs)
    with open(hashes_path, "w", encoding="utf-8") as hashes, _progress(progress, sum(counts)) as advance:
        for labels in label_batches(counts, batch):
            # Drawn sequentially from one stream: image k's noise does not depend on the batch size.
            noise = rng.standard_normal((len(labels), *shape), dtype=np.float32)
            first = _index_in_class(labels, per_class_written)
            images = sess.run(["images"], generator_feed(sess, noise, labels, first, starts))[0]
            if images.shape != (len(labels), *shape) or not np.all(np.isfinite(images)):
                raise ReleaseError("the generator returned images of the wrong shape or non-finite values")
            for img, lab in zip(images, labels):
                k = per_class_written[lab]
                per_class_written[lab] += 1
                rel = f"{dirs[lab]}/{k:06d}.png"
                data = _to_png(img, info)
                (tmp / rel).write_bytes(data)
                hashes.write(json.dumps([rel, hashlib.sha256(data).hexdigest()]) + "\n")
            advance(len(labels))


def _index_in_class(labels: np.ndarray, written: Sequence[int]) -> np.ndarray:
    """Each label's index within its class over the whole output (the start image it cycles to)."""
    seen = list(written)
    out = np.empty(len(labels), np.int64)
    for i, lab in enumerate(labels):
        out[i], seen[lab] = seen[lab], seen[lab] + 1
    return out


def synthesize(
    release_dir: str | Path,
    out: str | Path,
    trusted: Any,  # TrustRoots or {site_id: admin key(s)} (see verify_release)
    *,
    num: int | None = None,
    per_class: Sequence[int] | None = None,
    seed: int = 0,
    batch: int = 64,
    threads: int | None = None,
    progress: bool = True,
    verification: VerificationResult | None = None,
    key: Ed25519PrivateKey | None = None,
    signer_name: str | None = None,
    source: str | None = None,
) -> SynthesisReport:
    """Verify the release, then write PNGs per class and ``certificate.json`` into ``out`` (all or nothing).

    ``key`` signs the certificate (named ``signer_name``); without it the certificate is unsigned and
    ``verify-synthetic`` will say so. ``source``: ``"release"`` (SDEdit from the release's central images),
    ``"noise"``, or None for what the signed release says.
    """
    out = Path(out)
    if batch < 1:
        raise ConfigError(f"--batch must be >= 1, got {batch}")
    res = verification or verify_release(release_dir, trusted)
    require_valid(res)
    assert res.manifest is not None and res.generator_bytes is not None
    man = res.manifest
    classes = list(man["generator"]["classes"])
    c, h, w = (int(v) for v in man["generator"]["image_shape"])
    counts = class_counts(num, len(classes), per_class)
    dirs = class_dirs(classes)
    source = start_source(source, res)
    _prepare_out(out)

    threads = threads or available_cores()
    sess = make_session(res.generator_bytes, threads=threads)
    total = sum(counts)
    rng = np.random.Generator(np.random.PCG64(int(seed)))
    info = png_info(png_text(str(res.manifest_sha256), man["sites"]))
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    t0 = time.perf_counter()
    try:
        hashes_path = tmp / ".hashes.jsonl"
        starts = release_starts(res, seed) if source == "release" else None
        _write_pngs(sess, rng, counts, batch, dirs, (c, h, w), info, tmp, hashes_path, progress, starts)
        seconds = time.perf_counter() - t0
        generation = _generation_record(
            res,
            classes,
            counts,
            dirs,
            seed=seed,
            batch=batch,
            threads=threads,
            source=source,
            seconds=seconds,
        )
        _write_certificate(
            tmp / CERTIFICATE_FILE, release_dir, out, res, generation, hashes_path, key, signer_name
        )
        hashes_path.unlink()
        if out.exists():
            out.rmdir()  # empty (checked above); rename needs the name free
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return SynthesisReport(
        out, total, dict(zip(classes, counts)), out / CERTIFICATE_FILE, seconds, threads, source
    )


def _generation_record(
    res: VerificationResult,
    classes: list[str],
    counts: Sequence[int],
    dirs: Sequence[str],
    *,
    seed: int,
    batch: int,
    threads: int,
    source: str,
    seconds: float,
) -> dict[str, Any]:
    """The certificate's ``generation`` section: what was drawn, from which noise and starts, with what
    runtime."""
    import onnxruntime as ort  # loaded by make_session already; lazy here as there (fast `--help` of the CLI)

    man = res.manifest
    assert man is not None
    return {
        "num_images": sum(counts),
        "per_class": dict(zip(classes, counts)),
        "folders": dict(zip(classes, dirs)),
        "seed": int(seed),
        "noise": "numpy PCG64(seed).standard_normal float32, drawn image after image in class order",
        "batch": batch,
        "threads": threads,
        "sampler": man["generator"]["sampler"],
        "start": start_statement(source, man, res.starts_claims, res.aux_claims),
        "onnxruntime": ort.__version__,
        "seconds": round(seconds, 3),
    }


def _aux_statement(
    src: str, man: dict[str, Any], claims: dict[str, Any] | None, aux_claims: dict[str, Any] | None
) -> dict[str, Any]:
    """The certificate's start section of a ``start_source`` aux/mix release (claims as verify recomputed
    them)."""
    rec = man["aux_starts"]
    assert aux_claims is not None
    which = (
        "an augmented image of the release's aux-generator pool"
        if src == "aux"
        else "an augmented aux-generator pool image (even index within its class) or released central image "
        "(odd)"
    )
    out: dict[str, Any] = {
        "from": "release",
        "start_source": src,
        "meaning": (
            f"SDEdit: each image denoised from {which} of its class plus "
            f"N(0, {man['generator']['sampler']['start_sigma']}^2) noise, from sigma start_sigma"
        ),
        "start_sigma": man["generator"]["sampler"]["start_sigma"],
        "aux_images": {
            "file": rec["file"],
            "sha256": rec["sha256"],
            "images": aux_claims["images"],
            "source": aux_claims["source"],
        },
        "augmentation": aux_claims["augmentation"],
        "augmentation_randomnes"
        "s": "numpy PCG64(SeedSequence(seed, spawn_key=(1,))), one row of uniforms per image",
        # the frequency release the pool is post-processing of: per site, alone, and (secure aggregation) if
        # every other site colludes with the coordinator; the unit those figures protect (as the central start
        # states)
        "frequency_epsilon_alone": aux_claims["frequency_epsilon_alone"],
        "frequency_epsilon_worst_case": aux_claims["frequency_epsilon_worst_case"],
        "unit": aux_claims["unit"],
    }
    fields, words = _per_patient(man, "frequency", aux_claims)
    out |= fields
    out["privacy"] = aux_claims["privacy"] + words
    if src == "mix" and claims is not None:
        srec = man["starts"]
        out["central_images"] = {"file": srec["file"], "sha256": srec["sha256"], "images": claims["images"]}
        out["central_epsilon_alone"] = claims["central_epsilon_alone"]
        out["central_epsilon_worst_case"] = claims["central_epsilon_worst_case"]
        fields, words = _per_patient(man, "central", claims)
        out |= fields
        if claims["unit"] != aux_claims["unit"]:
            out["unit"] = f"{aux_claims['unit']} (aux-generator images), {claims['unit']} (central images)"
        out["privacy"] = f"{out['privacy']} {claims['privacy']}{words}"  # both sources' caveats
    return out


def _per_patient(man: dict[str, Any], stage: str, claims: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(the start section's figures of ``stage`` per PATIENT at the release's patient-level sites, the
    sentence its words still lack): recomputed, as verify does, from the sites' signed statements, whatever
    the manifest's format. A format 2/3 record (verified as signed, with a warning) states its stage per
    image only; a format 4 record's words already give the figures per patient. None at image-level sites."""
    figures = _patient_figures(man, stage)
    said = f"{stage}_epsilon_per_patient" in claims
    return patient_fields(stage, figures), ("" if said else patient_words(figures, stage))


def _patient_figures(man: dict[str, Any], stage: str) -> PatientFigures | None:
    """The figures per patient of ``stage`` from the verified sites' signed statements (None: no
    patient-level site)."""
    return patient_figures([s["attestation"]["statement"] for s in man["sites"]], stage)


def start_statement(
    source: str, man: dict[str, Any], claims: dict[str, Any] | None, aux_claims: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What the certificate says the images started from (and, for SDEdit, that the central images are a
    release). ``claims``: the starts record as verify RECOMPUTED it from the signed inputs (never the
    coordinator's text)."""
    rec = man.get("starts")
    if source == "noise":
        unused = [
            what
            for what, key in (("central images", "starts"), ("an aux-generator image pool", "aux_starts"))
            if man.get(key)
        ]
        return {
            "from": "noise",
            "meaning": "pure noise at sigma_max (the generator's noise sampler)"
            + (
                f"; the release also carries {' and '.join(unused)}, not used (--from noise)"
                if unused
                else ""
            ),
        }
    src = man["generator"]["sampler"].get("start_source", "central")
    if src != "central":
        return _aux_statement(src, man, claims, aux_claims)
    assert rec is not None and claims is not None
    # these words are the certificate's own, not the record's: they give the figures per patient themselves
    patients = _patient_figures(man, "central")
    return {
        "from": "release",
        "meaning": (
            f"SDEdit: each image denoised from an augmented released central image of its class plus "
            f"N(0, {man['generator']['sampler']['start_sigma']}^2) noise, from sigma start_sigma"
        ),
        "start_sigma": man["generator"]["sampler"]["start_sigma"],
        "central_images": {"file": rec["file"], "sha256": rec["sha256"], "images": claims["images"]},
        "central_epsilon_alone": claims["central_epsilon_alone"],  # per image, this job's central stage alone
        "central_epsilon_worst_case": claims[
            "central_epsilon_worst_case"
        ],  # secure aggregation, all others collude
        # at a patient-level site: the central stage per PATIENT, the figure its caps bound
        **patient_fields("central", patients),
        "unit": claims["unit"],
        "augmentation": claims["augmentation"],
        "augmentation_randomnes"
        "s": "numpy PCG64(SeedSequence(seed, spawn_key=(1,))), one row of uniforms per image",
        "privacy": (
            "the central images are differentially private outputs already charged in each site's "
            "attested history (the privacy figures above include them); starting from them is "
            "post-processing and costs nothing further." + patient_words(patients, "central")
        ),
    }


class _progress:
    """A rich progress bar on stderr (or nothing); yields an ``advance(n)`` callable."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled, total
        self.bar: Any = None

    def __enter__(self) -> Any:
        if not self.enabled:
            return lambda n: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("generating"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self.bar.__enter__()
        task = self.bar.add_task("generate", total=self.total)
        return lambda n: self.bar.update(task, advance=n)

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


def _write_certificate(
    path: Path,
    release_dir: str | Path,
    out: Path,
    res: VerificationResult,
    generation: dict[str, Any],
    hashes_path: Path,
    key: Ed25519PrivateKey | None,
    signer_name: str | None,
) -> None:
    man = res.manifest
    assert man is not None
    signed = read_manifest(release_dir)  # a regular file under the manifest cap, as verify read it
    if signed.get("manifest") != man:
        raise ReleaseError(f"{release_dir}/{MANIFEST_FILE} changed during synthesis; run again")
    privacy = certificate_privacy(man["sites"])
    verification = res.to_dict()
    # no local absolute path in a release
    verification["release_dir"] = relative_release_path(release_dir, out)
    head = {
        "created": utc_stamp(),
        "release": {
            "path": relative_release_path(release_dir, out),
            "manifest_sha256": res.manifest_sha256,
            "generator_sha256": res.generator_sha256,
        },
        "privacy": privacy,
        "privacy_note": (
            f"The unit of privacy is {_units(man['sites'])}. Each site's figure is its total over every "
            "stage of this job; images generated from the release are post-processing and cost nothing "
            "further."
        ),
        "png_metadata": png_text(str(res.manifest_sha256), man["sites"]),
        "generation": generation,
        "verification": verification,
    }
    write_certificate(path, head, signed, hashes_path, key, signer_name)


def _units(sites: list[dict[str, Any]]) -> str:
    """What each site's figure in the certificate protects: one patient with all of their images at a
    patient-level site (its figures are per patient, ``certificate_privacy``), else one image."""
    from ..privacy_unit import figure_unit_words, statement_patient_cap

    def words(s: dict[str, Any]) -> str:
        return figure_unit_words(statement_patient_cap((s.get("attestation") or {}).get("statement") or {}))

    phrases = {words(s) for s in sites}
    if len(phrases) > 1:  # a federation that mixes units (or caps): each site's own
        return "; ".join(f"site {s.get('site_id')}: {words(s)}" for s in sites)
    return "; ".join(p.replace("that site", "one site") for p in sorted(phrases))


__all__ = [
    "synthesize",
    "make_session",
    "class_counts",
    "class_dirs",
    "SynthesisReport",
    "start_source",
    "release_starts",
    "generator_feed",
]
