"""A site that drew its public size for a job (``feta-release train`` without a declared size:
``mechanisms.count``) charged that noisy count first, under the job's id. The coordinator's plan
(``plan.json``) and its per-job check count it as the site's ledger does: first in the job's history, so the
planned ε is the total the site attests.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from coordinator.setup import prepare_federation, sign_job_file
from feta_release.accounting import epsilon, events_from_list
from feta_release.federation.secure_collect import secure_plan
from feta_release.ledger import Budget, Ledger
from feta_release.mechanisms.count import SIZE_SIGMA, SIZE_STAGE, size_event
from feta_release.planning import stage_event
from feta_release.signing import load_private_key
from tests.support.federation import fedsgd_job, harness, run_harness_job, site_and_job, tiny_job, tiny_sites

SITE = "site-a"


def _one_site(tmp_path: Path, job_id: str):
    """A one-site federation whose site charged its drawn size under ``job_id`` before the job is run."""
    fed = prepare_federation(tmp_path / "fed", {SITE: tiny_sites(1, per_site=40)[SITE]})
    cfg = tiny_job(federation={"min_sites": 1, "rounds": 1})
    signed, _ = sign_job_file(fed, cfg, job_id)
    site = fed.site(SITE)
    budget = Budget(job_epsilon=math.inf, lifetime_epsilon=math.inf, delta=float(cfg.privacy.delta))
    with Ledger(site.ledger, key=load_private_key(site.site_key)) as led:
        rid = f"{job_id}:{SIZE_STAGE}:0"
        led.charge(job_id, rid, SIZE_STAGE, [size_event()], budget)
        led.record_response(rid, json.dumps({"count": site.size, "sigma": SIZE_SIGMA}).encode())
    return fed, signed


def test_the_plan_counts_the_drawn_size_so_its_epsilon_is_the_attested_total(tmp_path: Path) -> None:
    fed, signed = _one_site(tmp_path, "job-drawn")
    res = run_harness_job(fed, harness(fed), signed, tmp_path / "out")
    planned = json.loads((tmp_path / "out" / "plan.json").read_text("utf-8"))[SITE]
    att = res.attestations[SITE]["statement"]
    assert planned["events"][0] == size_event().to_dict()
    assert planned["events"] == att["events"]
    assert planned["planned_epsilon"] == pytest.approx(att["epsilon"], rel=1e-12)
    assert att["epsilon"] == pytest.approx(epsilon(events_from_list(att["events"]), att["delta"]), rel=1e-12)


def _drawn_size_charged(site: Any, job_id: str, delta: float) -> None:
    """``site`` charged a drawn public size under ``job_id`` before the job runs (train's first charge)."""
    budget = Budget(job_epsilon=math.inf, lifetime_epsilon=math.inf, delta=delta)
    with Ledger(site.ledger, key=load_private_key(site.site_key)) as led:
        rid = f"{job_id}:{SIZE_STAGE}:0"
        led.charge(job_id, rid, SIZE_STAGE, [size_event()], budget)
        led.record_response(rid, json.dumps({"count": site.size, "sigma": SIZE_SIGMA}).encode())


def test_a_secure_job_calibrates_dpsgd_over_the_drawn_size_so_the_site_spends_the_jobs_epsilon(
    tmp_path: Path,
) -> None:
    # a per-job cap above the job's epsilon: only the planner holds the site to the job's [privacy] epsilon
    sites = tiny_sites(2, per_site=40)
    fed = prepare_federation(
        tmp_path / "fed", sites, policy_overrides={s: {"per_job": (2.0, 1e-5)} for s in sites}
    )
    # one secure sum (frequency statistics, a tiny warm-up on them) before the per-site DP-SGD round; at
    # epsilon 0.5 the drawn size's cost (about 0.005 here) is more than the calibration's slack
    cfg = tiny_job(
        privacy={"epsilon": 0.5},
        frequency={"sigma": 26.6, "features": 200, "chunk": 64},
        warmup={"frequency_images": 20, "frequency_batch": 10},
        auxgen={"epochs": 1, "iterations_per_epoch": 1, "batch": 10, "width": 8},
        federation={"min_sites": 2, "rounds": 1, "local_steps": 1, "secure_aggregation": True},
    )
    signed, _ = sign_job_file(fed, cfg, "job-secure-drawn")
    _drawn_size_charged(fed.site(SITE), "job-secure-drawn", float(cfg.privacy.delta))
    res = run_harness_job(fed, harness(fed), signed, tmp_path / "out")
    planned = json.loads((tmp_path / "out" / "plan.json").read_text("utf-8"))
    sigma = {}
    for sid in sites:
        att = res.attestations[sid]["statement"]
        assert planned[sid]["events"] == att["events"]
        assert planned[sid]["planned_epsilon"] == pytest.approx(att["epsilon"], rel=1e-12)
        with Ledger(fed.site(sid).ledger) as led:
            charged = events_from_list([e for r in led.requests("job-secure-drawn") for e in r["events"]])
        assert [e.to_dict() for e in charged] == att["events"]
        # DP-SGD was calibrated over the whole history the ledger holds: the job's epsilon, not more
        assert att["epsilon"] <= cfg.privacy.epsilon + 1e-9
        assert att["epsilon"] == pytest.approx(cfg.privacy.epsilon, abs=0.02)
        sigma[sid] = next(e["sigma"] for e in att["events"] if e["stage"] == "dpsgd")
    assert att_stages(res, SITE)[0] == SIZE_STAGE and SIZE_STAGE not in att_stages(res, "site-b")
    assert sigma[SITE] > sigma["site-b"]  # site-a's drawn size left less for DP-SGD


def att_stages(res: Any, sid: str) -> list[str]:
    return [e["stage"] for e in res.attestations[sid]["statement"]["events"]]


def test_a_fedsgd_node_calibrates_its_rounds_over_the_drawn_size_as_the_coordinator_plans(
    tmp_path: Path,
) -> None:
    from edge.protocol import planned, secure_warmup

    sites = tiny_sites(3, per_site=40)
    fed = prepare_federation(
        tmp_path / "fed", sites, policy_overrides={s: {"per_job": (2.0, 1e-5)} for s in sites}
    )
    cfg = fedsgd_job()
    _drawn_size_charged(fed.site(SITE), "job-fedsgd-drawn", float(cfg.privacy.delta))
    site, job, _ = site_and_job(fed, "job-fedsgd-drawn", cfg)
    event, _ = planned(site, job, "dpsgd")
    history = [size_event(), *(secure_warmup(site, job) or []), *[event] * cfg.federated_rounds]
    # the rounds' sigma leaves room for the size the ledger charged first: the job's epsilon, not more
    assert epsilon(history, cfg.privacy.delta) <= cfg.privacy.epsilon + 1e-9
    driver = SimpleNamespace(cfg=job.config, job=job)
    shape = SimpleNamespace(
        policy=site.policy,
        size=site.n_public,
        image_shape=site.data.image_shape,
        n_classes=site.data.n_classes,
    )
    assert stage_event(secure_plan(driver, shape, [size_event()])[1], "dpsgd") == event  # type: ignore[arg-type]
