"""A site's data as a hospital supplies it (PNG files listed in a labels CSV) and coordinator-chosen
weights."""

from __future__ import annotations

import numpy as np

BASE_LABELS = ["benign"] * 10 + ["malignant"] * 10


def csv_site(root, labels: list[str], colour: list[bool] | None = None):
    """A CSV site of 28x28 PNGs, one per label (``colour[i]``: image i is RGB, else greyscale)."""
    from PIL import Image

    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    rows = ["path,label"]
    for i, lab in enumerate(labels):
        if colour is not None and colour[i]:
            img = Image.fromarray((rng.random((28, 28, 3)) * 255).astype(np.uint8), mode="RGB")
        else:
            img = Image.fromarray((rng.random((28, 28)) * 255).astype(np.uint8), mode="L")
        img.save(root / f"{i:03d}.png")
        rows.append(f"{i:03d}.png,{lab}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n", "utf-8")
    return root / "labels.csv"


def perturbed_weights(cfg, seed: int = 0) -> dict[str, np.ndarray]:
    """Coordinator-chosen finite weights (the zero-initialised output convs make dropout invisible at
    init)."""
    import torch

    from feta_release.models import build_denoiser

    rng = np.random.default_rng(seed)
    out = {}
    for k, v in build_denoiser(cfg.model, (1, 28, 28), 10).state_dict().items():
        a = v.numpy()
        out[k] = a + 0.05 * rng.standard_normal(a.shape).astype(a.dtype) if v.dtype == torch.float32 else a
    return out
