"""A no-op Flower app: measures the platform's own round trip (bench/bench_federation.py).

The ClientApp imports nothing beyond flwr and numpy and answers at once, so a round's wall time is
Flower's fixed cost: message push, node poll, a fresh ``flwr-clientapp`` process, reply pull.
"""

from __future__ import annotations

import json
import time

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

client = ClientApp()
server = ServerApp()


@client.query("ping")
def ping(msg: Message, context: Context) -> Message:
    return Message(msg.content, reply_to=msg)


@server.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    rounds, floats, out = int(rc["rounds"]), int(rc["payload-floats"]), str(rc["out-file"])
    while not list(grid.get_node_ids()):
        time.sleep(0.5)
    time.sleep(2.0)  # let every node register
    nodes = list(grid.get_node_ids())
    payload = RecordDict({"a": ArrayRecord({"x": Array(np.zeros(max(floats, 1), dtype=np.float32))})})
    times = []
    for r in range(rounds):
        t0 = time.monotonic()
        msgs = [Message(payload, dst_node_id=n, message_type="query.ping", group_id=str(r)) for n in nodes]
        replies = list(grid.send_and_receive(msgs, timeout=300))
        times.append(time.monotonic() - t0)
        if any(rep.has_error() for rep in replies) or len(replies) != len(nodes):
            raise RuntimeError(f"ping round {r}: {len(replies)} replies of {len(nodes)}")
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            json.dump({"nodes": len(nodes), "payload_floats": floats, "round_seconds": times}, fh)
