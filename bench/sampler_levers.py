"""Sampler settings of a FINISHED validation run, scored under the protocol (post-processing: no privacy cost).

    python bench/sampler_levers.py --run runs/q4/lean/validation/RUN/seed0 --variants "heun8:heun:8;heun16:heun:16"

Each variant ``name:solver:steps[:guidance[:start_sigma[:source]]]`` draws ``--n`` balanced images from the run's
model.pt with the same sampling seed, trains the protocol classifier (seed 0) on them and scores it on the
VALIDATION part (fit 3,200 / validation 800; the held-out part is never loaded). The run must come from
``eval_protocol.py --mode validation``. ``--mode test`` (a run of ``eval_protocol.py --mode test``) scores on the
held-out part instead: only for the one final figure of a variant already chosen on validation.
With ``start_sigma`` the images are drawn as the pipeline's synthetic set is with ``[sampler] start_sigma``: SDEdit
from RandAugment-ed copies of the run's released central images (``released/central.npz``) plus N(0, start_sigma^2)
noise (post-processing of the release). ``source`` (default ``central``): ``aux`` starts from the run's auxiliary
generator images (``checkpoints/auxgen.pt``, post-processing of the frequency release), ``mix`` from half aux,
half central (alternating), ``mixP`` from P % aux (spread evenly). ``--polish N``: first N more polish steps
(the run's ``[warmup] polish_lr``) on the released central images, then every variant from that model.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np


def _job_config(run: Path):
    """The run's job settings (``job.json`` as the pipeline wrote it)."""
    from feta_release.config import JobConfig

    return JobConfig.from_dict(json.loads((run / "job.json").read_text("utf-8")), str(run / "job.json"))


def _polish(model, central: tuple[np.ndarray, np.ndarray], job, steps: int) -> None:
    """``steps`` more polish steps on the released central images (the pipeline's ``central_polish``)."""
    from feta_release.stages.spatial import central_polish

    model.train()
    central_polish(model, central, job.replace(warmup={"polish_iterations": steps}))
    model.eval()


def _aux_starts(run: Path, job, labels: np.ndarray, seed: int):
    """Aux-generator images of ``labels`` (each class's images in label order) from the run's fitted generator."""
    import torch

    from feta_release.models.auxgen import AuxGenerator
    from feta_release.training.checkpoint import load_torch

    a = job.auxgen
    aux = AuxGenerator(1, 28, int(labels.max()) + 1, z_dim=a.z_dim, width=a.width)
    aux.load_state_dict(load_torch(run / "checkpoints" / "auxgen.pt")["model"])
    aux.eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        y = torch.from_numpy(labels)
        x = aux(torch.randn((len(y), a.z_dim), generator=g), y)
    return x.clamp(0, 1)  # the generator draws in [0, 1] (generate_aux_images)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, type=Path)
    ap.add_argument("--variants", required=True, help="name:solver:steps[:guidance];...")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--weights", default="", help="a checkpoints/ file of the run instead of model.pt")
    ap.add_argument("--polish", type=int, default=0, help="extra polish steps on the released central images first")
    ap.add_argument("--mode", choices=["validation", "test"], default="validation",
                    help="test: the held-out score of a variant chosen on validation (a --mode test run)")
    args = ap.parse_args()
    import torch

    from feta_release.config import SamplerSection
    from feta_release.data import ImageDataset, load_embedded
    from feta_release.eval_protocol import balanced_labels, protocol_splits
    from feta_release.evaluation import accuracy, train_classifier
    from feta_release.models.sampler import generate
    from feta_release.release.jobdir import load_model
    from feta_release.stages.synthesis import release_starts

    torch.set_num_threads(args.threads)
    fit, val = protocol_splits(load_embedded(), args.mode)
    job = _job_config(args.run)
    if args.weights:  # a stage checkpoint ({"model": state_dict}) of the run, e.g. before model.pt is written
        from feta_release.stages.context import initial_denoiser
        from feta_release.training.checkpoint import load_torch

        model = initial_denoiser(job, fit.image_shape, fit.n_classes)
        model.load_state_dict(load_torch(args.run / "checkpoints" / args.weights)["model"])
    else:
        model = load_model(args.run)
    c = np.load(args.run / "released" / "central.npz")
    central = (c["images"].astype(np.float32), c["labels"].astype(np.int64))
    if args.polish:
        _polish(model, central, job, args.polish)
    labels = balanced_labels(args.n, fit.n_classes)
    rows = []
    for spec in args.variants.split(";"):
        name, solver, steps, *rest = spec.split(":")
        cfg = replace(SamplerSection(), solver=solver, steps=int(steps), guidance=float(rest[0]) if rest else 0.0)
        start = float(rest[1]) if len(rest) > 1 else None
        t0 = time.perf_counter()
        init = None
        if start is not None:  # as the pipeline's _write_synthetic: SDEdit from augmented released images
            cfg = replace(cfg, sigma_max=start)
            lab = np.asarray(labels)
            init = release_starts(central, lab, job, torch.Generator().manual_seed(77 + args.seed))
            source = rest[2] if len(rest) > 2 else "central"
            if source == "aux" or source.startswith("mix"):
                aux = _aux_starts(args.run, job, lab, 88 + args.seed)
                take = np.ones(len(lab), bool) if source == "aux" else np.arange(len(lab)) % 2 == 0
                if source[3:]:  # "mixP": P % of the starts from the aux generator, spread evenly over the set
                    i, share = np.arange(len(lab)), int(source[3:]) / 100
                    take = np.floor((i + 1) * share) > np.floor(i * share)
                init[torch.from_numpy(take)] = aux[torch.from_numpy(take)]
        imgs, _ = generate(model, labels, 1_000 + args.seed, cfg, init=init)
        syn = ImageDataset(imgs.numpy().astype(np.float32), np.asarray(labels), fit.class_names, source=name)
        acc = accuracy(train_classifier(syn, 5, args.seed), val)
        rows.append({"variant": name, "solver": solver, "steps": int(steps), "guidance": cfg.guidance,
                     "start_sigma": start, "source": rest[2] if len(rest) > 2 else None,
                     "polish": args.polish, "acc": round(acc, 4), "s": round(time.perf_counter() - t0, 1)})
        print(json.dumps(rows[-1]), flush=True)
        Path(args.out).write_text(json.dumps({"run": str(args.run), "n": args.n, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
