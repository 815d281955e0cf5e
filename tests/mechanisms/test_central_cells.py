"""Central images split into slant cells (``[central] cells``): sensitivity, noise scale, cell function,
accounting, config refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from feta_release.accounting import PrivacyEvent
from feta_release.config import load_preset
from feta_release.errors import ConfigError, PrivacyError
from feta_release.mechanisms.central import (
    SLANT_RANGE,
    CentralRelease,
    central_images,
    central_query,
    image_slant,
    postprocess_central,
    slant_cells,
)
from feta_release.planning import stage_noise

K = 3


def stroke(slant: float, size: int = 12) -> np.ndarray:
    """A vertical bar sheared by ``slant`` (columns move by -slant per row): a one-stroke 'digit'."""
    img = np.zeros((1, size, size), dtype=np.float32)
    mid = (size - 1) / 2
    for r in range(1, size - 1):
        c = int(round(mid - slant * (r - mid)))
        img[0, r, max(0, min(size - 1, c))] = 1.0
    return img


def data(n: int = 120, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    return g.random((n, 1, 12, 12), dtype=np.float32), np.arange(n) % K


def test_slant_of_a_sheared_stroke_has_its_sign_and_size() -> None:
    for s in (-0.5, 0.0, 0.3, 0.6):
        assert image_slant(stroke(s, 28)[None])[0] == pytest.approx(s, abs=0.02)
    assert image_slant(np.zeros((1, 1, 8, 8), np.float32))[0] == 0.0  # blank image: defined, no NaN


def test_slant_cells_use_the_fixed_public_edges() -> None:
    # measured slants -0.60, 0.07, 0.40, 0.80
    imgs = np.stack([stroke(s, 28) for s in (-0.6, 0.08, 0.4, 0.8)])
    assert slant_cells(imgs, 1).tolist() == [0, 0, 0, 0]
    assert slant_cells(imgs, 2).tolist() == [0, 0, 1, 1]  # one edge at the middle of SLANT_RANGE (0.15)
    assert slant_cells(imgs, 3).tolist() == [0, 1, 2, 2]  # edges 0.017, 0.283
    assert sum(SLANT_RANGE) / 2 == pytest.approx(0.15)


@settings(max_examples=40, deadline=None)
@given(arrays(np.float32, (6, 1, 8, 8), elements=st.floats(0, 1, width=32)), st.integers(1, 5))
def test_a_cell_depends_on_its_own_image_only(x: np.ndarray, cells: int) -> None:
    """Adding or removing other images never moves an image's cell (what keeps the sensitivity at C)."""
    full = slant_cells(x, cells)
    assert full.min() >= 0 and full.max() < cells
    for i in range(len(x)):
        assert slant_cells(x[i : i + 1], cells)[0] == full[i]
        assert np.array_equal(np.delete(full, i), slant_cells(np.delete(x, i, axis=0), cells))


@pytest.mark.parametrize("cells", [1, 2, 4])
def test_sensitivity_worst_case_neighbours(cells: int) -> None:
    """Add one image to any class: the (class, cell) sums move by <= C, tight for a max-norm image."""
    x, y = data()
    base, bound = central_query(x, y, K, clip=2.0, cells=cells)
    assert bound == 2.0 and base.shape == (K * cells, 36)
    for extra, cls in [
        (np.ones((1, 1, 12, 12), np.float32), 0),
        (stroke(0.7)[None], 2),
        (stroke(-0.4)[None], 1),
    ]:
        plus, _ = central_query(np.concatenate([x, extra]), np.append(y, cls), K, clip=2.0, cells=cells)
        moved = np.flatnonzero(np.abs(plus - base).sum(axis=1) > 0)
        assert len(moved) == 1 and moved[0] // cells == cls  # exactly one sum, in the image's own class
        own = float(np.linalg.norm(extra[0, 0, ::2, ::2]))  # the image's own norm at the query's 6x6
        assert np.linalg.norm(plus - base) == pytest.approx(min(2.0, own), rel=1e-6)  # <= C, = C for all-ones


def test_cells_partition_the_class_sum() -> None:
    x, y = data()
    whole, _ = central_query(x, y, K, clip=2.0)
    split, _ = central_query(x, y, K, clip=2.0, cells=3)
    assert np.allclose(split.reshape(K, 3, -1).sum(axis=1), whole)


def test_noise_scale_and_public_denominator_with_cells() -> None:
    """q = 1: released x (B_c / cells) - query is exactly the noise, std sigma * C (same as one cell)."""
    x, y = data()
    sigma, cells = 2.0, 3
    rel, ev = central_images(
        x,
        y,
        K,
        rounds=15,
        batch=120,
        sigma=sigma,
        clip=2.0,
        n_public=120,
        rng=np.random.default_rng(3),
        cells=cells,
    )
    assert ev == PrivacyEvent("central", sigma, 1.0, 15)  # the same event as cells = 1
    assert rel.denominator == pytest.approx(120 / (K * cells)) and rel.cells == cells
    assert rel.values.shape == (15 * K * cells, 1, 6, 6)
    assert rel.labels.tolist() == np.tile(np.repeat(np.arange(K), cells), 15).tolist()
    query, _ = central_query(x, y, K, clip=2.0, cells=cells)
    noise = rel.values.reshape(15, K * cells, -1) * rel.denominator - query[None]
    # 15 x 9 x 36 = 4,860 draws: relative se of the std 1 %; 5 % is > 4.5 se and rules out sigma*C*cells
    assert noise.std() == pytest.approx(sigma * 2.0, rel=0.05)
    assert abs(noise.mean()) < 4 * sigma * 2.0 / math.sqrt(noise.size)
    back = CentralRelease.from_arrays(rel.to_arrays())
    assert back.cells == cells and np.array_equal(back.values, rel.values)
    old = {k: v for k, v in rel.to_arrays().items() if k != "cells"}  # a release written before cells existed
    assert CentralRelease.from_arrays(old).cells == 1
    img, lab = postprocess_central(rel, stretch=True)
    assert img.shape == (15 * K * cells, 1, 12, 12) and np.array_equal(lab, rel.labels)


def test_refusals() -> None:
    x, y = data()
    ok = dict(rounds=1, batch=60, sigma=1.0, n_public=120, rng=np.random.default_rng(0))
    for bad in (dict(cells=0), dict(cells=2, kind="mode"), dict(cells=1.5)):
        with pytest.raises(PrivacyError):
            central_images(x, y, K, **{**ok, **bad})  # type: ignore[arg-type]
    cfg = load_preset("cpu-eps1")
    with pytest.raises(ConfigError, match="cells"):
        cfg.replace(central={"cells": 0})
    with pytest.raises(ConfigError, match="kind"):
        cfg.replace(central={"cells": 2, "kind": "mode"})
    # federated jobs split by the same public cells (tests/federation/test_federation_cells.py): no longer
    # refused
    assert cfg.replace(central={"cells": 2}, federation={"sites": ("a", "b")}).central.cells == 2


def test_plan_noise_figure_counts_the_cells() -> None:
    cfg = load_preset("cpu-eps1").replace(
        central={"rounds": 1, "batch": 4000, "rate": None, "sigma": 5.0, "clip": 2.0}
    )
    r1, _ = stage_noise(cfg, "central", 4000)
    r3, text = stage_noise(cfg.replace(central={"cells": 3}), "central", 4000)
    assert r1 == pytest.approx(5.0 * 2.0 / 400) and r3 == pytest.approx(3 * r1)
    assert "133 images per released sum" in text


def test_nodpsgd_preset_plans_the_whole_budget_on_the_releases() -> None:
    """cpu-eps1-nodpsgd: central + frequency only, within epsilon 1 at any public size (rates, not
    batches)."""
    from feta_release.planning import plan

    cfg = load_preset("cpu-eps1-nodpsgd")
    assert cfg.central.cells == 2 and cfg.central.stretch and cfg.dpsgd_steps(4000) == 0
    for n in (500, 1400, 4000, 60000):
        p = plan(cfg, n)
        assert p.epsilon <= 1.0 and p.noise_multiplier is None
        assert [e.stage for e in p.events] == ["central", "frequency"]
        assert "2 slant cells" in p.stage("central").note


def test_nodpsgd_preset_is_the_measured_configuration() -> None:
    """docs/evaluation.md row B was measured as cpu-eps1 with these overrides: the preset must stay that
    job."""
    measured = (
        load_preset("cpu-eps1")
        .replace(
            central={"rounds": 1, "rate": 1.0, "clip": 2.0, "sigma": 5.0, "cells": 2, "stretch": True},
            frequency={"sigma": 7.0},
            warmup={"frequency_mix_central": True, "polish_iterations": 500, "polish_lr": 5e-4},
            dpsgd={
                "steps": 0,
                "physical_batch": 32,
            },  # as measured (inert without DP-SGD; cpu-eps1's is 84 since)
            sampler={"start_sigma": 0.5},
        )
        .to_dict()
    )
    shipped = load_preset("cpu-eps1-nodpsgd").to_dict()
    assert {k: v for k, v in shipped.items() if k != "job"} == {
        k: v for k, v in measured.items() if k != "job"
    }


def test_eps10_nodpsgd_preset_plans_within_ten_on_the_releases_only() -> None:
    """cpu-eps10-nodpsgd: central + frequency only, within epsilon 10 at any public size (rates, not
    batches)."""
    from feta_release.planning import plan

    cfg = load_preset("cpu-eps10-nodpsgd")
    assert cfg.privacy.epsilon == 10.0 and cfg.central.cells == 4 and cfg.dpsgd_steps(4000) == 0
    for n in (500, 1400, 3200, 4000, 60000):
        p = plan(cfg, n)
        assert 9.0 < p.epsilon <= 10.0 and p.noise_multiplier is None
        assert [e.stage for e in p.events] == ["central", "frequency"]
        assert "4 slant cells" in p.stage("central").note


def test_eps10_nodpsgd_preset_is_the_measured_configuration() -> None:
    """docs/evaluation.md (epsilon = 10 with polish + SDEdit) measured cpu-eps10 with these overrides."""
    measured = (
        load_preset("cpu-eps10")
        .replace(
            central={"rounds": 1, "rate": 1.0, "clip": 2.0, "sigma": 0.65, "cells": 4, "stretch": True},
            frequency={"sigma": 1.1},
            warmup={"frequency_mix_central": True, "polish_iterations": 500, "polish_lr": 5e-4},
            dpsgd={
                "steps": 0,
                "physical_batch": 32,
            },  # as measured (inert without DP-SGD; cpu-eps10's is 84 since)
            sampler={"start_sigma": 0.7, "start_source": "mix"},
            auxgen={"epochs": 10},
        )
        .replace(  # "A better-fitted aux generator"
            frequency={"features": 2048, "patch": 7, "stride": 3}
        )
        .replace(  # "A patch feature map"
            auxgen={"restarts": 4, "keep": 4}
        )
        .to_dict()
    )  # "an ensemble of aux-generator fits"
    shipped = load_preset("cpu-eps10-nodpsgd").to_dict()
    assert {k: v for k, v in shipped.items() if k != "job"} == {
        k: v for k, v in measured.items() if k != "job"
    }
