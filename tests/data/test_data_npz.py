""".npz parser: layouts, dtypes, labels, and every bad-array case; hypothesis properties."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from feta_release.data import load_dataset, parse_arrays
from feta_release.errors import DataError


def save(path: Path, **arrays) -> Path:
    np.savez(path, **arrays)
    return path


def labels_for(n: int, k: int = 2) -> np.ndarray:
    return np.arange(n) % k


# -- layouts and dtypes -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape, layout",
    [
        ((4, 6, 5), "NHW"),
        ((4, 6, 5, 1), "NHWC"),
        ((4, 6, 5, 3), "NHWC"),
        ((4, 1, 6, 5), "NCHW"),
        ((4, 3, 6, 5), "NCHW"),
    ],
)
def test_layouts(tmp_path: Path, shape, layout) -> None:
    raw = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    ds, report = load_dataset(save(tmp_path / "d.npz", images=raw, labels=labels_for(4)))
    c = 1 if layout == "NHW" else (shape[3] if layout == "NHWC" else shape[1])
    assert ds.image_shape == (c, 6, 5)
    expect = {"NHW": raw[:, None], "NHWC": raw.transpose(0, 3, 1, 2) if raw.ndim == 4 else None, "NCHW": raw}[
        layout
    ]
    assert np.array_equal(ds.images, expect / np.float32(255))
    assert ds.class_names == ("0", "1") and report.kind == "npz"


def test_dtypes(tmp_path: Path) -> None:
    lab = labels_for(2)
    u16 = np.array([[[0, 65535]], [[32768, 1]]], np.uint16)
    ds, report = load_dataset(save(tmp_path / "a.npz", images=u16, labels=lab))
    assert (
        ds.images[0, 0, 0].tolist() == [0.0, 1.0] and report.conversions["16-bit scaled from 0..65535"] == 2
    )
    ds, _ = load_dataset(save(tmp_path / "b.npz", images=np.array([[[True, False]]] * 2), labels=lab))
    assert ds.images[:, 0, 0].tolist() == [[1.0, 0.0]] * 2
    f64 = np.array([[[0.0, 0.25]], [[1.0, 0.5]]])
    ds, _ = load_dataset(save(tmp_path / "c.npz", images=f64, labels=lab))
    assert ds.images.dtype == np.float32 and ds.images.reshape(-1).tolist() == [0.0, 0.25, 1.0, 0.5]
    i32 = np.array([[[0, 255]], [[3, 4]]], np.int32)
    ds, _ = load_dataset(save(tmp_path / "d.npz", images=i32, labels=lab))
    assert ds.images.max() == 1.0


def test_class_names_and_string_labels(tmp_path: Path) -> None:
    imgs = np.zeros((4, 5, 5), np.uint8)
    ds, _ = load_dataset(
        save(tmp_path / "a.npz", images=imgs, labels=[0, 1, 2, 1], class_names=["x", "y", "z"])
    )
    assert ds.class_names == ("x", "y", "z") and ds.labels.tolist() == [0, 1, 2, 1]
    ds, _ = load_dataset(save(tmp_path / "b.npz", images=imgs, labels=np.array(["dog", "cat", "dog", "cat"])))
    assert ds.class_names == ("cat", "dog") and ds.labels.tolist() == [1, 0, 1, 0]
    ds, _ = load_dataset(save(tmp_path / "c.npz", images=imgs, labels=[[0], [1], [0], [1]]))  # (N, 1) column
    assert ds.labels.tolist() == [0, 1, 0, 1]


def test_image_size_policy(tmp_path: Path) -> None:
    p = save(tmp_path / "a.npz", images=np.full((2, 8, 8), 0.5), labels=[0, 1])
    with pytest.raises(DataError, match="all images are 8x8 but image_size = 4"):
        load_dataset(p, image_size=4)
    ds, report = load_dataset(p, image_size=4, resize="resize")
    assert ds.image_shape == (1, 4, 4) and np.allclose(ds.images, 0.5) and report.n_resized == 2


# -- bad arrays ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "arrays, match",
    [
        ({"images": np.zeros((3, 4, 4))}, r"missing array\(s\) \['labels'\]"),
        ({"images": np.zeros((3, 4, 4)), "labels": [0, 1]}, "3 images but 2 labels"),
        ({"images": np.zeros((3, 4, 4)), "labels": [0, 1, 1, 0]}, "3 images but 4 labels"),
        ({"images": np.zeros((0, 4, 4)), "labels": np.zeros(0, int)}, "empty"),
        ({"images": np.zeros((2, 4)), "labels": [0, 1]}, "must have shape"),
        ({"images": np.zeros((2, 5, 5, 5)), "labels": [0, 1]}, "channel axis"),
        ({"images": np.zeros((2, 3, 4, 3)), "labels": [0, 1]}, "ambiguous"),
        (
            {"images": np.full((2, 4, 4), np.nan), "labels": [0, 1]},
            r"32 NaN/inf pixel value\(s\) in 2 image\(s\), first at index 0",
        ),
        (
            {"images": np.array([np.zeros((4, 4)), np.full((4, 4), np.inf)]), "labels": [0, 1]},
            "first at index 1",
        ),
        ({"images": np.full((2, 4, 4), 255.0), "labels": [0, 1]}, r"\[0, 1\].*divide by 255"),
        ({"images": np.full((2, 4, 4), -1.0), "labels": [0, 1]}, r"\(x \+ 1\) / 2"),
        ({"images": np.full((2, 4, 4), 300, np.int32), "labels": [0, 1]}, "outside 0..255"),
        ({"images": np.zeros((2, 4, 4), np.complex64), "labels": [0, 1]}, "unsupported pixel dtype"),
        ({"images": np.zeros((2, 4, 4)), "labels": [0, 0]}, "only one class"),
        ({"images": np.zeros((3, 4, 4)), "labels": [0, 2, 2]}, r"without any image: \['1'\]"),
        ({"images": np.zeros((2, 4, 4)), "labels": [0, -1]}, "negative label"),
        ({"images": np.zeros((2, 4, 4)), "labels": [0.0, 0.5]}, "must be integers"),
        ({"images": np.zeros((2, 4, 4)), "labels": [0, 3], "class_names": ["a", "b"]}, "label 3 but only 2"),
        ({"images": np.zeros((2, 4, 4)), "labels": [0, 1], "class_names": ["a", "a"]}, "duplicate"),
        (
            {"images": np.zeros((2, 4, 4)), "labels": ["a", "q"], "class_names": ["a", "b"]},
            r"\['q'\] are not in",
        ),
        ({"images": np.zeros((2, 4, 4)), "labels": np.zeros((2, 2), int)}, "one-dimensional"),
    ],
)
def test_bad_arrays(tmp_path: Path, arrays: dict, match: str) -> None:
    p = save(tmp_path / "bad.npz", **arrays)
    with pytest.raises(DataError, match=match) as err:
        load_dataset(p)
    assert "bad.npz" in str(err.value)


def test_corrupt_truncated_and_pickled_npz(tmp_path: Path) -> None:
    good = save(tmp_path / "good.npz", images=np.zeros((2, 4, 4)), labels=[0, 1])
    data = good.read_bytes()
    (tmp_path / "trunc.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"trunc\.npz: not a readable \.npz"):
        load_dataset(tmp_path / "trunc.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match=r"junk\.npz: not a readable \.npz"):
        load_dataset(tmp_path / "junk.npz")
    obj = np.empty(2, dtype=object)
    obj[:] = [np.zeros((4, 4)), np.zeros((4, 4))]
    np.savez(tmp_path / "obj.npz", images=obj, labels=[0, 1])
    with pytest.raises(DataError, match=r"obj\.npz: unsupported array contents"):
        load_dataset(tmp_path / "obj.npz")


# -- properties ---------------------------------------------------------------------------------
dims = st.integers(4, 9)


@st.composite
def uint8_dataset(draw):
    n = draw(st.integers(2, 6))
    h, w = draw(dims), draw(dims)
    c = draw(st.sampled_from([0, 1, 3]))  # 0: (N, H, W)
    shape = (n, h, w) if c == 0 else (n, c, h, w)
    imgs = draw(hnp.arrays(np.uint8, shape))
    k = draw(st.integers(2, n))
    labels = np.concatenate([np.arange(k), draw(hnp.arrays(np.int64, n - k, elements=st.integers(0, k - 1)))])
    channels_last = c != 0 and draw(st.booleans())
    return imgs, labels, k, channels_last


@settings(max_examples=60, deadline=None)
@given(uint8_dataset())
def test_property_uint8_any_layout_round_trips(data) -> None:
    imgs, labels, k, channels_last = data
    given_imgs = imgs.transpose(0, 2, 3, 1) if channels_last else imgs
    ds = parse_arrays(given_imgs, labels)
    nchw = imgs[:, None] if imgs.ndim == 3 else imgs
    assert ds.images.shape == nchw.shape
    assert np.array_equal(np.rint(ds.images * 255).astype(np.uint8), nchw)
    assert ds.labels.tolist() == labels.tolist() and ds.n_classes == k


finite_floats = st.floats(0.0, 1.0, width=32)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    hnp.arrays(np.float32, st.tuples(st.integers(2, 5), dims, dims), elements=finite_floats),
    st.sampled_from([np.nan, np.inf, -np.inf, -0.5, 1.01, 255.0]),
    st.data(),
)
def test_property_any_bad_pixel_is_refused(imgs, bad, data) -> None:
    labels = np.arange(len(imgs)) % 2
    # Valid floats pass unchanged ...
    assert np.array_equal(parse_arrays(imgs, labels).images[:, 0], imgs)
    # ... and a single bad value anywhere is refused, naming the image that holds it.
    idx = tuple(data.draw(st.integers(0, s - 1)) for s in imgs.shape)
    broken = imgs.copy()
    broken[idx] = bad
    with pytest.raises(DataError, match=f"first at index {idx[0]}"):
        parse_arrays(broken, labels, source="prop")


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 8))
def test_property_length_mismatch_refused(n_images, n_labels) -> None:
    imgs = np.zeros((n_images, 4, 4), np.uint8)
    labels = np.arange(n_labels) % 2
    if n_images == n_labels and n_images >= 2:
        assert parse_arrays(imgs, labels).n == n_images
    else:
        with pytest.raises(DataError):
            parse_arrays(imgs, labels)


def test_a_set_over_the_memory_limit_is_refused_from_its_header_in_one_line(tmp_path, monkeypatch) -> None:
    """A site whose float32 images would not fit is refused before any pixel is read, in one line naming the
    figure (N*C*H*W*4 bytes) and the limit, instead of exhausting the machine part-way through a stage."""
    from feta_release.data.dataset import MEMORY_ENV
    from feta_release.data.loading import load_dataset

    path = tmp_path / "big.npz"
    np.savez(path, images=np.zeros((40, 16, 16), dtype=np.uint8), labels=np.arange(40, dtype=np.int64) % 2)
    monkeypatch.setenv(MEMORY_ENV, str(40 * 256 * 4 / 2**20 * 0.99))  # just under the set's 40,960 bytes
    with pytest.raises(DataError) as err:
        load_dataset(path)
    line = str(err.value)
    assert (
        "\n" not in line and str(path) in line and "40 images of 256 values" in line and "N*C*H*W*4" in line
    )
    monkeypatch.setenv(MEMORY_ENV, str(40 * 256 * 4 / 2**20))  # exactly the set: accepted
    assert load_dataset(path)[0].n == 40
