"""The warm-up is post-processing of the released statistics with public seeds only: from a ``train`` run's
job directory (the site's releases as the coordinator collected them), the coordinator's warm-up reaches
exactly the weights the run warmed up to, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from feta_release.config import JobConfig, load_preset
from feta_release.data import ImageDataset, load_embedded
from feta_release.errors import DataError
from feta_release.federation import checkpoint_io
from feta_release.federation.warmup import pooled_central, pooled_frequency, warm_up
from feta_release.stages.context import initial_denoiser
from tests.support.training import train_run


def _data(n: int = 200) -> ImageDataset:
    full = load_embedded()
    rng = np.random.default_rng(3)
    idx = np.concatenate(
        [rng.choice(np.flatnonzero(full.labels == c), n // 10, replace=False) for c in range(10)]
    )
    return full.subset(np.sort(idx))


def _released(run: Path) -> tuple[JobConfig, dict[str, np.ndarray], dict[str, np.ndarray], int]:
    """What the run's site released, as the coordinator collected it (the raw central release, the frequency
    release), the signed job and the public size."""
    cfg = JobConfig.from_dict(json.loads((run / "signed_job.json").read_text("utf-8"))["job"]["config"])
    sid = json.loads((run / "signed_job.json").read_text("utf-8"))["job"]["sites"][0]
    with np.load(run / "state" / f"central_{sid}.npz") as z:
        central = {k: z[k] for k in z.files}
    with np.load(run / "state" / f"frequency_{sid}.npz") as z:
        freq = {k: z[k] for k in z.files}
    n_public = int(json.loads((run / "plan.json").read_text("utf-8"))[sid]["size"])
    return cfg, central, freq, n_public


@pytest.mark.parametrize("mix,polish", [(False, 0), (True, 0), (True, 6)], ids=["aux", "mix", "mix+polish"])
def test_the_warm_up_of_a_train_run_is_a_public_function_of_its_releases(
    tmp_path: Path, mix: bool, polish: int
) -> None:
    cfg = load_preset("tiny").replace(
        dpsgd={"steps": 0},
        central={"stretch": True},
        warmup={"frequency_mix_central": mix, "polish_iterations": polish},
    )
    run = tmp_path / "run"
    train_run(cfg, _data(), run, public_size=200, release=False)
    ck = checkpoint_io.load_warmup(run / "state")
    assert ck is not None
    local = ck["model"]
    eff, central, freq, n_pub = _released(run)

    model = initial_denoiser(eff, (1, 28, 28), 10)
    warm_up(model, {"site-a": central}, {"site-a": freq}, eff, {"site-a": n_pub}, lambda msg: None)
    fed = model.state_dict()
    assert local.keys() == fed.keys()
    assert all(torch.equal(local[k], fed[k]) for k in local)

    # and the stage really moved the weights: the comparison is not of two untouched inits
    init = initial_denoiser(eff, (1, 28, 28), 10).state_dict()
    assert not all(torch.equal(init[k], fed[k]) for k in init)
    # the combined central images of one site are its own post-processed release
    images, labels = pooled_central({"site-a": central}, {"site-a": n_pub}, eff)
    with np.load(run / "released" / "central.npz") as z:
        assert np.array_equal(images, z["images"]) and np.array_equal(labels, z["labels"])


def test_a_frequency_release_for_other_features_is_refused() -> None:
    cfg = load_preset("tiny")
    arrays = {
        "embedding": np.zeros((64, 10), np.float32),
        "n_public": np.int64(100),
        "features": np.int64(64),
        "bandwidth2": np.float64(cfg.frequency.bandwidth2),
        "seed": np.int64(cfg.frequency.seed + 1),
        "sigma": np.float64(10.0),
    }
    with pytest.raises(DataError, match="not made for this job"):
        pooled_frequency({"a": arrays}, {"a": 100}, cfg)
