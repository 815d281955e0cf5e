"""The per-message process waited on the worker for a constant hour (``channel.CLIENT_TIMEOUT``), not for
the job's own deadline. A worker hung on a message of a job with a 2-minute round timeout kept that process
(and its Flower task) for an hour after the coordinator had stopped waiting. Now the wait is the signed job's
round timeout plus ``edge.forward.ROUND_MARGIN``, with the constant as a ceiling."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from edge import channel
from edge import forward as fwd
from feta_release.federation import messages as fm
from feta_release.policy.jobs import sign_job
from tests.support.federation import tiny_job
from tests.support.flower import flower_message as _msg
from tests.support.flower import node_context as _ctx


def _job_msg(round_timeout: float) -> Any:
    signed = sign_job(
        tiny_job(federation={"round_timeout": round_timeout}),
        Ed25519PrivateKey.generate(),
        "job-l4",
        ["site-a"],
    )
    return _msg({"job": signed}, fm.HELLO)


@pytest.fixture()
def hung_worker(tmp_path: Path) -> Iterator[tuple[Path, bytes]]:
    """A real channel listener that authenticates its client, takes the request and then never replies."""
    sock, key = tmp_path / "w" / "worker.sock", b"k" * channel.KEY_BYTES
    listener = channel.listen(sock, key, timeout=30.0)
    kept: list[Any] = []

    def take() -> None:
        try:
            kept.append(listener.accept())
        except OSError:
            pass

    t = threading.Thread(target=take, daemon=True)
    t.start()
    yield sock, key
    for c in kept:
        c.close()
    listener.close()


def _timed(fn: Any, seconds: float) -> tuple[str, Any, float] | None:
    box: list[tuple[str, Any, float]] = []
    t0 = time.monotonic()

    def run() -> None:
        try:
            box.append(("ok", fn(), time.monotonic() - t0))
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box.append(("raised", exc, time.monotonic() - t0))

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    return box[0] if box else None


def test_a_hung_worker_call_ends_after_the_jobs_deadline_not_the_ceiling(hung_worker, monkeypatch):
    sock, key = hung_worker
    monkeypatch.setattr(channel, "CLIENT_TIMEOUT", 60.0)  # the ceiling, far above the job's deadline
    monkeypatch.setattr(fwd, "ROUND_MARGIN", 0.3, raising=False)
    got = _timed(lambda: fwd.forward(_job_msg(0.5), _ctx({}), str(sock), key), 20)
    assert got is not None, "the per-message process waits for the ceiling, not for the job's round timeout"
    kind, exc, seconds = got
    assert kind == "raised" and isinstance(exc, channel.WorkerTimeout), got
    assert 0.8 <= seconds < 10, seconds


def test_a_stuck_worker_times_out_at_the_jobs_deadline_before_the_challenge(tmp_path, monkeypatch):
    """A socket that takes the connection and never speaks: the connect/challenge deadline is the job's
    too."""
    sock = tmp_path / "stuck.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(sock))
    srv.listen(4)
    try:
        monkeypatch.setattr(channel, "CLIENT_TIMEOUT", 60.0)
        monkeypatch.setattr(fwd, "ROUND_MARGIN", 0.3, raising=False)
        got = _timed(lambda: fwd.forward(_job_msg(0.5), _ctx({}), str(sock), b"k" * channel.KEY_BYTES), 20)
        assert got is not None and got[0] == "raised" and isinstance(got[1], channel.WorkerUnavailable), got
        assert "within 0.8 s" in str(got[1])
    finally:
        srv.close()


@settings(max_examples=25, deadline=None)
@given(rt=st.floats(min_value=1e-3, max_value=1e6))
def test_the_wait_is_the_round_timeout_plus_the_margin_capped_by_the_ceiling(rt):
    want = min(channel.CLIENT_TIMEOUT, rt + fwd.ROUND_MARGIN)
    assert fwd.reply_timeout(_job_msg(rt)) == pytest.approx(want)


@pytest.mark.parametrize(
    "doc",
    [
        {},
        {"job": "not a job"},
        {"job": {"job": {"config": {}}}},
        {"job": {"job": {"config": {"federation": {"round_timeout": "soon"}}}}},
        {"job": {"job": {"config": {"federation": {"round_timeout": -5}}}}},
        {"job": {"job": {"config": {"federation": {"round_timeout": True}}}}},
    ],
)
def test_a_message_without_a_readable_job_waits_the_ceiling(doc):
    assert fwd.reply_timeout(_msg(doc)) == channel.CLIENT_TIMEOUT


def test_a_huge_round_timeout_waits_the_ceiling_instead_of_raising():
    # An int beyond float range made math.isfinite raise OverflowError out of the forwarder
    doc = {"job": {"job": {"config": {"federation": {"round_timeout": 10**400}}}}}
    assert fwd.reply_timeout(_msg(doc)) == channel.CLIENT_TIMEOUT


def test_a_deeply_nested_job_document_waits_the_ceiling_instead_of_raising():
    # Json.loads of a deeply nested document raises RecursionError
    m = _msg({})
    m.content.config_records["cfg"]["json"] = "[" * 200_000 + "]" * 200_000
    assert fwd.reply_timeout(m) == channel.CLIENT_TIMEOUT
