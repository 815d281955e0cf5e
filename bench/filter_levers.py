"""Select the synthetic set from a larger pool (post-processing: no privacy cost), scored under the protocol.

    python bench/filter_levers.py --run runs/fkp0/validation/cpu-eps10-nodpsgd_p7s3/seed0 --seed 0 --extra 5000 \
        --out bench/results/filter-s0.json

The pool is the run's own ``synthetic.npz`` (the pipeline's draw) plus ``--extra`` images drawn the same way (the
run's model, its SDEdit sampler and start source) with another sampling seed. Each variant keeps ``--n`` balanced
images of the pool and trains the protocol classifier (seed = ``--seed``) on them, scored on the VALIDATION part
(the held-out part is never loaded):

- ``run``: the run's synthetic.npz as it is (the baseline: the pipeline's own figure);
- ``random``: a random balanced ``--n`` of the pool (control: a different draw, no selection);
- ``self``: 2-fold cross-fitted protocol classifiers on the pool; each image's p(its label) from the fold that did
  not see it; the top ``--n / classes`` of each class (drops images the set itself calls mislabelled);
- ``central``: a classifier trained on augmented copies of the released central images (the release-only
  baseline's set); the top of each class by its p(label) (drops images unlike the released digits).
Every selector sees only synthetic and released images: post-processing of the release.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np


def _draw(run: Path, job, labels: np.ndarray, seed: int):
    """``labels`` images drawn as the pipeline's synthetic set (SDEdit from the job's start source)."""
    import torch

    from feta_release.models.sampler import generate
    from feta_release.release.jobdir import load_model
    from feta_release.stages.synthesis import aux_taken, release_starts

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sampler_levers import _aux_starts  # bench sibling

    c = np.load(run / "released" / "central.npz")
    central = (c["images"].astype(np.float32), c["labels"].astype(np.int64))
    init = release_starts(central, labels, job, torch.Generator().manual_seed(77 + seed))
    if job.sampler.uses_aux:
        take = torch.from_numpy(aux_taken(labels, job.sampler.start_source))
        init[take] = _aux_starts(run, job, labels, 88 + seed)[take]
    cfg = replace(job.sampler, sigma_max=job.sampler.start_sigma)  # SDEdit: from the start level (synthesis.py)
    imgs, _ = generate(load_model(run), labels, 1_000 + seed, cfg, init=init)
    return imgs.numpy().astype(np.float32)


def _probs(net, x: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return torch.cat([torch.softmax(net(torch.from_numpy(x[i:i + 1000])), 1) for i in range(0, len(x), 1000)]).numpy()


def _top(score: np.ndarray, labels: np.ndarray, n: int, n_classes: int) -> np.ndarray:
    per = n // n_classes
    return np.concatenate([np.flatnonzero(labels == c)[np.argsort(-score[labels == c])[:per]] for c in range(n_classes)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--extra", type=int, default=5000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", default="run,random,self,central")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    from feta_release.config import JobConfig
    from feta_release.data import ImageDataset, load_embedded
    from feta_release.eval_protocol import balanced_labels, protocol_splits, release_only
    from feta_release.evaluation import accuracy, train_classifier

    torch.set_num_threads(args.threads)
    fit, val = protocol_splits(load_embedded(), "validation")
    names = fit.class_names
    job = JobConfig.from_dict(json.loads((args.run / "job.json").read_text("utf-8")), str(args.run / "job.json"))
    s = np.load(args.run / "synthetic.npz")
    own_x, own_y = s["images"].astype(np.float32), s["labels"].astype(np.int64)
    t0 = time.perf_counter()
    ex_y = balanced_labels(args.extra, fit.n_classes)
    ex_x = _draw(args.run, job, ex_y, 10_000 + args.seed)
    x, y = np.concatenate([own_x, ex_x]), np.concatenate([own_y, ex_y])
    rows = [{"variant": "pool", "size": len(y), "draw_s": round(time.perf_counter() - t0, 1)}]
    k = fit.n_classes
    for v in args.variants.split(","):
        t0 = time.perf_counter()
        if v == "run":
            keep = np.arange(len(own_y))
        elif v == "random":
            keep = _top(np.random.default_rng(args.seed).random(len(y)), y, args.n, k)
        elif v == "self":
            fold = np.random.default_rng(args.seed + 1).random(len(y)) < 0.5
            score = np.zeros(len(y))
            for f in (True, False):
                tr = fold == f
                net = train_classifier(ImageDataset(x[tr], y[tr], names, source="fold"), 5, args.seed + 100)
                score[~tr] = _probs(net, x[~tr])[np.arange(int((~tr).sum())), y[~tr]]
            keep = _top(score, y, args.n, k)
        elif v == "central":
            c = np.load(args.run / "released" / "central.npz")
            ro = release_only(c["images"], c["labels"], names, args.n, args.seed + 200)
            net = train_classifier(ro, 5, args.seed + 100)
            keep = _top(_probs(net, x)[np.arange(len(y)), y], y, args.n, k)
        else:
            raise SystemExit(f"unknown variant {v}")
        syn = ImageDataset(x[keep], y[keep], names, source=v)
        acc = accuracy(train_classifier(syn, 5, args.seed), val)
        rows.append({"variant": v, "acc": round(acc, 4), "from_extra": int((keep >= len(own_y)).sum()),
                     "s": round(time.perf_counter() - t0, 1)})
        print(json.dumps(rows[-1]), flush=True)
        Path(args.out).write_text(json.dumps({"run": str(args.run), "n": args.n, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
