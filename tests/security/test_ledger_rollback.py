"""A site's ledger deleted or restored from an older copy must not re-grant its spent lifetime budget.

The chain inside the ledger cannot see the whole file rolled back or removed; the coordinator keeps the ledger
position (id, rows, head) of every site's last attestation and refuses a hello that does not extend it, and
the node keeps its own copy beside its state and refuses to start on a missing or older ledger."""

from __future__ import annotations

import shutil

import pytest
from click.testing import CliRunner

from coordinator.setup import prepare_federation, sign_job_file
from edge import ledger_anchor
from edge.site import Site, forget_sites
from feta_release.accounting import PrivacyEvent
from feta_release.errors import PrivacyError
from feta_release.federation.anchors import AnchorStore, LedgerRegressed, anchors_path, regression
from feta_release.ledger import Budget, Ledger
from feta_release.policy.errors import JobDoesNotFit
from feta_release.signing import load_private_key
from tests.support.federation import harness, node_settings, run_harness_job, tiny_job, tiny_sites
from tests.support.lost_ledger import lose_ledger

JOB = {"federation": {"rounds": 1, "local_steps": 1}}


def _federation(tmp_path):
    # site-a: a lifetime cap that one job fits and two do not (tests/federation/test_federation.py pins that
    # refusal)
    return prepare_federation(
        tmp_path / "fed",
        tiny_sites(2),
        policy_overrides={"site-a": {"lifetime": (1.2, 1e-5)}, "site-b": {"lifetime": (10.0, 1e-5)}},
    )


def _job(fed, tmp_path, job_id):
    signed, _ = sign_job_file(fed, tiny_job(**JOB), job_id)
    forget_sites()  # each job's nodes open their site afresh, as a restarted node would
    return run_harness_job(
        fed, harness(fed), signed, tmp_path / job_id, anchors=anchors_path(fed.coordinator_key)
    )


def _requests(fed, site, job_id):
    with Ledger(fed.site(site).ledger) as led:
        return led.requests(job_id)


def _wipe(site_dir):
    for p in [*site_dir.glob("ledger.db*"), site_dir / "work"]:
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def test_restoring_an_older_ledger_copy_does_not_regrant_the_lifetime_budget(tmp_path):
    fed = _federation(tmp_path)
    a = fed.site("site-a")
    Site.open(a.node_config()).ledger.close()  # the node's first start made its (empty) ledger: backed up
    forget_sites()
    backup = tmp_path / "backup"
    backup.mkdir()
    for p in [*a.ledger.parent.glob("ledger.db*"), a.ledger.parent / "work"]:
        (shutil.copytree if p.is_dir() else shutil.copy2)(p, backup / p.name)
    _job(fed, tmp_path, "job-1")
    assert _requests(fed, "site-a", "job-1")
    # the whole node state of site-a restored from the backup: its ledger (and work directory) from before
    # job-1
    _wipe(a.ledger.parent)
    for p in backup.iterdir():
        (shutil.copytree if p.is_dir() else shutil.copy2)(p, a.ledger.parent / p.name)
    with pytest.raises(
        LedgerRegressed,
        match=r"site site-a's ledger was restored from an older copy.*fix: site "
        r"site-a restores its latest ledger",
    ):
        _job(fed, tmp_path, "job-2")
    assert _requests(fed, "site-a", "job-2") == [] and _requests(fed, "site-b", "job-2") == []


def test_a_deleted_ledger_is_refused_until_accepted_and_its_spend_stays_counted(tmp_path):
    fed = _federation(tmp_path)
    _job(fed, tmp_path, "job-1")
    # ledger and node state gone: the node silently starts a new ledger
    _wipe(fed.site("site-a").ledger.parent)
    with pytest.raises(
        LedgerRegressed,
        match=r"site site-a's ledger was deleted or replaced.*accept-ledger --site "
        r"site-a --ledger-id",
    ):
        _job(fed, tmp_path, "job-2")
    with Ledger(fed.site("site-a").ledger) as led:
        new_id = led.anchor()["ledger_id"]
    r = CliRunner().invoke(
        _coordinator_cli(),
        ["accept-ledger", "--site", "site-a", "--ledger-id", new_id, "--key", str(fed.coordinator_key)],
    )
    assert r.exit_code == 0, r.output
    assert "accepted" in r.output and any(new_id in line for line in _anchors(fed)["log"])
    # accepted, but the old ledger's attested spend is still counted: a second job does not fit the lifetime
    # cap
    with pytest.raises(JobDoesNotFit, match="site-a.*budget.lifetime.epsilon"):
        _job(fed, tmp_path, "job-3")
    assert _requests(fed, "site-a", "job-3") == []


def _coordinator_cli():
    from coordinator.cli import coordinator

    return coordinator


def _anchors(fed):
    import json

    return json.loads(anchors_path(fed.coordinator_key).read_text("utf-8"))


def test_the_attestation_signs_the_ledger_position_and_the_coordinator_keeps_it(tmp_path):
    fed = _federation(tmp_path)
    res = _job(fed, tmp_path, "job-1")
    for sid in ("site-a", "site-b"):
        with Ledger(fed.site(sid).ledger) as led:
            now = led.anchor()
        assert res.attestations[sid]["statement"]["ledger"] == now  # signed with the spend
        kept = _anchors(fed)["sites"][sid]
        assert {k: kept[k] for k in now} == now and kept["job_id"] == "job-1"


# -- the node's own record
# ----------------------------------------------------------------------------------------


def _node(tmp_path):
    fed = prepare_federation(tmp_path / "fed", tiny_sites(2))
    s = fed.site("site-a")
    site = Site.open(s.node_config())
    return fed, s, site


def _charge(ledger, n):
    budget = Budget(job_epsilon=50.0, lifetime_epsilon=50.0, delta=1e-5)
    for i in range(n):
        ledger.charge(
            "job",
            f"r{ledger.anchor()['rows'] + i}",
            "central",
            [PrivacyEvent("central", 5.0, 0.1, 1)],
            budget,
            response=b"x",
        )


def test_node_refuses_to_open_a_deleted_ledger_it_ran_on_and_new_ledger_is_explicit_and_logged(tmp_path):
    from edge.launch import preflight

    fed, s, site = _node(tmp_path)
    _charge(site.ledger, 2)
    ledger_anchor.record(site.ledger, site.work_dir)
    site.ledger.close()
    forget_sites()
    lose_ledger(s.ledger)
    with pytest.raises(
        ledger_anchor.LedgerRegressedError,
        match=r"ledger is missing.*2 row\(s\).*restore the "
        r"latest copy.*--new-ledger",
    ):
        Site.open(s.node_config())
    assert not s.ledger.exists()  # refused BEFORE a fresh ledger was created
    settings = node_settings(s, insecure=True, new_ledger=True)
    preflight(settings).ledger.close()
    rec = ledger_anchor.read(site.work_dir)
    with Ledger(s.ledger) as led:
        assert rec["ledger_id"] == led.anchor()["ledger_id"] and rec["rows"] == 0
    assert any("--new-ledger" in line for line in rec["history"])


def test_node_refuses_an_older_copy_of_its_ledger_and_a_copy_that_went_on_from_one(tmp_path):
    fed, s, site = _node(tmp_path)
    _charge(site.ledger, 1)
    site.ledger.close()
    old = tmp_path / "old.db"
    shutil.copy2(s.ledger, old)
    forget_sites()
    site = Site.open(s.node_config())
    _charge(site.ledger, 2)
    ledger_anchor.record(site.ledger, site.work_dir)
    site.ledger.close()
    forget_sites()
    shutil.copy2(old, s.ledger)
    with pytest.raises(ledger_anchor.LedgerRegressedError, match=r"an older copy of it \(1 row"):
        Site.open(s.node_config())
    # the old copy goes on past the recorded rows
    with Ledger(s.ledger, key=load_private_key(s.site_key)) as led:
        _charge(led, 3)
    with pytest.raises(ledger_anchor.LedgerRegressedError, match="went on from an older one"):
        Site.open(s.node_config())


# -- the rule itself
# ------------------------------------------------------------------------------------------------


def test_regression_rule_accepts_only_extensions_or_an_accepted_new_ledger():
    last = {"ledger_id": "L1", "rows": 5, "head": "h5", "job_id": "j"}
    assert regression("s", last, {"ledger_id": "L1", "rows": 5, "head": "h5"}, None) is None
    assert regression("s", last, {"ledger_id": "L1", "rows": 9, "head": "h9"}, None) is None
    assert "older copy" in regression("s", last, {"ledger_id": "L1", "rows": 4, "head": "h4"}, None)
    assert "older copy" in regression("s", last, {"ledger_id": "L1", "rows": 5, "head": "x"}, None)
    assert "deleted or replaced" in regression("s", last, {"ledger_id": "L2", "rows": 0, "head": "g"}, None)
    assert regression("s", last, {"ledger_id": "L2", "rows": 0, "head": "g"}, "L2") is None
    assert "sent no ledger position" in regression("s", last, None, None)


def test_anchor_store_refuses_to_record_a_regression_and_accept_needs_a_known_site(tmp_path):
    store = AnchorStore(tmp_path / "a.json")
    store.record(
        "s", "j1", {"ledger": {"ledger_id": "L1", "rows": 3, "head": "h3"}, "lifetime": {"events": [1]}}
    )
    with pytest.raises(LedgerRegressed):
        store.record("s", "j2", {"ledger": {"ledger_id": "L1", "rows": 2, "head": "h2"}})
    with pytest.raises(PrivacyError, match="no ledger of site t"):
        store.accept("t", "L9")
    store.accept("s", "L2")
    assert store.check("s", {"ledger_id": "L2", "rows": 0, "head": "g"}) == [1]  # the old spend, carried
    store.record(
        "s", "j2", {"ledger": {"ledger_id": "L2", "rows": 1, "head": "g1"}, "lifetime": {"events": [2]}}
    )
    assert store.check("s", {"ledger_id": "L2", "rows": 1, "head": "g1"}) == [1]
    with pytest.raises(LedgerRegressed):  # the acceptance was used once: the first ledger is refused now
        store.check("s", {"ledger_id": "L1", "rows": 3, "head": "h3"})
