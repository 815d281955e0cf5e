"""Images larger than 28 px end to end: the xray64-eps10 preset's architecture and stage settings on 64x64
data read through the same crop option as the CLI (counts shrunk so the test takes seconds)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from feta_release.config import load_preset
from feta_release.data import LoadOptions, load_dataset


def _xray_like(root: Path, n: int = 60) -> Path:
    rng = np.random.default_rng(0)
    lines = ["path,label,patient_id"]
    for i in range(n):
        # wider than tall
        img = np.clip(rng.normal(120 + 60 * (i % 2), 30, (64, 80)), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(root / f"{i}.png")
        lines.append(f"{i}.png,{'effusion' if i % 2 else 'normal'},P{i // 3}")
    (root / "labels.csv").write_text("\n".join(lines) + "\n")
    return root / "labels.csv"


@pytest.mark.slow  # ~65 s of CPU (minutes on a loaded machine): a 3-level UNet at 64x64
def test_xray64_preset_trains_and_samples_64px(tmp_path: Path) -> None:
    from tests.support.training import train_run

    cfg = load_preset("xray64-eps10")
    assert (cfg.job.image_size, cfg.job.resize) == (64, "crop")
    data, report = load_dataset(
        _xray_like(tmp_path), **LoadOptions(cfg.job.resize, cfg.job.image_size, patient_cap=2).kwargs()
    )
    assert (
        data.image_shape == (1, 64, 64)
        and report.n_resized == 60
        and data.n == 40
        and report.n_patients == 20
    )
    small = cfg.replace(
        central={"batch": 20},
        frequency={"features": 32},
        warmup={
            "spatial_iterations": 2,
            "spatial_batch": 8,
            "frequency_images": 16,
            "frequency_epochs": 1,
            "frequency_batch": 8,
        },
        auxgen={"epochs": 1, "iterations_per_epoch": 2, "batch": 8},
        dpsgd={"batch": 8, "steps": 2, "physical_batch": 8},
        sampler={"steps": 2},
    )
    # a declared size: a noisy count of 40 images (std 50) could fall below the central batch (sizing is
    # tested in test_public_size_draw)
    res = train_run(small, data, tmp_path / "run", n_synthetic=4, public_size=40, release=False)
    with np.load(tmp_path / "run" / "synthetic.npz") as z:
        assert z["images"].shape[1:] in ((64, 64), (1, 64, 64), (64, 64, 1))
    assert res.epsilon <= 10.0
