"""``[warmup] frequency_mix_central``: the frequency warm-up set also holds augmented released central
images."""

from __future__ import annotations

import numpy as np
import torch

from feta_release.config import load_preset
from feta_release.stages import mix_central


def _central(n_classes: int = 3, per_class: int = 2) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(n_classes), per_class)
    return rng.random((len(y), 1, 8, 8)).astype(np.float32), y.astype(np.int64)


def test_off_by_default_and_without_central_images() -> None:
    x, y = torch.rand(12, 1, 8, 8), torch.arange(12) % 3
    off = load_preset("tiny")
    assert off.warmup.frequency_mix_central is False
    assert mix_central(x, y, _central(), off, torch.Generator())[0] is x
    on = off.replace(warmup={"frequency_mix_central": True})
    assert mix_central(x, y, None, on, torch.Generator())[0] is x  # dp-feta / freq-only: nothing to mix


def test_mix_adds_as_many_augmented_central_images_with_their_labels() -> None:
    x, y = torch.rand(12, 1, 8, 8), torch.arange(12) % 3
    cimg, clab = _central()
    cfg = load_preset("tiny").replace(warmup={"frequency_mix_central": True})
    mx, my = mix_central(x, y, (cimg, clab), cfg, torch.Generator().manual_seed(0))
    assert mx.shape == (24, 1, 8, 8) and my.shape == (24,)
    assert torch.equal(mx[:12], x) and torch.equal(my[:12], y)
    assert torch.equal(my[12:], torch.from_numpy(np.resize(clab, 12)))  # cycled over the release, labels kept
    assert float(mx.min()) >= 0 and float(mx.max()) <= 1
    # augmented, not verbatim copies
    assert not all(torch.equal(mx[12 + i], torch.from_numpy(cimg[i % 6])) for i in range(12))
    again = mix_central(x, y, (cimg, clab), cfg, torch.Generator().manual_seed(0))
    assert torch.equal(again[0], mx)
