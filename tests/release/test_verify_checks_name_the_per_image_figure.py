"""`verify --explain` of a PATIENT-level site's release: the checks that recompute the statement's signed
job and lifetime ε (the events composed as if each protected one image) say so and give the figure per
patient beside it. They printed "stated ε = 0.668" and "lifetime ε = 0.973" with no unit, where one patient
can lose 3.43 in the job and 5.15 over the site's jobs."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")  # only to BUILD the test release

from feta_release.accounting import PrivacyEvent, patient_epsilon  # noqa: E402
from feta_release.release.onnx_export import export_denoiser  # noqa: E402
from feta_release.release.verify import verify_release  # noqa: E402
from tests.support.release import IMAGE_SHAPE, new_keys, patient_release, small_denoiser  # noqa: E402

DELTA, CAP = 1e-5, 4
EVENTS = [PrivacyEvent("central", 6.0, 1.0, 1), PrivacyEvent("dpsgd", 20.0, 0.05, 200, unit="patient")]
LIFE = EVENTS + EVENTS


def test_the_recomputation_checks_give_the_per_patient_figure_beside_the_signed_one(tmp_path) -> None:  # noqa: ANN001
    keys = new_keys()
    rel = patient_release(tmp_path / "r", export_denoiser(small_denoiser(), IMAGE_SHAPE), keys, EVENTS, LIFE)
    res = verify_release(rel, keys.trust())
    assert res.ok, res.reason()
    detail = {c.name: c.detail for c in res.checks}
    job, life = patient_epsilon(EVENTS, DELTA, CAP), patient_epsilon(LIFE, DELTA, CAP)
    assert (
        "per image: the events composed as if each protected one image; the site's unit is the patient: "
        f"ε per patient = {job:.6g}" in detail["site a epsilon"]
    )
    assert f"ε per patient = {life:.6g}" in detail["site a lifetime"]
