"""The coordinator's public numbers of a site: its size (from its signed policy) and its FedAvg weight.

A site's privacy events are planned by ``feta_release.planning.stage_events`` (the one planner the
single-site run, the coordinator and every node share); this module only reads sizes.
"""

from __future__ import annotations

import math
from typing import Any

from ..accounting import event_from_dict
from ..errors import FetaError, PolicyError, PrivacyError


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


def _key(e: Any) -> tuple[Any, ...]:
    d = e.to_dict()
    return tuple(sorted((k, round(v, 9) if isinstance(v, float) else v) for k, v in d.items()))


def check_requested(asked: Any, own: Any, site_id: str) -> None:
    """The coordinator's planned event for a request (``asked``: its dict, sent with the request; None when it
    sent none) must be the event this site planned from its OWN signed policy (``own``), unit included: a
    coordinator that plans a patient-level site as image-level (or with another q or sigma) is refused before
    anything is charged. The site never uses the coordinator's numbers: it releases with its own plan or not
    at all."""
    if asked is None:
        return
    try:
        ev = event_from_dict(asked)
    except FetaError as exc:
        raise PolicyError(
            f"the coordinator's planned event for this request is malformed ({exc}); refused"
        ) from None
    if _key(ev) != _key(own):
        raise PolicyError(
            f"the coordinator planned {ev.to_dict()} for this request but site {site_id}'s signed policy "
            f"gives {own.to_dict()} (unit of privacy, q or sigma differ); refused before any charge: the "
            "coordinator must plan each site from its signed policy (dataset.privacy_unit, patients)"
        )
