"""The coordinator's public numbers of a site: its size (from its signed policy) and its FedAvg weight.

A site's privacy events are planned by ``feta_release.planning.stage_events`` (the one planner the
single-site run, the coordinator and every node share); this module only reads sizes.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import PrivacyError


def public_size(policy: Any) -> int:
    """A site's PUBLIC size, fixed by its signed policy (never a number from a reply).

    The nominal size when the policy declares one, else the policy's dataset size.
    """
    for attr in ("public_size", "nominal_size"):
        value = getattr(policy, attr, None)
        if value is not None:
            return int(value)
    return int(policy.dataset_size)


def fedavg_weights(sizes: dict[str, int]) -> dict[str, float]:
    """FedAvg weights from each answering site's PUBLIC dataset size."""
    total = sum(sizes.values())
    if total <= 0 or any(s <= 0 or not math.isfinite(s) for s in sizes.values()):
        raise PrivacyError(f"FedAvg needs positive public sizes, got {sizes}")
    return {k: v / total for k, v in sizes.items()}
