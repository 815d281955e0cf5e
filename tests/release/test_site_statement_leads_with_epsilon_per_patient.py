"""A PATIENT-level site's paragraph for a data-protection officer (the certificate's signed ``statement``,
the HTML report, `feta-release verify`) opens with ε PER PATIENT and "whether or not any single patient's
images were used", and says DP-SGD samples patients; the per-image figure comes after, labelled as such. It
opened with "ε = 0.668 ... whether or not any single image of this site was used ... e^0.668" and "each image
with probability 0.05", the patient figure (3.43) only after. Certificates of version 4 signed that opening:
they still verify against it, with a warning that gives the figure per patient."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

pytest.importorskip("torch")

from feta_release.accounting import PrivacyEvent, epsilon, patient_epsilon  # noqa: E402
from feta_release.release.certificate import CERTIFICATE_VERSION, verify_synthetic  # noqa: E402
from feta_release.release.verify import describe_site  # noqa: E402
from tests.support.release import patient_folders, reword_certificate  # noqa: E402

DELTA, CAP = 1e-5, 4
EVENTS = [PrivacyEvent("central", 6.0, 1.0, 1), PrivacyEvent("dpsgd", 20.0, 0.05, 200, unit="patient")]
PER_PATIENT, PER_IMAGE = patient_epsilon(EVENTS, DELTA, CAP), epsilon(EVENTS, DELTA)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Ed25519PrivateKey]:
    root = tmp_path_factory.mktemp("lead")
    keys, signer = patient_folders(root, EVENTS, EVENTS, {"signed": ([1, 0, 0], True)})
    return root, keys, signer


def _site(made: Any) -> dict[str, Any]:
    doc = json.loads((made[0] / "release" / "manifest.json").read_text("utf-8"))
    return dict((doc.get("manifest") or doc)["sites"][0])


def test_a_patient_level_sites_paragraph_opens_with_epsilon_per_patient(made: Any) -> None:
    words = describe_site(_site(made))
    assert PER_PATIENT > 4 * PER_IMAGE
    assert words.startswith(f"Site a: ε per PATIENT = {PER_PATIENT:.3g} at δ = {DELTA:g}"), words[:120]
    assert "whether or not any single patient's images were used" in words, words
    assert "single image of this site" not in words, words
    assert "DP-SGD fine-tuning (noise σ = 20, 200 steps, each patient with probability 0.05)" in words, words
    first_image_figure = words.index(f"ε = {PER_IMAGE:.3g}")
    assert words.index(f"e^{PER_PATIENT:.3g}") < first_image_figure, words
    assert words[:first_image_figure].endswith("Per image (secondary, not the site's unit): "), words


def test_the_certificate_signs_the_paragraph_that_opens_per_patient(made: Any) -> None:
    cert = json.loads((made[0] / "signed" / "certificate.json").read_text("utf-8"))["certificate"]
    assert cert["certificate_version"] == CERTIFICATE_VERSION
    assert cert["privacy"][0]["statement"] == describe_site(_site(made))
    res = verify_synthetic(made[0] / "signed", made[1].trust(), [made[2].public_key()])
    assert res.ok and not [c for c in res.checks if c.status == "warn"], res.reason()


def test_a_version_4_certificate_still_verifies_with_a_warning_per_patient(made: Any, tmp_path: Path) -> None:
    shutil.copytree(made[0], tmp_path / "w")
    reword_certificate(tmp_path / "w" / "signed", made[2], "feta-release/certificate/4")
    cert = json.loads((tmp_path / "w" / "signed" / "certificate.json").read_text("utf-8"))["certificate"]
    assert cert["privacy"][0]["statement"].startswith(f"Site a: ε = {PER_IMAGE:.3g}")
    res = verify_synthetic(tmp_path / "w" / "signed", made[1].trust(), [made[2].public_key()])
    assert res.ok, res.reason()
    warned = [c.detail for c in res.checks if c.status == "warn" and c.name == "job ε per patient"]
    assert warned and f"ε per PATIENT = {PER_PATIENT:.3g}" in warned[0], warned


def test_the_current_version_with_the_per_image_opening_is_refused(made: Any, tmp_path: Path) -> None:
    shutil.copytree(made[0], tmp_path / "w")
    reword_certificate(tmp_path / "w" / "signed", made[2], "feta-release/certificate/4", CERTIFICATE_VERSION)
    res = verify_synthetic(tmp_path / "w" / "signed", made[1].trust(), [made[2].public_key()])
    assert "certified privacy" in {c.name for c in res.failures}, res.reason()
