"""The coordinator's plan line ("job fits every site's policy: ...") gave each site's planned ε without its
unit: at a patient-level site that figure is per PATIENT (what its caps bound), at the others per image, and a
reader of the line could not tell them apart. Each figure now names its unit, as the site's signed policy
sets it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from coordinator.setup import sign_job_file
from feta_release.signing import load_private_key
from tests.support.federation import harness, tiny_job
from tests.support.patients import PATIENT_SITE
from tests.support.patients import patient_federation as _federation


def test_the_plan_line_labels_each_sites_epsilon_with_its_unit(tmp_path: Path) -> None:
    from feta_release.federation.driver import JobDriver

    fed, _ = _federation(tmp_path)
    signed, _ = sign_job_file(fed, tiny_job(), "job-unit")
    events: list[dict[str, Any]] = []
    d = JobDriver(
        harness(fed),
        signed,
        tmp_path / "out",
        coordinator_key=load_private_key(fed.coordinator_key),
        progress=events.append,
        wait_timeout=2,
        poll_interval=0.05,
    )
    d.wait_for_sites()
    plan = d.plan_sites()
    line = next(e["message"] for e in events if e["phase"] == "plan")
    assert line.startswith("job fits every site's policy: "), line
    figures = dict(re.findall(r"(\S+) ε=[0-9.]+ per (image|patient)", line))
    assert figures == {s.site_id: ("patient" if s.site_id == PATIENT_SITE else "image") for s in fed.sites}, (
        line
    )
    assert figures == {sid: v["privacy_unit"] for sid, v in plan.items()}
    # the figure beside the unit is plan.json's, the site's planned ε in that unit
    for sid, v in json.loads((tmp_path / "out" / "plan.json").read_text()).items():
        assert f"{sid} ε={v['planned_epsilon']:.3f} per {figures[sid]}" in line
