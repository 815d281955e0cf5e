"""The release manifest and the per-site spend attestations it carries.

A release directory holds::

    manifest.json                 {"manifest": {...}, "signature": coordinator signature over
                                  canonical_json(manifest)}
    generator.onnx                the one-file generator (noise, labels) -> images
    central_images.npz            optional ([sampler] start_sigma): the released central images the
                                  generator's SDEdit path starts from (already-charged DP outputs; hashed in
                                  ``starts``)
    aux_images.npz                optional ([sampler] start_source aux/mix): a fixed pool of aux-generator
                                  images (post-processing of the frequency release; hashed in ``aux_starts``,
                                  format 3; format 4 where a site is patient-level)
    policies/SITE.signed.json     optional: the signed policy each site ran under (lets verify check the caps)

Each site's entry carries an *attestation*: a spend statement (site, job, full event history, (eps, delta),
accountant, policy hash) signed with the SITE's key. The site's ledger produces it in a federated run
(``edge.attest`` calls :func:`build_attestation`); ``feta-release export --site-key`` does it for a
single-site run. The coordinator then signs the whole manifest. So a verifier needs no trust in the
coordinator for a site's privacy figures: the site itself signed them, and ``verify`` recomputes epsilon from
the events.

This module imports neither torch nor onnx: verification and synthesis run where only onnxruntime exists.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from .. import __version__
from ..accounting import (
    Event,
    epsilon,
    epsilon_breakdown,
    events_from_list,
    events_to_list,
    has_secure_aggregation,
    patient_epsilon,
    worst_case_epsilon,
)
from ..errors import ReleaseError
from ..files import read_regular
from ..policy.document import utc_stamp
from ..privacy_unit import statement_patient_cap
from ..signing import canonical_json, loads_strict, sha256_file, sha256_hex, sign_document

FORMAT_VERSION = "feta-release/manifest/1"
# A release with an SDEdit sampler / shipped central images (``starts``): an older verifier, which checks
# neither, refuses format 2 instead of answering OK for a file it never hashed.
FORMAT_VERSION_SDEDIT = "feta-release/manifest/2"
# The generator's ``feta.format`` (release.onnx_export): format 2 has the SDEdit inputs start, from_release.
GENERATOR_FORMATS = {False: "feta-release-generator/1", True: "feta-release-generator/2"}


# A release whose SDEdit starts come (partly) from a shipped aux-generator pool (``aux_starts``, sampler
# ``start_source``): a format-2 verifier would answer OK without hashing that pool, so it must refuse format
# 3.
FORMAT_VERSION_AUX = "feta-release/manifest/3"
# A release with a ``starts`` or ``aux_starts`` record and a PATIENT-level site: each record also gives, per
# patient-level site, its stage's ε per PATIENT (``<stage>_epsilon_per_patient``, over the site's signed
# images-per-patient cap), beside the per-image figures that alone were stated before. An older verifier
# refuses format 4 (a field it does not know); a format 2 or 3 manifest of such a release, exported before,
# still verifies against the words it signed, with a warning giving the figures per patient.
FORMAT_VERSION_PATIENT = "feta-release/manifest/4"


# What verify, synthesize and report read of a release (``files.read_regular``: regular files through no
# link): a file's signed ``size`` is checked before it is read, and these caps bound every read, the
# manifest's and the policies' (read before the manifest's signature can be checked) and those of releases
# whose records state no size.
MAX_MANIFEST_BYTES = 64 << 20
MAX_POLICY_BYTES = 4 << 20
MAX_GENERATOR_BYTES = 2 << 30  # protobuf's own limit on one serialized ONNX model
MAX_IMAGES_BYTES = 1 << 30  # central_images.npz / aux_images.npz
TAKE_AS_PUBLISHED = "take the release as it was published (its files are regular files, no links)"


def file_record(release_dir: str | Path, file: str) -> dict[str, Any]:
    """A release file's ``file``, ``sha256`` and ``size`` (bytes): the size lets verify refuse a file of any
    other size before reading a byte of it."""
    path = Path(release_dir) / file
    return {"file": file, "sha256": sha256_file(path), "size": path.stat().st_size}


def manifest_format(
    sampler: dict[str, Any],
    starts: dict[str, Any] | None,
    aux_starts: dict[str, Any] | None = None,
    sites: Sequence[dict[str, Any]] = (),
) -> str:
    """The format a manifest with this sampler, ``starts`` and ``aux_starts`` records and these ``sites``
    (site records or signed statements) must carry."""
    if aux_starts is not None or "start_source" in sampler:
        base = FORMAT_VERSION_AUX
    else:
        base = FORMAT_VERSION_SDEDIT if starts is not None or "start_sigma" in sampler else FORMAT_VERSION
    return FORMAT_VERSION_PATIENT if base != FORMAT_VERSION and patient_caps(sites) else base


def patient_caps(sites: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Each patient-level site's signed images-per-patient cap, by site id (``sites``: site records, whose
    attestation carries the statement, or signed statements)."""
    out: dict[str, int] = {}
    for s in sites:
        st = (s.get("attestation") or {}).get("statement") or s
        cap = statement_patient_cap(st)
        if cap is not None:
            out[str(st["site_id"])] = cap
    return out


# [sampler] fields `feta-release export --solver/--steps` may set for a release (how many denoising steps and
# which solver: post-processing, no privacy cost, and no file more or less in the release). Every other field
# of the released sampler is the signed job's (:func:`released_sampler`; verify refuses a release whose
# sampler is not).
EXPORT_SAMPLER_OVERRIDES = ("solver", "steps")


def sampler_record(settings: Mapping[str, Any]) -> dict[str, Any]:
    """A sampler (``SamplerSettings``' or a job's ``[sampler]`` fields) as the generator metadata and the
    manifest record it: ``start_sigma`` only for an SDEdit sampler and ``start_source`` only when it is not
    the default, so a noise-only or central-start release reads as before those options existed."""
    out = dict(settings)
    if out.get("start_sigma") is None:
        out.pop("start_sigma", None)
    if out.get("start_source", "central") == "central":
        out.pop("start_source", None)
    return out


def released_sampler(sampler: Mapping[str, Any], central_images: bool) -> dict[str, Any]:
    """Export's one normalisation of a job's sampler record (:func:`sampler_record`): a central-start SDEdit
    sampler whose release carries no central images is released as the noise sampler (``start_sigma``
    dropped). Export applies it; verify holds the released sampler to it applied to the SIGNED job's
    ``[sampler]``."""
    out = dict(sampler)
    if out.get("start_source", "central") == "central" and not central_images:
        out.pop("start_sigma", None)
    return out


def sampler_problem(
    released: Mapping[str, Any], job_config: Mapping[str, Any], central_images: bool
) -> str | None:
    """Why the released sampler is not the signed job's ``[sampler]`` as export releases it (None: it is),
    naming the first field that differs (``EXPORT_SAMPLER_OVERRIDES`` may)."""
    from ..config import JobConfig

    section = JobConfig.from_dict(dict(job_config)).sampler
    want = released_sampler(
        sampler_record({f.name: getattr(section, f.name) for f in fields(section)}), central_images
    )
    for k in sorted(set(released) | set(want)):
        if k not in EXPORT_SAMPLER_OVERRIDES and released.get(k) != want.get(k):
            return (
                f"generator.sampler.{k} is {json.dumps(released.get(k))}, the signed job's [sampler] gives "
                f"{json.dumps(want.get(k))}"
            )
    return None


ATTESTATION_KIND = "feta-release/spend-attestation/1"
MANIFEST_FILE = "manifest.json"
GENERATOR_FILE = "generator.onnx"
POLICY_DIR = "policies"

GENERATOR_INPUTS = {
    "noise": {"dtype": "float32", "shape": ["batch", "C", "H", "W"], "meaning": "standard normal noise"},
    "labels": {"dtype": "int64", "shape": ["batch"], "meaning": "class index into classes"},
}
SDEDIT_INPUTS = {
    "start": {
        "dtype": "float32",
        "shape": ["batch", "C", "H", "W"],
        "meaning": "an augmented released central image of the label's class, in [0, 1] (SDEdit start)",
    },
    "from_release": {
        "dtype": "bool",
        "shape": [],
        "meaning": "true: SDEdit from start at start_sigma; false: noise",
    },
}
# what the signed manifest says a start image is, per [sampler] start_source (review: it said
START_MEANING = {
    # "central image" for aux releases too)
    "central": "an augmented released central image of the label's class, in [0, 1] (SDEdit start)",
    "aux": "an augmented image of the label's class from the release's aux-generator pool (aux_images.npz), "
    "in [0, 1] (SDEdit start)",
    "mix": "per class alternately an augmented aux-generator pool image (aux_images.npz) and an augmented "
    "released central image of the label's class, in [0, 1] (SDEdit start)",
}


def sdedit_inputs(sampler: Mapping[str, Any]) -> dict[str, Any]:
    """The SDEdit inputs of the generator, the start's meaning naming where its images come from."""
    meaning = START_MEANING.get(str(sampler.get("start_source", "central")), START_MEANING["central"])
    return {**SDEDIT_INPUTS, "start": {**SDEDIT_INPUTS["start"], "meaning": meaning}}


GENERATOR_OUTPUTS = {"images": {"dtype": "float32", "shape": ["batch", "C", "H", "W"], "range": [0.0, 1.0]}}

# Packages whose versions the manifest records; read from installed metadata, never by importing them.
SOFTWARE = ("feta-release", "torch", "onnx", "onnxruntime", "flwr", "opacus")


def software_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in SOFTWARE:
        try:
            out[name.replace("-", "_")] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name.replace("-", "_")] = None
    out["feta_release"] = out.get("feta_release") or __version__
    return out


def policy_file_name(site_id: str) -> str:
    return f"{POLICY_DIR}/{site_id}.signed.json"


# -- attestations -----------------------------------------------------------------------------------------


def build_attestation(
    site_id: str,
    job_id: str,
    events: Iterable[Event],
    delta: float,
    accountant: str,
    policy_sha256: str | None,
    key: Ed25519PrivateKey,
    *,
    created: str | None = None,
    job_sha256: str | None = None,
    lifetime_events: Iterable[Event] | None = None,
    lifetime_delta: float | None = None,
    history: str = "site-ledger",
    max_colluders: int | None = None,
    unit_policy: Any = None,
    ledger: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A site's signed, FINAL spend statement for one job: ``{"statement": {...}, "signature": {...}}``.

    epsilon is computed here from the events (never taken from the caller), so a site cannot sign a figure
    that its own history does not support. ``job_sha256`` binds the statement to the exact signed job (and so
    to the job's list of sites); ``lifetime_events`` is everything the site has ever released from this
    dataset (all jobs, all coordinators): a release built on an earlier job's weights depends on both.
    ``final: true`` says the job is closed at the site: it spends nothing more after this statement.
    A history with secure-aggregation (Skellam) events also carries ``secure_aggregation``: the site's trust
    assumption (``max_colluders``) under which ``epsilon`` holds, and ``worst_case_epsilon`` (job and
    lifetime) if every other site colluded with the coordinator (its own noise share only), both recomputed
    here. ``unit_policy``: the site's verified policy: the statement then carries ``privacy_unit``, what its ε
    protects (one patient or one image, ``feta_release.privacy_unit.site_unit_statement``), also recomputed
    here. ``ledger``: the site ledger's ``{ledger_id, rows, head}`` after this job (``Ledger.anchor``): the
    coordinator keeps the last one per site and refuses a later job from a ledger that does not extend it
    (deleted, restored).
    """
    evs = list(events)
    life = evs if lifetime_events is None else list(lifetime_events)
    life_delta = float(delta if lifetime_delta is None else lifetime_delta)
    job_eps = epsilon(evs, delta, accountant)  # type: ignore[arg-type]
    statement = {
        "kind": ATTESTATION_KIND,
        "site_id": str(site_id),
        "job_id": str(job_id),
        "job_sha256": job_sha256,
        "final": True,
        # Where the events come from: the node's own ledger, or an (unsigned) single-site run directory.
        "history": history,
        "events": events_to_list(evs),
        "epsilon": job_eps,
        "delta": float(delta),
        "accountant": accountant,
        "lifetime": {
            "events": events_to_list(life),
            "epsilon": epsilon(life, life_delta, accountant),  # type: ignore[arg-type]
            "delta": life_delta,
        },
        "policy_sha256": policy_sha256,
        "created": created or utc_stamp(),
    }
    if ledger is not None:
        statement["ledger"] = {
            "ledger_id": str(ledger["ledger_id"]),
            "rows": int(ledger["rows"]),
            "head": str(ledger["head"]),
        }
    if unit_policy is not None:
        from ..privacy_unit import site_unit_statement

        statement["privacy_unit"] = site_unit_statement(unit_policy, job_eps, float(delta), evs, accountant)
    if has_secure_aggregation(life):
        statement["secure_aggregation"] = {
            "max_colluders": int(max_colluders or 0),
            "worst_case_epsilon": worst_case_epsilon(evs, delta)
            if has_secure_aggregation(evs)
            else statement["epsilon"],
            "lifetime_worst_case_epsilon": worst_case_epsilon(life, life_delta),
        }
    return {"statement": statement, "signature": sign_document(statement, key)}


def site_record(attestation: dict[str, Any]) -> dict[str, Any]:
    """The manifest's entry for a site: the attested figures, repeated in the clear, plus the attestation."""
    st = attestation["statement"]
    return {
        "site_id": st["site_id"],
        "events": st["events"],
        "epsilon": st["epsilon"],
        "delta": st["delta"],
        "accountant": st["accountant"],
        "policy_sha256": st["policy_sha256"],
        "lifetime_epsilon": (st.get("lifetime") or {}).get("epsilon"),
        "attestation": attestation,
    }


# Fields of a site record that must equal its signed statement.
ATTESTED_FIELDS = ("site_id", "events", "epsilon", "delta", "accountant", "policy_sha256")


# -- release statement (what the generator's metadata binds to) ---------------------------------------------


def release_statement(job: dict[str, Any], sites: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Job + every site's privacy figures: fixed BEFORE the generator is written (see onnx_export
    docstring)."""
    return {
        "job": {"job_id": job["job_id"], "config": job["config"]},
        "sites": [{k: s[k] for k in ATTESTED_FIELDS} for s in sites],
    }


def statement_sha256(job: dict[str, Any], sites: Sequence[dict[str, Any]]) -> str:
    return sha256_hex(canonical_json(release_statement(job, sites)))


# -- manifest -------------------------------------------------------------------------------------------


def build_manifest(
    release_dir: str | Path,
    *,
    job_id: str,
    config: dict[str, Any],
    classes: Sequence[str],
    image_shape: Sequence[int],
    sampler: dict[str, Any],
    sites: Sequence[dict[str, Any]],
    timestamps: dict[str, str] | None = None,
    generator_file: str = GENERATOR_FILE,
    signed_job: dict[str, Any] | None = None,
    starts: dict[str, Any] | None = None,
    aux_starts: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The unsigned manifest body for a release directory whose generator is already written.

    ``signed_job`` (the coordinator's ``{"job": ..., "signature": ...}``) is carried whole: its list of sites
    is what ``verify`` holds the release to (every listed site needs a final attestation for this job).
    ``starts``: the record of the released central images shipped for SDEdit (:func:`starts_record`);
    ``aux_starts``: the record of the aux-generator pool shipped for ``start_source`` aux/mix
    (:func:`aux_record`).
    """
    gen_path = Path(release_dir) / generator_file
    if not gen_path.is_file():
        raise ReleaseError(f"{gen_path}: generator file missing; write it before the manifest")
    if not sites:
        raise ReleaseError("a release needs at least one site's attestation")
    ids = [s["site_id"] for s in sites]
    if len(set(ids)) != len(ids):
        raise ReleaseError(f"duplicate site ids in release: {ids}")
    created = utc_stamp()
    return {
        "format_version": manifest_format(sampler, starts, aux_starts, sites),
        "created": created,
        "generator": {
            **file_record(release_dir, generator_file),
            "inputs": {**GENERATOR_INPUTS, **(sdedit_inputs(sampler) if "start_sigma" in sampler else {})},
            "outputs": GENERATOR_OUTPUTS,
            "classes": list(classes),
            "image_shape": [int(v) for v in image_shape],
            "sampler": dict(sampler),
        },
        "job": {
            "job_id": job_id,
            "config": config,
            **(
                {}
                if signed_job is None
                else {"sites": list(signed_job["job"]["sites"]), "signed": signed_job}
            ),
        },
        "software": software_versions(),
        "sites": list(sites),
        "timestamps": {"manifest_created": created, **(timestamps or {})},
        **({} if starts is None else {"starts": starts}),
        **({} if aux_starts is None else {"aux_starts": aux_starts}),
    }


STARTS_KIND = "RandAugment bag of training.augment (numpy port, release/starts.py), magnitude drawn per image"


def starts_source(n_sites: int) -> str:
    """Where the shipped central images come from, in words (a function of the public site count only)."""
    return (
        "one site's release, post-processed as the warm-up used it"
        if n_sites == 1
        else f"the {n_sites} sites' releases combined (public-size weighted mean, post-processed) as the "
        "coordinator's warm-up used them"
    )


def starts_claims(
    config: dict[str, Any], sites: Sequence[dict[str, Any]], n_classes: int, *, per_patient: bool = True
) -> dict[str, Any]:
    """Every claim of the ``starts`` record, computed from signed inputs only: the job config (counts,
    augmentation) and each site's signed history (the central stage's ε, as the privacy report computes it).
    ``sites``: site records or signed statements (site_id, events, delta, accountant). Export writes these and
    verify recomputes them, so no figure in the record is the coordinator's word. ``per_patient``: with each
    patient-level site's figure per patient (``FORMAT_VERSION_PATIENT``); False: the claims of a format 2 or 3
    manifest, per image only."""
    from ..config import JobConfig

    cfg = JobConfig.from_dict(config)
    augmentation = _augmentation(cfg)
    if cfg.central.rounds <= 0:
        raise ReleaseError(
            "the job has no central stage ([central] rounds = 0) but the release carries central "
            "images: they are not this job's release; leave [sampler] start_sigma out"
        )
    for s in sites:
        if not any(e.stage == "central" for e in events_from_list(s["events"])):  # every site
            # released its part, in its history
            raise ReleaseError(
                f"site {s['site_id']}'s signed history has no 'central' event for this job, so the "
                "central images are not what the sites released; leave [sampler] start_sigma out"
            )
    unit, per_site, worst = _stage_figures(sites, "central")
    patients = patient_figures(sites, "central") if per_patient else None
    # rows are (round, class, cell); cells = 1 unless "mean"
    per_class = cfg.central.rounds * cfg.central.cells
    source = starts_source(len(sites))
    return {
        "images": per_class * n_classes,
        "per_class": [per_class] * n_classes,
        "source": source,
        "augmentation": augmentation,
        "unit": unit,  # image: the central stage is image-level at every site (privacy_unit.py)
        "central_epsilon_alone": per_site,
        "central_epsilon_worst_case": worst,
        **patient_fields("central", patients),
        "privacy": _starts_words(source, per_site, worst, unit, patients),
    }


def _stage_figures(
    sites: Sequence[dict[str, Any]], stage: str
) -> tuple[str, dict[str, float], dict[str, float]]:
    """What the signed histories say about one stage's release, per site: its unit of privacy ("image" unless
    a site's events of that stage say "patient"), its ε alone at the site's delta, and (secure aggregation
    only, ) its ε if every other site colludes with the coordinator."""
    per_site: dict[str, float] = {}
    worst: dict[str, float] = {}
    units: set[str] = set()
    for s in sites:
        evs = [e for e in events_from_list(s["events"]) if e.stage == stage]
        sid, delta = str(s["site_id"]), float(s["delta"])
        units |= {str(getattr(e, "unit", "image")) for e in evs}
        per_site[sid] = epsilon_breakdown(evs, delta, s["accountant"])[stage]
        if has_secure_aggregation(evs):
            worst[sid] = epsilon_breakdown(evs, delta, s["accountant"], view="worst_case")[stage]
    return ("patient" if "patient" in units else "image"), per_site, worst


@dataclass(frozen=True)
class PatientFigures:
    """A stage's figures per PATIENT at the patient-level sites of a release: ``cap`` (site: its signed
    images-per-patient cap), ``alone`` (site: the stage's ε per patient at the site's delta, as its caps count
    it: ``accounting.patient_epsilon``, group privacy over the cap for these image-level releases) and
    ``worst`` (the same if every other site colludes with the coordinator; secure aggregation only)."""

    cap: dict[str, int]
    alone: dict[str, float]
    worst: dict[str, float]


def patient_figures(sites: Sequence[dict[str, Any]], stage: str) -> PatientFigures | None:
    """:class:`PatientFigures` of ``stage`` from the sites' signed histories (None: no patient-level site)."""
    caps = patient_caps(sites)
    if not caps:
        return None
    alone: dict[str, float] = {}
    worst: dict[str, float] = {}
    for s in sites:
        sid = str(s["site_id"])
        if sid not in caps:
            continue
        evs = [e for e in events_from_list(s["events"]) if e.stage == stage]
        delta, acc = float(s["delta"]), s["accountant"]
        alone[sid] = patient_epsilon(evs, delta, caps[sid], acc)
        if has_secure_aggregation(evs):
            worst[sid] = patient_epsilon(evs, delta, caps[sid], acc, view="worst_case")
    return PatientFigures(caps, alone, worst)


def patient_fields(stage: str, patients: PatientFigures | None) -> dict[str, Any]:
    """The record's per-patient fields (none without a patient-level site, or in a format 2/3 record)."""
    if patients is None:
        return {}
    return {
        f"{stage}_epsilon_per_patient": patients.alone,
        f"{stage}_epsilon_worst_case_per_patient": patients.worst,
    }


def _augmentation(cfg: Any) -> dict[str, Any]:
    """The start images' augmentation as the signed job sets it, bounded before any use."""
    from .starts import MAX_OPS, N_BINS

    w = cfg.warmup
    if not (0 <= w.augment_ops <= MAX_OPS and 1 <= w.augment_magnitude < N_BINS):
        raise ReleaseError(
            f"[warmup] augment_ops = {w.augment_ops}, augment_magnitude = {w.augment_magnitude}: the "
            f"release's start augmentation needs 0 <= augment_ops <= {MAX_OPS} and 1 <= "
            f"augment_magnitude <= {N_BINS - 1}"
        )
    return {"kind": STARTS_KIND, "ops": int(w.augment_ops), "magnitude_max": int(w.augment_magnitude)}


AUX_SOURCE = (
    "the auxiliary generator fitted to this job's noised frequency release (random-Fourier-feature "
    "statistics), sampled with the public seed rule (job seed, 'aux-pool')"
)


def aux_claims(
    config: dict[str, Any], sites: Sequence[dict[str, Any]], n_classes: int, *, per_patient: bool = True
) -> dict[str, Any]:
    """Every claim of the ``aux_starts`` record, from signed inputs and public constants only (as
    :func:`starts_claims`, ``per_patient`` too): the pool's size (``AUX_POOL_PER_CLASS`` per class),
    augmentation, and that the job and every site's signed history have the frequency release the generator is
    fitted to."""
    from ..config import JobConfig
    from .jobfiles import AUX_POOL_PER_CLASS

    cfg = JobConfig.from_dict(config)
    augmentation = _augmentation(cfg)
    if cfg.frequency.sigma is None or not cfg.sampler.uses_aux:
        raise ReleaseError(
            "the signed job has no frequency stage or no [sampler] start_source aux/mix, but the "
            "release carries aux-generator images: they are not this job's; set start_source = "
            '"central"'
        )
    for s in sites:
        if not any(e.stage == "frequency" for e in events_from_list(s["events"])):
            raise ReleaseError(
                f"site {s['site_id']}'s signed history has no 'frequency' event for this job, so no "
                'aux generator was fitted to its release; set [sampler] start_source = "central"'
            )
    unit, per_site, worst = _stage_figures(sites, "frequency")
    patients = patient_figures(sites, "frequency") if per_patient else None
    return {
        "images": AUX_POOL_PER_CLASS * n_classes,
        "per_class": [AUX_POOL_PER_CLASS] * n_classes,
        "source": AUX_SOURCE,
        "augmentation": augmentation,
        "unit": unit,
        "frequency_epsilon_alone": per_site,
        "frequency_epsilon_worst_case": worst,
        **patient_fields("frequency", patients),
        "privacy": _aux_words(unit, per_site, worst, patients),
    }


def _aux_words(
    unit: str, per_site: dict[str, float], worst: dict[str, float], patients: PatientFigures | None = None
) -> str:
    """The DPO's text of the aux_starts record, with the caveats of :func:`_starts_words`: unit, scope, the
    collusion assumption under secure aggregation, and that each site's job and lifetime ε cover the pool."""
    return (
        "Images of the auxiliary generator, which was fitted to the noised frequency release only (already "
        "charged in every site's signed history) with public randomness: post-processing of a release, no "
        "further privacy cost. "
        + _figure_words("frequency", unit, per_site, worst, patients)
        + " Each site's job ε and lifetime ε (its site record and the synthesize certificate) cover them. "
        "That they come from that generator is the coordinator's signed word; verify checks their hash, "
        "shape and counts and that every site released frequency statistics in this job. synthesize starts "
        "SDEdit samples from augmented copies (start_source aux: all, mix: every other image of each class)."
    )


def _figure_words(
    stage: str,
    unit: str,
    per_site: dict[str, float],
    worst: dict[str, float],
    patients: PatientFigures | None = None,
) -> str:
    """A stage's figures in words: per unit, that stage alone, and the collusion caveat when the
    stage was summed by secure aggregation; then, at the patient-level sites (``patients``), the figures per
    patient that their caps bound (a format 2/3 record has none: its words are kept as they were signed)."""
    words = ", ".join(f"site {k}: ε = {v:.3f}" for k, v in per_site.items())
    worst_words = (
        ""
        if not worst
        else (
            " These figures assume the other sites do not collude with the coordinator (secure aggregation); "
            "if they all do: " + ", ".join(f"site {k}: ε = {v:.3f}" for k, v in worst.items()) + "."
        )
    )
    # The former "(a patient-level site with patient cap k: k·ε per patient)" read as a patient bound of an
    # image-level site and left out that δ grows too. Group privacy for k images of one person: (kε,
    # k·e^((k−1)ε)·δ).
    group = (
        ""
        if unit == "patient"
        else " (per image: a person with k images in a site's data is protected only at (k·ε, "
        "k·e^((k−1)·ε)·δ) by group privacy, and an image-level site caps no one's number of images)"
    )
    return (
        f"Privacy per {unit.upper()}, for this job's {stage} stage alone, at each site's delta: "
        f"{words}{group}.{worst_words}{patient_words(patients)}"
    )


def patient_words(patients: PatientFigures | None, stage: str | None = None) -> str:
    """The per-patient sentence of a stage's figures (empty without patient-level sites). ``stage``: named in
    the sentence, where it does not follow that stage's per-image figures (words added to a format 2/3
    record's)."""
    if patients is None:
        return ""
    words = ", ".join(
        f"site {k}: ε = {v:.3f} (at most {patients.cap[k]} image(s) of a patient)"
        for k, v in patients.alone.items()
    )
    worst = (
        ""
        if not patients.worst
        else "; if the other sites all collude with the coordinator: "
        + ", ".join(f"site {k}: ε = {v:.3f}" for k, v in patients.worst.items())
    )
    scope = "" if stage is None else f" for this job's {stage} stage alone"
    return (
        f" Per PATIENT{scope}, the unit of privacy a patient-level site's caps bound (group privacy over its "
        f"cap, at its delta): {words}{worst}."
    )


def aux_record(
    release_dir: str | Path,
    file: str,
    config: dict[str, Any],
    sites: Sequence[dict[str, Any]],
    n_classes: int,
) -> dict[str, Any]:
    """The manifest's ``aux_starts`` entry: the pool's file and hash, and :func:`aux_claims`."""
    return {**file_record(release_dir, file), **aux_claims(config, sites, n_classes)}


def _starts_words(
    source: str,
    per_site: dict[str, float],
    worst: dict[str, float],
    unit: str = "image",
    patients: PatientFigures | None = None,
) -> str:
    """The DPO's text of the starts record: unit, scope, collusion assumption, lifetime."""
    return (
        "This release CONTAINS the noisy central images that the site(s) released in this job's 'central' "
        f"stage ({source}). {_figure_words('central', unit, per_site, worst, patients)} They are "
        "differentially private outputs already charged in every site's signed event history, so shipping "
        "them is post-processing and costs no further privacy; each site's job ε and lifetime ε (its site "
        "record and the synthesize certificate) cover them. synthesize starts its SDEdit samples from "
        "augmented copies of them (--from release)."
    )


def starts_record(
    release_dir: str | Path,
    file: str,
    config: dict[str, Any],
    sites: Sequence[dict[str, Any]],
    n_classes: int,
) -> dict[str, Any]:
    """The manifest's ``starts`` entry: the released central images' file and hash,
    and :func:`starts_claims`."""
    return {**file_record(release_dir, file), **starts_claims(config, sites, n_classes)}


def starts_count_problem(labels: Any, per_class: Sequence[int]) -> str | None:
    """Why the file's labels are not the per-class counts the signed job releases (None: they are)."""
    have = [int(sum(1 for v in labels if int(v) == c)) for c in range(len(per_class))]
    if have != list(per_class) or len(labels) != sum(per_class):
        return (
            f"the central images hold {have} images per class ({len(labels)} in all), the signed job "
            f"releases {list(per_class)} per class (central rounds x cells)"
        )
    return None


def sign_manifest(manifest: dict[str, Any], key: Ed25519PrivateKey) -> dict[str, Any]:
    return {"manifest": manifest, "signature": sign_document(manifest, key)}


def write_manifest(release_dir: str | Path, signed: dict[str, Any]) -> Path:
    path = Path(release_dir) / MANIFEST_FILE
    # Human-readable on disk; the signature covers canonical_json(manifest), not these bytes.
    path.write_text(json.dumps(signed, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")
    return path


def read_manifest(release_dir: str | Path) -> dict[str, Any]:
    path = Path(release_dir) / MANIFEST_FILE
    if not path.exists() and not path.is_symlink():
        raise ReleaseError(f"{path}: no manifest.json; is {release_dir} a release directory?")
    raw = read_regular(
        path, limit=MAX_MANIFEST_BYTES, error=ReleaseError, what="manifest", fix=TAKE_AS_PUBLISHED
    )
    try:
        doc = loads_strict(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ReleaseError(f"{path}: manifest is not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("manifest"), dict) or "signature" not in doc:
        raise ReleaseError(f'{path}: expected {{"manifest": {{...}}, "signature": {{...}}}}')
    return doc


def site_events(site: dict[str, Any]) -> list[Event]:
    return events_from_list(site["events"])
