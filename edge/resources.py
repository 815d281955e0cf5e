"""What one message may make the node allocate: the site policy's ``resources`` caps in the processes that
compute.

The job's own numbers (model size, physical batch, rows per pass) are refused from its config before anything
is built (``feta_release.policy.enforce.check_resources``, the first step of every handler:
``edge.protocol``). Here, around every handler of the site's ClientApp (the warm worker and a per-message
process alike):
  * ``resources.max_message_mb``: a coordinator message larger than the cap is refused before its arrays are
    read (they are copied into numpy, and into the model, only after);
  * ``resources.max_worker_memory_mb``: the process's RLIMIT_DATA (heap and private writable mappings, which
    hold every numpy array and torch tensor): whatever a job gets past the caps fails in this process (the
    charged request then releases nothing, ``edge.protocol``) instead of exhausting the host. Only the soft
    limit is set, so a new policy with a higher cap takes effect without a restart.
"""

from __future__ import annotations

import os
import resource
from typing import Any

from flwr.app import Context, Message, RecordDict

from feta_release.policy.enforce import resource_cap
from feta_release.policy.errors import PolicyViolation

from .runtime_api import ENV_SOCKET
from .site import site_for

MIB = 2**20


def message_bytes(content: RecordDict) -> int:
    """The bytes a message carries: its arrays' buffers and its records' text, read off the records (nothing
    is decoded or copied)."""
    n = sum(len(a.data) for rec in content.array_records.values() for a in rec.values())
    for rec in content.config_records.values():
        for v in rec.values():
            for item in v if isinstance(v, list) else [v]:
                n += len(item) if isinstance(item, (str, bytes)) else 8
    return n


def check_message_size(policy: Any, message: Message) -> None:
    cap = resource_cap(policy, "max_message_mb")
    size = message_bytes(message.content) if message.has_content() else 0
    if size > cap * MIB:
        raise PolicyViolation(
            "resources.max_message_mb",
            f"a {message.metadata.message_type} message of "
            f"{size / MIB:,.1f} MiB > cap {cap:g} MiB; refused before its arrays were read",
            site=policy.site_id,
        )


def limit_memory(policy: Any, device: str = "cpu") -> int | None:
    """Set this process's RLIMIT_DATA soft limit to ``resources.max_worker_memory_mb`` (never above the hard
    limit the node was started under); returns it in bytes, or None when there is none: the policy says 0, or
    the node computes on a GPU (``node start --device auto|cuda``) and the policy does not state the limit
    itself (the CUDA driver's own host mappings have not been measured against the default)."""
    if device != "cpu" and "max_worker_memory_mb" not in policy.resources:
        return None
    mb = int(resource_cap(policy, "max_worker_memory_mb"))
    if mb <= 0:
        return None
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    want = mb * MIB if hard == resource.RLIM_INFINITY else min(mb * MIB, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (want, hard))
    return want


def resources_mod(message: Message, context: Context, call_next: Any) -> Message:
    """Flower mod around every handler: the memory limit (in a node's own processes: those ``node start``
    started, which carry its Runtime API socket in their environment; not a process that hosts the ClientApp
    in-process, as the coordinator's tests and harness do), then the message size, then the handler."""
    site = site_for(context.node_config)
    if os.environ.get(ENV_SOCKET):
        limit_memory(site.policy, site.device)
    check_message_size(site.policy, message)
    return call_next(message, context)  # type: ignore[no-any-return]
