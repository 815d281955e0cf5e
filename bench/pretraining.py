"""Public pretraining x DP-SGD variants: held-out accuracy and FD under the project's evaluator.

    python bench/pretraining.py --quick --out runs/pretraining     # the small table of docs/explanation/public-pretraining.md
    python bench/pretraining.py --out runs/pretraining             # the presets' full sizes (hours on 2 CPU cores)
    python bench/pretraining.py --pretrain-only --device cuda      # time the pretraining alone (full size)

Per dataset and epsilon, six cells: {no pretraining, pretraining} x {no DP-SGD, DP-SGD of all parameters, DP-SGD of
normalisation + attention + conditioning only ([dpsgd] trainable = "norm_attention")}. The no-DP-SGD cells run the
``cpu-eps*-nodpsgd`` preset, the DP-SGD cells ``cpu-eps*`` (the tuned digit presets; both datasets are 28x28 grey).

- digits: private = the embedded MNIST training split (protocol ``fit`` part), scored on its ``validation`` part (the
  held-out test part is never read); public = procedural pen strokes (``data generate strokes``): derived from no
  digit set, so pretraining on it is unconditional (its classes name no digit).
- medical: private = procedural chest images of population A, scored on other population-A images; public =
  population B (another hospital: other contrast, noise and class balance; the same four class names, so
  pretraining is class-conditional).

Pretraining runs once per dataset (``[public] pretrain_iterations`` on the public set, a function of public data and
the job seed only) and every pretrained cell starts from that file (``train --pretrained``'s route). One seed:
figures are single runs, not means.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np


# the most telling comparisons first (a stopped run still has them)
CELLS = ((False, "none"), (True, "none"), (False, "all"), (True, "all"), (True, "norm_attention"),
         (False, "norm_attention"))


def _split(kind: str, n_private: int, n_eval: int, n_public: int) -> tuple[Any, Any, Any]:
    from feta_release.data import load_embedded
    from feta_release.data.procedural import generate_dataset
    from feta_release.eval_protocol import protocol_splits

    if kind == "digits":
        fit, val = protocol_splits(load_embedded(), "validation")
        rng = np.random.default_rng(0)
        return (fit.subset(np.sort(rng.permutation(fit.n)[:n_private])),
                val.subset(np.sort(rng.permutation(val.n)[:n_eval])), generate_dataset("strokes", n_public, size=28, seed=7))
    private = generate_dataset("medical", n_private + n_eval, size=28, seed=1, population="A")
    return (private.subset(np.arange(n_private)), private.subset(np.arange(n_private, n_private + n_eval)),
            generate_dataset("medical", n_public, size=28, seed=7, population="B"))


def _job(eps: int, dpsgd: str, quick: bool) -> Any:
    from feta_release.config import load_preset

    cfg = load_preset(f"cpu-eps{eps}" if dpsgd != "none" else f"cpu-eps{eps}-nodpsgd")
    if dpsgd == "norm_attention":
        cfg = cfg.replace(dpsgd={"trainable": "norm_attention"})
    if quick:  # the same stages, shorter: every cell of the table shrinks alike
        cfg = cfg.replace(warmup={"spatial_iterations": 150, "frequency_epochs": 1, "frequency_images": 600},
                          auxgen={"epochs": 1, "iterations_per_epoch": 10})
        if dpsgd != "none":
            cfg = cfg.replace(dpsgd={"steps": 10})
    return cfg


def _pretrained(out: Path, kind: str, public: Any, private: Any, iterations: int,
                device: str = "cpu") -> Path:
    """The public model file of ``kind`` (trained once on ``device``; reused when present)."""
    import torch

    from feta_release.config import load_preset
    from feta_release.stages.pretrain import PRETRAINED_FILE, PublicInputs, pretrain, with_public
    from feta_release.stages.context import initial_denoiser
    from feta_release.models.model_file import write_model_file
    from feta_release.models.edm import denoiser_spec

    path = out / f"pretrained-{kind}.pt"
    if path.exists():
        return path
    cfg = with_public(load_preset("cpu-eps1").replace(public={"pretrain_iterations": iterations}),
                      PublicInputs(public), private.image_shape)
    model = initial_denoiser(cfg, private.image_shape, private.n_classes).to(device)
    t0 = time.perf_counter()
    res = pretrain(model, public, private.class_names, cfg)  # trains where the model is
    seconds = time.perf_counter() - t0
    model = model.cpu()
    print(f"{kind}: pretrained {res.steps} steps on {public.n} public images in {seconds:.0f} s on {device} "
          f"(final loss {res.final_loss:.3f}) -> {path.name} (as {PRETRAINED_FILE})", flush=True)
    print(json.dumps({"pretrain": kind, "device": device, "steps": res.steps, "public_images": public.n,
                      "image_shape": list(private.image_shape), "seconds": round(seconds, 1),
                      "threads": torch.get_num_threads()}), flush=True)
    write_model_file(path, spec=denoiser_spec(cfg.model, private.image_shape, private.n_classes),
                     state_dict=model.state_dict(), class_names=list(private.class_names))
    return path


def _cell(out: Path, kind: str, eps: int, pre: bool, dpsgd: str, data: tuple[Any, Any, Path | None],
          args: argparse.Namespace) -> dict[str, Any]:
    from feta_release.data import ImageDataset
    from feta_release.evaluation import evaluate
    from feta_release.stages import PublicInputs
    from feta_release.training.pipeline import run_pipeline

    private, real_eval, pretrained = data
    name = f"{kind}-eps{eps}-{'pre' if pre else 'scratch'}-{dpsgd}"
    done = out / f"{name}.json"
    if done.exists():
        return json.loads(done.read_text())
    cfg = _job(eps, dpsgd, args.quick)
    t0 = time.perf_counter()
    res = run_pipeline(cfg, private, out / name, n_synthetic=args.n_synthetic, grid_per_class=2, noise_seed=0,
                       public_size=private.n, public=PublicInputs(pretrained=pretrained) if pre else None,
                       device=args.device)
    seconds = time.perf_counter() - t0
    with np.load(out / name / "synthetic.npz") as z:
        syn = ImageDataset(z["images"], z["labels"], tuple(private.class_names), source=name)
    rep = evaluate(syn, real_eval, 0, classifier_epochs=args.epochs, feature_epochs=args.epochs)
    row = {"dataset": kind, "epsilon": eps, "pretraining": pre, "dpsgd": dpsgd, "accuracy": rep.accuracy,
           "fd": rep.fd, "spent": res.epsilon, "dpsgd_steps": res.dpsgd_steps_trained, "seconds": round(seconds)}
    done.write_text(json.dumps(row))
    print(json.dumps(row), flush=True)
    return row


def _table(rows: list[dict[str, Any]]) -> str:
    words = {"none": "no DP-SGD", "all": "DP-SGD, all parameters", "norm_attention": "DP-SGD, norm + attention + cond."}
    lines = ["| dataset | ε | start | DP-SGD | accuracy | FD | train s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dataset']} | {r['epsilon']} | {'public pretraining' if r['pretraining'] else 'scratch'} "
                     f"| {words[r['dpsgd']]} | {r['accuracy']:.3f} | {r['fd']:.1f} | {r['seconds']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sets and short stages (the documented table)")
    ap.add_argument("--datasets", default="medical,digits")
    ap.add_argument("--eps", default="1,10")
    ap.add_argument("--out", default="runs/pretraining")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the pipeline runs trains and samples")
    ap.add_argument("--pretrain-only", action="store_true",
                    help="only pretrain each dataset's public model (timed)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    n_private, n_eval, n_public, iters = (600, 300, 1000, 200) if args.quick else (4000, 1000, 10000, 4000)
    args.n_synthetic, args.epochs = (400, 2) if args.quick else (10000, 5)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    sets = {}
    for kind in args.datasets.split(","):
        private, real_eval, public = _split(kind, n_private, n_eval, n_public)
        sets[kind] = (private, real_eval, _pretrained(out, kind, public, private, iters, args.device))
    if args.pretrain_only:
        return
    for eps in (int(e) for e in args.eps.split(",")):
        for kind, data in sets.items():
            for pre, dpsgd in CELLS:
                rows.append(_cell(out, kind, eps, pre, dpsgd, data, args))
                (out / "results.md").write_text(_table(rows) + "\n")  # a partial table survives a stop
    print(_table(rows))


if __name__ == "__main__":
    main()
