"""Message payloads carry their arrays packed into one byte array (feta_release/federation/messages.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from feta_release.errors import PolicyError
from feta_release.federation import messages as fm

DTYPES = st.sampled_from(
    ["bool", "int8", "int32", "int64", "uint8", "float16", "float32", "float64", "<U4", "|S3"]
)
ARRAYS = DTYPES.flatmap(
    lambda dt: hnp.arrays(np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
)


@settings(max_examples=150, deadline=None)
@given(arrays=st.dictionaries(st.text(min_size=1, max_size=12), ARRAYS, max_size=6))
def test_arrays_round_trip_exactly_through_the_wire(arrays):
    doc, back = fm.read_payload(fm.payload_from_bytes(fm.payload_bytes(fm.make_payload({"k": 1}, arrays))))
    assert doc == {"k": 1} and set(back) == set(arrays)
    for k, v in arrays.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        assert np.array_equal(back[k], v, equal_nan=v.dtype.kind == "f")


def test_a_model_travels_as_one_array():
    from flwr.app import Message
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    weights = {f"w{i}": np.random.default_rng(i).random((8, 8, 3, 3), dtype=np.float32) for i in range(65)}
    rd = fm.make_payload({"round": 0}, weights)
    assert list(rd.array_records) == [fm.PACKED] and len(rd.array_records[fm.PACKED]) == 1
    assert len(get_all_nested_objects(Message(rd, dst_node_id=1, message_type="train"))) < 10  # unpacked: 134


def _packed(manifest, blob: bytes) -> RecordDict:
    return RecordDict(
        {
            "cfg": ConfigRecord({"json": json.dumps({"_packed": manifest})}),
            fm.PACKED: ArrayRecord({"blob": Array(np.frombuffer(blob, dtype=np.uint8))}),
        }
    )


@pytest.mark.parametrize(
    "manifest,blob,why",
    [
        ([["a", "<f4", [2]]], b"\0" * 4, "runs past the end"),
        ([["a", "<f4", [1]]], b"\0" * 8, "4 bytes left over"),
        ([["a", "|O", [1]]], b"\0" * 8, "allowed dtype"),
        ([["a", "<U0", [1]]], b"\0" * 8, "allowed dtype"),
        ([["a", "<U99999", [1]]], b"\0" * 8, "allowed dtype"),
        ([["a", "<f4", [-1]]], b"\0" * 4, "allowed dtype and a shape"),
        ([["a", "<f4", [1]], ["a", "<f4", [1]]], b"\0" * 8, "not a new name"),
        ([["a", "<f4", [True]]], b"\0" * 4, "allowed dtype and a shape"),
        ([["a", "<f4", [2**40, 2**40]]], b"\0" * 4, "runs past the end"),
        ({"a": 1}, b"", "no array list"),
    ],
)
def test_a_malformed_packing_is_refused_in_one_line(manifest, blob, why):
    with pytest.raises(PolicyError, match="packed arrays are malformed") as e:
        fm.read_payload(_packed(manifest, blob))
    assert why in str(e.value) and "\n" not in str(e.value)


def test_a_manifest_without_its_bytes_is_refused():
    rd = RecordDict({"cfg": ConfigRecord({"json": json.dumps({"_packed": [["a", "<f4", [1]]]})})})
    with pytest.raises(PolicyError, match="missing"):
        fm.read_payload(rd)


def test_payloads_recorded_before_packing_still_read():
    """A ledger's recorded answers from before packing (an ``arrays`` record) replay as they were."""
    old = RecordDict(
        {
            "cfg": ConfigRecord({"json": json.dumps({"_scalars": ["s"], "k": 2})}),
            "arrays": ArrayRecord(
                {"w": Array(np.arange(6, dtype=np.float32).reshape(2, 3)), "s": Array(np.array([1.5]))}
            ),
        }
    )
    doc, arrays = fm.read_payload(fm.payload_from_bytes(fm.payload_bytes(old)))
    assert doc == {"k": 2} and arrays["s"].shape == () and arrays["w"].shape == (2, 3)
