"""Central images split by public aux-generator prototypes (``[central] cell_rule = "aux"``): the cell
function, the sensitivity, refusals, the k-means centres and the order of the site's releases that makes the
prototypes public in time."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from feta_release.config import load_preset
from feta_release.errors import ConfigError, PrivacyError
from feta_release.mechanisms.central import central_images, prototype_cells
from feta_release.models.auxgen import AuxGenerator
from feta_release.stages.prototypes import cell_prototypes, kmeans

K, CELLS, SIDE = 3, 2, 8


def protos(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((K, CELLS, SIDE * SIDE))


def test_each_image_goes_to_the_nearest_prototype_of_its_own_class() -> None:
    p = np.zeros((2, 2, 4))
    p[0, 1] = 1.0  # class 0: dark (cell 0) or bright (cell 1)
    p[1, 0] = 1.0  # class 1: the other way round
    bright, dark = np.full((1, 2, 2), 0.9), np.full((1, 2, 2), 0.1)
    x = np.stack([bright, dark, bright, dark])
    assert prototype_cells(x, np.array([0, 0, 1, 1]), p).tolist() == [1, 0, 0, 1]


@settings(max_examples=40, deadline=None)
@given(
    arrays(np.float32, (6, 1, SIDE, SIDE), elements=st.floats(0, 1, width=32)),
    st.lists(st.integers(0, K - 1), min_size=6, max_size=6),
    st.integers(0, 3),
)
def test_a_prototype_cell_depends_on_its_own_image_only(x: np.ndarray, labels: list[int], seed: int) -> None:
    """Adding or removing other images never moves an image's cell: what keeps the per-cell sums at
    sensitivity C."""
    y, p = np.array(labels), protos(seed)
    full = prototype_cells(x, y, p)
    assert full.min() >= 0 and full.max() < CELLS
    for i in range(len(x)):
        assert prototype_cells(x[i : i + 1], y[i : i + 1], p)[0] == full[i]
        assert np.array_equal(
            np.delete(full, i), prototype_cells(np.delete(x, i, axis=0), np.delete(y, i), p)
        )


def _sums(x: np.ndarray, y: np.ndarray, p: np.ndarray) -> np.ndarray:
    """The released cell sums with (practically) no noise, q = 1: the query itself."""
    rel, _ = central_images(
        x,
        y,
        K,
        kind="mean",
        rounds=1,
        batch=len(x),
        sigma=1e-12,
        clip=2.0,
        downsample=0.5,
        n_public=len(x),
        rng=np.random.default_rng(0),
        cells=CELLS,
        prototypes=p,
    )
    return rel.values.reshape(K * CELLS, -1) * (len(x) / (K * CELLS))


def test_one_more_image_moves_one_sum_of_its_class_by_at_most_the_clip() -> None:
    g = np.random.default_rng(1)
    x, y, p = g.random((60, 1, SIDE, SIDE), dtype=np.float32), np.arange(60) % K, protos()
    base = _sums(x, y, p)
    for cls in range(K):
        extra = np.ones((1, 1, SIDE, SIDE), np.float32)
        plus = _sums(np.concatenate([x, extra]), np.append(y, cls), p)
        moved = np.flatnonzero(np.abs(plus - base).sum(axis=1) > 1e-3)  # float32 release
        assert len(moved) == 1 and moved[0] // CELLS == cls
        assert np.linalg.norm(plus - base) == pytest.approx(2.0, rel=1e-4)  # clipped to C = 2 (norm 4 at 4x4)


def test_the_event_is_the_slant_rules_event() -> None:
    g = np.random.default_rng(2)
    x, y = g.random((30, 1, SIDE, SIDE), dtype=np.float32), np.arange(30) % K
    kw = dict(
        kind="mean",
        rounds=1,
        batch=30,
        sigma=3.0,
        clip=2.0,
        downsample=0.5,
        n_public=30,
        rng=np.random.default_rng(0),
        cells=CELLS,
    )
    _, slant = central_images(x, y, K, **kw)
    _, aux = central_images(x, y, K, prototypes=protos(), **kw)
    assert aux == slant


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((K, CELLS + 1, SIDE * SIDE)),
        np.full((K, CELLS, SIDE * SIDE), np.nan),
        np.zeros((K, CELLS, 10)),
    ],
)
def test_prototypes_of_the_wrong_shape_or_not_finite_are_refused(bad: np.ndarray) -> None:
    x, y = np.zeros((6, 1, SIDE, SIDE), np.float32), np.arange(6) % K
    with pytest.raises(PrivacyError, match="cell prototypes must be finite numbers of shape"):
        central_images(
            x,
            y,
            K,
            kind="mean",
            rounds=1,
            batch=6,
            sigma=3.0,
            clip=2.0,
            n_public=6,
            rng=np.random.default_rng(0),
            cells=CELLS,
            prototypes=bad,
        )


def test_config_refusals() -> None:
    cfg = load_preset("cpu-eps10-nodpsgd")
    assert cfg.replace(central={"cell_rule": "aux"}).central.cell_rule == "aux"
    with pytest.raises(ConfigError, match='needs kind = "mean" and \\[frequency\\] sigma'):
        cfg.replace(central={"cell_rule": "aux"}, frequency={"sigma": None})
    with pytest.raises(ConfigError, match="single-site only"):
        cfg.replace(central={"cell_rule": "aux"}, federation={"sites": ("a", "b")})
    with pytest.raises(ConfigError, match="cell_rule"):
        cfg.replace(central={"cell_rule": "width"})


def test_a_node_refuses_the_aux_rule_without_the_coordinators_prototypes() -> None:
    """A job without [federation] sites passes config validation; the node must still not fall back to
    slant, nor split by prototypes a job does not name."""
    from types import SimpleNamespace

    from edge.releases import release_central

    cfg = load_preset("tiny").replace(central={"cell_rule": "aux", "cells": 2})
    ds = SimpleNamespace(
        images=np.zeros((20, 1, 28, 28), np.float32), labels=np.arange(20) % 10, n_classes=10
    )
    with pytest.raises(PrivacyError, match="needs the coordinator's public cell prototypes"):
        release_central(ds, cfg, 20, np.random.default_rng(0))
    slant = cfg.replace(central={"cell_rule": "slant"})
    with pytest.raises(PrivacyError, match="takes no prototypes"):
        release_central(ds, slant, 20, np.random.default_rng(0), np.zeros((10, 2, 784)))


@pytest.mark.slow  # two tiny `train` runs without DP-SGD
@pytest.mark.parametrize("rule", ["aux", "slant"])
def test_the_frequency_release_runs_first_only_for_the_aux_rule(tmp_path, rule: str) -> None:
    """The order the site is asked in (its ledger's requests): the aux rule's prototypes come from the aux
    generator fitted to the frequency release, so that release is asked for first; otherwise central first."""
    from tests.support.training import embedded_subset, site_requests, train_run

    cfg = load_preset("tiny").replace(
        central={"cell_rule": rule, "cells": 2},
        dpsgd={"steps": 0},
        warmup={"spatial_iterations": 1, "frequency_epochs": 0},
    )
    train_run(cfg, embedded_subset(), tmp_path / "r", public_size=240)
    asked = [r["mechanism"] for r in site_requests(tmp_path / "r")]
    assert asked == (["frequency", "central"] if rule == "aux" else ["central", "frequency"])


def test_kmeans_finds_separated_clusters_and_is_deterministic() -> None:
    g = np.random.default_rng(3)
    centres = np.array([[0.0, 0.0], [5.0, 5.0], [0.0, 9.0]])
    x = np.concatenate([c + 0.1 * g.standard_normal((40, 2)) for c in centres])
    got = kmeans(x, 3, np.random.default_rng(0))
    assert np.allclose(sorted(map(tuple, got.round(0))), sorted(map(tuple, centres)))
    assert np.array_equal(got, kmeans(x, 3, np.random.default_rng(0)))


def test_cell_prototypes_come_from_the_public_seed_only() -> None:
    cfg = load_preset("tiny").replace(central={"cell_rule": "aux", "cells": 3})
    torch.manual_seed(0)
    aux = AuxGenerator(1, 28, 10, z_dim=8, width=8)
    a, b = cell_prototypes(aux, cfg), cell_prototypes(aux, cfg)
    assert a.shape == (10, 3, 784) and np.all((a >= 0) & (a <= 1))
    assert np.array_equal(a, b)  # nothing private and nothing global: the same job draws the same prototypes
    assert not np.array_equal(a, cell_prototypes(aux, cfg.replace(job={"seed": 1})))
