"""The dimension DP-SGD's noise is drawn in, counted from the job's config alone
(``model_size.dpsgd_dimension``): equal, for every ``[dpsgd] trainable`` mode, to the scalars
``models.trainable.set_trainable`` leaves trainable on the model training builds (``training.dpsgd`` draws one
Gaussian per trainable coordinate)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.config import ModelSection
from feta_release.errors import ConfigError
from feta_release.model_size import denoiser_parameters, dpsgd_dimension
from feta_release.models import build_denoiser
from feta_release.models.trainable import MODES, set_trainable


@settings(max_examples=30, deadline=None)
@given(
    levels=st.integers(1, 3),
    side=st.integers(4, 12),
    img_ch=st.sampled_from([1, 3]),
    classes=st.integers(1, 5),
    channels=st.sampled_from([4, 8, 12]),
    blocks=st.integers(0, 3),
    rank=st.integers(1, 6),
    data=st.data(),
)
def test_the_counted_dimension_is_what_set_trainable_leaves_trainable(
    levels, side, img_ch, classes, channels, blocks, rank, data
):
    mult = tuple(data.draw(st.lists(st.integers(1, 3), min_size=levels, max_size=levels)))
    attn = tuple(data.draw(st.sets(st.integers(1, 12), max_size=3)))
    cfg = ModelSection(channels=channels, channel_mult=mult, num_res_blocks=blocks, attn_resolutions=attn)
    shape = (img_ch, side, side)
    for mode in MODES:
        trained = set_trainable(build_denoiser(cfg, shape, classes), mode, rank)
        assert dpsgd_dimension(cfg, shape, classes, mode, rank) == trained, mode


@pytest.mark.parametrize("shape", [(1, 28, 28), (1, 64, 64), (3, 32, 32)])
def test_the_derived_jobs_model_trains_fewer_parameters_in_the_parameter_efficient_modes(shape):
    cfg = ModelSection(channels=16, channel_mult=(1, 2, 2) if shape[1] > 28 else (1, 2))
    every = denoiser_parameters(cfg, shape, 10)
    assert dpsgd_dimension(cfg, shape, 10, "all", 4) == every
    for mode in ("norm_attention", "lora"):
        d = dpsgd_dimension(cfg, shape, 10, mode, 4)
        assert d == set_trainable(build_denoiser(cfg, shape, 10), mode, 4)
        assert d < every / 4  # a small share of the model: the whole count would overstate the noise


def test_the_dimension_does_not_walk_the_blocks_a_job_names():
    cfg = ModelSection(channels=8, channel_mult=(1,), num_res_blocks=10**12, attn_resolutions=(8,))
    for mode in MODES:
        assert dpsgd_dimension(cfg, (1, 8, 8), 10, mode, 4) > 10**12  # closed form: returns at once


def test_an_unknown_trainable_mode_is_refused_naming_the_setting():
    with pytest.raises(ConfigError, match=r"\[dpsgd\] trainable"):
        dpsgd_dimension(ModelSection(), (1, 28, 28), 10, "convs", 4)
