"""Release-only accuracy of the central images at a FIXED central epsilon, on the validation split.

    python bench/central_sweep.py --out bench/results/central-sweep.json

The central images are the stage the cpu-eps1 diagnosis found to bound everything after it (docs/evaluation.md).
Each row: (rounds, rate, downsample, clip) with sigma calibrated so the central release alone costs the preset's
epsilon; score = the protocol classifier trained on 2,000 augmented copies, scored on the 800 validation images,
mean ± std over noise seeds. Held-out images are never loaded.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/central-sweep.json")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--target-epsilon", type=float, default=None, help="central epsilon (default: the old preset's 0.360)")
    ap.add_argument("--configs", default="", help="ROUNDS:Q:CLIP:STRETCH[:CELLS],... (STRETCH 0/1, CELLS slant cells per class, "
                    "default 1); default: the grid below")
    args = ap.parse_args()
    import torch

    from feta_release.accounting import PrivacyEvent, epsilon
    from feta_release.data import load_embedded
    from feta_release.eval_protocol import mean_std, protocol_splits, release_only
    from feta_release.evaluation import accuracy, train_classifier
    from feta_release.mechanisms.central import central_images, postprocess_central

    torch.set_num_threads(args.threads)
    fit, val = protocol_splits(load_embedded(), "validation")
    target = args.target_epsilon or epsilon([PrivacyEvent("central", 8.0, 0.5, 2)], 1e-5)  # the old preset's setting

    def sigma_for(rounds: int, q: float) -> float:
        lo, hi = 0.3, 200.0  # epsilon falls as sigma grows: bisection
        for _ in range(40):
            mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if epsilon([PrivacyEvent("central", mid, q, rounds)], 1e-5) > target else (lo, mid)
        return hi

    rows = []
    grid = [(2, 0.5, 0.5, 3.0, False, 1), (1, 0.5, 0.5, 3.0, False, 1), (1, 1.0, 0.5, 3.0, False, 1),
            (2, 1.0, 0.5, 3.0, False, 1), (2, 0.5, 0.5, 2.0, False, 1), (1, 1.0, 0.5, 2.0, False, 1)]
    if args.configs:
        grid = [(int(f[0]), float(f[1]), 0.5, float(f[2]), f[3] == "1", int(f[4]) if len(f) > 4 else 1)
                for f in (x.split(":") for x in args.configs.split(","))]
    for rounds, q, ds, clip, stretch, cells in grid:
        sigma = sigma_for(rounds, q)
        accs = []
        t0 = time.perf_counter()
        for seed in (int(s) for s in args.seeds.split(",")):
            rel, _ = central_images(fit.images, fit.labels, fit.n_classes, kind="mean", rounds=rounds,
                                    batch=max(1, round(q * fit.n)), sigma=sigma, clip=clip, downsample=ds, bins=2,
                                    n_public=fit.n, rng=np.random.default_rng(100 + seed), cells=cells)
            img, lab = postprocess_central(rel, stretch=stretch)
            ro = release_only(img, lab, fit.class_names, args.n, seed)
            accs.append(accuracy(train_classifier(ro, 5, seed), val))
        m, s = mean_std(accs)
        row = {"rounds": rounds, "q": q, "downsample": ds, "clip": clip, "stretch": stretch, "cells": cells,
               "sigma": round(sigma, 3), "noise_per_pixel": round(sigma * clip * cells / (q * fit.n / fit.n_classes), 4),
               "acc": accs,
               "mean": round(m, 4), "std": round(s, 4), "s": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump({"target_central_epsilon": target, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
