"""`node status` of a PATIENT-level site: every ε it prints says what it is per. With the site's policy the
figures are per patient (the ledger's caps bound them) and the header says so; without a policy the ledger
cannot know the cap, so the figures compose the events as if each protected one image and the status says,
in its own line, that this is less than one patient can lose. It printed "lifetime ε spent 0.6677" with no
unit at all, where one patient of that site can lose 3.43."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from feta_release.accounting import PrivacyEvent, epsilon, patient_epsilon
from feta_release.ledger import Budget, Ledger

DELTA, CAP = 1e-5, 4
EVENTS = [PrivacyEvent("central", 6.0, 1.0, 1), PrivacyEvent("dpsgd", 20.0, 0.05, 200, unit="patient")]
PATIENT_SITE = Budget(10.0, 20.0, DELTA, patient_cap=CAP)


def _ledger(tmp_path: Path) -> Path:
    path = tmp_path / "ledger.db"
    with Ledger(path, key=Ed25519PrivateKey.generate()) as led:
        for i, e in enumerate(EVENTS):
            led.charge("job-1", f"r{i}", e.stage, [e], PATIENT_SITE)
    return path


def test_the_ledgers_summary_states_its_figures_per_patient_under_a_patient_level_budget(
    tmp_path: Path,
) -> None:
    from edge.cli import _unit_line

    with Ledger(_ledger(tmp_path)) as led:
        summary = led.summary(PATIENT_SITE)
        bare = led.summary()
    assert summary["unit"] == "patient" and summary["lifetime_epsilon_spent"] > 4 * epsilon(EVENTS, DELTA)
    assert "ε per PATIENT" in _unit_line(summary)
    assert bare["unit"] is None and bare["patient_events"] is True


def test_status_without_a_policy_says_its_per_image_figures_understate_a_patient(tmp_path: Path) -> None:
    from edge.cli import node

    res = CliRunner().invoke(node, ["status", "--ledger", str(_ledger(tmp_path))])
    assert res.exit_code == 0, res.output
    assert f"{epsilon(EVENTS, DELTA):.4f}" in res.output  # what the bare ledger can compose
    text = " ".join(res.output.split())  # (the console wraps long lines)
    line = text[text.index("unit:") : text.index("lifetime ε")]
    assert "NOT known" in line and "LESS than one patient can lose" in line and "--policy" in line
    assert patient_epsilon(EVENTS, DELTA, CAP) > 4 * epsilon(EVENTS, DELTA)


def test_status_names_the_unit_beside_every_figure_also_per_image(tmp_path: Path) -> None:
    """The lifetime line and the table's headers said "ε per patient" at a patient-level site and a bare "ε"
    otherwise; figures composed per image (here: no policy given) now say "per image", as every line that
    states a site's ε does."""
    from edge.cli import node

    # wide enough that the table's headers stay on one line
    res = CliRunner().invoke(node, ["status", "--ledger", str(_ledger(tmp_path))], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert f"lifetime ε per image spent {epsilon(EVENTS, DELTA):.4f}" in text, text
    assert "┃ ε per image spent ┃ ε per image left (job) ┃" in text, text
