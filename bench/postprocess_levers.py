"""Post-processing of a finished run's synthetic set, scored on the validation part (issue 15 probe).

The released central images carry the Gaussian noise of their release (speckle on the background, sharpened by the
contrast stretch), the denoiser learns that texture, and the synthetic images keep it, while real digits have an
exactly black background. This probe trains the protocol classifier on the run's ``synthetic.npz`` after a
per-image map (post-processing: no privacy cost) and scores it on the validation part:

    none          as released
    floorT        soft background floor: x -> max(x - T, 0) / (1 - T)
    medianK       K x K median filter
    blur          3x3 binomial blur
    stretch       per-image contrast stretch (``mechanisms.central.stretch_contrast``: quantile 0.6 -> 0, 0.98 -> 1);
                  stretchLO-HI with other quantiles (e.g. stretch0.5-0.95)
    sigT          sigmoid sharpening around T: x -> s(12 (x - T)) rescaled so 0 -> 0 and 1 -> 1 (bright strokes, black
                  background, as real digits; a public prior on the data kind, like the stretch)
    A+B           B after A (e.g. ``blur+sig0.4``)

    python bench/postprocess_levers.py --run runs/e10b/protocol/validation/cpu-eps10-nodpsgd/seed0 --seed 0 \
        --variants none,floor0.1,floor0.2,median3 --out bench/results/post-s0.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def apply(name: str, x: np.ndarray) -> np.ndarray:
    """The post-processing ``name`` of float32 images (N, C, H, W) in [0, 1]."""
    import torch
    import torch.nn.functional as F

    if "+" in name:
        for part in name.split("+"):
            x = apply(part, x)
        return x
    if name == "none":
        return x
    if name.startswith("stretch"):  # stretch, or stretchLO-HI with the two quantiles
        from feta_release.mechanisms.central import stretch_contrast

        q = [float(v) for v in name[7:].split("-")] if name != "stretch" else []
        return stretch_contrast(x, *q)
    if name.startswith("sig"):
        t = float(name[3:])
        lo, hi = 1 / (1 + np.exp(12 * t)), 1 / (1 + np.exp(-12 * (1 - t)))
        return ((1 / (1 + np.exp(-12 * (x - t))) - lo) / (hi - lo)).clip(0, 1).astype(np.float32)
    if name.startswith("floor"):
        t = float(name[5:])
        return (np.maximum(x - t, 0.0) / (1.0 - t)).astype(np.float32)
    t = torch.from_numpy(x)
    if name.startswith("median"):
        k = int(name[6:])
        p = F.pad(t, (k // 2,) * 4, mode="replicate").unfold(2, k, 1).unfold(3, k, 1)
        return p.reshape(*p.shape[:4], -1).median(-1).values.numpy().astype(np.float32)
    if name == "blur":
        w = torch.tensor([1.0, 2.0, 1.0])
        w = (w[:, None] * w[None, :] / 16).reshape(1, 1, 3, 3).repeat(t.shape[1], 1, 1, 1)
        return F.conv2d(F.pad(t, (1,) * 4, mode="replicate"), w, groups=t.shape[1]).numpy().astype(np.float32)
    raise SystemExit(f"unknown variant {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, type=Path)
    ap.add_argument("--variants", default="none,floor0.1,floor0.2,median3,blur")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    from feta_release.data import ImageDataset, load_embedded
    from feta_release.eval_protocol import protocol_splits
    from feta_release.evaluation import accuracy, train_classifier

    torch.set_num_threads(args.threads)
    _, val = protocol_splits(load_embedded(), "validation")
    syn = np.load(args.run / "synthetic.npz")
    rows = []
    for name in args.variants.split(","):
        t0 = time.perf_counter()
        ds = ImageDataset(apply(name, syn["images"].astype(np.float32)), syn["labels"].astype(np.int64),
                          val.class_names, source=name)
        rows.append({"variant": name, "acc": round(accuracy(train_classifier(ds, 5, args.seed), val), 4),
                     "s": round(time.perf_counter() - t0, 1)})
        print(json.dumps(rows[-1]), flush=True)
        Path(args.out).write_text(json.dumps({"run": str(args.run), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
