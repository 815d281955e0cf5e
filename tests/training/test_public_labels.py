"""How public classes map onto private ones for pretraining, and how a public set is told from another."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.data import ImageDataset
from feta_release.data.public import public_problem, public_record
from feta_release.stages.pretrain import mapped_labels

names = st.lists(st.sampled_from(["a", "b", "c", "d", "e", "f"]), min_size=1, max_size=4, unique=True)


@settings(max_examples=60, deadline=None)
@given(public=names, private=names, data=st.data())
def test_a_public_image_gets_its_mapped_private_class_or_the_null_label(public, private, data):
    pairs = data.draw(
        st.dictionaries(st.sampled_from(public), st.sampled_from(private), max_size=len(public))
    )
    labels = np.array(data.draw(st.lists(st.integers(0, len(public) - 1), min_size=1, max_size=12)), np.int64)
    ds = ImageDataset(np.zeros((len(labels), 1, 4, 4), np.float32), labels, tuple(public))
    got = mapped_labels(ds, tuple(private), tuple(f"{k}={v}" for k, v in pairs.items()))
    for lab, g in zip(labels, got, strict=True):
        name = public[lab]
        want = pairs.get(name, name)
        assert g == (private.index(want) if want in private else len(private))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 6))
def test_a_changed_pixel_or_label_is_another_public_set(seed, n):
    rng = np.random.default_rng(seed)
    ds = ImageDataset(rng.random((n, 1, 4, 4), dtype=np.float32), rng.integers(0, 2, n), ("x", "y"))
    named = public_record(ds, "d")
    assert public_problem(named, ds) is None
    pixels = ds.images.copy()
    pixels[0, 0, 0, 0] = np.float32(1.0) - pixels[0, 0, 0, 0] if pixels[0, 0, 0, 0] != 0.5 else 0.25
    assert "sha256" in str(public_problem(named, ImageDataset(pixels, ds.labels, ds.class_names)))
    flipped = ds.labels.copy()
    flipped[0] = 1 - flipped[0]
    assert public_problem(named, ImageDataset(ds.images, flipped, ds.class_names)) is not None
