"""`train`'s stage grids (``grids/NN-<stage>.png``) at a PATIENT-level site are titled with the ε the site
charged so far per patient, as its ledger caps it. They were titled with the events composed as if each
protected one image, "(unit: one image of one site)", several times less than one patient can lose."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from feta_release.accounting import PrivacyEvent, epsilon, patient_epsilon
from feta_release.config import load_preset
from feta_release.data import ImageDataset
from feta_release.ledger import Budget

DELTA, CAP = 1e-5, 4
EVENTS = [PrivacyEvent("central", 6.0, 1.0, 1), PrivacyEvent("dpsgd", 20.0, 0.05, 200, unit="patient")]


@pytest.mark.parametrize("cap", [CAP, None])
def test_a_stage_grid_is_titled_with_the_epsilon_the_sites_caps_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cap: int | None
) -> None:
    import coordinator.local_run as local_run

    titles: list[str] = []
    monkeypatch.setattr(local_run, "save_grid", lambda *a, **kw: titles.append(str(kw["title"])))
    ledger = SimpleNamespace(job_events=lambda job_id: [e.to_dict() for e in EVENTS])
    site = SimpleNamespace(policy=Budget(10.0, 20.0, DELTA, patient_cap=cap), ledger=ledger)
    data = ImageDataset(np.zeros((2, 1, 8, 8), np.float32), np.array([0, 1]), ("a", "b"))
    cfg = load_preset("tiny").replace(privacy={"delta": DELTA})
    observe: Any = local_run._grids(tmp_path, cfg, data, site, "j", 1)  # type: ignore[arg-type]
    observe("central-images", (np.zeros((2, 1, 8, 8), np.float32), np.array([0, 1])))
    (title,) = titles
    if cap is None:  # an image-level site: its figure per image, as before
        assert f"ε = {epsilon(EVENTS, DELTA):.3g}" in title and "one image of one site" in title, title
        return
    per = patient_epsilon(EVENTS, DELTA, CAP)
    assert per > 4 * epsilon(EVENTS, DELTA)
    assert f"ε = {per:.3g}" in title and "per patient" in title, title
