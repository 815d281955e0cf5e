"""DP-SGD-stage and sampler levers, started from the warm-up of a FINISHED validation run (issue 15).

    python bench/dpsgd_levers.py --run runs/q3/lean/validation/cpu-eps1_TAG/seed0 \\
        --variants "base;pub200:dpsgd.public_batch=200;w2:sampler.guidance=2.0" --out bench/results/levers.json

The run directory must come from ``bench/eval_protocol.py --mode validation`` (its job saw the FIT part only; the
held-out part is never loaded here). From it: the job config (``job.json``), the model after the frequency
warm-up (``checkpoints/after-frequency.pt``) and the released central images (``released/central.npz``).
Each variant = the run's config with ``section.key=value`` overrides (TOML literals, ``,``-separated); its DP-SGD
is planned anew (sigma re-calibrated to the same total epsilon when steps/rate change), trained on the fit part
with a fixed benchmark generator, and scored like the protocol's ``--lean`` mode: ``--n`` balanced samples, the
protocol classifier (5 epochs, seed 0) on the validation images. Variants differing only in ``[sampler]`` reuse
the trained model. Saves a grid per variant next to ``--out``.

Why not re-run the pipeline per variant: the warm-ups (~2/3 of a run) are the same for every DP-SGD lever, and
the 2 shared cores make each full run cost 30-45 minutes.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch


def parse_variants(text: str) -> list[tuple[str, dict[str, dict]]]:
    out = []
    for item in (v for v in text.split(";") if v.strip()):
        name, _, sets = item.partition(":")
        over: dict[str, dict] = {}
        for kv in (s for s in sets.split(",") if s):
            key, val = kv.split("=", 1)
            sec, k = key.strip().split(".")
            over.setdefault(sec, {})[k] = tomllib.loads(f"v = {val}")["v"]
        out.append((name.strip(), over))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True)
    ap.add_argument("--variants", default="base")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench/results/dpsgd-levers.json")
    ap.add_argument("--sigma", type=float, default=None,
                    help="PROBE: DP-SGD noise multiplier instead of the planned one (the run's releases already "
                         "spent their budget, so the plan would leave DP-SGD almost none); the row's epsilon is "
                         "then the stated sigma's DP-SGD cost on top of the run's releases")
    ap.add_argument("--save", action="store_true",
                    help="write each variant's model to the run's checkpoints/lever-NAME.pt ({'model': state}) "
                         "for bench/sampler_levers.py --weights")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from feta_release.config import JobConfig
    from feta_release.data import ImageDataset, load_embedded
    from feta_release.eval_protocol import PROTOCOL, balanced_labels, protocol_splits
    from feta_release.evaluation import accuracy, train_classifier
    from feta_release.models.edm import build_denoiser
    from feta_release.models.sampler import generate
    from feta_release.planning import plan as privacy_plan
    from feta_release.stages.dpsgd import _public_mix
    from feta_release.training.checkpoint import load_torch, save_torch
    from feta_release.training.dpsgd import DPSGDTrainer
    from feta_release.viz import save_grid

    run = Path(args.run)
    base_cfg = JobConfig.from_dict(json.loads((run / "job.json").read_text()), source=str(run / "job.json"))
    fit, val = protocol_splits(load_embedded(), "validation")
    z = np.load(run / "released" / "central.npz")
    central = (z["images"], z["labels"])
    start = load_torch(run / "checkpoints" / "after-frequency.pt")["model"]
    xr, yr = torch.from_numpy(fit.images) * 2 - 1, torch.from_numpy(fit.labels)
    out = Path(args.out)
    rows: list[dict] = []
    trained: dict[str, torch.nn.Module] = {}
    for name, over in parse_variants(args.variants):
        t0 = time.perf_counter()
        cfg = base_cfg.replace(**over).for_size(fit.n)
        pl = privacy_plan(cfg, fit.n)
        key = json.dumps({k: v for k, v in over.items() if k != "sampler"}, sort_keys=True)
        if key not in trained:
            den = build_denoiser(cfg.model, fit.image_shape, fit.n_classes)
            den.load_state_dict(copy.deepcopy(start))
            if cfg.dpsgd_steps(fit.n) == 0:  # the model after the frequency warm-up itself
                trained[key] = den.eval()
            else:
                ctx = SimpleNamespace(cfg=cfg, central=central, public_gen=lambda n: torch.Generator().manual_seed(11))
                sigma = pl.noise_multiplier if args.sigma is None else args.sigma
                tr = DPSGDTrainer(den, cfg, sigma, cfg.dpsgd.batch / fit.n,
                                  torch.Generator().manual_seed(7), n_public=fit.n,
                                  public=_public_mix(ctx))  # type: ignore[arg-type]
                tr.run(xr, yr, cfg.dpsgd_steps(fit.n))
                trained[key] = tr.ema_model()
            if args.save:
                save_torch(run / "checkpoints" / f"lever-{name}.pt", {"model": trained[key].state_dict()})
        acc = float("nan")
        if args.n:  # --n 0 with --save: train only (score the saved model with bench/sampler_levers.py)
            labels = balanced_labels(args.n, fit.n_classes)
            imgs, _ = generate(trained[key], labels, 1234, cfg.sampler)  # type: ignore[arg-type]
            syn = ImageDataset(imgs.numpy(), np.asarray(labels), fit.class_names, source=name)
            acc = accuracy(train_classifier(syn, PROTOCOL.classifier_epochs, 0), val)
            save_grid(imgs.numpy(), np.asarray(labels), out.with_name(f"{out.stem}-{name}.png"), per_class=8,
                      n_classes=fit.n_classes)
        eps = pl.epsilon if args.sigma is None else None  # a probe's sigma is not the plan's: no total to state
        row = {"variant": name, "overrides": over, "epsilon": eps, "sigma_sgd": args.sigma or pl.noise_multiplier,
               "dpsgd_steps": cfg.dpsgd_steps(fit.n), "val_acc": round(acc, 4), "s": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        out.write_text(json.dumps({"run": str(run), "n": args.n, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
