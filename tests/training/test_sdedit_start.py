"""[sampler] start_sigma: the run's synthetic set denoised from noised, augmented released central images
(SDEdit; post-processing of the release)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from feta_release.config import load_preset
from feta_release.errors import ConfigError
from feta_release.models import build_denoiser
from feta_release.models.sampler import sample
from feta_release.release.jobdir import synthetic_set
from tests.support.single_thread import single_thread  # noqa: F401  (autouse fixture)
from tests.support.training import TINY, bars, job, train_run
from tests.support.training import embedded_subset as _data


def test_no_init_is_the_noise_sampler_and_tiny_start_sigma_keeps_the_start_images() -> None:
    torch.manual_seed(0)
    d = build_denoiser(TINY, (1, 16, 16), 2).eval()
    x, y = bars()
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    a = sample(d, y, noise, steps=4)
    b = sample(d, y, noise, steps=4, init=None)
    assert torch.equal(a, b)
    # from sigma 0.01 the EDM denoiser is close to the identity (c_skip -> 1): the output is the start image
    kept = sample(d, y, noise, steps=3, sigma_max=0.01, init=x)
    assert (kept - x).abs().max() < 0.1
    moved = sample(d, y, noise, steps=3, sigma_max=2.0, init=x)
    assert (moved - x).abs().mean() > (kept - x).abs().mean()


@pytest.mark.parametrize("bad", [0.001, 0.002, 81.0, -1.0])
def test_start_sigma_outside_the_schedule_is_refused(bad: float) -> None:
    with pytest.raises(ConfigError, match="start_sigma"):
        job(sampler={"start_sigma": bad})


def test_train_writes_a_balanced_synthetic_set_from_release_starts(tmp_path) -> None:
    cfg = load_preset("tiny").replace(sampler={"start_sigma": 0.5}, dpsgd={"steps": 0})
    train_run(cfg, _data(), tmp_path / "r", n_synthetic=30, public_size=240, release=False)
    z = np.load(tmp_path / "r" / "synthetic.npz")
    assert np.bincount(z["labels"]).tolist() == [3] * 10
    assert z["images"].min() >= 0 and z["images"].max() <= 1 and np.isfinite(z["images"]).all()


def test_a_run_redrawn_under_other_sampler_settings_changes_only_the_named_set(tmp_path) -> None:
    cfg = load_preset("tiny").replace(sampler={"start_sigma": 0.5}, dpsgd={"steps": 0})
    run = tmp_path / "r"
    train_run(cfg, _data(), run, n_synthetic=20, public_size=240, release=False)
    first = (run / "synthetic.npz").read_bytes()
    with (
        np.load(synthetic_set(run, 20, cfg.job.seed, name="again.npz")) as again,
        np.load(run / "synthetic.npz") as kept,
    ):
        # the signed job's own setting redraws train's set exactly: the bench's baseline is the real one
        assert np.array_equal(again["images"], kept["images"])
    with np.load(synthetic_set(run, 20, cfg.job.seed, sampler={"guidance": 2.0}, name="g.npz")) as guided:
        with np.load(run / "synthetic.npz") as kept:
            assert not np.allclose(guided["images"], kept["images"])
    assert (run / "synthetic.npz").read_bytes() == first


def test_an_aux_pool_handed_to_the_redraw_is_the_one_its_starts_are_drawn_from(tmp_path) -> None:
    """A sampler setting starting from the aux generator's pool, tried on a run that shipped none
    (``bench/resample.py``): the pool handed in, not a file in ``released/``, is what the starts come from."""
    from feta_release.release.jobdir import load_model

    cfg = load_preset("tiny").replace(sampler={"start_sigma": 0.5}, dpsgd={"steps": 0})
    run = tmp_path / "r"
    train_run(cfg, _data(), run, n_synthetic=10, public_size=240, release=False)
    model = load_model(run)
    labels = np.repeat(np.arange(model.n_classes, dtype=np.int64), 2)
    dark = (np.zeros((len(labels), *model.image_shape), np.float32), labels)
    light = (np.ones((len(labels), *model.image_shape), np.float32), labels)
    setting = {"start_sigma": 0.5, "start_source": "aux"}
    with (
        np.load(synthetic_set(run, 10, 0, sampler=setting, name="a.npz", aux=dark)) as a,
        np.load(synthetic_set(run, 10, 0, sampler=setting, name="b.npz", aux=light)) as b,
    ):
        assert a["images"].mean() < b["images"].mean()
