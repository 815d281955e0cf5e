"""``files.read_npz``, the one bounded ``.npz`` reader (release start images, the node's ``.npz`` dataset).

np.load trusts the archive: a 1.2 MB file of deflated zeros took the node's loader to 2.7 GB. Here a header is
read before its data, its shape x dtype must be exactly the bytes its member declares, the total must fit the
caller's limit, a large member may not inflate more than ``NPZ_MAX_RATIO`` times, and each array is read into
a buffer of its declared size: whatever the bytes, the answer is the arrays or one error line.
"""

from __future__ import annotations

import io
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feta_release.errors import DataError
from feta_release.files import NPZ_MAX_RATIO, NPZ_RATIO_FLOOR, read_npz

DTYPES = ["<u1", "<u2", "<i4", "<i8", "<f4", "<f8", "|b1", "<U3"]


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def _header(shape: tuple[int, ...], dtype: str) -> bytes:
    """A version 1.0 .npy header declaring ``shape`` and ``dtype`` (numpy's own writer, no data)."""
    from numpy.lib import format as npy_format

    buf = io.BytesIO()
    npy_format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def _zip(members: dict[str, bytes], compress: int = zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=compress) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


shapes = st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple)


@settings(max_examples=150, deadline=None)
@given(
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    fortran=st.booleans(),
    compressed=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_plain_array_round_trips_exactly(shape, dtype, fortran, compressed, seed) -> None:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 200, size=shape).astype(dtype)
    if fortran:
        arr = np.asfortranarray(arr)
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, x=arr)
    got = read_npz(buf.getvalue(), "x.npz", names=("x",), max_bytes=1 << 20, error=DataError)["x"]
    assert got.dtype == arr.dtype and got.shape == arr.shape and np.array_equal(got, arr)


@settings(max_examples=200, deadline=None)
@given(shape=shapes, dtype=st.sampled_from(DTYPES), data_len=st.integers(0, 400))
def test_a_header_is_accepted_iff_its_shape_and_dtype_are_exactly_the_members_data(
    shape, dtype, data_len
) -> None:
    """The declared shape x dtype against the bytes that follow the header: anything else is refused before
    any buffer of the declared size is made."""
    declared = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    raw = _zip({"x.npy": _header(shape, dtype) + bytes(data_len)})
    if declared == data_len:
        got = read_npz(raw, "x.npz", names=("x",), max_bytes=1 << 20, error=DataError)["x"]
        assert got.shape == shape and got.dtype == np.dtype(dtype)
    else:
        with pytest.raises(DataError, match=r"x\.npz: array 'x' declares shape"):
            read_npz(raw, "x.npz", names=("x",), max_bytes=1 << 20, error=DataError)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_corruption_of_a_valid_file_is_the_arrays_or_one_error(data) -> None:
    buf = io.BytesIO()
    np.savez_compressed(buf, images=np.arange(48, dtype=np.float32).reshape(3, 4, 4), labels=np.arange(3))
    raw = bytearray(buf.getvalue())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(raw)))
    try:
        out = read_npz(bytes(raw[:cut]), "f.npz", names=("images", "labels"), max_bytes=4096, error=DataError)
    except DataError as exc:
        assert str(exc).startswith("f.npz: ") and "\n" not in str(exc)
    else:
        assert sum(a.nbytes for a in out.values()) <= 4096


@settings(max_examples=50, deadline=None)
@given(blob=st.binary(max_size=300))
def test_arbitrary_bytes_are_refused_in_one_line(blob) -> None:
    with pytest.raises(DataError, match=r"^g\.npz: "):
        read_npz(blob, "g.npz", names=("images",), max_bytes=4096, error=DataError)


def test_the_total_is_bounded_before_anything_is_inflated() -> None:
    raw = _zip({"x.npy": _npy(np.zeros(5000, np.float32))}, zipfile.ZIP_DEFLATED)
    with pytest.raises(DataError, match="would take 20,000 bytes, over the limit of 19,999"):
        read_npz(raw, "x.npz", names=("x",), max_bytes=19_999, error=DataError)


def test_a_large_member_that_inflates_like_a_bomb_is_refused() -> None:
    n = NPZ_RATIO_FLOOR // 4 + 1000  # float32 zeros just over the floor: deflate packs them ~1000x
    raw = _zip({"x.npy": _npy(np.zeros(n, np.float32))}, zipfile.ZIP_DEFLATED)
    assert len(raw) * NPZ_MAX_RATIO < n * 4
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match="decompression bomb"):
            read_npz(raw, "x.npz", names=("x",), max_bytes=1 << 30, error=DataError)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


def test_object_arrays_are_never_unpickled() -> None:
    obj = np.empty(2, dtype=object)
    obj[:] = [1, "x"]
    buf = io.BytesIO()
    np.savez(buf, x=obj)
    with pytest.raises(DataError, match="unsupported array contents"):
        read_npz(buf.getvalue(), "o.npz", names=("x",), max_bytes=1 << 20, error=DataError)


def test_the_nodes_npz_loader_refuses_a_deflate_bomb_without_inflating_it(tmp_path: Path) -> None:
    """A 1.2 MB labelled-images file of deflated zeros took ``load_dataset`` to 2.7 GB: refused from its zip
    directory and array headers, in one line, without the arrays being made."""
    from feta_release.data.loading import load_dataset

    n = 60_000  # uint8 28 x 28 zeros: 47 MB inflated from ~50 KB
    path = tmp_path / "bomb.npz"
    np.savez_compressed(path, images=np.zeros((n, 28, 28), np.uint8), labels=np.arange(n) % 2)
    tracemalloc.start()
    try:
        with pytest.raises(
            DataError, match=r"bomb\.npz: array 'images' inflates .* decompression bomb"
        ) as err:
            load_dataset(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "\n" not in str(err.value)
    assert peak < 8 << 20, f"the loader took {peak / 1e6:.0f} MB before refusing"


def test_the_nodes_npz_loader_still_reads_real_compressed_data(tmp_path: Path) -> None:
    from feta_release.data.loading import load_dataset

    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (40, 12, 12), dtype=np.uint8)
    np.savez_compressed(tmp_path / "d.npz", images=images, labels=np.arange(40) % 3)
    ds, report = load_dataset(tmp_path / "d.npz")
    assert ds.n == 40 and np.allclose(ds.images[:, 0], images / 255.0) and report.kind == "npz"
