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
from tests.support.architectures import denoiser_architectures


@settings(max_examples=30, deadline=None)
@given(arch=denoiser_architectures(), rank=st.integers(1, 6))
def test_the_counted_dimension_is_what_set_trainable_leaves_trainable(arch, rank):
    cfg, shape, classes = arch
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
