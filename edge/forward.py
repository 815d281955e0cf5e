"""The thin per-message ClientApp: hands each message to the site's warm worker (``edge.worker``).

``edge.trust`` loads this in place of ``edge.clientapp:app`` (the component the allowed app bundle names)
AFTER Flower's FAB gate passed, when the node was started with a worker
(``FETA_WORKER_SOCKET``/``FETA_WORKER_KEY`` in the node's own environment). It imports neither torch nor the
handlers: it sends the message and the context, as Flower delivered them, over the authenticated local channel
and returns the worker's reply; the worker runs the same ``edge.clientapp.app``, so every check of the release
protocol runs there, unchanged.

When no worker answers (not running, or it died: ``WorkerUnavailable``) the message is handled here, in this
process, by the same ``edge.clientapp.app`` (slower: torch and the site are loaded for this one message; the
site from the private cache ``node start`` wrote, with work padded to the public size: ``edge.site_cache``).
That is safe even after a worker died mid-request: the ledger refuses to re-run a request that was charged but
not recorded, and answers a recorded one from its record. A channel that answers wrongly (wrong key, malformed
reply) is NOT bypassed: the message fails with that one line.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time

import psutil
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.common.serde import context_from_proto, context_to_proto, message_to_proto
from flwr.proto.message_pb2 import Context as ProtoContext  # pylint: disable=no-name-in-module
from flwr.supercore.task_identity import TaskIdentity

from feta_release.federation import messages as fm

from . import channel
from .public_errors import mark_public, public_error

log = logging.getLogger("feta.forward")

CLIENTAPP_REF = "edge.clientapp:app"  # the component of feta-release's app bundle that the worker serves
# Past the job's round timeout the coordinator has stopped waiting for the reply: this process waits that
# long plus this slack (queueing, clocks), never more than ``channel.CLIENT_TIMEOUT``.
ROUND_MARGIN = 60.0
_QUALNAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class WorkerRaised(Exception):
    """Base of the exceptions re-raised here from the worker's error replies (same type name, same text)."""


def remote_error(type_name: object, text: object) -> Exception:
    """An exception whose ``str(type(e))`` and ``str(e)`` are the worker's, so the error reply Flower builds
    from it (``"<class 'M.T'>:<'text'>"``) reads exactly as if the handler had run in this process. Only the
    name is reused; nothing is imported or evaluated from it."""
    name = (
        str(type_name)
        if isinstance(type_name, str) and _QUALNAME.fullmatch(type_name)
        else "edge.forward.WorkerRaised"
    )
    module, _, qual = name.rpartition(".")
    cls = type(qual, (WorkerRaised,), {"__module__": module or "edge.forward", "__qualname__": qual})
    return mark_public(cls(str(text)))  # the worker made it public (edge.public_errors) before sending it


def _task_id() -> int:
    try:
        return int(TaskIdentity.task_id)
    except RuntimeError:
        return 0


def _process_age() -> float:
    """Seconds since this per-message process started (for the worker's log: Flower's start-up cost per
    message)."""
    try:
        return round(time.time() - psutil.Process().create_time(), 3)
    except psutil.Error:
        return -1.0


def reply_timeout(message: Message) -> float:
    """Seconds this process gives the worker per step of ``message``'s call (connect, challenge, each read and
    write): the job's ``[federation] round_timeout`` (the coordinator waits no longer for any reply of the
    job) plus ``ROUND_MARGIN``, at most ``channel.CLIENT_TIMEOUT``, which is also the answer for a message
    that carries no readable job. Read before the worker checks the job's signature: whatever the value, this
    process waits at most the ceiling, and a shorter wait only gives up on this message's own reply sooner."""
    ceiling = float(channel.CLIENT_TIMEOUT)
    try:
        doc = json.loads(str(message.content.config_records["cfg"]["json"]))
        value = doc["job"]["job"]["config"]["federation"]["round_timeout"]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return ceiling
        seconds = float(value)  # an int beyond float range raises OverflowError: the ceiling, not a crash
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, RecursionError):
        return ceiling
    if not math.isfinite(seconds) or seconds <= 0:
        return ceiling
    return min(ceiling, seconds + ROUND_MARGIN)


def forward(message: Message, context: Context, sock: str, key: bytes) -> Message:
    """One message through the worker; the worker's updated ``context.state`` is copied into ``context``
    (Flower pushes this same object back to the SuperNode)."""
    doc = {
        "kind": "message",
        "message_id": message.metadata.message_id,
        "task_id": _task_id(),
        "process_age": _process_age(),
    }
    frames = [message_to_proto(message).SerializeToString(), context_to_proto(context).SerializeToString()]
    reply, rest = channel.call(sock, key, doc, frames, timeout=reply_timeout(message))
    if reply.get("ok") is not True:
        raise remote_error(reply.get("error_type"), reply.get("error", "the worker failed without a reason"))
    if len(rest) != 2:
        raise channel.WorkerRequestError(
            f"the worker at {sock} replied with {len(rest)} frames, not 2; refused"
        )
    content = fm.payload_from_bytes(rest[0])
    pc = ProtoContext()
    pc.ParseFromString(rest[1])
    context.state = context_from_proto(pc).state
    return Message(content, reply_to=message)


def in_process(message: Message, context: Context) -> Message:
    from .clientapp import app as full_app  # torch and the site, for this message only (the fallback)

    return full_app(message, context)


class ForwardingApp(ClientApp):
    """A ClientApp that forwards every message (any type: the worker's ClientApp routes it).

    The channel is the node's (its environment, set by ``node start``) unless given (tests, the in-process
    grid)."""

    def __init__(self, sock: str | None = None, key_file: str | None = None) -> None:
        super().__init__()
        self._sock, self._key_file = sock, key_file

    def __call__(self, message: Message, context: Context) -> Message:  # type: ignore[override]
        try:
            return self._handle(message, context)
        except Exception as exc:  # noqa: BLE001 - a channel failure names local files: only its public form leaves
            raise public_error(
                exc, context.node_config, where=f"{message.metadata.message_type} request"
            ) from None

    def _handle(self, message: Message, context: Context) -> Message:
        sock = self._sock or os.environ.get(channel.ENV_SOCKET)
        key_file = self._key_file or os.environ.get(channel.ENV_KEY)
        if not sock or not key_file:
            return in_process(message, context)
        try:
            key = channel.read_key(key_file)
            return forward(message, context, sock, key)
        except channel.WorkerUnavailable as exc:
            log.warning(
                "%s; handling %s in this process instead (slower)", exc, message.metadata.message_type
            )
            return in_process(message, context)


app = ForwardingApp()


def worker_configured() -> bool:
    return bool(os.environ.get(channel.ENV_SOCKET) and os.environ.get(channel.ENV_KEY))
