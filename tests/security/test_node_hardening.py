"""Each test is an attack on a site node that the code before this change let through.

Ledger attacks come from a local user on the node (edits the SQLite file); cap attacks from a coordinator
sending concurrent requests; the rest are named in each docstring.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import stat
import threading

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feta_release.accounting import PrivacyEvent
from feta_release.errors import PolicyError, PrivacyError
from feta_release.ledger import Budget, Ledger

KEY = Ed25519PrivateKey.generate()
BUDGET = Budget(job_epsilon=50.0, lifetime_epsilon=100.0, delta=1e-5)
EV = [PrivacyEvent("dpsgd", 2.0, 0.05, 2)]


def _ledger_with_rows(path, n: int = 4) -> None:
    with Ledger(path, key=KEY) as led:
        led.observe_policy_version(3)
        for i in range(n):
            led.charge(f"job{i % 2}", f"r{i}", "dpsgd", EV, BUDGET, response=f"answer {i}".encode())


def _tamper(path, sql: str, *args) -> None:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute(sql, args)
    db.close()


def _tampered(path) -> str:
    from feta_release.ledger import LedgerTamperedError

    with pytest.raises(LedgerTamperedError) as exc:
        Ledger(path, key=KEY).close()
    return str(exc.value)


# -- 1. tamper-evident ledger ------------------------------------------------------------------------------


def test_lowering_a_recorded_spend_is_detected(tmp_path):
    """Attack: a local user rewrites a row's events to a tiny spend, to free budget. Detected at open."""
    p = tmp_path / "l.db"
    _ledger_with_rows(p)
    _tamper(
        p,
        "UPDATE requests SET events=? WHERE request_id='r1'",
        '[{"stage":"dpsgd","sigma":90.0,"q":0.05,"steps":2}]',
    )
    assert "row 2 (request 'r1') was changed" in _tampered(p)


def test_deleting_a_middle_row_is_detected(tmp_path):
    """Attack: a local user deletes one charge (and renumbers) so its ε no longer counts."""
    p = tmp_path / "l.db"
    _ledger_with_rows(p)
    _tamper(p, "DELETE FROM requests WHERE request_id='r1'")
    assert "row 2 is missing" in _tampered(p)
    _tamper(p, "UPDATE requests SET seq = seq - 1 WHERE seq > 2")
    assert "chain breaks" in _tampered(p)


def test_deleting_the_last_rows_is_detected(tmp_path):
    """Attack: truncating the ledger (drop the newest charges); every remaining link still holds."""
    p = tmp_path / "l.db"
    _ledger_with_rows(p)
    _tamper(p, "DELETE FROM requests WHERE seq >= 3")
    assert "signed head covers 4 row(s) but the file has 2" in _tampered(p)


def test_rehashing_the_chain_without_the_site_key_is_detected(tmp_path):
    """Attack: delete a row and recompute every hash and the head: only the signature can catch it."""
    from feta_release import ledger_chain as chain

    p = tmp_path / "l.db"
    _ledger_with_rows(p)
    db = sqlite3.connect(p, isolation_level=None)
    db.execute("DELETE FROM requests WHERE request_id='r3'")
    chain.seal_chain(db, Ed25519PrivateKey.generate())  # the attacker's own key
    db.close()
    assert "signed by another key" in _tampered(p)


def test_lowering_the_policy_version_seen_is_detected(tmp_path):
    """Attack: roll back the highest policy version seen, so an old (laxer) signed policy is accepted
    again."""
    p = tmp_path / "l.db"
    _ledger_with_rows(p)
    _tamper(p, "UPDATE meta SET value='1' WHERE key='policy_version'")
    assert "meta table" in _tampered(p)


def test_replacing_the_file_with_another_sites_ledger_is_detected(tmp_path):
    """Attack: swap in a ledger made by another node (own key, nearly empty)."""
    p, other = tmp_path / "l.db", tmp_path / "other.db"
    _ledger_with_rows(p)
    with Ledger(other, key=Ed25519PrivateKey.generate()):
        pass
    shutil.copy(other, p)
    assert "another key" in _tampered(p)


def test_replacing_the_file_with_an_unchained_one_is_refused_with_the_fix(tmp_path):
    """Attack/migration: a plain SQLite ledger (as written before this change) is not silently trusted."""
    from feta_release.ledger import LedgerNotChainedError

    p = tmp_path / "old.db"
    db = sqlite3.connect(p)
    db.executescript("""CREATE TABLE requests (request_id TEXT PRIMARY KEY, job_id TEXT NOT NULL, mechanism TEXT NOT NULL,
        events TEXT NOT NULL, status TEXT NOT NULL, response BLOB, response_sha256 TEXT, job_epsilon REAL NOT NULL,
        lifetime_epsilon REAL NOT NULL, created_at REAL NOT NULL, completed_at REAL);
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO requests VALUES ('a', 'j', 'dpsgd', '[{"stage":"dpsgd","sigma":2.0,"q":0.05,"steps":2}]', 'done',
            x'00', '6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d', 0.1, 0.1, 1.0, 1.0);""")  # noqa: E501
    db.close()
    with pytest.raises(LedgerNotChainedError, match="feta-release node migrate-ledger"):
        Ledger(p, key=KEY)
    from click.testing import CliRunner

    from edge.cli import node
    from feta_release.signing import generate_keypair, load_private_key

    kp, _ = generate_keypair(tmp_path, "site")
    res = CliRunner().invoke(node, ["migrate-ledger", "--ledger", str(p), "--site-key", str(kp)])
    assert res.exit_code == 0, res.output
    with Ledger(p, key=load_private_key(kp), deep=True) as led:
        assert [r["request_id"] for r in led.requests()] == ["a"]
    assert stat.S_IMODE(p.stat().st_mode) == 0o600


def test_an_emptied_ledger_file_is_refused(tmp_path):
    """Attack: truncate the ledger file to 0 bytes (a fresh, empty budget) instead of deleting rows."""
    p = tmp_path / "l.db"
    _ledger_with_rows(p)
    for extra in ("-wal", "-shm"):
        (tmp_path / f"l.db{extra}").unlink(missing_ok=True)
    p.write_bytes(b"")
    assert "holds no ledger" in _tampered(p)


def test_edited_stored_answer_is_never_replayed(tmp_path):
    """Attack: change a stored answer so a replay sends the coordinator bytes that were never released."""
    from feta_release.ledger import LedgerTamperedError

    p = tmp_path / "l.db"
    _ledger_with_rows(p)
    _tamper(p, "UPDATE requests SET response=? WHERE request_id='r2'", b"raw data")
    with pytest.raises(LedgerTamperedError, match="stored answer"):
        Ledger(p, key=KEY, deep=True)
    with Ledger(p, key=KEY) as led, pytest.raises(LedgerTamperedError, match="stored answer"):
        led.charge("job0", "r2", "dpsgd", EV, BUDGET)


def test_ledger_file_is_created_0600_exclusively_and_group_writable_refused(tmp_path):
    """Attack: another local user reads/writes the ledger, or pre-places a link where it will be created."""
    p = tmp_path / "l.db"
    Ledger(p, key=KEY).close()
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    link = tmp_path / "link.db"
    os.symlink(tmp_path / "elsewhere.db", link)  # dangling: the node must not create a file through it
    with pytest.raises(PrivacyError, match="already there"):
        Ledger(link, key=KEY)
    assert not (tmp_path / "elsewhere.db").exists()
    os.chmod(p, 0o666)
    with pytest.raises(PolicyError, match="chmod 600"):
        Ledger(p, key=KEY)


def test_ledger_without_site_key_reads_but_cannot_record(tmp_path):
    p = tmp_path / "l.db"
    _ledger_with_rows(p, 1)
    with Ledger(p, verify_key=KEY.public_key()) as led:
        assert len(led.requests()) == 1
        with pytest.raises(PrivacyError, match="without the site key"):
            led.charge("j", "x", "dpsgd", EV, BUDGET)
    with pytest.raises(PrivacyError, match="no ledger here"):
        Ledger(tmp_path / "missing.db")


def test_node_status_checks_the_chain_and_signature(tmp_path):
    """`node status` shows a tampered ledger as one clear line (exit code, no traceback)."""
    from click.testing import CliRunner

    from edge.cli import node
    from feta_release.cli import main  # noqa: F401 - the CLI's error handling
    from feta_release.signing import public_key_pem

    p = tmp_path / "l.db"
    _ledger_with_rows(p)
    pub = tmp_path / "site.pub"
    pub.write_text(public_key_pem(KEY))
    ok = CliRunner().invoke(node, ["status", "--ledger", str(p), "--site-key", str(pub)])
    assert ok.exit_code == 0 and "chain and signed head verified" in ok.output, ok.output
    _tamper(p, "UPDATE requests SET job_epsilon=0.0 WHERE seq=1")
    bad = CliRunner().invoke(node, ["status", "--ledger", str(p), "--site-key", str(pub)])
    assert bad.exit_code != 0 and "was changed after it was recorded" in str(bad.exception)


_COLUMNS = [
    "request_id",
    "job_id",
    "mechanism",
    "events",
    "status",
    "response_sha256",
    "job_epsilon",
    "lifetime_epsilon",
    "created_at",
    "completed_at",
]


@st.composite
def _attack(draw):
    kind = draw(st.sampled_from(["edit", "delete", "swap", "truncate"]))
    n = 5
    a = draw(st.integers(1, n))
    b = draw(st.integers(1, n).filter(lambda x: x != a))
    col = draw(st.sampled_from(_COLUMNS))
    return kind, a, b, col


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(attack=_attack())
def test_any_edit_delete_or_reorder_is_detected(tmp_path_factory, attack):
    """Property: whatever single edit, deletion, reordering or truncation is made, opening the ledger
    refuses."""
    kind, a, b, col = attack
    p = tmp_path_factory.mktemp("led") / "l.db"
    _ledger_with_rows(p, 5)
    db = sqlite3.connect(p, isolation_level=None)
    if kind == "edit":
        new = {
            "job_epsilon": 0.0,
            "lifetime_epsilon": 0.0,
            "created_at": 1.0,
            "completed_at": 2.0,
            "events": '[{"stage":"dpsgd","sigma":9.0,"q":0.05,"steps":2}]',
        }.get(col, "tampered")
        db.execute(f"UPDATE requests SET {col}=? WHERE seq=?", (new, a))
    elif kind == "delete":
        db.execute("DELETE FROM requests WHERE seq=?", (a,))
    elif kind == "swap":  # exchange the positions of two rows (hashes move with them)
        db.execute("UPDATE requests SET seq=-1 WHERE seq=?", (a,))
        db.execute("UPDATE requests SET seq=? WHERE seq=?", (a, b))
        db.execute("UPDATE requests SET seq=? WHERE seq=-1", (b,))
    else:
        db.execute("DELETE FROM requests WHERE seq>=?", (a,))
    db.close()
    _tampered(p)


def test_untampered_ledger_survives_reopen_and_writes(tmp_path):
    p = tmp_path / "l.db"
    _ledger_with_rows(p)
    with Ledger(p, key=KEY, deep=True) as led:
        led.charge("job9", "r9", "dpsgd", EV, BUDGET)
        led.record_response("r9", b"late answer")
        led.observe_policy_version(4)
    with Ledger(p, verify_key=KEY.public_key(), deep=True) as led:
        assert len(led.requests()) == 5 and led.highest_policy_version() == 4


# -- 2. caps re-checked at commit ---------------------------------------------------------------------------


def _capped_policy(max_steps: int, max_rounds: int):
    from feta_release.policy.document import SitePolicy, make_policy

    doc = make_policy(
        "site-a",
        "ab" * 32,
        1000,
        [KEY.public_key()],
        per_job=(50.0, 1e-5),
        lifetime=(100.0, 1e-5),
        mechanisms={"dpsgd": {"max_steps": max_steps}, "central": {"max_rounds": max_rounds}},
    )
    return SitePolicy.from_document(doc, signer="test")


@pytest.mark.parametrize(
    "mechanism,event,cap",
    [
        ("dpsgd", PrivacyEvent("dpsgd", 2.0, 0.05, 2), {"max_steps": 3, "max_rounds": 50}),
        ("central", PrivacyEvent("central", 5.0, 0.01, 2), {"max_steps": 1000, "max_rounds": 3}),
    ],
)
def test_concurrent_requests_cannot_pass_the_step_caps(tmp_path, mechanism, event, cap):
    """Attack: a coordinator sends two requests of one job at once (rounds 0 and 1). Both pass the pre-check
    against the same empty history; within the ε budget, only the step/round cap stops the second, so it
    must be re-checked under the ledger's write lock at commit."""
    from feta_release.policy.enforce import check_request
    from feta_release.policy.errors import PolicyViolation

    policy = _capped_policy(**cap)
    p = tmp_path / "l.db"
    Ledger(p, key=KEY).close()
    barrier = threading.Barrier(2)
    results: list[str] = []

    def handler(rid: str) -> None:
        with Ledger(p, key=KEY) as led:  # one connection per handler, as in separate processes
            hist = [PrivacyEvent(**e) for e in led.job_events("job")]
            # both pass: nothing recorded yet
            check_request(policy, event, job_events=hist, require_job=False)
            led.check("job", rid, mechanism, [event], policy)
            barrier.wait()
            try:
                led.charge("job", rid, mechanism, [event], policy, response=b"x")
                results.append("ok")
            except PolicyViolation as exc:
                results.append(exc.rule)

    threads = [threading.Thread(target=handler, args=(f"r{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    rule = f"mechanisms.{mechanism}.{'max_rounds' if mechanism == 'central' else 'max_steps'}"
    assert sorted(results) == sorted(["ok", rule])
    with Ledger(p, key=KEY) as led:
        assert sum(e["steps"] for e in led.job_events("job")) == event.steps


# -- 3. the coordinator authenticates sites ---------------------------------------------------------------


class _InflatingApp:
    """A malicious site: its hello reply claims a huge dataset so FedAvg gives its weights all the mass."""

    def __init__(self, app):
        self.app = app

    def __call__(self, msg, ctx):
        from flwr.app import Message

        from feta_release.federation import messages as fm

        rep = self.app(msg, ctx)
        if msg.metadata.message_type == fm.HELLO and not rep.has_error():
            doc, arrays = fm.read_payload(rep.content)
            return Message(fm.make_payload({**doc, "dataset_size": 10**9}, arrays), reply_to=msg)
        return rep


def _driver(tmp_path, nodes):
    from coordinator.setup import sign_job_file
    from feta_release.federation.driver import JobDriver
    from feta_release.federation.harness import InProcessGrid
    from tests.support.federation import tiny_job

    fed = nodes(tmp_path)
    grid = InProcessGrid(fed[1])
    signed, _ = sign_job_file(fed[0], tiny_job(), "job-auth", sites=["site-a", "site-b"])
    return fed[0], JobDriver(grid, signed, tmp_path / "out", wait_timeout=5.0, poll_interval=0.05)


def _nodes(specs):
    """specs: [(site whose config the node runs, registered name, app wrapper or None)]."""

    def build(tmp_path):
        from edge.clientapp import app
        from feta_release.federation.harness import HarnessNode
        from tests.support.federation import make_federation

        fed = make_federation(tmp_path / "fed")
        nodes = {
            100 + i: HarnessNode(wrap(app) if wrap else app, fed.site(site).node_config(), name=name)
            for i, (site, name, wrap) in enumerate(specs)
        }
        return fed, nodes

    return build


def test_fedavg_weights_come_from_the_signed_policy_not_from_a_reply(tmp_path):
    """Attack: a site's hello says it holds 10^9 images, to dominate FedAvg (and shape the global model)."""
    from feta_release.federation import plan

    fed, drv = _driver(tmp_path, _nodes([("site-a", "", _InflatingApp), ("site-b", "", None)]))
    drv.wait_for_sites()
    sizes = {sid: s.size for sid, s in drv.sites.items()}
    assert sizes == {sid: plan.public_size(drv.sites[sid].policy) for sid in sizes}
    assert sizes["site-a"] == fed.site("site-a").size
    w = plan.fedavg_weights(sizes)
    assert w["site-a"] < 0.75


def test_a_second_node_claiming_a_joined_site_is_refused(tmp_path):
    """Attack: an impostor node answers hello as site-a (with site-a's public signed policy) next to the real
    one."""
    _, drv = _driver(tmp_path, _nodes([("site-a", "", None), ("site-a", "", None), ("site-b", "", None)]))
    with pytest.raises(PolicyError, match="already holds"):
        drv.wait_for_sites()


def test_a_node_may_speak_only_for_the_site_its_key_was_registered_for(tmp_path):
    """Attack: the node registered (authenticated) as site-b claims to be site-a."""
    _, drv = _driver(tmp_path, _nodes([("site-a", "site-b", None), ("site-b", "site-c", None)]))
    with pytest.raises(PolicyError, match="registered as 'site-b' but claims to be site 'site-a'"):
        drv.wait_for_sites()


def test_registered_nodes_matching_their_sites_join(tmp_path):
    _, drv = _driver(tmp_path, _nodes([("site-a", "site-a", None), ("site-b", "site-b", None)]))
    drv.wait_for_sites()
    assert set(drv.sites) == {"site-a", "site-b"}


def test_superlink_turns_node_authentication_on_outside_loopback(tmp_path):
    """Attack: any machine that reaches a coordinator's public port joins as a node (auth was opt-in)."""
    from coordinator.superlink import SuperLinkSettings, superlink_command
    from feta_release.errors import ConfigError

    tls = dict(
        ssl_certfile=tmp_path / "c",
        ssl_keyfile=tmp_path / "k",
        ssl_ca_certfile=tmp_path / "ca",
        database=tmp_path / "s.db",
    )
    assert "--enable-supernode-auth" in superlink_command(SuperLinkSettings(host="0.0.0.0", **tls))
    assert "--enable-supernode-auth" in superlink_command(SuperLinkSettings(host="10.0.0.5", **tls))
    assert "--enable-supernode-auth" not in superlink_command(SuperLinkSettings(host="127.0.0.1", **tls))
    with pytest.raises(ConfigError, match="without node authentication"):
        superlink_command(SuperLinkSettings(host="0.0.0.0", enable_supernode_auth=False, **tls))


def test_node_refuses_a_remote_superlink_without_an_auth_key(tmp_path):
    """Attack surface: a node that joins a remote SuperLink unauthenticated can be impersonated there."""
    from edge.launch import NodeSettings, check_transport
    from feta_release.errors import ConfigError

    base = dict(
        data=tmp_path,
        policy=tmp_path,
        trusted_policy_key=tmp_path,
        ledger=tmp_path / "l.db",
        site_key=tmp_path,
        data_secret=tmp_path,
        root_certificates=tmp_path / "ca.crt",
    )
    with pytest.raises(ConfigError, match="--auth-key"):
        check_transport(NodeSettings(**base, superlink="10.1.2.3:9092"))
    check_transport(NodeSettings(**base, superlink="10.1.2.3:9092", auth_key=tmp_path / "node"))
    check_transport(NodeSettings(**base, superlink="127.0.0.1:9092"))


def test_tls_and_node_keys_are_0600_and_never_overwritten(tmp_path):
    """Attack: a planted file/link at a key path, or a re-run that silently replaces the coordinator's CA
    key."""
    from coordinator.tls import make_certificates
    from feta_release.errors import ConfigError
    from feta_release.signing import make_node_auth_key

    paths = make_certificates(tmp_path / "certs")
    priv, _ = make_node_auth_key(tmp_path / "certs" / "nodes", "site-a")
    for p in (paths["ca_key"], paths["server_key"], priv):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
    before = paths["ca_key"].read_bytes()
    with pytest.raises(ConfigError, match="already exist"):
        make_certificates(tmp_path / "certs")
    assert paths["ca_key"].read_bytes() == before
    with pytest.raises(ConfigError, match="already exists"):
        make_node_auth_key(tmp_path / "certs" / "nodes", "site-a")
    os.symlink(tmp_path / "planted", tmp_path / "certs" / "nodes" / "site-b")
    with pytest.raises(ConfigError, match="already exists"):
        make_node_auth_key(tmp_path / "certs" / "nodes", "site-b")
    assert not (tmp_path / "planted").exists()


# -- 4. only allow-listed code runs ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_fab():
    """The project's own app bundle (what the demo's coordinator submits) and its sha256."""
    import hashlib

    from flwr.cli.build import build_fab_from_disk

    from coordinator.setup import APP_DIR

    data = build_fab_from_disk(APP_DIR)
    return data, hashlib.sha256(data).hexdigest()


def _run_fab(fab_id="feta-release/feta-release-app", version="0.1.0", hash_=None, content=b""):
    from types import SimpleNamespace

    return SimpleNamespace(fab_id=fab_id, fab_version=version), SimpleNamespace(
        hash_str=hash_, content=content
    )


def _gated(monkeypatch, tmp_path, run, fab, allowed):
    """Install the node's gate on Flower's real run_clientapp module around a task input the SuperLink
    sent."""
    from flwr.supernode.runtime import run_clientapp as rc

    from edge import trust

    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr_home"))
    monkeypatch.setenv(trust.ENV_ALLOWED, ",".join(allowed))
    monkeypatch.setattr(rc, "pull_task_input", lambda client: ("msg", "ctx", run, fab))
    monkeypatch.setattr(rc, "install_from_fab", rc.install_from_fab)  # restored after the test
    monkeypatch.setattr(trust, "_current", {})
    trust.install_gate()
    return rc


@pytest.mark.parametrize("version", ["0.1.0/../../../../tmp/evil", "../0.1.0", "0.1.0/x"])
def test_a_fab_version_with_path_parts_is_refused(monkeypatch, tmp_path, real_fab, version):
    """Attack: the SuperLink sends the allowed bundle but a fab_version with ``/../``: Flower would import the
    ClientApp from a directory outside FLWR_HOME (only the bytes were checked before)."""
    from edge.trust import UntrustedAppError

    data, h = real_fab
    rc = _gated(monkeypatch, tmp_path, *_run_fab(version=version, hash_=h, content=data), {h})
    rc.pull_task_input(None)  # the refusal is raised at the install step, before unpacking
    with pytest.raises(UntrustedAppError, match="not plain names"):
        rc.install_from_fab(data, skip_prompt=True)


def test_a_run_pointing_at_another_installed_app_is_refused(monkeypatch, tmp_path, real_fab):
    """Attack: allowed bytes, but the hash/version sent name an older app still installed under FLWR_HOME
    (no longer allowed): Flower installs the new bundle and then loads the old directory."""
    from edge.trust import UntrustedAppError

    data, h = real_fab
    old = "0" * 64
    rc = _gated(monkeypatch, tmp_path, *_run_fab(hash_=old, content=data), {h})
    rc.pull_task_input(None)  # the refusal is raised at the install step, before unpacking
    with pytest.raises(UntrustedAppError, match="names hash"):
        rc.install_from_fab(data, skip_prompt=True)
    rc = _gated(monkeypatch, tmp_path, *_run_fab(version="0.0.9", hash_=h, content=data), {h})
    rc.pull_task_input(None)  # the refusal is raised at the install step, before unpacking
    with pytest.raises(UntrustedAppError, match="but the bundle is"):
        rc.install_from_fab(data, skip_prompt=True)


def test_a_planted_or_changed_app_directory_is_refused(monkeypatch, tmp_path, real_fab):
    """Attack: Flower skips installing when the app directory exists and imports what is there; a file
    added (it would shadow any import) or changed in it must not run."""
    from edge.trust import UntrustedAppError

    data, h = real_fab
    rc = _gated(monkeypatch, tmp_path, *_run_fab(hash_=h, content=data), {h})
    rc.pull_task_input(None)
    app_dir = rc.install_from_fab(data, skip_prompt=True)  # first install: exactly the bundle, accepted
    assert (
        app_dir.parent == (tmp_path / "flwr_home" / "apps").resolve()
        or app_dir.parent == tmp_path / "flwr_home" / "apps"
    )
    (app_dir / "numpy.py").write_text("import os  # planted\n")
    rc.pull_task_input(None)
    with pytest.raises(UntrustedAppError, match="differs from the allowed bundle"):
        rc.install_from_fab(data, skip_prompt=True)
    (app_dir / "numpy.py").unlink()
    (app_dir / "pyproject.toml").write_text("changed")
    rc.pull_task_input(None)
    with pytest.raises(UntrustedAppError, match="pyproject.toml"):
        rc.install_from_fab(data, skip_prompt=True)


def test_a_symlinked_app_directory_is_refused(tmp_path, monkeypatch, real_fab):
    """Attack: the app directory is a link to elsewhere (Flower would follow it)."""
    from edge.trust import UntrustedAppError, check_app_identity

    data, h = real_fab
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "home"))
    apps = tmp_path / "home" / "apps"
    apps.mkdir(parents=True)
    target = check_app_identity("feta-release/feta-release-app", "0.1.0", h, data, tmp_path / "home", {h})
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", target)
    with pytest.raises(UntrustedAppError, match="outside"):
        check_app_identity("feta-release/feta-release-app", "0.1.0", h, data, tmp_path / "home", {h})


_TOKENS = list("ab0._-/\\~ \x00:%") + ["..", "feta-release", "feta-release-app", "0.1.0"]
_PATHISH = st.lists(st.sampled_from(_TOKENS), min_size=1, max_size=6).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(publisher=_PATHISH, name=_PATHISH, version=_PATHISH)
def test_whatever_names_the_superlink_sends_the_app_dir_stays_a_child_of_apps(
    tmp_path, monkeypatch, real_fab, publisher, name, version
):
    """Property: for any fab_id/fab_version either the check refuses, or Flower's own get_project_dir
    lands directly in FLWR_HOME/apps and the names are the bundle's own."""
    from flwr.common.config import get_project_dir

    from edge.trust import UntrustedAppError, check_app_identity

    data, h = real_fab
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "home"))
    fab_id = f"{publisher}/{name}"
    try:
        got = check_app_identity(fab_id, version, h, data, tmp_path / "home", {h})
    except UntrustedAppError:
        return
    assert (fab_id, version) == ("feta-release/feta-release-app", "0.1.0")
    assert got == get_project_dir(fab_id, version, h)
    assert got.resolve().parent == (tmp_path / "home" / "apps").resolve()


def test_the_allowed_bundle_with_its_own_names_passes(tmp_path, monkeypatch, real_fab):
    from edge.trust import check_app_identity

    data, h = real_fab
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "home"))
    got = check_app_identity("feta-release/feta-release-app", "0.1.0", h, data, tmp_path / "home", {h})
    assert got.name == f"feta-release.feta-release-app.0.1.0.{h[:8]}"


def test_node_start_refuses_a_tampered_ledger_with_one_line(tmp_path):
    """Attack: a local user lowers the node's recorded spend between two runs; `node start` must refuse."""
    from click.testing import CliRunner

    from edge.cli import node
    from edge.site import Site
    from feta_release.ledger import LedgerTamperedError
    from tests.support.federation import make_federation, node_file_options

    fed = make_federation(tmp_path / "fed")
    s = fed.site("site-a")
    site = Site.open(s.node_config())  # first start: the ledger is created, 0600, head signed by the site key
    site.ledger.charge("job", "r1", "dpsgd", EV, site.policy, response=b"x")
    site.ledger.close()
    assert stat.S_IMODE(s.ledger.stat().st_mode) == 0o600
    _tamper(s.ledger, "UPDATE requests SET lifetime_epsilon=0.0")
    args = [
        "start",
        *node_file_options(s),
        "--trusted",
        str(s.policy_pub),
        "--superlink",
        "127.0.0.1:1",
        "--insecure",
    ]
    res = CliRunner().invoke(node, args)
    assert isinstance(res.exception, LedgerTamperedError), res.output
    msg = str(res.exception)
    assert "\n" not in msg and str(s.ledger) in msg and "Restore the ledger from a backup" in msg
