"""Small denoiser architectures for property tests of the closed-form counts in ``feta_release.model_size``
against the models ``feta_release.models.build_denoiser`` builds."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from feta_release.config import ModelSection


@st.composite
def denoiser_architectures(draw: Any) -> tuple[ModelSection, tuple[int, int, int], int]:
    """(model section, image shape, classes): 1-3 levels of multipliers 1-3, 4-12 px square images of 1 or 3
    channels, 0-3 residual blocks a level, attention at up to three resolutions, 1-5 classes."""
    levels = draw(st.integers(1, 3))
    mult = tuple(draw(st.lists(st.integers(1, 3), min_size=levels, max_size=levels)))
    attn = tuple(draw(st.sets(st.integers(1, 12), max_size=3)))
    cfg = ModelSection(
        channels=draw(st.sampled_from([4, 8, 12])),
        channel_mult=mult,
        num_res_blocks=draw(st.integers(0, 3)),
        attn_resolutions=attn,
    )
    side = draw(st.integers(4, 12))
    return cfg, (draw(st.sampled_from([1, 3])), side, side), draw(st.integers(1, 5))
