"""In-process Flower Grid: runs a ServerApp against ClientApps in one process, for fast tests.

Every message and reply goes through Flower's wire encoding (protobuf) both ways, and the task
identity is set as the real runtimes set it, so handlers see what they would see behind a
SuperNode. Faults are injected per node: ``down`` (never answers: the coordinator's timeout path)
and ``fail_on`` (a callable deciding, per message, whether the node dies instead of answering).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.proto.node_pb2 import NodeInfo
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity


def _wire(msg: Message) -> Message:
    """Round-trip through the protobuf encoding (what crosses the network), keeping the id."""
    mid = msg.metadata.message_id
    out = message_from_proto(message_to_proto(msg))
    out.metadata.__dict__["_message_id"] = mid
    return out


def _set_identity(run_id: int, node_id: int, task_id: int) -> None:
    TaskIdentity.run_id = run_id
    TaskIdentity.node_id = node_id
    TaskIdentity.task_id = task_id


@dataclass
class HarnessNode:
    app: ClientApp
    node_config: dict[str, bool | float | int | str]
    down: bool = False
    # Returns True when the node should die on this message (it then never replies).
    fail_on: Callable[[Message], bool] | None = None
    name: str = ""  # the name its key is registered under at the SuperLink ("" : no node authentication)
    state: RecordDict = field(default_factory=RecordDict)
    received: list[str] = field(default_factory=list)  # message types seen, for assertions


class InProcessGrid(Grid):
    """A Grid whose nodes are ClientApps in this process."""

    def __init__(self, nodes: dict[int, HarnessNode], run_id: int = 4242) -> None:
        self.nodes = nodes
        self._run = Run.create_empty(run_id)
        self._ids = itertools.count(1)
        self._replies: dict[str, Message] = {}
        self.sent: list[Message] = []
        # The ServerApp creates messages with Message(...), which reads the task identity.
        _set_identity(run_id, SUPERLINK_NODE_ID, 1)

    # -- Grid API ------------------------------------------------------------------------------
    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        _set_identity(self._run.run_id, SUPERLINK_NODE_ID, 1)
        return Message(
            content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl
        )

    def get_node_ids(self) -> Iterable[int]:
        return [nid for nid, n in self.nodes.items() if not n.down]

    def get_nodes(self) -> list[NodeInfo]:
        """Node info as a SuperLink's Runtime API gives it (id and registered name)."""
        return [NodeInfo(node_id=nid, name=n.name) for nid, n in self.nodes.items() if not n.down]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            mid = uuid.uuid4().hex
            msg.metadata.__dict__["_message_id"] = mid
            self.sent.append(msg)
            ids.append(mid)
            reply = self._deliver(msg)
            if reply is not None:
                self._replies[mid] = reply
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(m) for m in message_ids if m in self._replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return list(self.pull_messages(list(self.push_messages(messages))))

    # -- delivery --------------------------------------------------------------------------------
    def _deliver(self, msg: Message) -> Message | None:
        node = self.nodes.get(msg.metadata.dst_node_id)
        if node is None or node.down:
            return None
        node.received.append(msg.metadata.message_type)
        if node.fail_on is not None and node.fail_on(msg):
            node.down = True  # the node dies while handling this message
            return None
        incoming = _wire(msg)
        _set_identity(self._run.run_id, msg.metadata.dst_node_id, next(self._ids))
        ctx = Context(
            run_id=self._run.run_id,
            node_id=msg.metadata.dst_node_id,
            node_config=dict(node.node_config),
            state=node.state,
            run_config={},
        )
        try:
            reply = node.app(incoming, ctx)
        except Exception as exc:  # what flwr-clientapp does: an error reply, the node lives on
            reason = f"{type(exc)}:<'{exc}'>"
            reply = Message(
                Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=incoming
            )
        finally:
            _set_identity(self._run.run_id, SUPERLINK_NODE_ID, 1)
        return _wire(reply)


def run_server_app(app: ServerApp, grid: InProcessGrid, run_config: dict | None = None) -> Context:
    """Run ``app``'s main on ``grid`` as the SuperLink's runtime would."""
    _set_identity(grid.run.run_id, SUPERLINK_NODE_ID, 1)
    ctx = Context(
        run_id=grid.run.run_id,
        node_id=SUPERLINK_NODE_ID,
        node_config={},
        state=RecordDict(),
        run_config=dict(run_config or {}),
    )
    app(grid, ctx)
    return ctx
