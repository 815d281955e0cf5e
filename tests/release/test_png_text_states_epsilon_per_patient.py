"""The images `synthesize` writes from a PATIENT-level site's release carry, in their PNG text chunk
``feta:privacy``, the site's job ε PER PATIENT (the figure its ledger caps and its statement signs) and say
so; the certificate's privacy section states it too (version 4), and ``samples.png``'s title in the job
directory. They stated the events composed as if each protected one image, several times smaller than what
one patient can lose. Version 3 certificates still verify against the words they signed, with a warning
giving the figure per patient; a current one with the per-image words is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

pytest.importorskip("torch")

from feta_release.accounting import PrivacyEvent, epsilon, patient_epsilon  # noqa: E402
from feta_release.privacy_unit import PrivacyUnit  # noqa: E402
from feta_release.release.certificate import CERTIFICATE_VERSION, verify_synthetic  # noqa: E402
from tests.support.release import patient_folders, report_job_dir, reword_certificate, small_denoiser  # noqa: E402

DELTA, CAP = 1e-5, 4
EVENTS = [PrivacyEvent("central", 6.0, 1.0, 1), PrivacyEvent("dpsgd", 20.0, 0.05, 200, unit="patient")]
PER_PATIENT, PER_IMAGE = patient_epsilon(EVENTS, DELTA, CAP), epsilon(EVENTS, DELTA)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Ed25519PrivateKey]:
    root = tmp_path_factory.mktemp("ppng")
    folders = {"synthetic": ([1, 1, 1], False), "signed": ([1, 0, 0], True)}
    keys, signer = patient_folders(root, EVENTS, EVENTS, folders)
    return root, keys, signer


def test_every_png_states_the_jobs_epsilon_per_patient(made: Any) -> None:
    """It read "site a: epsilon=0.668, delta=1e-05 (RDP, unit = one patient of that site for DP-SGD ...)"
    where one patient can lose 3.43."""
    from PIL import Image

    assert PER_PATIENT > 4 * PER_IMAGE
    pngs = sorted((made[0] / "synthetic").rglob("*.png"))
    assert len(pngs) == 3
    for p in pngs:
        with Image.open(p) as im:
            text = dict(im.text)["feta:privacy"]
        assert text.isascii()
        assert f"site a: epsilon per patient={PER_PATIENT:.4g}, delta={DELTA:g}" in text, text
        assert f"{PER_IMAGE:.4g}" not in text, text
    cert = json.loads((made[0] / "synthetic" / "certificate.json").read_text("utf-8"))["certificate"]
    site = cert["privacy"][0]
    assert site["epsilon"] == pytest.approx(PER_PATIENT) and site["unit"] == "patient"
    assert site["epsilon_per_image"] == pytest.approx(PER_IMAGE)
    assert "one patient of one site with all of their images" in cert["privacy_note"]


def _reword(made: Any, tmp_path: Path, words: str, label: str | None = None) -> Path:
    shutil.copytree(made[0], tmp_path / "w")
    reword_certificate(tmp_path / "w" / "signed", made[2], words, label)
    return tmp_path / "w" / "signed"


def test_a_version_3_certificate_still_verifies_with_a_warning_per_patient(made: Any, tmp_path: Path) -> None:
    folder = _reword(made, tmp_path, "feta-release/certificate/3")
    res = verify_synthetic(folder, made[1].trust(), [made[2].public_key()])
    assert res.ok, res.reason()
    warned = [c.detail for c in res.checks if c.status == "warn" and c.name == "job ε per patient"]
    assert warned and f"ε per PATIENT = {PER_PATIENT:.3g}" in warned[0], warned
    assert f"ε per image, {PER_IMAGE:.3g}" in warned[0], warned


def test_a_current_certificate_with_the_per_image_words_is_refused(made: Any, tmp_path: Path) -> None:
    folder = _reword(made, tmp_path, "feta-release/certificate/3", CERTIFICATE_VERSION)
    res = verify_synthetic(folder, made[1].trust(), [made[2].public_key()])
    assert "certified privacy" in {c.name for c in res.failures}, res.reason()


def test_the_job_directorys_sample_grid_title_states_epsilon_per_patient(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``samples.png`` drawn by the job directory's model: its title read "ε per site site: 0.668"."""
    import feta_release.release.jobdir as jobdir
    from feta_release.config import load_preset

    job_dir = report_job_dir(tmp_path, EVENTS, DELTA, PrivacyUnit("patient", CAP))
    job = {"job_id": "j", "sites": ["site"], "config": load_preset("tiny").to_dict()}
    (job_dir / "signed_job.json").write_text(json.dumps({"job": job}))
    monkeypatch.setattr(jobdir, "load_model", lambda _: small_denoiser())
    seen: dict[str, Any] = {}

    def keep(images: np.ndarray, labels: np.ndarray, path: Path, **kw: Any) -> Path:
        seen.update(kw)
        return path

    monkeypatch.setattr(jobdir, "save_grid", keep)
    jobdir.sample_grid(job_dir, per_class=1)
    title = str(seen["title"])
    assert f"site: {PER_PATIENT:.3g}" in title and "per patient" in title, title
    assert f"{PER_IMAGE:.3g}" not in title, title
