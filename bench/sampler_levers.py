"""Sampler settings of a FINISHED validation run, scored under the protocol (post-processing: no privacy cost).

    python bench/sampler_levers.py --run runs/q4/lean/validation/RUN/seed0 --variants "heun8:heun:8;heun16:heun:16"

Each variant ``name:solver:steps[:guidance]`` draws ``--n`` balanced images from the run's model.pt with the same
sampling seed, trains the protocol classifier (seed 0) on them and scores it on the VALIDATION part (fit 3,200 /
validation 800; the held-out part is never loaded). The run must come from ``eval_protocol.py --mode validation``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, type=Path)
    ap.add_argument("--variants", required=True, help="name:solver:steps[:guidance];...")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    from feta_release.config import SamplerSection
    from feta_release.data import ImageDataset, load_embedded
    from feta_release.eval_protocol import balanced_labels, protocol_splits
    from feta_release.evaluation import accuracy, train_classifier
    from feta_release.models.sampler import generate
    from feta_release.release.jobdir import load_model

    torch.set_num_threads(args.threads)
    fit, val = protocol_splits(load_embedded(), "validation")
    model = load_model(args.run)
    labels = balanced_labels(args.n, fit.n_classes)
    rows = []
    for spec in args.variants.split(";"):
        name, solver, steps, *rest = spec.split(":")
        cfg = replace(SamplerSection(), solver=solver, steps=int(steps), guidance=float(rest[0]) if rest else 0.0)
        t0 = time.perf_counter()
        imgs, _ = generate(model, labels, 1_000 + args.seed, cfg)
        syn = ImageDataset(imgs.numpy().astype(np.float32), np.asarray(labels), fit.class_names, source=name)
        acc = accuracy(train_classifier(syn, 5, args.seed), val)
        rows.append({"variant": name, "solver": solver, "steps": int(steps), "guidance": cfg.guidance,
                     "acc": round(acc, 4), "s": round(time.perf_counter() - t0, 1)})
        print(json.dumps(rows[-1]), flush=True)
        Path(args.out).write_text(json.dumps({"run": str(args.run), "n": args.n, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
