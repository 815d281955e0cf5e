"""Message payloads shared by the site node and the coordinator (Flower Message API).

A payload is a ``RecordDict`` with up to two records:
  ``"arrays"``: an ``ArrayRecord`` of named numpy arrays (weights, released statistics);
  ``"cfg"``:    a ``ConfigRecord`` whose single ``"json"`` entry holds a canonical JSON document
                (request ids, signed job, events, refusals). One JSON string instead of many
                config entries keeps nested documents (signatures, event lists) intact.

``payload_bytes``/``payload_from_bytes`` use Flower's own wire encoding (protobuf), which is what
the site ledger stores as the recorded answer of a request.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=no-name-in-module

from ..errors import PolicyError
from ..signing import canonical_json, loads_strict

# Message types (ClientApp handlers are registered under these names).
HELLO = "query.hello"
CENTRAL = "query.central"
FREQUENCY = "query.frequency"
TRAIN = "train"
SECAGG = "query.secagg"  # one stage of a secure sum (edge/secure.py)


def make_payload(doc: dict[str, Any], arrays: dict[str, np.ndarray] | None = None) -> RecordDict:
    arrays = {k: np.asarray(v) for k, v in (arrays or {}).items()}
    # Flower's Array does not keep 0-d shapes; name them so read_payload restores scalars exactly.
    scalars = sorted(k for k, v in arrays.items() if v.ndim == 0)
    if scalars:
        doc = {**doc, "_scalars": scalars}
    rd = RecordDict({"cfg": ConfigRecord({"json": canonical_json(doc).decode("utf-8")})})
    if arrays:
        rd["arrays"] = ArrayRecord({k: Array(np.ascontiguousarray(v.reshape(-1) if v.ndim == 0 else v))
                                    for k, v in arrays.items()})
    return rd


def read_payload(rd: RecordDict) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    doc: dict[str, Any] = {}
    if "cfg" in rd.config_records:
        try:  # carries signed jobs and attestations: a duplicated key would be read two ways
            doc = loads_strict(str(rd.config_records["cfg"]["json"]))
        except ValueError as exc:
            raise PolicyError(f"message refused: its JSON is not canonical ({exc}); send each key once") from None
    arrays: dict[str, np.ndarray] = {}
    if "arrays" in rd.array_records:
        arrays = {k: v.numpy() for k, v in rd.array_records["arrays"].items()}
    for k in doc.pop("_scalars", []):
        arrays[k] = arrays[k].reshape(())
    return doc, arrays


def payload_bytes(rd: RecordDict) -> bytes:
    return recorddict_to_proto(rd).SerializeToString(deterministic=True)


def payload_from_bytes(data: bytes) -> RecordDict:
    proto = ProtoRecordDict()
    proto.ParseFromString(data)
    return recorddict_from_proto(proto)


def request_id(job_id: str, phase: str, round_: int = 0) -> str:
    """Deterministic per job/phase/round: a coordinator that asks again after a restart asks for the SAME
    release, which the site's ledger answers from its record instead of charging twice."""
    return f"{job_id}:{phase}:{round_}"
