"""The release manifest's record of the central images it ships (``starts``) stated the central stage's ε
per IMAGE only, even at a patient-level site, where the figure that site's caps bound is per PATIENT (group
privacy over its signed cap). A release with a patient-level site now gives that figure beside the per-image
one (``central_epsilon_per_patient`` and the record's words; manifest format 4), verify recomputes it from
the signed history, and a format 2 manifest of such a release, exported before, still verifies against the
words it signed, with a warning giving the figure per patient."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from feta_release.accounting import PrivacyEvent, patient_epsilon
from feta_release.release.manifest import FORMAT_VERSION_PATIENT, FORMAT_VERSION_SDEDIT, starts_claims
from feta_release.release.verify import verify_release
from tests.support.release import (
    IMAGE_SHAPE,
    load_signed,
    new_keys,
    patient_release,
    resign,
    sdedit_central,
    small_denoiser,
)

CAP = 4  # patient_release's signed images-per-patient cap
# a patient-level site's job: its central release (image-level, so per patient by group privacy over the cap)
# and patient-level DP-SGD
EVENTS = [PrivacyEvent("central", 6.0, 1.0, 1), PrivacyEvent("dpsgd", 20.0, 0.05, 200, unit="patient")]
PER_PATIENT = "central_epsilon_per_patient"


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    from feta_release.release.onnx_export import export_denoiser

    keys = new_keys()
    den = export_denoiser(small_denoiser(), IMAGE_SHAPE)
    out = tmp_path_factory.mktemp("patient-sd") / "rel"
    return patient_release(out, den, keys, EVENTS, EVENTS, start_sigma=0.5, starts=sdedit_central()), keys


def _copy(rel: Path, to: Path) -> Path:
    shutil.copytree(rel, to)
    return to


def test_the_central_images_record_gives_the_patient_level_sites_figure_per_patient(
    release: tuple[Path, Any],
) -> None:
    rel, keys = release
    man = load_signed(rel)["manifest"]
    rec = man["starts"]
    want = patient_epsilon([e for e in EVENTS if e.stage == "central"], 1e-5, CAP)
    assert man["format_version"] == FORMAT_VERSION_PATIENT
    assert rec[PER_PATIENT] == {"a": pytest.approx(want)} and want > rec["central_epsilon_alone"]["a"]
    assert (
        "Per PATIENT" in rec["privacy"]
        and f"site a: ε = {want:.3f} (at most {CAP} image(s)" in rec["privacy"]
    )
    res = verify_release(rel, keys.trust())
    assert res.ok, res.reason()
    assert not [c for c in res.checks if c.status == "warn" and c.name == "central images"]
    assert res.starts_claims is not None and res.starts_claims[PER_PATIENT]["a"] == pytest.approx(want)


def _as_exported_before(rel: Path, keys: Any) -> dict[str, Any]:
    """The release as the exporter before the per-patient figures wrote it: format 2, its starts record per
    image only (the claims :func:`starts_claims` gives without them), re-signed by the coordinator."""
    signed = load_signed(rel)
    man = signed["manifest"]
    statements = [s["attestation"]["statement"] for s in man["sites"]]
    old = starts_claims(man["job"]["config"], statements, len(man["generator"]["classes"]), per_patient=False)
    assert not any(k.endswith("_per_patient") for k in old) and "PATIENT" not in old["privacy"]
    man["format_version"] = FORMAT_VERSION_SDEDIT
    man["starts"] = {k: man["starts"][k] for k in ("file", "sha256", "size")} | old
    resign(rel, signed, keys.coordinator)
    return signed


def test_a_release_exported_before_still_verifies_and_warns_with_the_figure_per_patient(
    release: tuple[Path, Any], tmp_path: Path
) -> None:
    rel, keys = release
    figure = load_signed(rel)["manifest"]["starts"][PER_PATIENT]["a"]
    old = _copy(rel, tmp_path / "old")
    _as_exported_before(old, keys)
    res = verify_release(old, keys.trust())
    assert res.ok, res.reason()
    warned = [c.detail for c in res.checks if c.status == "warn" and c.name == "central images"]
    assert len(warned) == 1 and "per IMAGE only" in warned[0], warned
    assert f"site a: ε = {figure:.3f} (at most {CAP} image(s) of a patient)" in warned[0], warned


def test_a_record_stripped_of_its_figure_per_patient_is_refused(
    release: tuple[Path, Any], tmp_path: Path
) -> None:
    """Format 4 without the per-patient figure, or format 2 with it: neither is what the signed inputs
    make."""
    rel, keys = release
    stripped = _copy(rel, tmp_path / "stripped")
    signed = load_signed(stripped)
    del signed["manifest"]["starts"][PER_PATIENT]
    resign(stripped, signed, keys.coordinator)
    res = verify_release(stripped, keys.trust())
    assert not res.ok and f"starts.{PER_PATIENT} is null" in res.reason(), res.reason()
    relabelled = _copy(rel, tmp_path / "relabelled")
    signed = load_signed(relabelled)
    signed["manifest"]["format_version"] = FORMAT_VERSION_SDEDIT
    resign(relabelled, signed, keys.coordinator)
    res = verify_release(relabelled, keys.trust())
    assert not res.ok and f"starts.{PER_PATIENT} is not part of the record" in res.reason(), res.reason()


def _mix_release(out: Path, keys: Any) -> Path:
    """A patient-level site's ``start_source = "mix"`` release: its central images and an aux-generator pool,
    both records at format 4."""
    import numpy as np

    from feta_release.release.export_run import assemble_release
    from feta_release.release.jobfiles import AUX_POOL_PER_CLASS
    from feta_release.release.manifest import site_record
    from feta_release.release.onnx_export import SamplerSettings, export_denoiser
    from tests.support.release import CLASSES, patient_attestation

    events = [*EVENTS, PrivacyEvent("frequency", 26.6, 1.0, 1)]
    att, job, policy = patient_attestation(keys, events, events, {"start_sigma": 0.5, "start_source": "mix"})
    labels = np.repeat(np.arange(len(CLASSES), dtype=np.int64), AUX_POOL_PER_CLASS)
    pool = np.random.default_rng(1).random((len(labels), *IMAGE_SHAPE)).astype(np.float32)
    return assemble_release(
        out,
        denoiser=export_denoiser(small_denoiser(), IMAGE_SHAPE),
        classes=CLASSES,
        image_shape=IMAGE_SHAPE,
        sampler=SamplerSettings(steps=6, start_sigma=0.5, start_source="mix"),
        job_id=job["job"]["job_id"],
        config=job["job"]["config"],
        sites=[site_record(att)],
        coordinator_key=keys.coordinator,
        signed_policies={"a": policy},
        signed_job=job,
        enforce_policy=False,
        starts=sdedit_central(),
        aux_pool=(pool, labels),
    )


def test_the_aux_images_record_gives_it_too_and_an_older_one_still_verifies(tmp_path: Path) -> None:
    from feta_release.release.manifest import FORMAT_VERSION_AUX, aux_claims

    keys = new_keys()
    rel = _mix_release(tmp_path / "rel", keys)
    man = load_signed(rel)["manifest"]
    want = patient_epsilon([PrivacyEvent("frequency", 26.6, 1.0, 1)], 1e-5, CAP)
    assert man["format_version"] == FORMAT_VERSION_PATIENT
    assert man["aux_starts"]["frequency_epsilon_per_patient"] == {"a": pytest.approx(want)}
    assert f"site a: ε = {want:.3f} (at most {CAP} image(s)" in man["aux_starts"]["privacy"]
    res = verify_release(rel, keys.trust())
    assert res.ok and not [c for c in res.checks if c.status == "warn"], res.checks
    # as exported before: format 3, both records per image only
    signed = _as_exported_before(rel, keys)
    man = signed["manifest"]
    statements = [s["attestation"]["statement"] for s in man["sites"]]
    old = aux_claims(man["job"]["config"], statements, len(man["generator"]["classes"]), per_patient=False)
    man["format_version"] = FORMAT_VERSION_AUX
    man["aux_starts"] = {k: man["aux_starts"][k] for k in ("file", "sha256", "size")} | old
    resign(rel, signed, keys.coordinator)
    res = verify_release(rel, keys.trust())
    assert res.ok, res.reason()
    warned = {c.name: c.detail for c in res.checks if c.status == "warn"}
    assert set(warned) == {"central images", "aux images"}, warned
    assert f"site a: ε = {want:.3f} (at most {CAP} image(s) of a patient)" in warned["aux images"]


def _certificate_start(rel: Path, keys: Any, out: Path) -> dict[str, Any]:
    import json

    from feta_release.release.synthesize import synthesize

    synthesize(rel, out, keys.trust(), num=2, progress=False, threads=1)
    start: dict[str, Any] = json.loads((out / "certificate.json").read_text())["certificate"]["generation"][
        "start"
    ]
    return start


def test_the_synthesize_certificate_gives_the_central_stage_per_patient_at_any_format(
    release: tuple[Path, Any], tmp_path: Path
) -> None:
    """The certificate's start section gave the central stage per IMAGE only (``unit`` "image"), so a DPO
    reading it at a patient-level site saw no figure its caps bound; a format 2 manifest of the release, which
    verify passes with a warning, must not drop it either."""
    rel, keys = release
    want = patient_epsilon([e for e in EVENTS if e.stage == "central"], 1e-5, CAP)
    old = _copy(rel, tmp_path / "old")
    _as_exported_before(old, keys)
    for name, at in (("now", rel), ("before", old)):
        start = _certificate_start(at, keys, tmp_path / f"synth-{name}")
        assert start[PER_PATIENT] == {"a": pytest.approx(want)}, (name, start)
        assert f"site a: ε = {want:.3f} (at most {CAP} image(s) of a patient)" in start["privacy"], name
        assert "Per PATIENT for this job's central stage alone" in start["privacy"], name


def test_the_synthesize_certificate_of_a_mix_release_gives_both_stages_per_patient(tmp_path: Path) -> None:
    keys = new_keys()
    rel = _mix_release(tmp_path / "rel", keys)
    freq = patient_epsilon([PrivacyEvent("frequency", 26.6, 1.0, 1)], 1e-5, CAP)
    central = patient_epsilon([e for e in EVENTS if e.stage == "central"], 1e-5, CAP)
    start = _certificate_start(rel, keys, tmp_path / "synth")
    assert start["frequency_epsilon_per_patient"] == {"a": pytest.approx(freq)}, start
    assert start[PER_PATIENT] == {"a": pytest.approx(central)}, start
    assert start["privacy"].count("Per PATIENT") == 2, start["privacy"]


def test_the_warning_on_an_older_record_gives_the_worst_case_per_patient_too() -> None:
    """Under secure aggregation a format 4 record gives each patient-level site's figure per patient also if
    every other site colludes with the coordinator; the warning on a format 2/3 record of such a release gave
    only the figure that assumes they do not, the smaller one."""
    from feta_release.accounting import SkellamEvent
    from feta_release.release.verify import VerificationResult, _warn_per_image_only

    central = SkellamEvent("central", 0.5, 1, 10.0, 10.0, mu=200.0, mu_worst=100.0)
    statement = {
        "site_id": "a",
        "events": [central.to_dict()],
        "delta": 1e-5,
        "accountant": "rdp",
        "privacy_unit": {"unit": "patient", "images_per_patient_cap": CAP, "epsilon_per_patient": 1.0},
    }
    man = {"format_version": FORMAT_VERSION_SDEDIT, "sites": [{"attestation": {"statement": statement}}]}
    res = VerificationResult(release_dir="rel", per_patient_claims=False)
    _warn_per_image_only(res, man, "central images", "central")
    assumed = patient_epsilon([central], 1e-5, CAP)
    worst = patient_epsilon([central], 1e-5, CAP, view="worst_case")
    assert worst > assumed + 1e-3
    (warned,) = [c.detail for c in res.checks if c.status == "warn"]
    assert f"site a: ε = {assumed:.3f} (at most {CAP} image(s) of a patient)" in warned, warned
    assert "collude" in warned and f"site a: ε = {worst:.3f}" in warned, warned


def test_the_privacy_report_of_an_older_release_gives_the_central_stage_per_patient(
    release: tuple[Path, Any], tmp_path: Path
) -> None:
    """The report's row of the shipped central images quotes the record's words: a format 2 record's state
    the stage per image only, so the row gave a patient-level site no figure its caps bound."""
    import html as html_lib

    from feta_release.release import report

    rel, keys = release
    want = patient_epsilon([e for e in EVENTS if e.stage == "central"], 1e-5, CAP)
    old = _copy(rel, tmp_path / "old")
    _as_exported_before(old, keys)
    path, res = report.write_report(old, tmp_path / "r.html", keys.trust(), per_class=1)
    page = html_lib.unescape(path.read_text("utf-8"))
    row = page[page.index("central images (also released)") :]
    row = row[: row.index("</tr>")]
    assert res.ok and f"site a: ε = {want:.3f} (at most {CAP} image(s) of a patient)" in row, row
    # after the record's last words (about synthesize), not its figures: the sentence names its stage
    assert "Per PATIENT for this job's central stage alone" in row, row
