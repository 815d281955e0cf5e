"""Release-only accuracy of central images split by NEAREST-PROTOTYPE cells, validation only (issue 15, epsilon = 10).

    python bench/prototype_cells_probe.py --run runs/e10c/validation/cpu-eps10-nodpsgd_auxe10/seed{SEED} \
        --rules s4,p4,p8 --out bench/results/e10-proto-cells.json

The slant cells (``[central] cells``) split each class by a fixed prior on ONE image statistic. Here each class is
split instead by the nearest of P public prototypes of that class: k-means centres of the run's aux-generator images
(post-processing of the frequency release, no new epsilon; the generator is ``checkpoints/auxgen.pt`` of a
``eval_protocol.py --mode validation`` run). An image's cell is a function of that image and the public prototypes
only, so it still adds one clipped vector to ONE sum: sensitivity C, the same event as one cell. ``{SEED}`` in
``--run`` is replaced by each noise seed, so every seed's prototypes come from its own frequency release. The
prototypes go to ``central_images(prototypes=...)`` (``[central] cell_rule = "aux"``'s path), fitted by the library's
``kmeans`` on 200 aux images per class. Held-out images are never loaded.
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


def cell_prototypes(spec: str, run: str, fit, args, seed: int):
    """(prototypes or None, first-round release or None) of one rule: ``sN`` slant (None), ``pN`` k-means centres of
    the run's aux images (the library's ``kmeans``), ``rN`` round 1's released slant-cell images at sigma*sqrt(2)."""
    from feta_release.mechanisms import central
    from feta_release.stages.prototypes import kmeans

    cells = int(spec[1:])
    if spec[0] == "p":
        aux = aux_images(Path(run.replace("{SEED}", str(seed))), fit.n_classes, 200, seed)
        return np.stack([kmeans(aux[k], cells, np.random.default_rng(seed)) for k in range(fit.n_classes)]), None
    if spec[0] == "r":  # two rounds at sigma*sqrt(2) (same RDP as one at sigma): slant, then nearest round-1 image
        first, _ = central.central_images(fit.images, fit.labels, fit.n_classes, kind="mean", rounds=1, batch=fit.n,
                                          sigma=args.sigma * 2 ** 0.5, clip=args.clip, downsample=0.5, n_public=fit.n,
                                          rng=np.random.default_rng(200 + seed), cells=cells)
        fimg, _ = central.postprocess_central(first, stretch=True)
        return fimg.reshape(fit.n_classes, cells, -1).astype(np.float64), first
    return None, None


def score(spec: str, fit, val, args, seed: int) -> tuple[float, int]:
    """Release-only accuracy of one rule on one noise seed, and the fewest fit images in one of its cells."""
    from feta_release.eval_protocol import release_only
    from feta_release.evaluation import accuracy, train_classifier
    from feta_release.mechanisms import central

    cells = int(spec[1:])
    protos, first = cell_prototypes(spec, args.run, fit, args, seed)
    own = (central.slant_cells(fit.images, cells) if protos is None
           else central.prototype_cells(fit.images, fit.labels, protos))
    fewest = int(np.bincount(fit.labels * cells + own, minlength=fit.n_classes * cells).min())
    rel, _ = central.central_images(fit.images, fit.labels, fit.n_classes, kind="mean", rounds=1, batch=fit.n,
                                    sigma=args.sigma * (2 ** 0.5 if first is not None else 1.0), clip=args.clip,
                                    downsample=0.5, n_public=fit.n, rng=np.random.default_rng(100 + seed),
                                    cells=cells, prototypes=protos)
    img, lab = central.postprocess_central(rel, stretch=True)
    if first is not None:
        fimg, flab = central.postprocess_central(first, stretch=True)
        img, lab = np.concatenate([fimg, img]), np.concatenate([flab, lab])
    ro = release_only(img, lab, fit.class_names, args.n, seed)
    return accuracy(train_classifier(ro, 5, seed), val), fewest


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
    from feta_release.eval_protocol import mean_std, protocol_splits

    torch.set_num_threads(args.threads)
    fit, val = protocol_splits(load_embedded(), "validation")
    rows = []
    for spec in args.rules.split(","):
        cells, t0 = int(spec[1:]), time.perf_counter()
        accs, occs = zip(*(score(spec, fit, val, args, int(s)) for s in args.seeds.split(",")))
        m, s = mean_std(accs)
        row = {"rule": spec, "cells": cells, "sigma": args.sigma, "acc": list(accs), "mean": round(m, 4),
               "std": round(s, 4), "min_cell": list(occs), "s": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
