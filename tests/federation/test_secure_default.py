"""Secure aggregation is the DEFAULT for a job with >= 2 sites; per-site noise is the explicit opt-out
(``[federation] secure_aggregation = false``). The signed job always states the resolved value, so a node and
the coordinator never disagree on the mode, and old signed jobs (which state false) keep their per-site
mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from coordinator.setup import sign_job_file
from feta_release.accounting import SkellamEvent, events_from_list
from feta_release.config import JobConfig, load_preset
from feta_release.federation import messages as fm
from feta_release.policy.envelope import seal
from feta_release.policy.errors import PolicySchemaError
from feta_release.policy.jobs import sign_job, verify_job_with_keys
from tests.support.federation import full_job, harness, ledger_requests, make_federation, run_harness_job


def _unset(**federation: Any) -> JobConfig:
    return full_job(federation={"secure_aggregation": None, "rounds": 1, **federation})


def test_the_signed_job_states_the_default_for_its_sites() -> None:
    key = Ed25519PrivateKey.generate()
    assert _unset().federation.secure_aggregation is None
    three = sign_job(_unset(), key, "j3", ["a", "b", "c"])
    assert three["job"]["config"]["federation"]["secure_aggregation"] is True
    one = sign_job(_unset(), key, "j1", ["a"])
    assert one["job"]["config"]["federation"]["secure_aggregation"] is False
    opted_out = sign_job(_unset(secure_aggregation=False), key, "j0", ["a", "b", "c"])
    assert opted_out["job"]["config"]["federation"]["secure_aggregation"] is False
    # presets leave it to the default
    assert load_preset("cpu-eps1-nodpsgd").federation.secure_aggregation is None
    # a body signed without the value (not one of ours) reads as the default would, at the node and the
    # coordinator
    body = dict(
        three["job"],
        config={
            **three["job"]["config"],
            "federation": {**three["job"]["config"]["federation"], "secure_aggregation": None},
        },
    )
    job = verify_job_with_keys(seal("job", body, key), [key.public_key()])
    assert job.config.federation.secure_aggregation is True


def test_a_job_the_default_cannot_sum_is_refused_in_one_line_naming_the_fix() -> None:
    key = Ed25519PrivateKey.generate()
    mode = full_job(central={"kind": "mode"}, federation={"secure_aggregation": None})
    with pytest.raises(PolicySchemaError) as exc:
        sign_job(mode, key, "jm", ["a", "b", "c"])
    text = str(exc.value)
    assert "\n" not in text and "secure_aggregation = false" in text and "kind" in text
    sign_job(mode, key, "jm1", ["a"])  # one site: per-site, as before
    # the opt-out
    sign_job(mode.replace(federation={"secure_aggregation": False}), key, "jm0", ["a", "b", "c"])
    fedsgd = full_job(federation={"secure_aggregation": None, "fedsgd": True})
    with pytest.raises(PolicySchemaError, match="fedsgd"):
        sign_job(fedsgd, key, "jf", ["a"])


def test_a_job_without_the_setting_runs_over_secure_aggregation(tmp_path: Path) -> None:
    fed = make_federation(tmp_path / "fed")
    signed, _ = sign_job_file(fed, _unset(), "job-default")
    grid = harness(fed)
    res = run_harness_job(fed, grid, signed, tmp_path / "out")
    assert res.rounds_done == 1
    types = [m.metadata.message_type for m in grid.sent]
    assert fm.SECAGG in types and fm.CENTRAL not in types and fm.FREQUENCY not in types
    for s in fed.sites:
        events = events_from_list(
            [e for r in ledger_requests(fed, s.site_id, "job-default") for e in r["events"]]
        )
        assert [type(e).__name__ for e in events] == ["SkellamEvent", "SkellamEvent", "PrivacyEvent"]
        # the peers' shares counted
        assert all(e.mu > e.mu_worst for e in events if isinstance(e, SkellamEvent))


def test_a_site_trusting_no_peer_share_refuses_the_default_with_the_fix_named(tmp_path: Path) -> None:
    """Sites whose policies pin no peer keys count their own noise share only: a job sized for the pooled
    noise (no DP-SGD to calibrate) then breaks their per-job cap. Refused before any release, naming the fix;
    the explicit opt-out runs the job as before (per-site noise)."""
    from feta_release.policy.errors import JobDoesNotFit

    fed = make_federation(tmp_path / "fed", pin_peers=False)
    cfg = full_job(
        central={"batch": 40}, dpsgd={"steps": 0}, federation={"secure_aggregation": None, "rounds": 0}
    )
    signed, _ = sign_job_file(fed, cfg, "job-nopin")
    with pytest.raises(JobDoesNotFit) as exc:
        run_harness_job(fed, harness(fed), signed, tmp_path / "out")
    assert "secure_aggregation = false" in str(exc.value) and "pin" in str(exc.value)
    assert exc.value.problems[-1][1] == "federation.secure_aggregation"
    for s in fed.sites:
        assert ledger_requests(fed, s.site_id, "job-nopin") == []
    signed, _ = sign_job_file(fed, cfg.replace(federation={"secure_aggregation": False}), "job-nopin-off")
    assert run_harness_job(fed, harness(fed), signed, tmp_path / "off").rounds_done == 0
