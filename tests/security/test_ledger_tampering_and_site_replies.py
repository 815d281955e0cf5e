"""Ledger tampering and malformed site replies: each test is an attack the code before its fix let through.

A local user on a node: a SQLite trigger planted in the ledger file. The hash chain covers the rows, not the
schema, and every write re-links and re-signs the rows as they are after the INSERT: a trigger that rewrites
or drops each new charge made the node sign a ledger that never held the spend, so the budget was spent again.
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
    "rewrite each charge to a tiny spen"
    "d": "CREATE TRIGGER t AFTER INSERT ON requests BEGIN UPDATE requests SET "
    'events=\'[{"stage":"dpsgd","sigma":900.0,"q":0.05,"steps":2}]\' WHERE seq = NEW.seq; END',
    "drop each charge": "CREATE TRIGGER t BEFORE INSERT ON requests BEGIN SELECT RAISE(IGNORE); END",
    "keep closed jobs open": "CREATE TRIGGER t AFTER UPDATE ON meta BEGIN UPDATE meta SET "
    "value=replace(NEW.value, '\"closed\": true', '\"closed\": false') WHERE key = NEW.key; END",
}


@pytest.mark.parametrize("what", sorted(TRIGGERS))
def test_a_trigger_planted_in_the_ledger_is_refused(tmp_path, what):
    p = tmp_path / "l.db"
    with Ledger(p, key=KEY) as led:
        led.charge("job0", "r0", "dpsgd", EV, BUDGET, response=b"a")
    db = sqlite3.connect(p, isolation_level=None)
    db.execute(TRIGGERS[what])
    db.close()
    with pytest.raises(LedgerTamperedError, match="trigger"):
        with Ledger(p, key=KEY) as led:  # before the fix: opened, and the next charge was signed away
            led.charge("job0", "r1", "dpsgd", EV, BUDGET, response=b"b")


def test_a_trigger_planted_while_the_node_runs_is_refused_before_the_next_write(tmp_path):
    p = tmp_path / "l.db"
    led = Ledger(p, key=KEY)
    led.charge("job0", "r0", "dpsgd", EV, BUDGET, response=b"a")
    db = sqlite3.connect(p, isolation_level=None)
    db.execute(TRIGGERS["drop each charge"])
    db.close()
    with pytest.raises(LedgerTamperedError, match="trigger"):
        led.charge("job0", "r1", "dpsgd", EV, BUDGET, response=b"b")
    led.close()


# -- one site's DP-SGD reply
# ------------------------------------------------------------------------------------ Attack (a participating
# site, or whatever answers for its node): a round reply that is not the model's weights. A scalar or a
# (1,)-array per tensor BROADCAST into FedAvg and moved every weight of the global model all other sites then
# train on, silently; NaN/inf made the global model NaN; a missing tensor or an unparseable message (one
# duplicated JSON key) raised out of the round and ended the whole job. Now such a reply is the site's failure
# for that round: skipped (as a site that did not answer), named in the progress log, the others averaged.

torch = pytest.importorskip("torch")

from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
from flwr.app import ConfigRecord, RecordDict  # noqa: E402

from feta_release.federation import messages as fm  # noqa: E402
from feta_release.federation.driver import JobDriver  # noqa: E402


class _Grid:
    """Answers each message with ``answer(site node, its weights)``'s RecordDict."""

    def __init__(self, answer):
        self.answer = answer

    def send_and_receive(self, msgs, timeout):
        out = []
        for m in msgs:
            _, arrays = fm.read_payload(m.content)
            out.append(
                SimpleNamespace(
                    metadata=SimpleNamespace(src_node_id=m.metadata.dst_node_id),
                    has_error=lambda: False,
                    content=self.answer(m.metadata.dst_node_id, arrays),
                )
            )
        return out


def _driver(answer, events):
    from flwr.supercore.task_identity import TaskIdentity

    # Message(...) reads it (a ServerApp's)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    drv = JobDriver.__new__(JobDriver)  # the round's plumbing only: no signed job, no disk
    drv.grid, drv.signed_job, drv.query_timeout = _Grid(answer), {}, 1.0
    drv.cfg = SimpleNamespace(
        federation=SimpleNamespace(min_sites=1, local_steps=1), dpsgd=SimpleNamespace(ema=0.9, public_batch=0)
    )
    drv.sites = {"a": SimpleNamespace(node_id=1, size=100), "b": SimpleNamespace(node_id=2, size=100)}
    drv.planned_dpsgd, drv.skipped = {}, {}
    drv.emit = lambda phase, message, **kw: events.append(message)
    return drv


def _honest(arrays):
    return fm.make_payload({}, {k: v + 1.0 for k, v in arrays.items()})


BAD_REPLIES = {
    "a scalar per tensor (broadcast)": lambda arrays: fm.make_payload(
        {}, {k: np.float32(1e6) for k in arrays}
    ),
    "a (1,)-array per tensor (broadcast)": lambda arrays: fm.make_payload(
        {}, {k: np.full((1,), 1e6, np.float32) for k in arrays}
    ),
    "NaN weights": lambda arrays: fm.make_payload(
        {}, {k: np.full_like(v, np.nan) for k, v in arrays.items()}
    ),
    "inf weights": lambda arrays: fm.make_payload(
        {}, {k: np.full_like(v, np.inf) for k, v in arrays.items()}
    ),
    "a tensor missing": lambda arrays: fm.make_payload({}, {k: v for k, v in list(arrays.items())[1:]}),
    "an unparseable message": lambda arrays: RecordDict({"cfg": ConfigRecord({"json": '{"a": 1, "a": 2}'})}),
}


@pytest.mark.parametrize("what", sorted(BAD_REPLIES))
def test_a_bad_round_reply_is_skipped_not_averaged(what):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    events: list[str] = []
    drv = _driver(lambda node, arrays: BAD_REPLIES[what](arrays) if node == 2 else _honest(arrays), events)
    assert drv._round(0, model) == ["a"]
    for k, v in model.state_dict().items():  # the honest site's update alone (+1 on every weight)
        assert torch.allclose(v, before[k] + 1.0), (what, k)
    assert drv.skipped == {0: ["b"]}
    assert any("site b skipped" in e for e in events), events


def test_a_non_finite_warm_up_release_is_not_pooled(tmp_path):
    """Attack: a site's central release with NaN images: pooled, the warm-up set and then the global model
    were NaN (every honest node then refuses the weights: one site ended the job). Now it is that site's
    failure."""
    from feta_release.mechanisms.central import CentralRelease

    rel = CentralRelease(
        values=np.full((3, 1, 2, 2), 0.5, np.float32),
        labels=np.arange(3),
        rounds=1,
        kind="mean",
        denominator=4.0,
        image_shape=(1, 2, 2),
        n_classes=3,
        sigma=1.0,
        q=0.1,
        clip=None,
        bins=None,
    )
    good = rel.to_arrays()
    bad = {**good, "values": np.full((3, 1, 2, 2), np.nan, np.float32)}
    events: list[str] = []
    drv = _driver(lambda node, arrays: fm.make_payload({}, bad if node == 2 else good), events)
    drv.state, drv.timings = tmp_path, {}
    have = drv._collect("central", fm.CENTRAL)
    assert sorted(have) == ["a"] and not (tmp_path / "central_b.npz").exists()
    assert any("site b: no central release: release refused" in e for e in events), events


# -- deeply nested JSON
# ------------------------------------------------------------------------------------------ Attack: any
# unsigned JSON the project parses strictly (a site's reply, a manifest or certificate handed to verify)
# nested thousands deep: json raised RecursionError, which no caller expects (verify crashed with a traceback,
# and one site's reply ended the coordinator's job past the reply check); nested a few hundred deep it parsed
# and then overflowed the stack in canonical_json. Now it is one ValueError, as any other malformed document.


@pytest.mark.parametrize("depth", [300, 100_000])
def test_deeply_nested_json_is_one_value_error(depth):
    from feta_release.signing import loads_strict

    with pytest.raises(ValueError, match="nested"):
        loads_strict("[" * depth + "]" * depth)
    assert loads_strict('{"a": [[{"b": [1, 2]}]]}') == {"a": [[{"b": [1, 2]}]]}


def test_a_deeply_nested_reply_is_that_sites_failure():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    events: list[str] = []
    deep = RecordDict({"cfg": ConfigRecord({"json": "[" * 100_000 + "]" * 100_000})})
    drv = _driver(lambda node, arrays: deep if node == 2 else _honest(arrays), events)
    assert drv._round(0, model) == ["a"] and drv.skipped == {0: ["b"]}


def test_verify_refuses_a_deeply_nested_manifest(tmp_path):
    from feta_release.release.verify import verify_release

    (tmp_path / "manifest.json").write_text('{"manifest": ' + "[" * 100_000 + "]" * 100_000 + "}")
    res = verify_release(tmp_path, {"a": KEY.public_key()})
    assert not res.ok and "nested" in res.reason()


# -- the sites' attestations
# ------------------------------------------------------------------------------------- Attack: a site answers
# the attest query with a statement signed by any key (the coordinator checked it against the key EMBEDDED in
# the reply), with another site's statement, or with one of another job: it was kept as that site's
# attestation (or a malformed reply raised KeyError/PolicyError and ended the job after every site had spent).
# verify refused such a release later; now the coordinator refuses the attestation itself, as verify will.


def _attest_driver(answer, events):
    from feta_release.signing import public_key_pem

    drv = _driver(answer, events)
    drv.job = SimpleNamespace(job_id="job-1", digest="d" * 64)
    for s in drv.sites.values():
        s.key = Ed25519PrivateKey.generate()
        s.policy = SimpleNamespace(site_key=public_key_pem(s.key))
    return drv


def _statement(sid, key, **over):
    from feta_release.release.manifest import build_attestation

    att = build_attestation(sid, "job-1", EV, 1e-5, "rdp", None, key, job_sha256="d" * 64)
    if over:
        from feta_release.signing import sign_document

        att["statement"].update(over)
        att["signature"] = sign_document(att["statement"], key)
    return att


ATTACKS = {
    "signed by a key of its own": lambda drv: _statement("b", Ed25519PrivateKey.generate()),
    "site a's statement": lambda drv: _statement("a", drv.sites["a"].key),
    "another job's statement": lambda drv: _statement(
        "b", drv.sites["b"].key, job_id="job-0", job_sha256="e" * 64
    ),
    "not final": lambda drv: _statement("b", drv.sites["b"].key, final=False),
    "no attestation at all": lambda drv: None,
}


@pytest.mark.parametrize("what", sorted(ATTACKS))
def test_a_wrong_attestation_is_refused_by_the_coordinator(what):
    events: list[str] = []
    holder: dict = {}

    def answer(node, arrays):
        drv = holder["drv"]
        att = _statement("a", drv.sites["a"].key) if node == 1 else ATTACKS[what](drv)
        return fm.make_payload({} if att is None else {"attestation": att})

    holder["drv"] = drv = _attest_driver(answer, events)
    out = drv.attestations()
    assert sorted(out) == ["a"]
    assert any("site b: no attestation: attestation refused" in e for e in events), events


# -- a malformed hello ----------------------------------------------------------------
# Attack (anything that can answer for a node): a hello whose site_id is missing or a list, or whose policy is
# not a signed-policy object. Before: a KeyError / TypeError / AttributeError out of wait_for_sites ended the
# job for every site. Now that node is refused (named in the progress log) and the job waits for the real
# sites as it does for a node that refuses.

MALFORMED_HELLOS = {
    "no site_id": {"policy": {}},
    "site_id a list": {"site_id": ["a"], "policy": {}},
    "policy a string": {"site_id": "a", "policy": "signed"},
    "signature a string": {"site_id": "a", "policy": {"signature": "x"}},
    "lifetime_events a string": {"site_id": "a", "policy": {"signature": {}}, "lifetime_events": "abc"},
}


class _HelloGrid:
    def __init__(self, doc):
        self.doc = doc

    def get_node_ids(self):
        return [7]

    def send_and_receive(self, msgs, timeout):
        return [
            SimpleNamespace(
                metadata=SimpleNamespace(src_node_id=m.metadata.dst_node_id),
                has_error=lambda: False,
                content=RecordDict({"cfg": ConfigRecord({"json": __import__("json").dumps(self.doc)})}),
            )
            for m in msgs
        ]


@pytest.mark.parametrize("what", sorted(MALFORMED_HELLOS))
def test_a_malformed_hello_refuses_that_node_not_the_job(what):
    from feta_release.federation.driver import SiteUnavailable

    events: list[str] = []
    drv = _driver(lambda node, arrays: None, events)
    drv.grid, drv.sites = _HelloGrid(MALFORMED_HELLOS[what]), {}
    drv.job = SimpleNamespace(sites=("a",))
    drv.wait_timeout, drv.poll, drv.timings = 0.0, 0.0, {}
    with pytest.raises(SiteUnavailable, match="did not join") as err:
        drv.wait_for_sites()  # before: KeyError / TypeError / AttributeError out of the driver
    assert "hello refused" in str(err.value) and any(
        "node 7 refused the job: hello refused" in e for e in events
    )
