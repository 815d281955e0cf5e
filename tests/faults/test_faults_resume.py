"""Faults: the coordinator killed after the sites charged part of a job; its re-run must resume, also at a
site whose lifetime cap fits the job only once (the job's own charges are part of its plan, not an earlier
spend)."""

from __future__ import annotations

import pytest

from coordinator.setup import prepare_federation, sign_job_file
from edge.site import forget_sites
from feta_release.federation.driver import other_jobs
from feta_release.ledger import Ledger
from tests.support.federation import harness, run_harness_job, tiny_job, tiny_sites


@pytest.mark.slow
def test_a_killed_job_resumes_at_a_site_whose_lifetime_cap_fits_it_once(tmp_path, monkeypatch):
    import feta_release.federation.checkpoint_io as ck

    fed = prepare_federation(
        tmp_path / "fed",
        tiny_sites(2),
        policy_overrides={s: {"lifetime": (1.05, 1e-5)} for s in ("site-a", "site-b")},
    )
    signed, _ = sign_job_file(fed, tiny_job(federation={"rounds": 2, "local_steps": 1}), "job-r")
    real_save = ck.save_round

    def killed_after_round_one(state_dir, obj):  # noqa: ANN001, ANN202 - the sites answered (and charged) round 1
        raise KeyboardInterrupt("coordinator killed")

    monkeypatch.setattr(ck, "save_round", killed_after_round_one)
    with pytest.raises(KeyboardInterrupt):
        run_harness_job(fed, harness(fed), signed, tmp_path / "out")
    monkeypatch.setattr(ck, "save_round", real_save)
    forget_sites()
    res = run_harness_job(fed, harness(fed), signed, tmp_path / "out")
    assert res.rounds_done == 2
    for s in fed.sites:
        with Ledger(s.ledger) as led:
            assert [r["request_id"] for r in led.requests()] == ["job-r:train:0", "job-r:train:1"]


def test_other_jobs_removes_each_event_of_the_job_once():
    a, b = {"stage": "dpsgd", "sigma": 1.0}, {"stage": "central", "sigma": 5.0}
    assert other_jobs([b, a, a, b], [a, b]) == [a, b]
    assert other_jobs([a], []) == [a] and other_jobs([a], [a]) == []


@pytest.mark.slow
def test_a_site_down_when_the_others_attested_attests_when_the_finished_job_is_run_again(tmp_path):
    from feta_release.federation import messages as fm

    fed = prepare_federation(tmp_path / "fed", tiny_sites(3))
    signed, _ = sign_job_file(fed, tiny_job(federation={"rounds": 1, "local_steps": 1}), "job-att")
    down_at_attest = {"site-c": lambda m: m.metadata.message_type == "query.attest"}
    first = run_harness_job(fed, harness(fed, fail_on=down_at_attest), signed, tmp_path / "out")
    assert set(first.attestations) == {"site-a", "site-b"}  # closed at a and b, open at c
    rows = {s.site_id: len(_requests(s)) for s in fed.sites}
    forget_sites()
    grid = harness(fed)
    again = run_harness_job(fed, grid, signed, tmp_path / "out")  # the same --out, site-c back
    assert set(again.attestations) == {"site-a", "site-b", "site-c"}
    assert {s.site_id: len(_requests(s)) for s in fed.sites} == rows  # nothing released or charged again
    assert not [m for m in grid.sent if m.metadata.message_type == fm.TRAIN]
    for sid in ("site-a", "site-b"):  # the closed sites signed the same history again
        assert (
            again.attestations[sid]["statement"]["events"] == first.attestations[sid]["statement"]["events"]
        )


def _requests(site):
    with Ledger(site.ledger) as led:
        return led.requests()
