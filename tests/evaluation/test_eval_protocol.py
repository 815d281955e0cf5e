"""The evaluation protocol's code (splits, balance, release-only baseline, mean ± std), not its figures."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.data import ImageDataset
from feta_release.data.splits import balanced_labels
from feta_release.errors import ConfigError, DataError
from feta_release.eval_protocol import PROTOCOL, Protocol, format_row, mean_std, protocol_splits, release_only


def _ds(n_per_class: int = 20, n_classes: int = 4) -> ImageDataset:
    rng = np.random.default_rng(0)
    n = n_per_class * n_classes
    return ImageDataset(
        rng.random((n, 1, 8, 8), dtype=np.float32),
        np.repeat(np.arange(n_classes), n_per_class),
        tuple(str(c) for c in range(n_classes)),
        source="toy",
    )


def _keys(ds: ImageDataset) -> set[bytes]:
    return {img.tobytes() for img in ds.images}


def test_validation_mode_never_touches_the_heldout_part() -> None:
    ds = _ds()
    train, heldout = protocol_splits(ds, "test")
    fit, val = protocol_splits(ds, "validation")
    assert not (_keys(fit) | _keys(val)) & _keys(heldout)
    assert _keys(fit) | _keys(val) == _keys(train) and not _keys(fit) & _keys(val)
    # deterministic: the same split twice
    fit2, val2 = protocol_splits(ds, "validation")
    assert np.array_equal(fit.images, fit2.images) and np.array_equal(val.labels, val2.labels)
    with pytest.raises(ConfigError, match="validation' or 'test"):
        protocol_splits(ds, "heldout")  # type: ignore[arg-type]


def test_embedded_split_sizes_are_the_documented_ones() -> None:
    from feta_release.data import load_embedded

    fit, val = protocol_splits(load_embedded(), "validation")
    train, heldout = protocol_splits(load_embedded(), "test")
    assert (train.n, heldout.n, fit.n, val.n) == (4000, 1000, 3200, 800)
    assert PROTOCOL.n_synthetic >= 10_000 and len(PROTOCOL.seeds) >= 3


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), k=st.integers(1, 50))
def test_balanced_labels(n: int, k: int) -> None:
    y = balanced_labels(n, k)
    counts = np.bincount(y, minlength=k)
    assert len(y) == n and y.min() >= 0 and y.max() < k
    assert counts.max() - counts.min() <= 1
    assert counts.sum() == n


def test_release_only_is_balanced_augmented_copies_of_the_release() -> None:
    rel = _ds(2, 3)  # 6 released images, 2 per class
    out = release_only(rel.images, rel.labels, rel.class_names, 300, seed=0)
    assert out.n == 300 and np.array_equal(out.class_counts(), [100, 100, 100])
    assert out.images.min() >= 0 and out.images.max() <= 1
    assert len(_keys(out)) > 6  # augmented, not just repeated
    again = release_only(rel.images, rel.labels, rel.class_names, 300, seed=0)
    assert np.array_equal(out.images, again.images)
    with pytest.raises(DataError, match="no released image of class"):
        release_only(rel.images[:2], rel.labels[:2], rel.class_names, 30, seed=0)


@settings(max_examples=50, deadline=None)
@given(xs=st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=10))
def test_mean_std_is_the_sample_std(xs: list[float]) -> None:
    m, s = mean_std(xs)
    assert m == pytest.approx(float(np.mean(xs)), abs=1e-9)
    assert s == (pytest.approx(float(np.std(xs, ddof=1)), abs=1e-9) if len(xs) > 1 else 0.0)


def test_mean_std_and_protocol_reject_bad_input() -> None:
    with pytest.raises(DataError):
        mean_std([])
    with pytest.raises(DataError):
        mean_std([0.5, float("nan")])
    with pytest.raises(ConfigError):
        Protocol(seeds=())
    with pytest.raises(ConfigError):
        Protocol(classifier_epochs=0)  # an epoch cap, when given, is at least 1; None is the automatic cap
    assert Protocol(classifier_epochs=None, feature_epochs=None).classifier_epochs is None
    assert format_row("x", [0.5, 0.7], [10.0, 30.0]) == "| x | 0.600 ± 0.141 | 20 ± 14 | 2 |"
