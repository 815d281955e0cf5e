"""The records of a job directory (signed job, summary, attestations, policies) as every job writes them:
json only, so the coordinator's ServerApp writes them without loading the release's ONNX code
(``release.jobdir`` re-exports them beside the release builder)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..privacy_unit import job_in_unit

SIGNED_JOB = "signed_job.json"
SUMMARY = "job_summary.json"
ATTESTATIONS = "attestations.json"
POLICIES = "policies"
RELEASE = "release"
# The central images the warm-up used (a run's own release; a federation's combination of the sites'), which
# the release ships for SDEdit when the job says [sampler] start_sigma.
RELEASED_CENTRAL = "released/central.npz"
# The fixed pool of aux-generator images (post-processing of the frequency release) the release ships for
# [sampler] start_source = "aux" / "mix"; drawn where the generator is (end of a run, the coordinator's
# warm-up).
RELEASED_AUX = "released/aux_images.npz"
# Its images per class: a PUBLIC count (a function of nothing private; verify recomputes the record from it),
# enough that synthesize's augmented copies do not cycle over a few starts.
AUX_POOL_PER_CLASS = 64


def job_summary(
    job_id: str,
    sites: list[str],
    class_names: list[str],
    image_shape: list[int],
    rounds: int,
    skipped: dict[str, list[str]],
    attestations: dict[str, Any],
    timings: dict[str, float],
) -> dict[str, Any]:
    """``job_summary.json`` of a job, federated or one-site: per attesting site its signed ε, δ and
    history. ``site_epsilon`` is in the site's unit (``site_unit``; ``privacy_unit.job_in_unit``): per
    patient at a patient-level site, the figure its caps bound, whose statement's ``epsilon`` (the events
    composed as if each protected one image) is kept as ``site_epsilon_per_image``."""
    st = {sid: att["statement"] for sid, att in attestations.items()}
    figures = {sid: job_in_unit(s) for sid, s in st.items()}
    return {
        "job_id": job_id,
        "sites": sorted(sites),
        "class_names": list(class_names),
        "image_shape": list(image_shape),
        "rounds": rounds,
        "skipped": skipped,
        "site_epsilon": {sid: f["epsilon"] for sid, f in figures.items()},
        "site_unit": {sid: f.get("unit", "image") for sid, f in figures.items()},
        "site_epsilon_per_image": {sid: f["epsilon_per_image"] for sid, f in figures.items() if "unit" in f},
        "delta": {sid: s["delta"] for sid, s in st.items()},
        "histories": {sid: s["events"] for sid, s in st.items()},
        "timings": timings,
    }


def write_job_files(
    out_dir: Path,
    *,
    signed_job: dict[str, Any],
    summary: dict[str, Any],
    attestations: dict[str, Any],
    signed_policies: dict[str, dict[str, Any]],
) -> None:
    """The job's own records, as the coordinator writes them after collecting the sites' attestations."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / ATTESTATIONS).write_text(json.dumps(attestations, indent=2), "utf-8")
    if signed_policies:
        (out_dir / POLICIES).mkdir(exist_ok=True)
    for sid, signed in signed_policies.items():
        (out_dir / POLICIES / f"{sid}.signed.json").write_text(json.dumps(signed, indent=2), "utf-8")
    (out_dir / SUMMARY).write_text(json.dumps(summary, indent=2), "utf-8")
    (out_dir / SIGNED_JOB).write_text(json.dumps(signed_job, indent=2), "utf-8")
