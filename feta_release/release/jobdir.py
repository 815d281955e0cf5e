"""The job directory: what a finished job leaves for the release step, WHICHEVER driver ran it, and the one
code that turns it into a release (sample grid, privacy report, signed ONNX release).

Layout (``OUT``; the coordinator's ``--out``/``demo-out/job``, or a ``feta-release train`` RUN_DIR)::

    signed_job.json             the job signed by the coordinator key (its config and list of sites)
    job_summary.json            job id, sites, class names, image shape, DP-SGD rounds, skipped sites, each
                                site's epsilon/delta/history as it attested them, timings
    attestations.json           {site: the site's spend statement signed with the SITE key, from its own
                                ledger}
    policies/SITE.signed.json   each site's signed policy (when it has one)
    model.pt                    the released weights (``models.model_file.write_model_file``)
    released/central.npz        the central images the warm-up used (a run's own release; a federation's
                                combination of the sites' releases): shipped in release/ for SDEdit when the
                                job says start_sigma
    released/aux_images.npz     [sampler] start_source aux/mix: the aux-generator pool (post-processing of the
                                frequency release), shipped in release/ as aux_images.npz
    privacy_report.json/.txt    per site, epsilon by stage and in total, from the signed attestations
    budget.svg                  the same as a chart, against the policy caps
    samples.png                 a sample grid of the released model
    release/                    generator.onnx + manifest.json signed by the coordinator (+ policies/,
                                + central_images.npz for a start_sigma job)

Every job writes it through ``federation.job.run_job`` (a coordinator's, and ``train``'s federation of one),
and these functions make its report, grid, synthetic set and release, so ``verify``/``synthesize``/``report``
meet one release layout.

Everything here is post-processing of the trained model and of the sites' SIGNED attestations: the
privacy figures in the report are the ones each site computed from its own ledger, re-derived by the
release module from the event histories (never a number the coordinator made up).
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..accounting import epsilon_breakdown, events_from_list, patient_epsilon, per_unit, unit_name
from ..config import JobConfig
from ..errors import FetaError
from ..files import atomic_write_bytes
from ..models import generate
from ..models.model_file import MODEL_FILE, read_model_file
from ..privacy_unit import figures_in_unit, lifetime_in_unit, statement_patient_cap
from ..progress_events import REPORT, SAMPLE_GRID, SAMPLING, Meter, Sink, timed
from ..signing import load_private_key
from ..viz import epsilon_title, save_budget_svg, save_grid
from .export_run import assemble_release, denoiser_from_checkpoint, released_central
from .jobfiles import (
    ATTESTATIONS,
    POLICIES,
    RELEASE,
    RELEASED_AUX,
    SIGNED_JOB,
    SUMMARY,
    job_summary,
    write_job_files,
)
from .manifest import site_record
from .onnx_export import SamplerSettings
from .starts import mixed_start_images
from .verify import public_words

__all__ = [
    "ATTESTATIONS",
    "POLICIES",
    "RELEASE",
    "SIGNED_JOB",
    "SUMMARY",
    "build_release",
    "job_summary",
    "load_model",
    "privacy_report",
    "sample_grid",
    "synthetic_set",
    "write_job_files",
]


def privacy_report(out_dir: Path, sink: Sink | None = None) -> dict[str, Any]:
    """``privacy_report.json`` + ``privacy_report.txt``: per site, ε spent by stage and in total; at a
    PATIENT-level site the figure its caps bound, ε per patient, first (``_site_report``); its start and
    seconds reported to ``sink``."""
    with timed(sink, REPORT, "privacy_report.json/.txt and the budget chart (budget.svg)"):
        return _privacy_report(out_dir)


def _privacy_report(out_dir: Path) -> dict[str, Any]:
    summary = json.loads((out_dir / "job_summary.json").read_text("utf-8"))
    atts = json.loads((out_dir / "attestations.json").read_text("utf-8"))
    sites = {sid: _site_report(att) for sid, att in sorted(atts.items())}
    report = {
        "job_id": summary["job_id"],
        "unit_of_privacy": "one image of one site"
        + (
            "; one PATIENT at a patient-level site" if any("per_patient" in s for s in sites.values()) else ""
        ),
        "sites": sites,
        "rounds": summary["rounds"],
        "skipped": summary["skipped"],
        "timings_s": summary["timings"],
    }
    public = _signed_public(out_dir)
    if public:
        report["public_pretraining"] = public
    (out_dir / "privacy_report.json").write_text(json.dumps(report, indent=2), "utf-8")
    _budget_chart(out_dir, sites)
    lines = [f"Privacy report for job {report['job_id']} (unit of privacy: {report['unit_of_privacy']})", ""]
    for sid, s in sites.items():
        lines += _site_lines(sid, s)
    lines += [
        "",
        "Stage figures are each stage alone; composition is sub-additive, the total is what counts.",
        *_patient_stage_note(sites),
        "Each site's data never left it: only the noisy releases above did.",
    ]
    if public:
        lines.append(f"Public pretraining (in no site's ledger): {public_words(public)}.")
    (out_dir / "privacy_report.txt").write_text("\n".join(lines) + "\n", "utf-8")
    return report


def _patient_stage_note(sites: dict[str, Any]) -> list[str]:
    """Why a patient-level site's total can exceed the sum of its stages alone."""
    if all(s["unit"] != "patient" for s in sites.values()):
        return []
    return [
        "At a patient-level site each stage alone is stated at the whole δ; its total composes the "
        "image-level releases (group privacy) and the patient-level DP-SGD at δ/2 each, so it can exceed "
        "their sum."
    ]


def _site_report(att: dict[str, Any]) -> dict[str, Any]:
    """One site's part of the report from its signed statement, every ε in the SITE'S unit (``unit``): per
    patient at a patient-level site (its statement's ``privacy_unit``: the image-level releases by group
    privacy over the cap, patient-level DP-SGD as it is; the figure its ledger's caps bound), so a reader of
    ``epsilon_total``, ``lifetime.epsilon`` or a stage's figure gets the site's guarantee. There the
    statement's own figures, composed as if each event protected one image (smaller numbers that are not the
    site's guarantee), keep their unit in their name: ``*_per_image``."""
    st = att["statement"]
    events = events_from_list(st["events"])
    cap = statement_patient_cap(st)
    site: dict[str, Any] = {
        "unit": unit_name(cap),
        "epsilon_total": st["epsilon"] if cap is None else float(st["privacy_unit"]["epsilon_per_patient"]),
        "delta": st["delta"],
        "accountant": st["accountant"],
        "epsilon_by_stage_alone": epsilon_breakdown(events, st["delta"], st["accountant"], patient_cap=cap),
        "events": st["events"],
        "policy_sha256": st["policy_sha256"],
        "signed_by_site": att["signature"]["signer"],
    }
    if cap is not None:
        site["epsilon_total_per_image"] = st["epsilon"]
        site["per_patient"] = dict(st["privacy_unit"])
    # both figures the site signed (docs/secure-aggregation.md)
    if isinstance(st.get("secure_aggregation"), dict):
        site["secure_aggregation"] = _secure_in_unit(st, events, cap)
    life = lifetime_in_unit(st)  # the site's signed spend on the same images over all its jobs
    if life is not None:
        life_events = events_from_list(st["lifetime"]["events"])
        site["lifetime"] = {
            **life,
            "epsilon_by_stage_alone": epsilon_breakdown(
                life_events, life["delta"], st["accountant"], patient_cap=cap
            ),
        }
    return site


def _secure_in_unit(st: dict[str, Any], events: list[Any], cap: int | None) -> dict[str, Any]:
    """The statement's secure-aggregation figures; at a patient-level site the worst cases PER PATIENT, as its
    ledger caps them (``accounting.patient_epsilon`` over its cap, ``view="worst_case"``), the signed
    image-level ones kept as ``*_per_image``."""
    sa = dict(st["secure_aggregation"])
    if cap is None:
        return sa
    figures = [("worst_case_epsilon", events, float(st["delta"]))]
    if isinstance(st.get("lifetime"), dict):
        life = st["lifetime"]
        figures.append(
            ("lifetime_worst_case_epsilon", events_from_list(life["events"]), float(life["delta"]))
        )
    for key, evs, delta in figures:
        if key in sa:
            sa[key + "_per_image"] = sa[key]
            sa[key] = patient_epsilon(evs, delta, cap, st["accountant"], view="worst_case")
    return sa


def _site_lines(sid: str, s: dict[str, Any]) -> list[str]:
    """A site's lines of ``privacy_report.txt``: every ε in the site's unit (``_site_report``), named beside
    it in the words of every other line that states a site's ε (``accounting.per_unit``)."""
    per = s.get("per_patient")
    what = f"ε {per_unit(s['unit'])}"
    if per is not None:
        lines = [
            f"site {sid}: total {what} = {s['epsilon_total']:.3f} at δ = "
            f"{per['delta_per_patient']:g} (at most {per['images_per_patient_cap']} image(s) each: "
            f"{per['how']}), signed by the site's key {s['signed_by_site']}",
            "    the events composed as if each protected one image: "
            f"ε {per_unit('image')} = {s['epsilon_total_per_image']:.3f} "
            "(not the site's guarantee: its unit is the patient)",
        ]
    else:
        lines = [
            f"site {sid}: total {what} = {s['epsilon_total']:.3f} at δ = {s['delta']:g} ({s['accountant']} "
            f"accountant), signed by the site's key {s['signed_by_site']}"
        ]
    life, sa = s.get("lifetime"), s.get("secure_aggregation")
    if life is not None:
        lines.append(
            f"    lifetime on the same images (all jobs): {what} = {life['epsilon']:.3f} "
            f"at δ = {life['delta']:g}"
        )
    if sa:
        lines.append(
            f"    secure aggregation: the ε above assumes at most {sa.get('max_colluders', 0)} other "
            "site(s) collude with the coordinator (the site's signed policy); if every other site "
            f"colluded (only this site's own noise share protecting it): {what} = "
            f"{sa['worst_case_epsilon']:.3f}"
        )
    for stage, e in s["epsilon_by_stage_alone"].items():
        if stage != "total":
            lines.append(f"    {stage:<10} alone {what} = {e:.3f}")
    return lines


def _signed_public(out_dir: Path) -> dict[str, Any]:
    """What the signed job names as seen before any private image (its ``[public]`` set or model file; {}:
    none): public, so the report repeats it beside the spend it does not add to."""
    path = out_dir / SIGNED_JOB
    if not path.is_file():
        return {}
    section = json.loads(path.read_text("utf-8"))["job"]["config"].get("public") or {}
    if not (section.get("sha256") or section.get("pretrained_sha256")):
        return {}  # pretraining settings alone name nothing seen
    keys = ("sha256", "count", "shape", "description", "pretrained_sha256")
    return {k: section[k] for k in keys if section.get(k)}


def _budget_chart(out_dir: Path, sites: dict[str, Any]) -> Path:
    """``budget.svg``: per site, ε of each stage alone and the composed total, this job beside the site's
    lifetime, against the site's per-job and lifetime caps: all in the site's unit (per patient at a
    patient-level site, as its policy's caps are)."""
    chart = {}
    for sid, s in sites.items():
        budget: dict[str, Any] = {}
        pol = out_dir / "policies" / f"{sid}.signed.json"
        # the caps are context for the chart only; verify checks them against the signed policy
        if pol.is_file():
            budget = json.loads(pol.read_text("utf-8")).get("policy", {}).get("budget", {})
        chart[sid] = {
            "by_stage": s["epsilon_by_stage_alone"],
            "delta": s["delta"],
            "lifetime_by_stage": (s.get("lifetime") or {}).get("epsilon_by_stage_alone"),
            "cap": budget.get("per_job", {}).get("epsilon"),
            "lifetime_cap": budget.get("lifetime", {}).get("epsilon"),
            "unit": s["unit"],
        }
    return save_budget_svg(chart, out_dir / "budget.svg")


def load_model(out_dir: Path) -> Any:
    """The trained denoiser from ``out_dir/model.pt`` (the one model file format, read weights-only)."""
    return denoiser_from_checkpoint(read_model_file(out_dir / MODEL_FILE), str(out_dir / MODEL_FILE))


def sample_grid(
    out_dir: Path,
    per_class: int = 10,
    seed: int = 0,
    *,
    device: str | torch.device = "cpu",
    sink: Sink | None = None,
) -> Path:
    """``samples.png``: a grid of the released model, drawn as ``synthesize`` draws by default, from the job
    directory's files (the central images and pool bound to this job's id as :func:`build_release` reads
    them). ``device``: where the model read from ``model.pt`` samples (the noise is drawn on the CPU, so the
    grid is the same function of the weights on any device). Its start and seconds reported to ``sink``."""
    with timed(sink, SAMPLE_GRID, f"{per_class} images per class (samples.png)"):
        return _sample_grid(out_dir, per_class, seed, device)


def _sample_grid(out_dir: Path, per_class: int, seed: int, device: str | torch.device) -> Path:
    signed = json.loads((out_dir / "signed_job.json").read_text("utf-8"))
    cfg = JobConfig.from_dict(signed["job"]["config"])
    n_sites = len(signed["job"]["sites"])  # titled by what made it: one site's run, or a federation's job
    scfg, init = cfg.sampler, None
    what = "single-site model samples" if n_sites == 1 else f"federated model samples ({n_sites} sites)"
    job_id = signed["job"]["job_id"]
    model, central = load_model(out_dir).to(device), released_central(out_dir, job_id)
    aux = released_central(out_dir, job_id, RELEASED_AUX, "aux-generator images") if scfg.uses_aux else None
    src = scfg.start_source if aux is not None else "central"
    # as synthesize draws by default
    if scfg.start_sigma is not None and (src == "aux" or central is not None):
        want = np.repeat(np.arange(model.n_classes, dtype=np.int64), per_class)
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(1,))))
        init = torch.from_numpy(
            mixed_start_images(
                central,
                aux,
                src,
                want,
                np.tile(np.arange(per_class), model.n_classes),
                rng,
                n_ops=cfg.warmup.augment_ops,
                magnitude_max=cfg.warmup.augment_magnitude,
            )
        )
        scfg, what = (
            dataclasses.replace(scfg, sigma_max=scfg.start_sigma),
            f"{what} (SDEdit from the release)",
        )
    images, labels = generate(model, per_class, seed, scfg, init=init)
    names = None
    if (out_dir / "job_summary.json").is_file():
        names = json.loads((out_dir / "job_summary.json").read_text("utf-8")).get("class_names")
    return save_grid(
        images.numpy(),
        labels.numpy(),
        out_dir / "samples.png",
        per_class=per_class,
        n_classes=model.n_classes,
        class_names=names,
        title=grid_title(out_dir, what),
    )


def grid_title(out_dir: Path, what: str) -> str:
    """``samples.png``'s title: the sites' own signed totals (not a coordinator figure), each in its site's
    unit (``privacy_unit.figures_in_unit``): per patient at a patient-level site, the figure its caps bound,
    never the smaller one its events give composed as if each protected one image."""
    if not (out_dir / "attestations.json").is_file():
        return epsilon_title(what, None)
    atts = json.loads((out_dir / "attestations.json").read_text("utf-8"))
    eps, delta, unit = figures_in_unit({sid: a["statement"] for sid, a in atts.items()})
    return epsilon_title(what, eps, delta, unit)


def build_release(
    out_dir: Path,
    coordinator_key: Path | str | Ed25519PrivateKey,
    *,
    require_policies: bool = True,
    sampler: dict[str, Any] | None = None,
    sink: Sink | None = None,
) -> Path:
    """``out_dir/release``: generator.onnx + manifest signed by the coordinator, sites' attestations inside;
    the export's and the signing's start and seconds reported to ``sink``.

    ``require_policies``: every site must have its signed policy in ``policies/`` (every site of a job does:
    a node, and ``train``'s site, is opened under one). The central images (``released/central.npz``, shipped
    for SDEdit when the job says start_sigma) and the aux pool (``released/aux_images.npz``) must name this
    job (a stale file of an earlier job in the same directory is never shipped). ``sampler``: the released
    sampler's ``solver`` / ``steps`` in place of the signed job's (``export --solver/--steps``; verify allows
    these two, ``manifest.EXPORT_SAMPLER_OVERRIDES``)."""
    signed = json.loads((out_dir / "signed_job.json").read_text("utf-8"))
    job = signed["job"]
    cfg = JobConfig.from_dict(job["config"])
    summary = json.loads((out_dir / "job_summary.json").read_text("utf-8"))
    atts = json.loads((out_dir / "attestations.json").read_text("utf-8"))
    missing = sorted(set(job["sites"]) - set(atts))
    if missing:
        raise FetaError(f"no signed attestation from site(s) {', '.join(missing)}: cannot release")
    policies = {}
    for sid in atts:
        path = out_dir / POLICIES / f"{sid}.signed.json"
        if path.is_file():
            policies[sid] = json.loads(path.read_text("utf-8"))
        elif require_policies:
            raise FetaError(f"{path}: missing; the release needs site {sid}'s signed policy")
    key = (
        coordinator_key
        if isinstance(coordinator_key, Ed25519PrivateKey)
        else load_private_key(coordinator_key)
    )
    # The central images the warm-up used (the sites' releases combined), shipped for SDEdit (start_sigma),
    # and the aux pool (post-processing of the frequency release)
    starts = released_central(out_dir, job["job_id"])
    aux_pool = None
    if cfg.sampler.uses_aux:
        aux_pool = released_central(out_dir, job["job_id"], RELEASED_AUX, "aux-generator images")
    return assemble_release(
        out_dir / RELEASE,
        denoiser=load_model(out_dir),
        classes=summary["class_names"],
        image_shape=summary["image_shape"],
        sampler=SamplerSettings(**{**SamplerSettings.from_config(cfg.sampler).to_dict(), **(sampler or {})}),
        job_id=job["job_id"],
        config=job["config"],
        sites=[site_record(atts[s]) for s in sorted(atts)],
        coordinator_key=key,
        signed_policies=policies,
        signed_job=signed,
        starts=starts,
        aux_pool=aux_pool,
        sink=sink,
    )


def synthetic_set(
    out_dir: Path,
    n: int,
    seed: int = 0,
    device: str | torch.device = "cpu",
    *,
    sampler: dict[str, Any] | None = None,
    name: str = "synthetic.npz",
    aux: tuple[np.ndarray, np.ndarray] | None = None,
    sink: Sink | None = None,
) -> Path:
    """``synthetic.npz``: ``n`` images of the released model (balanced labels, interleaved so a prefix is
    balanced too), drawn as ``synthesize`` draws by default (SDEdit from the job's released central images /
    aux pool when the job says start_sigma). Post-processing of the release: images float32 (N, C, H, W) in
    [0, 1], labels int64, class_names. ``sampler``: ``[sampler]`` fields drawn with instead of the signed
    job's (``bench/resample.py`` compares sampler settings on one trained model), written to ``name``.
    ``aux``: the aux generator's pool (images, labels) drawn from instead of the released file, for a run
    that shipped none; it stays out of ``released/``, so no later release build can pick it up. ``sink``: the
    images drawn, their rate and the seconds left (``progress_events``)."""
    signed = json.loads((out_dir / "signed_job.json").read_text("utf-8"))
    cfg, job_id = JobConfig.from_dict(signed["job"]["config"]), signed["job"]["job_id"]
    if sampler:
        cfg = cfg.replace(sampler=sampler)
    model = load_model(out_dir).to(device)
    k = int(model.n_classes)
    labels = np.tile(np.arange(k, dtype=np.int64), -(-n // k))[:n]
    first = np.arange(n, dtype=np.int64) // k  # image j of its class
    central = released_central(out_dir, job_id)
    if not cfg.sampler.uses_aux:
        aux = None
    elif aux is None:
        aux = released_central(out_dir, job_id, RELEASED_AUX, "aux-generator images")
    src = cfg.sampler.start_source if aux is not None else "central"
    scfg, init = cfg.sampler, None
    if n and scfg.start_sigma is not None and (src == "aux" or central is not None):
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(2,))))
        starts = mixed_start_images(
            central,
            aux,
            src,
            labels,
            first,
            rng,
            n_ops=cfg.warmup.augment_ops,
            magnitude_max=cfg.warmup.augment_magnitude,
        )
        scfg, init = dataclasses.replace(scfg, sigma_max=scfg.start_sigma), torch.from_numpy(starts)
    how = f"{scfg.solver} {scfg.steps} steps" + (", SDEdit from the release" if init is not None else "")
    meter = Meter(sink, SAMPLING, "images", n, f"{n} synthetic images ({how}) into {name}")
    images, _ = (
        generate(model, labels, seed, scfg, init=init, progress=meter)
        if n
        else (torch.zeros((0, *model.image_shape)), None)
    )
    names = json.loads((out_dir / "job_summary.json").read_text("utf-8"))["class_names"]
    buf = io.BytesIO()
    np.savez_compressed(
        buf, images=images.numpy().astype(np.float32), labels=labels, class_names=np.array(names)
    )
    path = atomic_write_bytes(out_dir / name, buf.getvalue())
    meter.end()
    return path
