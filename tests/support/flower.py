"""Flower messages and contexts as the per-message ClientApp receives them, built in-process."""

from __future__ import annotations

import uuid
from typing import Any

from flwr.app import Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from feta_release.federation import messages as fm


def flower_message(doc: dict[str, Any], mtype: str = fm.HELLO) -> Message:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 0, 1
    m = Message(fm.make_payload(doc), dst_node_id=100, message_type=mtype, group_id="g")
    m.metadata.__dict__["_message_id"] = uuid.uuid4().hex
    return m


def node_context(node_config: dict[str, Any]) -> Context:
    return Context(run_id=7, node_id=100, node_config=dict(node_config), state=RecordDict(), run_config={})
