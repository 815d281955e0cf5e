"""The site privacy ledger: durable, idempotent per request id, refuses past its caps."""

from __future__ import annotations

import json
import multiprocessing as mp
import sqlite3

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from feta_release.accounting import PrivacyEvent, epsilon
from feta_release.errors import BudgetExceededError, PolicyError
from feta_release.ledger import Budget, Ledger

CENTRAL = [PrivacyEvent("central", 5.0, 0.1, 5)]
FREQ = [PrivacyEvent("frequency", 26.6, 1.0, 1)]
BUDGET = Budget(job_epsilon=1.0, lifetime_epsilon=1.5, delta=1e-5)
KEY = Ed25519PrivateKey.generate()  # the site key that signs the ledger head


def test_charge_records_before_return_and_uses_site_accountant(tmp_path):
    led = Ledger(tmp_path / "l.db", key=KEY)
    r = led.charge("job1", "job1:central:0", "central", CENTRAL, BUDGET)
    assert not r.replay
    assert r.job_epsilon == pytest.approx(epsilon(CENTRAL, 1e-5))
    # Durable: a second connection (another process would do the same) sees the committed row now.
    rows = sqlite3.connect(tmp_path / "l.db").execute("SELECT request_id, status FROM requests").fetchall()
    assert rows == [("job1:central:0", "charged")]
    assert sqlite3.connect(tmp_path / "l.db").execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_replay_returns_recorded_answer_and_is_not_charged_twice(tmp_path):
    led = Ledger(tmp_path / "l.db", key=KEY)
    led.charge("job1", "r1", "central", CENTRAL, BUDGET)
    led.record_response("r1", b"payload-1")
    before = led.summary(BUDGET)["lifetime_epsilon_spent"]
    again = led.charge("job1", "r1", "central", CENTRAL, BUDGET)
    assert again.replay and again.response == b"payload-1"
    assert led.check("job1", "r1", "central", CENTRAL, BUDGET).response == b"payload-1"
    assert led.summary(BUDGET)["lifetime_epsilon_spent"] == before
    assert len(led.requests()) == 1


def test_reused_request_id_with_other_parameters_is_refused(tmp_path):
    led = Ledger(tmp_path / "l.db", key=KEY)
    led.charge("job1", "r1", "central", CENTRAL, BUDGET)
    led.record_response("r1", b"x")
    with pytest.raises(PolicyError, match="already used"):
        led.charge("job1", "r1", "central", [PrivacyEvent("central", 4.0, 0.1, 5)], BUDGET)


def test_charged_but_unrecorded_request_is_refused_not_rerun(tmp_path):
    led = Ledger(tmp_path / "l.db", key=KEY)
    led.charge("job1", "r1", "central", CENTRAL, BUDGET)  # crash before record_response
    led.close()
    led = Ledger(tmp_path / "l.db", key=KEY)
    with pytest.raises(PolicyError, match="never recorded"):
        led.charge("job1", "r1", "central", CENTRAL, BUDGET)


def test_per_job_and_lifetime_caps(tmp_path):
    led = Ledger(tmp_path / "l.db", key=KEY)
    big = [PrivacyEvent("dpsgd", 1.0, 0.1, 200)]
    assert epsilon(big, 1e-5) > 1.0
    with pytest.raises(BudgetExceededError, match="budget.per_job.epsilon"):
        led.charge("job1", "r1", "dpsgd", big, BUDGET)
    assert led.requests() == []  # nothing recorded for a refusal
    # Lifetime: two jobs each within the per-job cap, together over the lifetime cap.
    ev = [PrivacyEvent("dpsgd", 2.0, 0.05, 30)]
    e1 = epsilon(ev, 1e-5)
    assert e1 < 0.8 and epsilon(ev * 2, 1e-5) > 0.8
    budget = Budget(job_epsilon=0.8, lifetime_epsilon=0.8, delta=1e-5)
    led.charge("jobA", "a1", "dpsgd", ev, budget)
    with pytest.raises(BudgetExceededError, match="lifetime"):
        led.charge("jobB", "b1", "dpsgd", ev, budget)


def test_history_composes_across_requests_of_a_job(tmp_path):
    led = Ledger(tmp_path / "l.db", key=KEY)
    led.charge("j", "c", "central", CENTRAL, BUDGET)
    r = led.charge("j", "f", "frequency", FREQ, BUDGET)
    assert r.job_epsilon == pytest.approx(epsilon(CENTRAL + FREQ, 1e-5))
    s = led.summary(BUDGET)
    assert set(s["jobs"]["j"]["mechanisms"]) == {"central", "frequency"}
    assert s["jobs"]["j"]["epsilon_left"] == pytest.approx(1.0 - r.job_epsilon)


def test_policy_version_only_goes_up(tmp_path):
    led = Ledger(tmp_path / "l.db", key=KEY)
    led.observe_policy_version(3)
    led.observe_policy_version(3)
    led.observe_policy_version(4)
    with pytest.raises(PolicyError, match="older"):
        led.observe_policy_version(2)
    assert Ledger(tmp_path / "l.db", key=KEY).highest_policy_version() == 4


def _racer(path: str, key_path: str, rid: str, q) -> None:
    from feta_release.signing import load_private_key

    led = Ledger(path, key=load_private_key(key_path))
    try:
        led.charge("j", rid, "dpsgd", [PrivacyEvent("dpsgd", 2.0, 0.05, 30)], Budget(0.8, 0.8, 1e-5))
        q.put("ok")
    except BudgetExceededError:
        q.put("refused")


def test_concurrent_charges_cannot_both_pass_the_check(tmp_path):
    # Each charge alone fits; together they do not. Two processes race: exactly one may win.
    from feta_release.signing import generate_keypair, load_private_key

    key_path, _ = generate_keypair(tmp_path, "site")
    Ledger(tmp_path / "l.db", key=load_private_key(key_path)).close()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [
        ctx.Process(target=_racer, args=(str(tmp_path / "l.db"), str(key_path), f"r{i}", q)) for i in range(2)
    ]
    for p in ps:
        p.start()
    for p in ps:
        p.join(60)
    assert sorted(q.get(timeout=5) for _ in ps) == ["ok", "refused"]


def test_node_status_cli(tmp_path):
    from edge.cli import node

    led = Ledger(tmp_path / "l.db", key=KEY)
    led.charge("job1", "r1", "central", CENTRAL, BUDGET)
    led.close()
    res = CliRunner().invoke(node, ["status", "--ledger", str(tmp_path / "l.db"), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["jobs"]["job1"]["mechanisms"]["central"]["epsilon_spent"] == pytest.approx(
        epsilon(CENTRAL, 1e-5)
    )
    res = CliRunner().invoke(node, ["status", "--ledger", str(tmp_path / "l.db")])
    assert res.exit_code == 0 and "job1" in res.output and "central" in res.output
