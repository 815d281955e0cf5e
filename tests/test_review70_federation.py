"""Review 70, ledger and coordinator side: each test is an attack the code before its fix let through.

M1 (local user on a node): a SQLite trigger planted in the ledger file. The hash chain covers the rows, not the
schema, and every write re-links and re-signs the rows as they are after the INSERT: a trigger that rewrites or
drops each new charge made the node sign a ledger that never held the spend, so the budget was spent again.
"""

from __future__ import annotations

import sqlite3

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from feta_release.accounting import PrivacyEvent
from feta_release.ledger import Budget, Ledger, LedgerTamperedError

KEY = Ed25519PrivateKey.generate()
BUDGET = Budget(job_epsilon=50.0, lifetime_epsilon=100.0, delta=1e-5)
EV = [PrivacyEvent("dpsgd", 2.0, 0.05, 2)]

TRIGGERS = {
    "rewrite each charge to a tiny spend": "CREATE TRIGGER t AFTER INSERT ON requests BEGIN UPDATE requests SET "
    "events='[{\"stage\":\"dpsgd\",\"sigma\":900.0,\"q\":0.05,\"steps\":2}]' WHERE seq = NEW.seq; END",
    "drop each charge": "CREATE TRIGGER t BEFORE INSERT ON requests BEGIN SELECT RAISE(IGNORE); END",
    "keep closed jobs open": "CREATE TRIGGER t AFTER UPDATE ON meta BEGIN UPDATE meta SET "
    "value=replace(NEW.value, '\"closed\": true', '\"closed\": false') WHERE key = NEW.key; END",
}


@pytest.mark.parametrize("what", sorted(TRIGGERS))
def test_m1_a_trigger_planted_in_the_ledger_is_refused(tmp_path, what):
    p = tmp_path / "l.db"
    with Ledger(p, key=KEY) as led:
        led.charge("job0", "r0", "dpsgd", EV, BUDGET, response=b"a")
    db = sqlite3.connect(p, isolation_level=None)
    db.execute(TRIGGERS[what])
    db.close()
    with pytest.raises(LedgerTamperedError, match="trigger"):
        with Ledger(p, key=KEY) as led:  # before the fix: opened, and the next charge was signed away
            led.charge("job0", "r1", "dpsgd", EV, BUDGET, response=b"b")


def test_m1_a_trigger_planted_while_the_node_runs_is_refused_before_the_next_write(tmp_path):
    p = tmp_path / "l.db"
    led = Ledger(p, key=KEY)
    led.charge("job0", "r0", "dpsgd", EV, BUDGET, response=b"a")
    db = sqlite3.connect(p, isolation_level=None)
    db.execute(TRIGGERS["drop each charge"])
    db.close()
    with pytest.raises(LedgerTamperedError, match="trigger"):
        led.charge("job0", "r1", "dpsgd", EV, BUDGET, response=b"b")
    led.close()
