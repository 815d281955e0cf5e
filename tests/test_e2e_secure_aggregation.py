"""End to end with REAL Flower processes on loopback (SuperLink + 3 SuperNodes): a small job whose central images
and frequency embedding are summed by secure aggregation. Slow: minutes."""

from __future__ import annotations

import json
import time

import pytest

from .federation_fixtures import full_job, make_federation

pytestmark = pytest.mark.slow


def test_real_processes_run_a_job_with_secure_aggregation(tmp_path):
    from coordinator.demo import _to_toml
    from coordinator.runner import run_signed_job, sign_or_resume
    from coordinator.superlink import SuperLinkSettings, start_superlink
    from edge.launch import NodeSettings, start_node
    from feta_release.accounting import SkellamEvent, epsilon, events_from_list
    from feta_release.federation.procs import free_port
    from feta_release.ledger import Ledger

    fed = make_federation(tmp_path / "fed")
    cfg = full_job(federation={"secure_aggregation": True, "secagg_threshold": 2, "rounds": 1, "local_steps": 1,
                               "min_sites": 2, "round_timeout": 600.0})
    job_toml = tmp_path / "job.toml"
    job_toml.write_text(_to_toml(cfg.to_dict()))
    out = tmp_path / "out"
    sites = [s.site_id for s in fed.sites]
    signed = sign_or_resume(job_toml, sites, fed.coordinator_key, out, "job-e2e-secagg")
    procs = []
    port = free_port()
    try:
        procs.append(start_superlink(SuperLinkSettings(port=port, database=tmp_path / "coord" / "state.db",
                                                       insecure=True, home=tmp_path / "coord")))
        for s in fed.sites:
            procs.append(start_node(NodeSettings(data=s.data, policy=s.policy, trusted_policy_key=s.policy_pub,
                                                 ledger=s.ledger, site_key=s.site_key, data_secret=s.data_secret,
                                                 superlink=f"127.0.0.1:{port}", port=free_port(), insecure=True)))
        time.sleep(3)  # let all three nodes register before the job's first hello
        summary = run_signed_job(signed, fed.coordinator_key, out, f"127.0.0.1:{port}", insecure=True)
    finally:
        for p in procs:
            p.stop()
    assert summary["rounds"] == 1 and set(summary["site_epsilon"]) == set(sites)
    for sid in sites:
        with Ledger(fed.site(sid).ledger) as led:
            reqs = led.requests()
        assert [r["mechanism"] for r in reqs] == ["central", "frequency", "dpsgd"]
        events = events_from_list([e for r in reqs for e in r["events"]])
        assert sum(isinstance(e, SkellamEvent) for e in events) == 2
        assert summary["site_epsilon"][sid] == pytest.approx(epsilon(events, 1e-5))
        # the round's secrets stay on the site, owner-only
        state = fed.site(sid).ledger.parent / "work" / "secagg"
        assert all((f.stat().st_mode & 0o077) == 0 for f in state.iterdir())
    for phase in ("central", "frequency"):
        assert json.loads((out / "state" / f"{phase}_secure.json").read_text())["sites"] == sorted(sites)
