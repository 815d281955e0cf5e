"""Which released central cells are mostly noise: the per-row noise-to-signal figure (released values and
public parameters only) and the rule that keeps a class's cells under the planner's line, and always its best
cell."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.mechanisms.central import CentralRelease, cell_noise_figures, central_images, kept_cells
from feta_release.planning import MOSTLY_NOISE


def one_full_cell(side: int, sigma: float, clip: float, n: int, rounds: int, seed: int) -> CentralRelease:
    """One class, two cells: every image is the bright one, nearest to prototype 0, so cell 1 of each round
    is the mechanism's noise alone and cell 0 carries all the signal."""
    images = np.ones((n, 1, side, side), np.float32)
    protos = np.stack([np.ones(side * side), -np.ones(side * side)])[None]  # (class, cell, pixels)
    release, _ = central_images(
        images,
        np.zeros(n, np.int64),
        1,
        rounds=rounds,
        batch=n,
        sigma=sigma,
        clip=clip,
        n_public=n,
        rng=np.random.default_rng(seed),
        cells=2,
        prototypes=protos,
    )
    return release


@settings(max_examples=25, deadline=None)
@given(
    side=st.sampled_from([8, 10, 12, 16]),
    sigma=st.floats(0.5, 8.0),
    clip=st.floats(0.1, 3.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_pure_noise_cell_is_dropped_and_a_strong_cell_kept(
    side: int, sigma: float, clip: float, seed: int
) -> None:
    d = (side // 2) ** 2
    # the full cell's figure is sqrt(d) sigma clip / (n min(clip, sqrt(d))) (each bright image clipped to
    # min(clip, sqrt(d)), both divided by the public n / 2): about 0.1 with this many images
    n = math.ceil(10 * math.sqrt(d) * sigma * clip / min(clip, math.sqrt(d)))
    release = one_full_cell(side, sigma, clip, n, 3, seed)
    fig = cell_noise_figures(release)
    assert np.all(fig[1::2] > MOSTLY_NOISE), fig  # the noise-only cells
    assert np.all(fig[0::2] < MOSTLY_NOISE), fig
    assert kept_cells(release, MOSTLY_NOISE).tolist() == [True, False] * 3


@settings(max_examples=10, deadline=None)
@given(
    side=st.sampled_from([8, 12]),
    sigma=st.floats(0.5, 8.0),
    clip=st.floats(0.1, 3.0),
    seed=st.integers(0, 99),
)
def test_the_figure_uses_the_noise_energy_the_mechanism_adds(
    side: int, sigma: float, clip: float, seed: int
) -> None:
    rounds = 400
    release = one_full_cell(side, sigma, clip, 50, rounds, seed)
    noise = release.values[1::2].reshape(rounds, -1).astype(np.float64)
    d, s = noise.shape[1], sigma * clip / release.denominator
    ratio = (noise**2).sum(1).mean() / (d * s * s)  # E||v||^2 = d s^2 on a noise-only row
    assert abs(ratio - 1.0) < 5 * math.sqrt(2.0 / (d * rounds)), ratio


def noise_release(values: np.ndarray, cells: int) -> CentralRelease:
    rows = len(values)
    return CentralRelease(
        values=values.astype(np.float32),
        labels=np.repeat(np.arange(rows // cells), cells),
        rounds=1,
        kind="mean",
        denominator=10.0,
        image_shape=(1, 4, 4),
        n_classes=rows // cells,
        sigma=2.0,
        clip=1.0,
        cells=cells,
        q=1.0,
        bins=None,
    )


@settings(max_examples=50, deadline=None)
@given(
    cells=st.integers(1, 4),
    classes=st.integers(1, 5),
    scale=st.floats(0.0, 2.0),
    line=st.floats(0.0, 5.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_every_class_keeps_at_least_its_best_cell(
    cells: int, classes: int, scale: float, line: float, seed: int
) -> None:
    values = np.random.default_rng(seed).normal(0.0, scale, (classes * cells, 1, 2, 2))
    release = noise_release(values, cells)
    keep, fig = kept_cells(release, line), cell_noise_figures(release)
    for c in range(classes):
        own = slice(c * cells, (c + 1) * cells)
        assert keep[own].any()
        assert keep[own][np.argmin(fig[own])]
        above = np.flatnonzero(keep[own] & (fig[own] > line))  # kept above the line: only the best
        assert above.size == 0 or (above.size == 1 and fig[own][above[0]] == fig[own].min())
