"""The central polish ([warmup] polish_iterations): low-lr steps on the released central images after the last
warm-up stage; off by default, counted and validated, run by the pipeline and by the coordinator's warm-up."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from feta_release.config import load_preset
from feta_release.errors import ConfigError
from feta_release.models import build_denoiser
from feta_release.progress_events import POLISH
from feta_release.stages.spatial import central_polish
from tests.support.single_thread import single_thread  # noqa: F401  (autouse fixture)
from tests.support.training import TINY, bars, fixed_noise_loss, job, train_run
from tests.support.training import embedded_subset as _data


def _central() -> tuple[np.ndarray, np.ndarray]:
    x, y = bars()
    return x.numpy(), y.numpy()


def test_polish_off_by_default_leaves_model_unchanged() -> None:
    d = build_denoiser(TINY, (1, 16, 16), 2)
    before = {k: v.clone() for k, v in d.state_dict().items()}
    assert job().warmup.polish_iterations == 0
    assert central_polish(d, _central(), job()) is None
    assert all(torch.equal(before[k], v) for k, v in d.state_dict().items())


def test_polish_runs_its_steps_at_its_own_lr_and_lowers_the_loss() -> None:
    torch.manual_seed(0)
    d = build_denoiser(TINY, (1, 16, 16), 2)
    x, y = bars()
    cfg = job(
        warmup={
            "spatial_iterations": 7,
            "spatial_batch": 4,
            "polish_iterations": 80,
            "polish_lr": 2e-3,
            "ema": 0.9,
        }
    )
    before = fixed_noise_loss(d, x, y)
    res = central_polish(d, _central(), cfg)
    assert res is not None and res.steps == 80  # the polish count, not spatial_iterations
    assert fixed_noise_loss(d, x, y) < 0.8 * before


def test_polish_lr_matters() -> None:
    outs = []
    for lr in (1e-4, 2e-3):
        torch.manual_seed(1)
        d = build_denoiser(TINY, (1, 16, 16), 2)
        central_polish(
            d, _central(), job(warmup={"polish_iterations": 3, "polish_lr": lr, "spatial_batch": 4})
        )
        outs.append(torch.cat([p.flatten() for p in d.parameters()]))
    assert not torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("over", [{"polish_iterations": -1}, {"polish_lr": 0.0}, {"polish_lr": -1e-3}])
def test_bad_polish_values_are_refused(over: dict) -> None:
    with pytest.raises(ConfigError, match="polish"):
        load_preset("tiny").replace(warmup=over)


def test_polish_is_allowed_in_federated_jobs() -> None:
    """The coordinator's warm-up polishes on the combined central images
    (tests/training/test_warmup_shared.py: a federation of one reaches the local driver's weights bit for bit,
    polish included)."""
    cfg = load_preset("tiny").replace(warmup={"polish_iterations": 5}, federation={"sites": ("a", "b")})
    assert cfg.warmup.polish_iterations == 5


@pytest.mark.parametrize("frequency", [True, False])
def test_train_runs_the_polish_once_after_the_last_warmup(tmp_path, frequency: bool) -> None:
    cfg = load_preset("tiny").replace(warmup={"polish_iterations": 4}, dpsgd={"steps": 0})
    if not frequency:  # no frequency warm-up: the polish ends the spatial stage instead
        cfg = cfg.replace(frequency={"sigma": None})
    train_run(cfg, _data(), tmp_path / "r", public_size=240, release=False)
    lines = (tmp_path / "r" / "progress.jsonl").read_text().splitlines()
    said = [json.loads(line)["message"] for line in lines if json.loads(line)["phase"] == "warmup"]
    polish = [i for i, m in enumerate(said) if m.startswith(f"{POLISH} done")]
    last = max(i for i, m in enumerate(said) if " warm-up done" in m)
    assert len(polish) == 1 and polish[0] > last  # once, after the last warm-up stage
    assert any(m.startswith("frequency warm-up done") for m in said) == frequency
