"""Release-only accuracy of central images split by NEAREST-PROTOTYPE cells, validation only (issue 15, epsilon = 10).

    python bench/prototype_cells_probe.py --run runs/e10c/validation/cpu-eps10-nodpsgd_auxe10/seed{SEED} \
        --rules s4,p4,p8 --out bench/results/e10-proto-cells.json

The slant cells (``[central] cells``) split each class by a fixed prior on ONE image statistic. Here each class is
split instead by the nearest of P public prototypes of that class: k-means centres of the run's aux-generator images
(post-processing of the frequency release, no new epsilon; the generator is ``checkpoints/auxgen.pt`` of a
``eval_protocol.py --mode validation`` run). An image's cell is a function of that image and the public prototypes
only, so it still adds one clipped vector to ONE sum: sensitivity C, the same event as one cell. ``{SEED}`` in
``--run`` is replaced by each noise seed, so every seed's prototypes come from its own frequency release. The probe
patches the cell function of ``central_images`` for the bench only. Held-out images are never loaded.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def aux_images(run: Path, n_classes: int, per_class: int, seed: int) -> np.ndarray:
    """(n_classes, per_class, 784) aux-generator images of each class from the run's fitted generator."""
    import torch

    from feta_release.config import JobConfig
    from feta_release.models.auxgen import AuxGenerator
    from feta_release.training.checkpoint import load_torch

    job = JobConfig.from_dict(json.loads((run / "job.json").read_text("utf-8")), str(run / "job.json"))
    a = job.auxgen
    gen = AuxGenerator(1, 28, n_classes, z_dim=a.z_dim, width=a.width)
    gen.load_state_dict(load_torch(run / "checkpoints" / "auxgen.pt")["model"])
    gen.eval()
    g = torch.Generator().manual_seed(1000 + seed)
    y = torch.arange(n_classes).repeat_interleave(per_class)
    with torch.no_grad():
        x = gen(torch.randn((len(y), a.z_dim), generator=g), y).clamp(0, 1)
    return x.reshape(n_classes, per_class, -1).numpy().astype(np.float64)


def kmeans(x: np.ndarray, k: int, seed: int, iters: int = 30) -> np.ndarray:
    """(k, d) centres of x (m, d): k-means++ start, Lloyd steps (post-processing of public images)."""
    rng = np.random.default_rng(seed)
    c = [x[rng.integers(len(x))]]
    for _ in range(1, k):
        d2 = np.min(((x[:, None, :] - np.asarray(c)[None]) ** 2).sum(-1), axis=1)
        c.append(x[rng.choice(len(x), p=d2 / d2.sum())])
    c = np.asarray(c)
    for _ in range(iters):
        a = np.argmin(((x[:, None, :] - c[None]) ** 2).sum(-1), axis=1)
        c = np.asarray([x[a == j].mean(0) if (a == j).any() else c[j] for j in range(k)])
    return c


def proto_rule(protos: np.ndarray, labels: np.ndarray):
    """cell fn: each image's nearest prototype of ITS class (``labels``: the probe's fit labels, same order)."""
    def fn(images: np.ndarray, cells: int) -> np.ndarray:
        lab = labels
        flat = images.reshape(len(images), -1).astype(np.float64)
        d2 = ((flat[:, None, :] - protos[lab]) ** 2).sum(-1)  # (N, P)
        return np.argmin(d2, axis=1).astype(np.int64)
    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="validation run dir with {SEED}")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--sigma", type=float, default=0.65)
    ap.add_argument("--clip", type=float, default=2.0)
    ap.add_argument("--rules", default="s4,p4,p8")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch

    from feta_release.data import load_embedded
    from feta_release.eval_protocol import mean_std, protocol_splits, release_only
    from feta_release.evaluation import accuracy, train_classifier
    from feta_release.mechanisms import central

    torch.set_num_threads(args.threads)
    fit, val = protocol_splits(load_embedded(), "validation")
    orig = central.slant_cells
    rows = []
    for spec in args.rules.split(","):
        cells = int(spec[1:])
        accs, t0, occs = [], time.perf_counter(), []
        for seed in (int(s) for s in args.seeds.split(",")):
            first = None
            if spec[0] == "r":  # two rounds at sigma*sqrt(2) (same RDP as one at sigma): slant, then nearest round-1 image
                first, _ = central.central_images(fit.images, fit.labels, fit.n_classes, kind="mean", rounds=1,
                                                  batch=fit.n, sigma=args.sigma * 2 ** 0.5, clip=args.clip,
                                                  downsample=0.5, n_public=fit.n,
                                                  rng=np.random.default_rng(200 + seed), cells=cells)
                fimg, _ = central.postprocess_central(first, stretch=True)
                protos = fimg.reshape(fit.n_classes, cells, -1).astype(np.float64)
                fn = proto_rule(protos, fit.labels)
            elif spec[0] == "p":
                aux = aux_images(Path(args.run.replace("{SEED}", str(seed))), fit.n_classes, 200, seed)
                protos = np.stack([kmeans(aux[k], cells, seed) for k in range(fit.n_classes)])
                fn = proto_rule(protos, fit.labels)
            else:
                fn = orig
            occs.append(int(np.bincount(fit.labels * cells + fn(fit.images, cells), minlength=fit.n_classes * cells).min()))
            central.slant_cells = fn
            try:
                sig = args.sigma * (2 ** 0.5 if first is not None else 1.0)
                rel, _ = central.central_images(fit.images, fit.labels, fit.n_classes, kind="mean", rounds=1,
                                                batch=fit.n, sigma=sig, clip=args.clip, downsample=0.5,
                                                n_public=fit.n, rng=np.random.default_rng(100 + seed), cells=cells)
            finally:
                central.slant_cells = orig
            img, lab = central.postprocess_central(rel, stretch=True)
            if first is not None:
                fimg, flab = central.postprocess_central(first, stretch=True)
                img, lab = np.concatenate([fimg, img]), np.concatenate([flab, lab])
            ro = release_only(img, lab, fit.class_names, args.n, seed)
            accs.append(accuracy(train_classifier(ro, 5, seed), val))
        m, s = mean_std(accs)
        row = {"rule": spec, "cells": cells, "sigma": args.sigma, "acc": accs, "mean": round(m, 4), "std": round(s, 4),
               "min_cell": occs, "s": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
