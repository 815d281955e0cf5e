"""The ledger's budget refusal gave an image-level site's ε bare ("has spent ε=0.5; ... > cap ε=1") and a
patient-level site's as "ε per patient=0.5", while every other line that states a site's ε names its unit
after the figure ("ε=0.998 per image", ``accounting.per_unit``). Both now read alike, with the rule's name
kept; and `train`'s closing line said "epsilon X" / "epsilon per patient X" in its own words where its start
line says "epsilon X per image"."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from coordinator.local_run import TrainResult
from feta_release.accounting import PrivacyEvent, epsilon
from feta_release.cli.train_cmd import _print_summary
from feta_release.errors import PolicyBudgetExceeded
from feta_release.ledger import Budget, check_spend

DELTA = 1e-5
BIG = PrivacyEvent("central", 2.0, 0.5, 4)


@pytest.mark.parametrize(("cap", "unit"), [(None, "image"), (5, "patient")])
@pytest.mark.parametrize("rule", ["budget.per_job.epsilon", "budget.lifetime.epsilon"])
def test_a_budget_refusal_names_the_sites_unit_beside_every_epsilon(
    cap: int | None, unit: str, rule: str
) -> None:
    job, life = (0.1, 100.0) if rule == "budget.per_job.epsilon" else (100.0, 0.1)
    budget = Budget(job_epsilon=job, lifetime_epsilon=life, delta=DELTA, patient_cap=cap)
    with pytest.raises(PolicyBudgetExceeded) as exc:
        check_spend(budget, [], [], [BIG])
    msg = str(exc.value)
    assert exc.value.rule == rule and f"policy rule {rule}: " in msg, msg
    figures = re.findall(r"ε=[0-9.e+-]+ (per \w+)", msg)
    assert figures == [f"per {unit}"] * 3, msg  # spent, after, cap
    assert "ε per" not in msg and msg.endswith("nothing was released"), msg
    if cap is not None:
        assert f"at most {cap} image(s) per patient" in msg, msg


def _closing_line(tmp_path: Path, per_patient: float | None, capsys: Any) -> str:
    res = TrainResult(
        run_dir=tmp_path,
        epsilon=epsilon([BIG], DELTA),
        delta=DELTA,
        events=[BIG],
        dpsgd_sigma=None,
        dpsgd_steps_trained=0,
        seconds=1.0,
        epsilon_per_patient=per_patient,
    )
    _print_summary(res, "rdp", None, False)
    return str(capsys.readouterr().out)


def test_trains_closing_line_names_the_unit_after_the_epsilon(tmp_path: Path, capsys: Any) -> None:
    image = _closing_line(tmp_path, None, capsys)
    assert f": epsilon {epsilon([BIG], DELTA):.3f} per image at delta {DELTA:g} " in image, image
    patient = _closing_line(tmp_path, 9.5, capsys)
    assert ": epsilon 9.500 per patient at delta" in patient, patient
