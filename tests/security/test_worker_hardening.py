"""Review finding W3: what a site's error replies may say, and deadlines on the worker's local channel.

Every error reply reaches the coordinator: it must name no local path and carry no internal exception text,
only a protocol refusal's one line (or one generic line) and a reference the site's administrator finds in the
node's LOCAL log with the detail. The channel must not let one hung client block the one-at-a-time worker, and
a stuck worker must not hang the per-message process for ever (it falls back in process, as for a dead
one)."""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from flwr.app import Message
from hypothesis import given, settings
from hypothesis import strategies as st

from edge import channel, public_errors
from edge.forward import ForwardingApp
from edge.site import forget_sites
from feta_release.errors import PolicyError
from feta_release.federation import messages as fm
from feta_release.files import private_dir
from tests.support.federation import make_federation, stop_serving, tiny_job
from tests.support.flower import flower_message as _msg
from tests.support.flower import node_context as _ctx

REF = re.compile(r"reference ([0-9a-f]{12})")


def _reason(exc: BaseException) -> str:
    """The reason Flower's runtime sends to the coordinator for ``exc`` (run_clientapp: type and text)."""
    return str(type(exc)) + ":<'" + str(exc) + "'>"


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("harden")
    f = make_federation(tmp / "fed")
    signed, _ = __import__("coordinator.setup", fromlist=["sign_job_file"]).sign_job_file(
        f, tiny_job(), "job-h"
    )
    return SimpleNamespace(fed=f, site=f.sites[0], signed=signed, tmp=tmp)


def _local_paths(node_config: dict[str, Any]) -> list[str]:
    return [str(v) for k, v in node_config.items() if k in public_errors.PATH_KEYS] + [str(Path.home())]


# -- error replies
# -----------------------------------------------------------------------------------------------------
def test_a_refusal_naming_a_local_file_leaves_without_the_path_and_with_a_reference(fed, caplog, tmp_path):
    """A policy file that fails verification: the refusal (a PolicyError naming the file) reaches the
    coordinator with its rule but not the site's path; the path and the same reference are in the node's local
    log."""
    cfg = dict(fed.site.node_config())
    bad = tmp_path / "hospital-secret-dir" / "policy.signed.json"
    bad.parent.mkdir()
    bad.write_text("{not a policy")
    cfg["policy-file"] = str(bad)
    from edge.clientapp import app

    with caplog.at_level(logging.ERROR, logger="feta.node"), pytest.raises(Exception) as e:
        app(_msg({"job": fed.signed}), _ctx(cfg))
    reason = _reason(e.value)
    assert "hospital-secret-dir" not in reason and str(tmp_path) not in reason
    assert public_errors.PLACEHOLDER in reason or "policy" in reason.lower()
    ref = REF.search(reason)
    assert ref, reason
    assert ref.group(1) in caplog.text and "hospital-secret-dir" in caplog.text  # the detail stays local


def test_an_internal_error_leaves_as_one_generic_line(fed, caplog, monkeypatch):
    """An exception that is not one of the protocol's refusals (a bug, an OSError, torch) can carry anything,
    image values included: only a fixed line and the reference leave."""
    import edge.clientapp as ca

    secret = "pixel 0.73125 of image 17 at /srv/hospital/data.npz"

    def broken(node_config: dict[str, Any]) -> Any:
        raise RuntimeError(secret)

    monkeypatch.setattr(ca, "site_for", broken)
    with caplog.at_level(logging.ERROR, logger="feta.node"), pytest.raises(Exception) as e:
        ca.app(_msg({"job": fed.signed}), _ctx(fed.site.node_config()))
    reason = _reason(e.value)
    assert "0.73125" not in reason and "/srv" not in reason and "RuntimeError" not in reason
    assert isinstance(e.value, public_errors.SiteFailure) and "\n" not in str(e.value)
    ref = REF.search(reason)
    assert ref and ref.group(1) in caplog.text and secret in caplog.text


def test_a_protocol_refusal_keeps_its_type_and_rule(fed):
    from edge.clientapp import app

    with pytest.raises(PolicyError) as e:  # callers in the process still catch it by type
        app(_msg({"no": "job"}), _ctx(fed.site.node_config()))
    assert str(e.value).startswith("request carries no signed job; refused [site error reference ")


def test_the_workers_error_reply_names_no_local_path(fed, caplog):
    from edge.worker import error_reply

    cfg = fed.site.node_config()
    exc = PolicyError(f"{cfg['policy-file']}: expired on 2020-01-01; ask the administrator for a new policy")
    with caplog.at_level(logging.ERROR, logger="feta.node"):
        out = error_reply(exc, cfg)
    assert out["ok"] is False and out["error_type"] == "feta_release.errors.PolicyError"
    assert cfg["policy-file"] not in out["error"] and "expired on 2020-01-01" in out["error"]
    assert REF.search(out["error"]).group(1) in caplog.text  # type: ignore[union-attr]


def test_a_channel_failure_in_the_per_message_process_names_no_local_path(fed, tmp_path):
    """The forwarder's own refusals (a key file others can read) named the key file's path."""
    kf = tmp_path / "node-work" / "worker.key"
    kf.parent.mkdir()
    channel.write_key(kf)
    os.chmod(kf, 0o644)
    app = ForwardingApp(str(tmp_path / "w.sock"), str(kf))
    with pytest.raises(Exception) as e:
        app(_msg({"job": fed.signed}), _ctx(fed.site.node_config()))
    reason = _reason(e.value)
    assert "mode 0600" in reason and "node-work" not in reason and str(tmp_path) not in reason
    assert REF.search(reason)


@settings(max_examples=200, deadline=None)
@given(
    head=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40),
    parts=st.lists(
        st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789._-", min_size=1, max_size=12),
        min_size=1,
        max_size=5,
    ),
    tail=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40),
)
def test_redact_removes_any_absolute_path(head, parts, tail):
    path = "/" + "/".join(parts)
    text = f"{head} {path} {tail}"
    out = public_errors.redact(text)
    assert path not in out.split() and f" {path} " not in f" {out} "


def test_redact_keeps_ratios_and_words():
    line = "sigma/sqrt(n) and q = 64/1000 and/or batch / N: refused (rule budget.per_job)"
    assert public_errors.redact(line) == line


def test_a_data_check_refusal_leaves_without_the_sites_counts(caplog):
    """A ``DataError`` is about the site's own images and its text may state their exact count or
    shape; it leaves with its type and a generic line, the detail stays in the local log."""
    from feta_release.errors import DataError

    exc = DataError("images.shape (1333, 1, 28, 28) does not match labels (1331,): 2 NaN images")
    with caplog.at_level("ERROR", logger="feta.node"):
        out = public_errors.public_error(exc)
    assert isinstance(out, DataError)
    assert not any(c in str(out) for c in ("1333", "1331", "NaN")) and "site error reference" in str(out)
    assert "1333" in caplog.text


# -- channel deadlines
# ---------------------------------------------------------------------------------------------------
class _Echo:
    def handle(self, doc: dict[str, Any], frames: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        return {"ok": True}, [f[::-1] for f in frames]


@pytest.fixture()
def short_worker(tmp_path, monkeypatch):
    """An echo worker whose clients get 0.5 s per read/write (SERVE_TIMEOUT is read when the socket is
    bound)."""
    from edge.worker import _Stop, serve

    monkeypatch.setattr(channel, "SERVE_TIMEOUT", 0.5, raising=False)
    state = private_dir(tmp_path / "w")
    sock, key = channel.socket_path(state), channel.write_key(state / "worker.key")
    listener = channel.listen(sock, key)
    stop = _Stop()
    stop.busy = True
    t = threading.Thread(target=serve, args=(listener, _Echo(), stop), daemon=True)
    t.start()
    yield SimpleNamespace(sock=sock, key=key)
    stop_serving(stop, sock, t, listener)


def _in_thread(fn: Any, seconds: float) -> Any:
    """``fn()``'s result or exception, or None when it did not return within ``seconds`` (it hangs)."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box.append(("raised", exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return box[0] if box else None


def test_a_client_hung_in_the_challenge_does_not_block_the_worker(short_worker):
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hung.connect(str(short_worker.sock))  # connects, never answers the challenge
    try:
        time.sleep(0.2)  # the worker has accepted it and waits for its answer
        got = _in_thread(
            lambda: channel.call(short_worker.sock, short_worker.key, {"kind": "echo"}, [b"ab"]), 20
        )
        assert got is not None, "the worker is still blocked by the hung client"
        assert got[0] == "ok" and got[1][1] == [b"ba"]
    finally:
        hung.close()


def test_a_client_hung_after_the_challenge_does_not_block_the_worker(short_worker):
    from multiprocessing.connection import answer_challenge, deliver_challenge

    conn = channel._dial(short_worker.sock, 5.0)
    answer_challenge(conn, short_worker.key)
    deliver_challenge(conn, short_worker.key)  # authenticated, then it sends no request
    try:
        got = _in_thread(
            lambda: channel.call(short_worker.sock, short_worker.key, {"kind": "echo"}, [b"xy"]), 20
        )
        assert got is not None and got[0] == "ok" and got[1][1] == [b"yx"]
    finally:
        conn.close()


@pytest.fixture()
def stuck_worker(tmp_path):
    """A socket that takes connections and then never speaks (a worker stuck in a request)."""
    sock = tmp_path / "stuck.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(sock))
    srv.listen(8)
    kept: list[socket.socket] = []
    stop = threading.Event()

    def take() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                kept.append(srv.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=take, daemon=True)
    t.start()
    yield sock
    stop.set()
    t.join(5)
    for c in kept:
        c.close()
    srv.close()


def test_a_stuck_worker_is_a_clear_local_error_not_a_hang(stuck_worker, monkeypatch):
    monkeypatch.setattr(channel, "CLIENT_TIMEOUT", 0.5, raising=False)
    got = _in_thread(lambda: channel.call(stuck_worker, b"k" * channel.KEY_BYTES, {"kind": "echo"}, []), 20)
    assert got is not None, "the client hangs on a stuck worker"
    assert got[0] == "raised" and isinstance(got[1], channel.WorkerUnavailable)
    assert "did not answer the channel's challenge within 0.5 s" in str(got[1]) and "\n" not in str(got[1])


def test_a_stuck_worker_falls_back_in_process(fed, stuck_worker, monkeypatch, caplog):
    monkeypatch.setattr(channel, "CLIENT_TIMEOUT", 0.5, raising=False)
    kf = fed.tmp / "stuck.key"
    if not kf.exists():
        channel.write_key(kf)
    app = ForwardingApp(str(stuck_worker), str(kf))

    def ask() -> Message:
        forget_sites()  # the site is opened in this thread (its SQLite connection is per thread)
        return app(_msg({"job": fed.signed}), _ctx(fed.site.node_config()))

    with caplog.at_level(logging.WARNING, logger="feta.forward"):
        got = _in_thread(ask, 240)
    assert got is not None and got[0] == "ok", got
    assert fm.read_payload(got[1].content)[0]["site_id"] == fed.site.site_id
    assert "in this process instead" in caplog.text


# -- the worker's per-request staleness check
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("n_files", [5, 13, 19])
def test_the_per_request_data_check_stats_a_public_number_of_entries(tmp_path, monkeypatch, n_files):
    """Before every request the worker stats every file of a folder dataset (~0.1 ms each): unpadded, each
    reply's latency timed the exact file count. With the public size known, the entries checked are
    ``public_rows``."""
    # site_stamp and its _file_id live there (moved from edge.worker: the site cache keys on it)
    import edge.site_cache as w

    data = tmp_path / "data" / "class0"
    data.mkdir(parents=True)
    for i in range(n_files):
        (data / f"{i}.png").write_bytes(b"x")
    stats: list[Path] = []
    real = w._file_id

    def counted(p: Path) -> list[int]:
        stats.append(p)
        return real(p)

    monkeypatch.setattr(w, "_file_id", counted)
    cfg = {"data-path": str(tmp_path / "data")}
    base = w.site_stamp(cfg, 20)
    under = [p for p in stats if str(p).startswith(str(tmp_path / "data"))]
    assert len(under) == 1 + 20  # the folder itself + 20 entries (n_files + 1 for the class folder, padded)
    assert base == w.site_stamp(cfg, 20) and base == w.site_stamp(cfg)  # padding never changes the stamp
