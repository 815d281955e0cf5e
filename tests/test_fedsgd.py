"""DP-SGD as FedSGD over secure aggregation (issue 14): one pooled DP-SGD step per round, each site sending its
clipped-gradient sum plus its Skellam noise share through the secure sum; the coordinator steps. In-process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.setup import sign_job_file
from feta_release.accounting import SkellamEvent, epsilon, events_from_list, worst_case_epsilon
from feta_release.federation import messages as fm
from feta_release.federation.job import run_job
from feta_release.ledger import Ledger
from feta_release.signing import load_private_key

from .federation_fixtures import full_job, harness, make_federation


def fedsgd_job(**fed: Any) -> Any:
    return full_job(federation={"secure_aggregation": True, "fedsgd": True, "rounds": 2, **fed})


def _run(fed: Any, grid: Any, signed: dict[str, Any], out: Path) -> Any:
    return run_job(grid, signed, out, coordinator_key=load_private_key(fed.coordinator_key), wait_timeout=2,
                   poll_interval=0.05)


def _requests(fed: Any, site_id: str, job_id: str) -> list[dict[str, Any]]:
    with Ledger(fed.site(site_id).ledger) as led:
        return led.requests(job_id)


def _doc(msg: Any) -> dict[str, Any]:
    return fm.read_payload(msg.content)[0]


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_federation(tmp_path_factory.mktemp("fedsgd") / "fed")


def test_a_fedsgd_job_runs_rounds_as_secure_sums_and_charges_one_skellam_event_per_round(fed: Any, tmp_path: Path
                                                                                          ) -> None:
    signed, _ = sign_job_file(fed, fedsgd_job(), "job-fsgd")
    grid = harness(fed)
    res = _run(fed, grid, signed, tmp_path / "out")
    assert res.rounds_done == 2
    types = [m.metadata.message_type for m in grid.sent]
    assert fm.TRAIN not in types
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    for s in fed.sites:
        reqs = _requests(fed, s.site_id, "job-fsgd")
        assert [r["mechanism"] for r in reqs] == ["central", "frequency", "dpsgd", "dpsgd"]
        events = events_from_list([e for r in reqs for e in r["events"]])
        assert all(isinstance(e, SkellamEvent) for e in events)
        eps = epsilon(events, 1e-5)
        assert eps <= 1.0 + 1e-9 < worst_case_epsilon(events, 1e-5)
        assert plan[s.site_id]["planned_epsilon"] == pytest.approx(eps)
        assert res.attestations[s.site_id]["statement"]["epsilon"] == pytest.approx(eps)
