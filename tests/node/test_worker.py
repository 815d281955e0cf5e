"""The warm per-site worker (edge/worker.py), its channel (edge/channel.py) and the thin ClientApp
(edge/forward.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Client
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge import channel
from edge.forward import ForwardingApp, remote_error
from feta_release.federation import messages as fm
from feta_release.files import private_dir
from tests.support.federation import make_federation, stop_serving, tiny_job
from tests.support.flower import flower_message as _msg
from tests.support.flower import node_context as _ctx

ROOT = Path(__file__).resolve().parents[2]


# -- the thin side imports no torch
# -------------------------------------------------------------------------------------
def test_the_per_message_clientapp_imports_no_torch():
    code = (
        "import sys, edge.trust, edge.forward, edge.channel\n"
        "edge.trust.install_gate()\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:3]\n"
        "assert 'edge.clientapp' not in sys.modules and 'edge.releases' not in sys.modules\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


# -- the channel, with a stand-in worker
# --------------------------------------------------------------------------------
class EchoWorker:
    def handle(self, doc: dict[str, Any], frames: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        if doc.get("kind") != "echo":
            raise channel.WorkerRequestError(f"worker request: unknown kind {doc.get('kind')!r}; refused")
        return {"ok": True}, [f[::-1] for f in frames]


@pytest.fixture()
def echo(tmp_path):
    from edge.worker import _Stop, serve

    state = private_dir(tmp_path / "w")
    sock, key_file = channel.socket_path(state), state / "worker.key"
    key = channel.write_key(key_file)
    listener = channel.listen(sock, key)
    stop = _Stop()
    stop.busy = True  # a test thread: no signal handler here; the loop ends when `requested` is set
    t = threading.Thread(target=serve, args=(listener, EchoWorker(), stop), daemon=True)
    t.start()
    yield SimpleNamespace(sock=sock, key=key, key_file=key_file, state=state)
    stop_serving(stop, sock, t, listener)


def test_channel_round_trip_and_file_modes(echo):
    reply, frames = channel.call(echo.sock, echo.key, {"kind": "echo"}, [b"abc", b""])
    assert reply["ok"] is True and frames == [b"cba", b""]
    assert stat.S_IMODE(echo.state.stat().st_mode) == 0o700
    assert stat.S_IMODE(echo.sock.stat().st_mode) == 0o600 and stat.S_ISSOCK(echo.sock.stat().st_mode)
    assert stat.S_IMODE(echo.key_file.stat().st_mode) == 0o600


def test_a_wrong_key_is_refused_and_the_worker_serves_on(echo):
    with pytest.raises(channel.WorkerRequestError, match="refused this channel's key"):
        channel.call(echo.sock, b"x" * channel.KEY_BYTES, {"kind": "echo"}, [b"1"])
    assert channel.call(echo.sock, echo.key, {"kind": "echo"}, [b"12"])[1] == [b"21"]


def test_the_challenge_is_mutual_an_impostor_without_the_key_gets_nothing(tmp_path):
    """A process that took the socket's place cannot pose as the worker: it waves the client's answer through,
    but cannot answer the client's own challenge, so the client sends it nothing of the request."""
    from multiprocessing import connection as mpc

    sock = tmp_path / "impostor.sock"
    impostor = mpc.Listener(str(sock), family="AF_UNIX")  # no key
    seen: list[bytes] = []

    def pose() -> None:
        c = impostor.accept()
        c.send_bytes(mpc.CHALLENGE + os.urandom(mpc.MESSAGE_LENGTH))
        c.recv_bytes(256)
        c.send_bytes(mpc.WELCOME)  # "your answer was right"
        c.recv_bytes(256)  # the client's challenge
        c.send_bytes(b"\0" * 16)  # no key: no HMAC
        try:
            while c.poll(2):
                seen.append(c.recv_bytes())
        except EOFError:  # the client closed its end after refusing
            pass

    t = threading.Thread(target=pose, daemon=True)
    t.start()
    try:
        with pytest.raises(channel.WorkerRequestError, match="refused this channel's key"):
            channel.call(sock, b"k" * channel.KEY_BYTES, {"kind": "echo"}, [b"secret"])
    finally:
        t.join(10)
        impostor.close()
    assert seen == [mpc.FAILURE]  # the client refused it and sent nothing else


def test_the_gate_hands_only_our_clientapp_to_the_worker(tmp_path, monkeypatch):
    """After the FAB gate, ``edge.clientapp:app`` becomes the thin forwarder when the node has a worker; any
    other allowed bundle (the ping app) and a node without a worker load as Flower would."""
    from flwr.supernode.runtime import run_clientapp as rc

    from edge import forward, trust

    flower_loaded = object()
    monkeypatch.setattr(rc, "install_from_fab", rc.install_from_fab)
    monkeypatch.setattr(rc, "pull_task_input", rc.pull_task_input)
    monkeypatch.setattr(rc, "get_load_client_app_fn", lambda *a, **k: lambda *x: flower_loaded)
    trust.install_gate()
    from flwr.common.config import get_project_dir

    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "home"))
    ident = ("feta-release/feta-release-app", "0.1.0", "ab" * 32)
    ours, ping = get_project_dir(*ident), tmp_path / "ping"
    ours.mkdir(parents=True)
    ping.mkdir()
    (ours / "pyproject.toml").write_text((ROOT / "coordinator" / "flower_app" / "pyproject.toml").read_text())
    (ping / "pyproject.toml").write_text((ROOT / "bench" / "ping_app" / "pyproject.toml").read_text())
    load = rc.get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
    monkeypatch.setattr(trust, "_current", {"dir": ours})
    monkeypatch.delenv(channel.ENV_SOCKET, raising=False)
    assert load(*ident) is flower_loaded  # no worker: Flower loads edge.clientapp:app itself
    monkeypatch.setenv(channel.ENV_SOCKET, str(tmp_path / "s"))
    monkeypatch.setenv(channel.ENV_KEY, str(tmp_path / "k"))
    assert load(*ident) is forward.app
    assert load(ident[0], "0.2.0", ident[2]) is flower_loaded  # not the directory the gate checked
    # same place, another component
    (ours / "pyproject.toml").write_text((ping / "pyproject.toml").read_text())
    assert load(*ident) is flower_loaded
    monkeypatch.setattr(trust, "_current", {})  # the gate did not pass this message: never the forwarder
    assert load(*ident) is flower_loaded


def test_no_socket_is_one_clear_line(tmp_path):
    with pytest.raises(channel.WorkerUnavailable, match="no worker socket at .* not running") as e:
        channel.call(tmp_path / "nothing.sock", b"k" * 32, {"kind": "echo"}, [])
    assert "\n" not in str(e.value)


def test_a_key_file_others_can_read_is_refused(tmp_path):
    kf = tmp_path / "k"
    channel.write_key(kf)
    assert len(channel.read_key(kf)) == channel.KEY_BYTES
    os.chmod(kf, 0o644)
    with pytest.raises(channel.WorkerRequestError, match="mode 0600"):
        channel.read_key(kf)
    with pytest.raises(channel.WorkerUnavailable, match="cannot read the worker key"):
        channel.read_key(tmp_path / "missing")


def _raw(echo, frames: list[bytes]) -> dict[str, Any]:
    conn = Client(str(echo.sock), family="AF_UNIX", authkey=echo.key)
    try:
        for f in frames:
            conn.send_bytes(f)
        head, _ = channel.receive(conn, "test reply")
        return head
    finally:
        conn.close()


@pytest.mark.parametrize(
    "frames,why",
    [
        ([b"not json"], "header is not JSON"),
        ([b"[1, 2]"], "not a feta-worker/1 object"),
        ([channel.encode_header({"protocol": "other/9", "frames": 0})], "not a feta-worker/1 object"),
        ([channel.encode_header({"protocol": channel.PROTOCOL, "frames": 99})], "announces 99 frames"),
        ([channel.encode_header({"protocol": channel.PROTOCOL, "frames": True})], "announces True frames"),
        (
            [channel.encode_header({"protocol": channel.PROTOCOL, "frames": 0, "kind": "rm -rf"})],
            "unknown kind",
        ),
    ],
)
def test_a_malformed_request_is_refused_in_one_line(echo, frames, why):
    head = _raw(echo, frames)
    assert head["ok"] is False and why in head["error"] and "\n" not in head["error"]


def test_a_pickled_request_is_never_unpickled(echo, tmp_path):
    """The stdlib channel would unpickle with recv(); the worker only takes bytes and parses JSON."""
    import pickle

    marker = tmp_path / "pwned"

    class Boom:
        def __reduce__(self):  # noqa: ANN204
            return (open, (str(marker), "w"))

    head = _raw(echo, [pickle.dumps(Boom())])
    assert head["ok"] is False and "not JSON" in head["error"]
    assert not marker.exists()


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=300))
def test_any_header_bytes_are_refused_in_one_line_or_parsed(raw):
    try:
        doc = channel.parse_header(raw, "fuzz")
    except channel.WorkerRequestError as exc:
        assert "\n" not in str(exc)
    else:
        assert doc["protocol"] == channel.PROTOCOL


def test_remote_errors_read_as_the_handlers_own():
    exc = remote_error("feta_release.errors.PolicyError", "job x is closed")
    assert f"{type(exc)}:<'{exc}'>" == "<class 'feta_release.errors.PolicyError'>:<'job x is closed'>"
    odd = remote_error("__import__('os').system('x')", "t")
    assert str(type(odd)) == "<class 'edge.forward.WorkerRaised'>"


# -- the real worker, serving one site
# ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("worker")
    fed = make_federation(tmp / "fed")
    site = fed.sites[0]
    state = private_dir(tmp / "state")
    sock, key_file = channel.socket_path(state), state / "worker.key"
    channel.write_key(key_file)
    log = tmp / "worker.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edge.worker",
            "--node-config",
            json.dumps(site.node_config()),
            "--socket",
            str(sock),
            "--key-file",
            str(key_file),
        ],
        cwd=ROOT,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 300
    while not sock.exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    signed, _ = __import__("coordinator.setup", fromlist=["sign_job_file"]).sign_job_file(
        fed, tiny_job(), "job-w"
    )
    yield SimpleNamespace(
        fed=fed,
        site=site,
        sock=sock,
        key_file=key_file,
        proc=proc,
        log=log,
        signed=signed,
        app=ForwardingApp(str(sock), str(key_file)),
    )
    if proc.poll() is None:
        proc.terminate()
        proc.wait(30)


def test_hello_through_the_worker_equals_hello_in_process(served):
    from edge.clientapp import app as in_process

    via_worker = served.app(_msg({"job": served.signed}), _ctx(served.site.node_config()))
    here = in_process(_msg({"job": served.signed}), _ctx(served.site.node_config()))
    assert fm.read_payload(via_worker.content)[0] == fm.read_payload(here.content)[0]
    assert via_worker.metadata.reply_to_message_id != "" and via_worker.metadata.message_type == fm.HELLO
    assert "answered query.hello" in served.log.read_text()


def test_a_refusal_in_the_worker_reaches_flower_as_the_same_error(served):
    with pytest.raises(Exception) as e:
        served.app(_msg({"no": "job"}), _ctx(served.site.node_config()))
    assert str(type(e.value)) == "<class 'feta_release.errors.PolicyError'>"
    # the worker's own refusal line, plus the reference under which its log keeps the detail
    # (edge.public_errors)
    assert re.fullmatch(
        r"request carries no signed job; refused \[site error reference [0-9a-f]{12}\]", str(e.value)
    )


def test_a_request_for_another_node_config_is_refused(served):
    other = {**served.site.node_config(), "data-path": "/etc"}
    with pytest.raises(Exception, match="not the one this worker serves"):
        served.app(_msg({"job": served.signed}), _ctx(other))


def test_garbage_message_frames_are_refused_in_one_line(served):
    key = channel.read_key(served.key_file)
    head, _ = channel.call(
        served.sock, key, {"kind": "message", "message_id": "m"}, [b"\xff\x00garbage", b"\x01"]
    )
    assert head["ok"] is False and "not Flower's encoding" in head["error"] and "\n" not in head["error"]


def test_a_changed_policy_is_noticed_before_the_next_request(served):
    policy = Path(served.site.node_config()["policy-file"])
    good = policy.read_bytes()
    try:
        doc = json.loads(good)
        doc["policy"]["budget"]["lifetime"]["epsilon"] = 1000.0  # edited after signing: the signature breaks
        policy.write_text(json.dumps(doc))
        with pytest.raises(Exception, match="signature|policy") as e:
            served.app(_msg({"job": served.signed}), _ctx(served.site.node_config()))
        assert "PolicyViolation" in str(type(e.value)) or "PolicyError" in str(type(e.value))
    finally:
        policy.write_bytes(good)
    ok = served.app(_msg({"job": served.signed}), _ctx(served.site.node_config()))
    assert fm.read_payload(ok.content)[0]["site_id"] == served.site.site_id
    assert "changed: opening and verifying it again" in served.log.read_text()


def test_sigterm_stops_the_worker_and_a_dead_worker_falls_back_in_process(served, caplog):
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(30) == 0
    assert not served.sock.exists()  # the listener removed its socket
    with caplog.at_level("WARNING", logger="feta.forward"):
        rep = served.app(_msg({"job": served.signed}), _ctx(served.site.node_config()))
    assert fm.read_payload(rep.content)[0]["site_id"] == served.site.site_id
    assert "in this process instead" in caplog.text


# -- node start: companions stop with the node; a dead worker is restarted
# ---------------------------------------------
def _sleeper(tmp_path: Path, name: str):
    from feta_release.federation.procs import ManagedProcess

    return ManagedProcess(
        name,
        [sys.executable, "-c", "import time; time.sleep(600)"],
        dict(os.environ),
        tmp_path / f"{name}.log",
    )


def test_stopping_the_node_stops_its_worker(tmp_path):
    node, worker = _sleeper(tmp_path, "node"), _sleeper(tmp_path, "worker")
    node.companions.append(worker)
    node.stop()
    assert not node.alive() and not worker.alive()


def test_node_start_restarts_a_dead_worker(tmp_path, capsys):
    from edge.launch import keep_worker

    node, worker = _sleeper(tmp_path, "node"), _sleeper(tmp_path, "worker")
    node.companions.append(worker)
    started = []

    def restart():  # noqa: ANN202
        started.append(_sleeper(tmp_path, "worker"))
        return started[-1]

    node.worker_start = restart  # type: ignore[attr-defined]
    try:
        keep_worker(node)
        assert started == []  # alive: left alone
        os.kill(worker.pid, signal.SIGKILL)
        worker.proc.wait(10)
        keep_worker(node)
        assert len(started) == 1 and node.companions == started and started[0].alive()
        assert "restarting it" in capsys.readouterr().out
    finally:
        node.stop()
    assert not started[0].alive()


def test_the_site_stamp_changes_with_every_file_the_site_is_opened_from(tmp_path):
    """What the worker re-checks before each request: policy/keys/secret by content, data and ledger by
    identity."""
    from edge.worker import site_stamp

    files = {
        k: tmp_path / k
        for k in ("policy-file", "trusted-policy-key", "site-key", "data-secret", "ledger-path")
    }
    for p in files.values():
        p.write_bytes(b"v1")
    data = tmp_path / "images"
    data.mkdir()
    (data / "a.png").write_bytes(b"img")
    cfg = {**{k: str(p) for k, p in files.items()}, "data-path": str(data)}
    base = site_stamp(cfg)
    assert site_stamp(cfg) == base
    for key in ("policy-file", "trusted-policy-key", "site-key", "data-secret"):
        files[key].write_bytes(b"v2")
        assert site_stamp(cfg) != base, key
        files[key].write_bytes(b"v1")
        assert site_stamp(cfg) == base, key  # by content: the same bytes again are the same site
    (data / "b.png").write_bytes(b"new image")
    changed = site_stamp(cfg)
    assert changed != base
    os.utime(data / "a.png", ns=(1, 1))  # rewritten in place, size unchanged: its times move
    assert site_stamp(cfg) != changed
    before = site_stamp(cfg)
    replaced = tmp_path / "restored.db"
    replaced.write_bytes(b"v1")
    # a ledger restored from a backup: a new file under the same name
    os.replace(replaced, files["ledger-path"])
    assert site_stamp(cfg) != before


def test_an_edge_package_planted_in_the_nodes_cwd_is_not_imported_by_the_worker(tmp_path, monkeypatch):
    """``python -m edge.worker`` put the current directory first on sys.path; an ``edge/`` package that
    another local user planted where the admin started the node ran as the site account."""
    from edge.launch import NodeSettings, WorkerChannel, start_worker

    shared = tmp_path / "shared"
    (shared / "edge").mkdir(parents=True)
    marker = tmp_path / "HIJACKED"
    (shared / "edge" / "__init__.py").write_text(
        f"import pathlib; pathlib.Path({str(marker)!r}).write_text('x')\n"
    )
    (shared / "edge" / "worker.py").write_text("raise SystemExit(3)\n")
    work = tmp_path / "work"
    work.mkdir()
    s = NodeSettings(
        data=work / "d",
        policy=work / "p",
        trusted_policy_key=work / "t",
        ledger=work / "l",
        site_key=work / "k",
        data_secret=work / "s",
        work_dir=work,
    )
    ch = WorkerChannel(work / "worker.sock", work / "worker.key")
    channel.write_key(ch.key_file)
    monkeypatch.chdir(shared)
    with pytest.raises(Exception):  # noqa: B017 - the real worker refuses these empty settings; either way no hijack
        start_worker(s, ch, dict(os.environ), work, timeout=20).stop()
    assert not marker.exists()
