"""A synthetic folder's certificate states a patient-level site's lifetime spend PER PATIENT, the figure its
ledger caps: the statement's ``lifetime.epsilon`` composes the events as if each protected one image, a
number several times smaller than one patient can lose. Certificates that stated it per image (version 2)
still verify against the words they signed, with a warning that gives the figure per patient."""

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
LIFE = EVENTS + EVENTS  # two jobs on the same patients
PER_PATIENT = patient_epsilon(LIFE, DELTA, CAP)
PER_IMAGE = epsilon(LIFE, DELTA)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Ed25519PrivateKey]:
    root = tmp_path_factory.mktemp("pcert")
    keys, signer = patient_folders(root, EVENTS, LIFE, {"synthetic": ([1, 1, 1], True)}, seed=5)
    return root, keys, signer


@pytest.fixture
def folder(made: tuple[Path, Any, Ed25519PrivateKey], tmp_path: Path) -> Path:
    shutil.copytree(made[0], tmp_path / "w")
    return tmp_path / "w"


def _verify(folder: Path, made: tuple[Path, Any, Ed25519PrivateKey]) -> Any:
    return verify_synthetic(folder / "synthetic", made[1].trust(), [made[2].public_key()])


def _resign_with_image_level_lifetime(folder: Path, signer: Ed25519PrivateKey, version: str) -> None:
    """The certificate in version 2's words (the statement's lifetime per image), labelled ``version``."""
    reword_certificate(folder / "synthetic", signer, "feta-release/certificate/2", version)


def test_a_patient_level_sites_certificate_states_its_lifetime_per_patient(made: Any) -> None:
    """Stated per image, the lifetime read "ε = 0.973 ... the lifetime figure is the one that bounds it"
    beside "ε per patient 3.43" for one job, where one patient can lose 5.15 over the two."""
    assert PER_PATIENT > 2 * PER_IMAGE
    cert = json.loads((made[0] / "synthetic" / "certificate.json").read_text("utf-8"))["certificate"]
    site = cert["privacy"][0]
    assert site["lifetime"]["epsilon"] == pytest.approx(PER_PATIENT)
    assert site["lifetime"]["unit"] == "patient"
    assert f"Lifetime: this site has spent ε per PATIENT = {PER_PATIENT:.3g} at δ" in site["statement"]
    assert f"ε = {PER_IMAGE:.3g}" not in site["statement"]
    res = _verify(made[0], made)
    assert res.ok, res.reason()


def test_a_certificate_that_stated_the_lifetime_per_image_still_verifies_with_a_warning(
    folder: Path, made: Any
) -> None:
    _resign_with_image_level_lifetime(folder, made[2], "feta-release/certificate/2")
    res = _verify(folder, made)
    assert res.ok, res.reason()
    notes = [c.detail for c in res.checks if c.status == "warn" and c.name == "lifetime per patient"]
    assert notes and f"lifetime ε per PATIENT = {PER_PATIENT:.3g}" in notes[0], notes


def test_a_current_certificate_stating_the_lifetime_per_image_is_refused(folder: Path, made: Any) -> None:
    """The per-image words under the current version are figures the release does not state: a signer
    cannot pass the smaller lifetime off as the site's."""
    _resign_with_image_level_lifetime(folder, made[2], CERTIFICATE_VERSION)
    res = _verify(folder, made)
    assert "certified privacy" in {c.name for c in res.failures}, res.reason()


def _site_record(events: list[Any], statement: dict[str, Any]) -> dict[str, Any]:
    """A certificate's site record (what ``describe_site`` words) for ``events`` and the site's statement."""
    return {
        "site_id": "s",
        "epsilon": epsilon(events, DELTA),
        "delta": DELTA,
        "accountant": "rdp",
        "events": [e.to_dict() for e in events],
        "attestation": {"statement": statement},
    }


def test_an_image_level_sites_lifetime_words_are_unchanged() -> None:
    events = [PrivacyEvent("dpsgd", 1.5, 0.05, 200)]
    st = {"lifetime": {"events": [e.to_dict() for e in events + events], "epsilon": 2.5, "delta": DELTA}}
    site = _site_record(events, st)
    assert describe_site(site).endswith(
        f" Lifetime: this site has spent ε = 2.5 at δ = {DELTA:g} on the same images over all its jobs "
        f"(this job: ε = {epsilon(events, DELTA):.3g}); a release built on an earlier job's model depends on "
        "both, so the lifetime figure is the one that bounds it."
    )


def test_a_patient_level_sites_secure_aggregation_words_are_per_patient() -> None:
    """Both secure-aggregation figures in the paragraph per patient, as the site's ledger caps them; they
    read the image-level 'ε = ...; if every other site colluded, ε would be ...'."""
    from feta_release.accounting import SkellamEvent, worst_case_epsilon
    from feta_release.privacy_unit import PrivacyUnit

    events = [SkellamEvent("central", 1.0, 1, l2=40.0, l1=1600.0, mu=4e5, mu_worst=1e5), EVENTS[1]]
    st = {
        "privacy_unit": PrivacyUnit("patient", CAP).statement(0.0, DELTA, events),
        "secure_aggregation": {"max_colluders": 0},
    }
    site = _site_record(events, st)
    per = patient_epsilon(events, DELTA, CAP)
    worst = patient_epsilon(events, DELTA, CAP, view="worst_case")
    assert worst > per > 2 * worst_case_epsilon(events, DELTA)
    words = describe_site(site)
    assert f"secure aggregation: ε per patient = {per:.3g} (δ = {DELTA:g}) holds if" in words, words
    assert f"ε per patient would be {worst:.3g} (this site's own noise share only)" in words, words
