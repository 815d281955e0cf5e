"""A site's warm worker: loads the site once and answers the node's messages, one at a time.

Flower 1.42 starts a fresh ``flwr-clientapp`` process for every message; importing torch, opening the site
(verifying its signed policy, the data's keyed commitment, the ledger's chain) and rebuilding the model in
each cost most of a short round. ``feta-release node start`` therefore also starts this process
(``python -m edge.worker``); the per-message process keeps Flower's FAB gate (``edge.trust``) and then hands
the message, as Flower delivered it, over the authenticated local channel (``edge.channel``) to this worker,
which runs the SAME ClientApp (``edge.clientapp.app``: every handler and ``edge.protocol.release`` unchanged)
and sends the reply back.

Why it stays as safe as a fresh process per message:
  * requests are served one at a time (one accept loop, no threads): the ledger has a single writer here, and
    SQLite's locking still guards it against anything else (a fallback in-process handler, ``node status``);
  * before every request the site's files are checked (``site_stamp``): the signed policy, trusted key, site
    key and data secret by their sha256, the data and the ledger by their file identity and times. Any change
    drops the cached site and opens it again, which re-verifies everything as a fresh process would; an
    unchanged policy is re-checked against the clock (``not_before``/``expires``);
  * the worker serves only the node config it was started with: a request naming another is refused.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from types import FrameType
from typing import Any

from flwr.app import Message
from flwr.common.serde import context_from_proto, context_to_proto, message_from_proto
from flwr.proto.message_pb2 import Context as ProtoContext  # pylint: disable=no-name-in-module
from flwr.proto.message_pb2 import Message as ProtoMessage  # pylint: disable=no-name-in-module
from flwr.supercore.task_identity import TaskIdentity
from google.protobuf.message import DecodeError

from feta_release.allocator import keep_freed_pages
from feta_release.federation import messages as fm
from feta_release.policy.document import check_validity

from . import channel, clientapp, resources
from .public_errors import public_error
from .site import CFG_POLICY, forget_sites, site_for
from .site_cache import (
    site_stamp,  # the per-request check of the site's files (moved there: the cache keys on it)
)

log = logging.getLogger("feta.worker")


class Worker:
    """The site's ClientApp, kept warm; ``handle`` answers one channel request."""

    def __init__(self, node_config: dict[str, Any]) -> None:
        self.node_config = dict(node_config)
        self._stamp: str | None = None
        self._n_public: int | None = None
        self.app = clientapp.app  # torch, the models and every handler: imported once, in this process

    def fresh_site(self) -> Any:
        """The cached site if nothing it was opened from changed (policy re-checked against the clock), else a
        newly opened and verified one."""
        stamp = site_stamp(self.node_config, self._n_public)
        if stamp != self._stamp:
            if self._stamp is not None:
                log.info("the site's policy, keys, data or ledger changed: opening and verifying it again")
            forget_sites()
            self._stamp = None
            site = site_for(self.node_config)  # verifies as Site.open always does; raises on any problem
            # Kept only if nothing changed while it was opened (opening may itself create the ledger):
            # otherwise the next request opens it again rather than trust a site read from half-changed files.
            self._stamp = stamp if site_stamp(self.node_config, self._n_public) == stamp else None
            self._n_public = int(site.n_public)  # public (the signed policy's): pads the next checks' work
            return site
        site = site_for(self.node_config)
        check_validity(site.policy, source=f"{self.node_config[CFG_POLICY]}")
        return site

    def handle(self, doc: dict[str, Any], frames: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        kind = doc.get("kind")
        if kind == "ping":
            return {"ok": True, "pid": os.getpid(), "site_id": self.fresh_site().site_id}, []
        if kind != "message":
            raise channel.WorkerRequestError(
                f"worker request: unknown kind {kind!r} (expected 'message' or 'ping'); refused"
            )
        message, context = _parse_message(doc, frames)
        if context.node_config != self.node_config:
            raise channel.WorkerRequestError(
                "worker request: its node config is not the one this worker serves; "
                "refused (restart the node so both come from the same settings)"
            )
        TaskIdentity.run_id, TaskIdentity.node_id = context.run_id, context.node_id
        TaskIdentity.task_id = int(doc.get("task_id") or 0)
        self.fresh_site()
        t0 = time.perf_counter()
        reply = self.app(message, context)
        # the message type and seconds stay in the site's own log (seconds track the realised batch size)
        age = doc.get("process_age")
        log.info(
            "answered %s in %.2f s (the per-message process was %s s old when it handed the message over)",
            message.metadata.message_type,
            time.perf_counter() - t0,
            age if isinstance(age, (int, float)) else "?",
        )
        if not reply.has_content():
            raise channel.WorkerRequestError(
                f"the ClientApp answered {message.metadata.message_type} with no content"
            )
        return {"ok": True}, [fm.payload_bytes(reply.content), context_to_proto(context).SerializeToString()]


def _parse_message(doc: dict[str, Any], frames: list[bytes]) -> tuple[Message, Any]:
    """The Message and Context as Flower delivered them (protobuf, parsed as data), or a one-line refusal."""
    mid = doc.get("message_id")
    if len(frames) != 2 or not isinstance(mid, str) or len(mid) > 256:
        raise channel.WorkerRequestError(
            "worker request: expected a message id, the message and its context; refused"
        )
    try:
        pm, pc = ProtoMessage(), ProtoContext()
        pm.ParseFromString(frames[0])
        pc.ParseFromString(frames[1])
        message, context = message_from_proto(pm), context_from_proto(pc)
    except (DecodeError, ValueError, TypeError) as exc:
        raise channel.WorkerRequestError(
            f"worker request: the message or context is not Flower's encoding ({type(exc).__name__}); refused"
        ) from None
    if not message.has_content():
        raise channel.WorkerRequestError("worker request: the message carries no content; refused")
    message.metadata.__dict__["_message_id"] = mid  # not part of the encoding (Flower sets it the same way)
    return message, context


def error_reply(exc: BaseException, node_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """What Flower's runtime would have put in the error reply (type and text), as ``edge.public_errors`` lets
    it leave the site: no local path, no internal text; the detail goes to this worker's log under a
    reference."""
    pub = public_error(exc, node_config, where="worker request")
    return {"ok": False, "error_type": f"{type(pub).__module__}.{type(pub).__qualname__}", "error": str(pub)}


def serve_one(conn: Connection, worker: Worker) -> None:
    """Answer one request on an authenticated connection. Failures go back as an error reply."""
    try:
        doc, frames = channel.receive(conn, "worker request", max_frames=2)
        out, rest = worker.handle(doc, frames)
    except (channel.WorkerUnavailable, channel.WorkerTimeout) as exc:  # the client went away or hung: drop it
        log.warning("%s", exc)
        return
    except Exception as exc:  # noqa: BLE001 - the handler's refusal or failure, as flwr-clientapp would report it
        out, rest = error_reply(exc, getattr(worker, "node_config", None)), []
    try:
        channel.send(
            conn, [channel.encode_header({**out, "protocol": channel.PROTOCOL, "frames": len(rest)}), *rest]
        )
    except (OSError, channel.WorkerTimeout) as exc:
        log.warning("could not send the reply (%s): the per-message ClientApp went away or hung", exc)


class _Stop:
    """SIGTERM/SIGINT: stop at once while idle, or after the request in hand (a charged request is finished
    and recorded rather than cut off between its charge and its record)."""

    def __init__(self) -> None:
        self.busy = False
        self.requested = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        if not self.busy:
            raise SystemExit(0)


def serve(listener: Listener, worker: Worker, stop: _Stop) -> None:
    while not stop.requested:
        try:
            conn = listener.accept()  # edge.channel.TimedListener: the challenge has a deadline
        except SystemExit:
            raise
        except Exception as exc:  # noqa: BLE001 - a wrong key, a broken or hung handshake: refuse that client, go on
            log.warning("refused a connection on the worker channel: %s (%s)", type(exc).__name__, exc)
            continue
        stop.busy = True
        try:
            serve_one(conn, worker)
        finally:
            conn.close()
            stop.busy = False


def main(argv: list[str] | None = None) -> int:
    # the site's rounds reuse the last step's pages, under the policy's data limit (feta_release.allocator)
    keep_freed_pages(under_data_limit=True)
    ap = argparse.ArgumentParser(prog="python -m edge.worker", description=__doc__.split("\n")[0])
    ap.add_argument("--node-config", required=True, help="the node's config as a JSON object")
    ap.add_argument("--socket", required=True, type=Path)
    ap.add_argument("--key-file", required=True, type=Path)
    a = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr
    )
    stop = _Stop()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    worker = Worker(json.loads(a.node_config))
    site = worker.fresh_site()  # fail at start, in the node's log, rather than at the first message
    # the policy's memory limit before the first message (each message sets it again: a new policy may change
    # it)
    limit = resources.limit_memory(site.policy, site.device)
    clientapp.site_device(site)  # likewise `node start --device cuda` where this process sees no GPU
    listener = channel.listen(a.socket, channel.read_key(a.key_file))
    log.info(
        "worker for site %s ready on %s (pid %d, memory limit %s)",
        site.site_id,
        a.socket,
        os.getpid(),
        "none" if limit is None else f"{limit >> 20} MiB",
    )
    try:
        serve(listener, worker, stop)
    finally:
        listener.close()  # also removes the socket file
    return 0


if __name__ == "__main__":
    sys.exit(main())
