"""Release-only accuracy of central images split by 2-D public cell rules (slant x ink / width), validation only.

    python bench/cell_rules_probe.py --sigma 0.65 --rules s4,s4i2,s4w2 --out bench/results/e10-cell-rules.json

A probe for issue 15 at epsilon = 10: the slant cells (``[central] cells``) flattened after 2-4 cells at central
epsilon 7.82 (docs/evaluation.md). Here each class is split by slant AND a second public function of the image
alone (ink = mean intensity, width = horizontal spread std in pixels) at FIXED edges (priors, not fitted). An
image still adds one clipped vector to one sum: sensitivity C, the same event as one cell. The probe patches the
cell function of ``central_images`` for the bench only. Held-out images are never loaded.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

INK_EDGES = {2: [0.13], 3: [0.10, 0.16]}  # mean intensity of a 28x28 digit: the public MNIST mean 0.1307 splits it
WIDTH_EDGES = {2: [3.2], 3: [2.6, 3.8]}  # horizontal std of the ink in pixels (a 20-px box: ~2-5)


def _ink(images: np.ndarray) -> np.ndarray:
    return images.astype(np.float64).mean(axis=(1, 2, 3))


def _width(images: np.ndarray) -> np.ndarray:
    x = images.astype(np.float64).mean(axis=1)
    c = np.arange(x.shape[2], dtype=np.float64)[None, None, :]
    m = np.maximum(x.sum(axis=(1, 2)), 1e-12)
    mc = (x * c).sum(axis=(1, 2)) / m
    return np.sqrt((x * (c - mc[:, None, None]) ** 2).sum(axis=(1, 2)) / m)


def rule(spec: str):
    """'s4i2' -> (cells, fn): 4 slant bins x 2 ink bins; 'w' = width."""
    import re

    from feta_release.mechanisms import central

    parts = re.findall(r"([siw])(\d+)", spec)
    sizes = [int(k) for _, k in parts]
    total = int(np.prod(sizes))
    orig = central.slant_cells

    def fn(images: np.ndarray, cells: int) -> np.ndarray:
        idx = np.zeros(len(images), dtype=np.int64)
        for kind, k in parts:
            k = int(k)
            if kind == "s":
                b = orig(images, k)
            elif kind == "i":
                b = np.searchsorted(INK_EDGES[k], _ink(images))
            else:
                b = np.searchsorted(WIDTH_EDGES[k], _width(images))
            idx = idx * k + b
        return idx

    return total, fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--sigma", type=float, default=0.65)
    ap.add_argument("--clip", type=float, default=2.0)
    ap.add_argument("--rules", default="s4,s4i2,s4w2,s3i2w2")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch

    from feta_release.data import load_embedded
    from feta_release.eval_protocol import mean_std, protocol_splits, release_only
    from feta_release.evaluation import accuracy, train_classifier
    from feta_release.mechanisms import central

    torch.set_num_threads(args.threads)
    fit, val = protocol_splits(load_embedded(), "validation")
    rows = []
    for spec in args.rules.split(","):
        cells, fn = rule(spec)
        occ = np.bincount(fit.labels * cells + fn(fit.images, cells), minlength=fit.n_classes * cells)
        orig = central.slant_cells
        central.slant_cells = fn
        try:
            accs, t0 = [], time.perf_counter()
            for seed in (int(s) for s in args.seeds.split(",")):
                rel, _ = central.central_images(fit.images, fit.labels, fit.n_classes, kind="mean", rounds=1,
                                                batch=fit.n, sigma=args.sigma, clip=args.clip, downsample=0.5,
                                                n_public=fit.n, rng=np.random.default_rng(100 + seed), cells=cells)
                img, lab = central.postprocess_central(rel, stretch=True)
                ro = release_only(img, lab, fit.class_names, args.n, seed)
                accs.append(accuracy(train_classifier(ro, 5, seed), val))
        finally:
            central.slant_cells = orig
        m, s = mean_std(accs)
        row = {"rule": spec, "cells": cells, "sigma": args.sigma, "acc": accs, "mean": round(m, 4),
               "std": round(s, 4), "min_cell": int(occ.min()), "empty_cells": int((occ == 0).sum()),
               "s": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
