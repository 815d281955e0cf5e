"""[sampler] start_source: SDEdit starts of the run's synthetic set from the aux generator's images ("aux")
or every other one ("mix"); the aux generator is fitted to the noised frequency release, so its images are
post-processing of a release. The default ("central") draws exactly as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from feta_release.config import load_preset
from feta_release.errors import ConfigError
from feta_release.models.auxgen import AuxGenerator
from feta_release.release.starts import aux_mask, index_within_class
from feta_release.stages.freq_warmup import AUX_POOL_PER_CLASS, aux_pool
from tests.support.single_thread import single_thread  # noqa: F401  (autouse fixture)
from tests.support.training import embedded_subset as _data
from tests.support.training import job, train_run

FREQ = {"sigma": 10.0, "features": 64}


def _aux(n_classes: int = 2, size: int = 16) -> AuxGenerator:
    torch.manual_seed(0)
    return AuxGenerator(1, size, n_classes, z_dim=4, width=4).eval()


# -- config
# ---------------------------------------------------------------------------------------------------


def test_default_is_central_and_presets_keep_it() -> None:
    assert job().sampler.start_source == "central"
    assert load_preset("tiny").sampler.start_source == "central"


def test_a_default_job_hashes_as_before_the_option_existed() -> None:
    """The default is left out of the job's dict: job hashes, signed jobs, ledgers and model.pt of every job
    that does not use the option stay byte for byte what they were (a run directory of the older code
    resumes)."""
    from feta_release.config import JobConfig

    tiny = load_preset("tiny")
    assert "start_source" not in tiny.to_dict()["sampler"] and JobConfig.from_dict(tiny.to_dict()) == tiny
    mix = tiny.replace(sampler={"start_sigma": 1.0, "start_source": "mix"})
    assert mix.to_dict()["sampler"]["start_source"] == "mix" and JobConfig.from_dict(mix.to_dict()) == mix


def test_an_unknown_start_source_is_refused_naming_the_allowed_values() -> None:
    with pytest.raises(ConfigError, match="start_source: 'noise' is not one of 'central', 'aux', 'mix'"):
        job(sampler={"start_source": "noise", "start_sigma": 1.0})


@pytest.mark.parametrize("source", ["aux", "mix"])
def test_aux_and_mix_need_start_sigma(source: str) -> None:
    with pytest.raises(ConfigError, match=f'start_source = "{source}" needs start_sigma'):
        job(frequency=FREQ, sampler={"start_source": source})


@pytest.mark.parametrize("source", ["aux", "mix"])
def test_aux_and_mix_need_the_frequency_stage(source: str) -> None:
    with pytest.raises(ConfigError, match=r"only the frequency stage fits: set \[frequency\] sigma"):
        job(sampler={"start_source": source, "start_sigma": 1.0})  # frequency off by default
    with pytest.raises(ConfigError, match="only the frequency stage fits"):  # a method that switches it off
        job(job={"method": "dp-feta"}, frequency=FREQ, sampler={"start_source": source, "start_sigma": 1.0})


def test_mix_needs_central_images_but_aux_does_not() -> None:
    with pytest.raises(ConfigError, match=r'"mix" takes half its starts from the released central images'):
        job(central={"rounds": 0}, frequency=FREQ, sampler={"start_source": "mix", "start_sigma": 1.0})
    cfg = job(central={"rounds": 0}, frequency=FREQ, sampler={"start_source": "aux", "start_sigma": 1.0})
    assert cfg.sampler.start_source == "aux"


# -- the starts
# -----------------------------------------------------------------------------------------------


def test_mix_alternates_within_each_class() -> None:
    """Even index within its class: aux (the set's labels are interleaved, so position parity would give whole
    classes to one source when the class count is even)."""
    labels = np.tile(np.arange(10), 3)
    take = aux_mask("mix", index_within_class(labels))
    for c in range(10):
        assert take[labels == c].tolist() == [True, False, True]
    assert aux_mask("aux", index_within_class(labels)).all()


def test_the_pool_is_public_count_per_class_and_seeded_by_the_job() -> None:
    aux, cfg = _aux(3), job(job={"seed": 4})
    images, labels = aux_pool(aux, cfg)
    assert np.bincount(labels).tolist() == [AUX_POOL_PER_CLASS] * 3 and labels.dtype == np.int64
    assert images.dtype == np.float32 and images.shape == (3 * AUX_POOL_PER_CLASS, 1, 16, 16)
    assert images.min() >= 0 and images.max() <= 1
    again, _ = aux_pool(aux, cfg)
    other, _ = aux_pool(aux, job(job={"seed": 5}))
    assert np.array_equal(images, again) and not np.array_equal(images, other)


def _spied_run(tmp_path, monkeypatch, cfg, name: str) -> tuple[list, np.lib.npyio.NpzFile]:  # noqa: ANN001
    """A ``train`` run whose synthetic set's sampler calls are recorded (labels, sigma_max, start images)."""
    from feta_release.release import jobdir

    inits: list = []
    real_generate = jobdir.generate

    def gen_spy(model, labels, seed, scfg, **kw):  # noqa: ANN001, ANN202
        inits.append((np.asarray(labels).copy(), scfg.sigma_max, kw.get("init")))
        return real_generate(model, labels, seed, scfg, **kw)

    monkeypatch.setattr(jobdir, "generate", gen_spy)
    train_run(cfg, _data(), tmp_path / name, n_synthetic=30, public_size=240, release=False)
    return inits, np.load(tmp_path / name / "synthetic.npz")


@pytest.mark.slow  # two tiny runs
def test_a_mix_run_starts_its_synthetic_set_from_the_aux_pool_it_writes(tmp_path, monkeypatch) -> None:
    cfg = load_preset("tiny").replace(sampler={"start_sigma": 1.0, "start_source": "mix"}, dpsgd={"steps": 0})
    inits, z = _spied_run(tmp_path, monkeypatch, cfg, "mix")
    labels, sigma_max, init = inits[-1]
    assert sigma_max == 1.0 and init is not None and tuple(init.shape) == (30, 1, 28, 28)
    assert np.bincount(z["labels"]).tolist() == [3] * 10 and np.array_equal(labels, z["labels"])
    with np.load(tmp_path / "mix" / "released" / "aux_images.npz") as pool:
        assert np.bincount(pool["labels"]).tolist() == [AUX_POOL_PER_CLASS] * 10
    # the default: no aux generator pool, central starts
    cfg0 = load_preset("tiny").replace(sampler={"start_sigma": 1.0}, dpsgd={"steps": 0})
    inits0, _ = _spied_run(tmp_path, monkeypatch, cfg0, "central")
    assert inits0[-1][2] is not None and not (tmp_path / "central" / "released" / "aux_images.npz").exists()
