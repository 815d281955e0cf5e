"""Message payloads shared by the site node and the coordinator (Flower Message API).

A payload is a ``RecordDict`` with up to two records:
  ``"packed"``: an ``ArrayRecord`` holding ONE flat byte array: the named numpy arrays (weights, released
                statistics) one after another, as the JSON's ``"_packed"`` list of [name, dtype, shape] says
                (payloads recorded before packing hold an ``"arrays"`` record of the arrays themselves);
  ``"cfg"``:    a ``ConfigRecord`` whose single ``"json"`` entry holds a canonical JSON document
                (request ids, signed job, events, refusals). One JSON string instead of many
                config entries keeps nested documents (signatures, event lists) intact.

``payload_bytes``/``payload_from_bytes`` use Flower's own wire encoding (protobuf), which is what
the site ledger stores as the recorded answer of a request.
"""

from __future__ import annotations

import re
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
SELECTION = "query.selection"  # the semantic selection query of public pretraining (edge.clientapp.selection)
TRAIN = "train"
SECAGG = "query.secagg"  # one stage of a secure sum (edge/secure.py)


# Arrays travel packed into ONE byte array: Flower 1.42 moves every Array of a message as its own objects, one
# request each at every hop (SuperLink, SuperNode, ClientApp, both ways), so a model's 65 weight tensors cost
# ~134 objects per message; packed, a DP-SGD round moves a handful (bench/bench_round.py).
PACKED = "packed"
_DTYPES = frozenset(
    np.dtype(t).str
    for t in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
)
_MAX_DIMS = 32
# fixed-width text (e.g. a release's "kind" label), <= 9,999 chars
_TEXT = re.compile(r"(<U|\|S)([1-9][0-9]{0,3})")


def _sendable(dtype: Any) -> bool:
    """Numbers, booleans and fixed-width text: dtypes whose bytes are plain values (never objects to
    unpickle)."""
    return isinstance(dtype, str) and (dtype in _DTYPES or _TEXT.fullmatch(dtype) is not None)


def make_payload(doc: dict[str, Any], arrays: dict[str, np.ndarray] | None = None) -> RecordDict:
    rd = RecordDict()
    if arrays:
        parts = [(k, np.asarray(arrays[k])) for k in sorted(arrays)]  # tobytes() below is C order, 0-d kept
        for k, v in parts:
            if not _sendable(v.dtype.str):
                raise ValueError(
                    f"array {k!r}: dtype {v.dtype} cannot be sent (numbers, booleans, fixed-width text)"
                )
        doc = {**doc, "_packed": [[k, v.dtype.str, list(v.shape)] for k, v in parts]}
        blob = np.frombuffer(b"".join(v.tobytes() for _, v in parts), dtype=np.uint8)
        rd[PACKED] = ArrayRecord({"blob": Array(blob)})
    rd["cfg"] = ConfigRecord({"json": canonical_json(doc).decode("utf-8")})
    return rd


def _unpack(manifest: Any, blob: np.ndarray) -> dict[str, np.ndarray]:
    """The named arrays of a packed payload; refuses (one line) a manifest that does not describe the bytes
    exactly. The manifest is the sender's: every name, dtype and shape is checked before a byte is read."""

    def bad(why: str) -> PolicyError:
        return PolicyError(f"message refused: its packed arrays are malformed ({why})")

    if not isinstance(manifest, list) or blob.dtype != np.uint8 or blob.ndim != 1:
        raise bad("no array list, or the bytes are not one flat uint8 array")
    data, out, offset = blob.tobytes(), {}, 0
    for entry in manifest:
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and isinstance(entry[0], str)
            and entry[0] not in out
            and _sendable(entry[1])
            and isinstance(entry[2], list)
            and len(entry[2]) <= _MAX_DIMS
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry[2])
        ):
            raise bad(f"entry {str(entry)[:80]} is not a new name, an allowed dtype and a shape")
        name, dtype, shape = entry[0], np.dtype(entry[1]), entry[2]
        size = int(np.prod(shape, dtype=object)) * dtype.itemsize
        if offset + size > len(data):
            raise bad(f"array {name!r} runs past the end of the bytes")
        out[name] = (
            np.frombuffer(data, dtype=dtype, count=size // dtype.itemsize, offset=offset)
            .reshape(shape)
            .copy()
        )
        offset += size
    if offset != len(data):
        raise bad(f"{len(data) - offset} bytes left over after the last array")
    return out


def read_payload(rd: RecordDict) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    doc: dict[str, Any] = {}
    if "cfg" in rd.config_records:
        try:  # carries signed jobs and attestations: a duplicated key would be read two ways
            doc = loads_strict(str(rd.config_records["cfg"]["json"]))
        except ValueError as exc:
            raise PolicyError(
                f"message refused: its JSON is not canonical ({exc}); send each key once"
            ) from None
    if not isinstance(doc, dict):
        raise PolicyError("message refused: its JSON is not an object")
    arrays: dict[str, np.ndarray] = {}
    if PACKED in rd.array_records or "_packed" in doc:
        if PACKED not in rd.array_records or "blob" not in rd.array_records[PACKED]:
            raise PolicyError(
                "message refused: its packed arrays are malformed (the list or the bytes are missing)"
            )
        arrays = _unpack(doc.pop("_packed", None), rd.array_records[PACKED]["blob"].numpy())
    if "arrays" in rd.array_records:  # the unpacked form (answers recorded in a ledger before packing)
        arrays.update({k: v.numpy() for k, v in rd.array_records["arrays"].items()})
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


# A per-site DP-SGD round carries the coordinator's EMA of the global model beside its weights, and its reply
# the site's EMA continued over the round's steps (docs/architecture.md, "the EMA is per step").
EMA_PREFIX = "ema:"


def with_ema(weights: dict[str, np.ndarray], ema: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays of a round message: the weights under their own names, the EMA under ``ema:<name>``."""
    return {**weights, **{EMA_PREFIX + k: v for k, v in ema.items()}}


def split_ema(arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(weights, EMA) of a round message or reply (:func:`with_ema`'s inverse; its public input left out)."""
    weights = {k: v for k, v in arrays.items() if not k.startswith((EMA_PREFIX, PUBLIC_PREFIX))}
    return weights, {k.removeprefix(EMA_PREFIX): v for k, v in arrays.items() if k.startswith(EMA_PREFIX)}


# With ``[dpsgd] public_batch``, a per-site round also carries the pooled, post-processed central images the
# coordinator warmed up on, as PUBLIC input the site mixes into every step (docs/architecture.md).
PUBLIC_PREFIX = "public:"
PUBLIC_IMAGES, PUBLIC_LABELS = PUBLIC_PREFIX + "images", PUBLIC_PREFIX + "labels"


def with_round_public(
    arrays: dict[str, np.ndarray], central: tuple[np.ndarray, np.ndarray]
) -> dict[str, np.ndarray]:
    """A round message's arrays with the released central images (images in [0, 1], labels) as public
    input."""
    return {**arrays, PUBLIC_IMAGES: np.asarray(central[0]), PUBLIC_LABELS: np.asarray(central[1])}


def round_public(arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray] | None:
    """The public input of a round message (None: it carries none); a half of it is refused."""
    keys = [k for k in arrays if k.startswith(PUBLIC_PREFIX)]
    if not keys:
        return None
    if sorted(keys) != sorted((PUBLIC_IMAGES, PUBLIC_LABELS)):
        raise PolicyError(
            f"round refused: its public input is {sorted(keys)}, not {PUBLIC_IMAGES} and {PUBLIC_LABELS}"
        )
    return arrays[PUBLIC_IMAGES], arrays[PUBLIC_LABELS]
