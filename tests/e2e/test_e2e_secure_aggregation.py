"""End to end with REAL Flower processes on loopback (SuperLink + 3 SuperNodes): a small job whose central
images and frequency embedding are summed by secure aggregation. Slow: minutes."""

from __future__ import annotations

import json

import pytest

from tests.support.federation import full_job, make_federation

pytestmark = pytest.mark.slow


def _run_real_job(tmp_path, loopback, cfg, job_id):
    """Sign ``cfg`` for the three sites and run it on the real SuperLink + nodes; (federation, out dir, sites,
    summary)."""
    from coordinator.runner import run_signed_job, sign_or_resume
    from feta_release import job_rules

    fed = make_federation(tmp_path / "fed")
    job_toml = tmp_path / "job.toml"
    job_toml.write_text(job_rules.job_toml(cfg))
    out = tmp_path / "out"
    sites = [s.site_id for s in fed.sites]
    signed = sign_or_resume(job_toml, sites, fed.coordinator_key, out, job_id)
    summary = run_signed_job(signed, fed.coordinator_key, out, loopback.start(fed), insecure=True)
    loopback.stop()
    return fed, out, sites, summary


def test_real_processes_run_a_job_with_secure_aggregation_and_fedsgd_rounds(tmp_path, loopback):
    """One job between real processes that uses every secure sum: the central images and the frequency
    embedding, then two FedSGD rounds (one pooled DP-SGD step each, the sites' gradient sums + noise shares
    masked), with a threshold below the site count. Each secure sum is charged once per site as a
    SkellamEvent; the round secrets stay on the site, owner-only. (One job, not two: each real-process job
    costs minutes of the CI budget; the per-site-noise DP-SGD rounds run between real processes in
    tests/e2e/test_e2e_federation.py.)"""
    from feta_release.accounting import SkellamEvent, epsilon, events_from_list
    from feta_release.ledger import Ledger

    cfg = full_job(
        federation={
            "secure_aggregation": True,
            "secagg_threshold": 2,
            "fedsgd": True,
            "rounds": 2,
            "min_sites": 2,
            "round_timeout": 600.0,
        }
    )
    fed, out, sites, summary = _run_real_job(tmp_path, loopback, cfg, "job-e2e-secagg")
    assert summary["rounds"] == 2 and set(summary["site_epsilon"]) == set(sites)
    for sid in sites:
        with Ledger(fed.site(sid).ledger) as led:
            reqs = led.requests()
        assert [r["mechanism"] for r in reqs] == ["central", "frequency", "dpsgd", "dpsgd"]
        assert [r["request_id"] for r in reqs][2:] == ["job-e2e-secagg:train:0", "job-e2e-secagg:train:1"]
        events = events_from_list([e for r in reqs for e in r["events"]])
        assert all(isinstance(e, SkellamEvent) for e in events) and len(events) == 4
        assert [e.steps for e in events if e.stage == "dpsgd"] == [1, 1]
        assert summary["site_epsilon"][sid] == pytest.approx(epsilon(events, 1e-5))
        state = fed.site(sid).ledger.parent / "work" / "secagg"
        assert all((f.stat().st_mode & 0o077) == 0 for f in state.iterdir())
    for phase in ("central", "frequency"):
        assert json.loads((out / "state" / f"{phase}_secure.json").read_text())["sites"] == sorted(sites)
    rounds = [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines()]
    assert [e["sites"] for e in rounds if e["message"].startswith("FedSGD round")] == [sorted(sites)] * 2
