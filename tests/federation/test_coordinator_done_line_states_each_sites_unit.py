"""The coordinator's closing line ("job ... finished: ...") named the unit only beside a patient-level site's
ε ("site-c ε per patient=1.000") and gave the image-level sites' figures bare ("site-a ε=0.998"), unlike the
plan line above it: a reader could not tell that a bare figure is per image. Every figure now names its unit
in the plan line's words (``accounting.site_epsilon_words``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from coordinator.setup import sign_job_file
from feta_release.accounting import site_epsilon_words
from tests.support.federation import harness, run_harness_job, tiny_job
from tests.support.patients import PATIENT_SITE
from tests.support.patients import patient_federation as _federation


def test_the_done_line_labels_each_sites_epsilon_with_its_unit_as_the_plan_line_does(tmp_path: Path) -> None:
    fed, _ = _federation(tmp_path)
    signed, _ = sign_job_file(fed, tiny_job(), "job-done-unit")
    events: list[dict[str, Any]] = []
    run_harness_job(fed, harness(fed), signed, tmp_path / "out", progress=events.append)
    line = next(e["message"] for e in events if e["phase"] == "done")
    plan = next(e["message"] for e in events if e["phase"] == "plan")
    assert line.startswith("job job-done-unit finished: "), line
    units = {s.site_id: ("patient" if s.site_id == PATIENT_SITE else "image") for s in fed.sites}
    pattern = r"(\S+) ε=[0-9.]+ per (image|patient)"
    assert dict(re.findall(pattern, line)) == units, line
    assert dict(re.findall(pattern, plan)) == units, plan  # the same words in both lines
    summary = json.loads((tmp_path / "out" / "job_summary.json").read_text("utf-8"))
    for sid, eps in summary["site_epsilon"].items():
        assert site_epsilon_words(sid, eps, summary["site_unit"][sid]) in line
