"""`verify`'s secure-aggregation trust-assumption note at a PATIENT-level site states both figures per
patient (the ones its ledger caps), from the statement its node signs. It read the image-level figures
("ε = 0.6 ... would be 0.9") where one patient can lose several times more."""

from __future__ import annotations

from feta_release.accounting import PrivacyEvent, SkellamEvent, patient_epsilon, worst_case_epsilon
from feta_release.release.verify import VerificationResult, _check_stated_worst_case
from tests.support.release import new_keys, patient_attestation

DELTA, CAP = 1e-5, 4
EVENTS = [
    SkellamEvent("central", 1.0, 1, l2=40.0, l1=1600.0, mu=4e5, mu_worst=1e5),
    PrivacyEvent("dpsgd", 20.0, 0.05, 200, unit="patient"),
]


def test_the_trust_assumption_note_is_per_patient_at_a_patient_level_site() -> None:
    st = patient_attestation(new_keys(), EVENTS, EVENTS)[0]["statement"]
    res = VerificationResult(release_dir="release")
    _check_stated_worst_case(res, "a", st, EVENTS)
    assert not res.failures, res.reason()
    notes = [c.detail for c in res.checks if c.status == "note"]
    per = patient_epsilon(EVENTS, DELTA, CAP)
    worst = patient_epsilon(EVENTS, DELTA, CAP, view="worst_case")
    assert worst > per > 2 * worst_case_epsilon(EVENTS, DELTA)
    assert len(notes) == 1 and f"ε per patient = {per:.3g} (δ = {DELTA:g}) holds if" in notes[0], notes
    assert f"ε per patient would be {worst:.3g}" in notes[0], notes
    assert f"ε = {float(st['epsilon']):.3g}" not in notes[0], notes
