"""Public pretraining x DP-SGD variants: held-out accuracy and FD under the project's evaluator.

    python bench/pretraining.py --quick --out runs/pretraining     # the small table of docs/explanation/public-pretraining.md
    python bench/pretraining.py --out runs/pretraining             # the presets' full sizes (hours on 2 CPU cores)
    python bench/pretraining.py --pretrain-only --device cuda      # time the pretraining alone (full size)
    python bench/pretraining.py --device cuda --starts scratch,pretrain,select \
        --dpsgd none,all,norm_attention,lora --out runs/pretraining-gpu   # the whole grid on a GPU

Per dataset and epsilon, the cells {start} x {DP-SGD}: start = scratch (no pretraining), pretrain (public
pretraining on the whole public set), select (public pretraining on the part the semantic selection keeps:
``[public] selection``, its noisy histogram charged in the run's epsilon); DP-SGD = none, all (every
parameter), norm_attention (normalisation + attention + conditioning), lora (low-rank adapters, ``[dpsgd]
lora_rank``). ``--starts`` / ``--dpsgd`` pick the cells; the sizes come from ``--n-private`` etc.
(``--quick`` sets small ones). The no-DP-SGD cells run the ``cpu-eps*-nodpsgd`` preset, the DP-SGD cells
``cpu-eps*`` (the tuned digit presets; both datasets are 28x28 grey). A select cell whose selection does not
fit the budget beside the preset's warm-up (the no-DP-SGD presets spend it all) is reported as refused.

- digits: private = the embedded MNIST training split (protocol ``fit`` part), scored on its ``validation``
  part (the held-out test part is never read); public = procedural pen strokes (``data generate strokes``):
  derived from no digit set, so pretraining on it is unconditional (its classes name no digit).
- medical: private = procedural chest images of population A, scored on other population-A images; public =
  population B (another hospital: other contrast, noise and class balance; the same four class names, so
  pretraining is class-conditional).

Pretraining runs once per dataset (``[public] pretrain_iterations`` on the public set, a function of public
data and the job seed only) and every pretrained cell starts from that file (``train --pretrained``'s
route). ``--seeds`` (default 0) runs every cell once per job seed (the model's initialisation and the job's
public draws; the releases' noise is fresh in every run) and the table gives mean ± std over them, the
accuracy of each dataset's "hardest" class (the digits' lowest, the medical set's ``finding``) and the
synthetic set's recall (diversity) beside it.
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

STARTS = ("scratch", "pretrain", "select")
DPSGD = ("none", "all", "norm_attention", "lora")


def _split(kind: str, n_private: int, n_eval: int, n_public: int) -> tuple[Any, Any, Any]:
    from feta_release.data import load_embedded
    from feta_release.data.procedural import generate_dataset
    from feta_release.eval_protocol import protocol_splits

    if kind == "digits":
        fit, val = protocol_splits(load_embedded(), "validation")
        rng = np.random.default_rng(0)
        return (
            fit.subset(np.sort(rng.permutation(fit.n)[:n_private])),
            val.subset(np.sort(rng.permutation(val.n)[:n_eval])),
            generate_dataset("strokes", n_public, size=28, seed=7),
        )
    private = generate_dataset("medical", n_private + n_eval, size=28, seed=1, population="A")
    return (
        private.subset(np.arange(n_private)),
        private.subset(np.arange(n_private, n_private + n_eval)),
        generate_dataset("medical", n_public, size=28, seed=7, population="B"),
    )


def _job(eps: int, dpsgd: str, start: str, args: argparse.Namespace, seed: int = 0) -> Any:
    from feta_release.config import load_preset

    cfg = load_preset(f"cpu-eps{eps}" if dpsgd != "none" else f"cpu-eps{eps}-nodpsgd")
    cfg = cfg.replace(job={"seed": seed})
    if dpsgd in ("norm_attention", "lora"):
        cfg = cfg.replace(dpsgd={"trainable": dpsgd, "lora_rank": args.lora_rank})
    if args.warmup_iterations is not None:  # the same stages, shorter: every cell of the table shrinks alike
        cfg = cfg.replace(
            warmup={
                "spatial_iterations": args.warmup_iterations,
                "frequency_epochs": 1,
                "frequency_images": min(600, 2 * args.n_private),
            },
            auxgen={"epochs": 1, "iterations_per_epoch": 10},
        )
    if args.dpsgd_steps is not None and dpsgd != "none":
        cfg = cfg.replace(dpsgd={"steps": args.dpsgd_steps})
    if start == "select":  # pretraining runs inside the cell: what it keeps depends on the private histogram
        cfg = cfg.replace(
            public={
                "pretrain_iterations": args.pretrain_iterations,
                "selection": True,
                "selection_groups": args.selection_groups,
                "selection_keep": args.selection_keep,
                "selection_sigma": args.selection_sigma,
            }
        )
    return cfg


def _pretrained(
    out: Path, kind: str, public: Any, private: Any, iterations: int, device: str = "cpu"
) -> Path:
    """The public model file of ``kind`` (trained once on ``device``; reused when present)."""
    import torch

    from feta_release.config import load_preset
    from feta_release.models.edm import denoiser_spec
    from feta_release.models.model_file import write_model_file
    from feta_release.stages.context import initial_denoiser
    from feta_release.stages.pretrain import PRETRAINED_FILE, PublicInputs, pretrain, with_public

    path = out / f"pretrained-{kind}.pt"
    if path.exists():
        return path
    cfg = with_public(
        load_preset("cpu-eps1").replace(public={"pretrain_iterations": iterations}),
        PublicInputs(public),
        private.image_shape,
    )
    model = initial_denoiser(cfg, private.image_shape, private.n_classes).to(device)
    t0 = time.perf_counter()
    res = pretrain(model, public, private.class_names, cfg)  # trains where the model is
    seconds = time.perf_counter() - t0
    model = model.cpu()
    print(
        f"{kind}: pretrained {res.steps} steps on {public.n} public images in {seconds:.0f} s on {device} "
        f"(final loss {res.final_loss:.3f}) -> {path.name} (as {PRETRAINED_FILE})",
        flush=True,
    )
    print(
        json.dumps(
            {
                "pretrain": kind,
                "device": device,
                "steps": res.steps,
                "public_images": public.n,
                "image_shape": list(private.image_shape),
                "seconds": round(seconds, 1),
                "threads": torch.get_num_threads(),
            }
        ),
        flush=True,
    )
    write_model_file(
        path,
        spec=denoiser_spec(cfg.model, private.image_shape, private.n_classes),
        state_dict=model.state_dict(),
        class_names=list(private.class_names),
    )
    return path


def _inputs(start: str, public: Any, pretrained: Path) -> Any:
    from feta_release.stages import PublicInputs

    if start == "scratch":
        return None
    return PublicInputs(pretrained=pretrained) if start == "pretrain" else PublicInputs(public, "public set")


def _cell(
    out: Path,
    kind: str,
    eps: int,
    start: str,
    dpsgd: str,
    data: tuple[Any, Any, Any, Path],
    args: argparse.Namespace,
    seed: int = 0,
) -> dict[str, Any]:
    from coordinator.local_run import TrainOptions, run_train
    from feta_release.data import ImageDataset
    from feta_release.errors import PrivacyError
    from feta_release.evaluation import evaluate

    private, real_eval, public, pretrained = data
    name = f"{kind}-eps{eps}-{start}-{dpsgd}" + (f"-seed{seed}" if seed else "")
    done = out / f"{name}.json"
    if done.exists():
        return json.loads(done.read_text())
    cfg = _job(eps, dpsgd, start, args, seed)
    cell = {"dataset": kind, "epsilon": eps, "start": start, "dpsgd": dpsgd, "seed": seed}  # the row's key
    t0 = time.perf_counter()
    try:
        opts = TrainOptions(
            n_synthetic=args.n_synthetic,
            grid_per_class=2,
            public_size=private.n,
            public=_inputs(start, public, pretrained),
            device=args.device,
        )
        res = run_train(cfg, private, out / name, opts)
    except PrivacyError as exc:  # a selection beside a warm-up that spends the whole budget
        row = {**cell, "refused": str(exc)}
        print(json.dumps(row), flush=True)
        return row
    seconds = time.perf_counter() - t0
    with np.load(out / name / "synthetic.npz") as z:
        syn = ImageDataset(z["images"], z["labels"], tuple(private.class_names), source=name)
    rep = evaluate(syn, real_eval, seed, classifier_epochs=args.epochs, feature_epochs=args.epochs)
    row = {
        **cell,
        "accuracy": rep.accuracy,
        "per_class": rep.per_class_accuracy,
        "recall": rep.recall,
        "fd": rep.fd,
        "spent": res.epsilon,
        "dpsgd_steps": res.dpsgd_steps_trained,
        "seconds": round(seconds),
    }
    done.write_text(json.dumps(row))
    print(json.dumps(row), flush=True)
    return row


def hardest_class(kind: str, per_class: dict[str, float]) -> tuple[str, float]:
    """The class a table reports beside the accuracy: the medical set's ``finding`` (told apart from
    ``normal`` only by a small local spot), else the class the release scores lowest on."""
    if "finding" in per_class:
        return "finding", per_class["finding"]
    name = min(per_class, key=lambda c: per_class[c])
    return name, per_class[name]


def _cells_by_route(rows: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["epsilon"], r["start"], r["dpsgd"]), []).append(r)
    return groups


def _mean_std(values: list[float], digits: int = 3) -> str:
    from feta_release.eval_protocol import mean_std

    m, s = mean_std(values)
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def _table(rows: list[dict[str, Any]]) -> str:
    words = {
        "none": "no DP-SGD",
        "all": "DP-SGD, all parameters",
        "norm_attention": "DP-SGD, norm + attention + cond.",
        "lora": "DP-SGD, LoRA adapters",
    }
    starts = {"scratch": "scratch", "pretrain": "public pretraining", "select": "pretrained on the selection"}
    lines = [
        "| dataset | ε | start | DP-SGD | accuracy | hardest class | recall | FD | ε spent | train s | seeds"
        " |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (kind, eps, start, dpsgd), group in _cells_by_route(rows).items():
        head = f"| {kind} | {eps} | {starts[start]} | {words[dpsgd]} |"
        done = [r for r in group if "refused" not in r]
        if not done:
            lines.append(f"{head} refused: over the budget | | | | | | {len(group)} |")
            continue
        hard = [hardest_class(kind, r["per_class"]) for r in done if r.get("per_class")]
        cls = f"{hard[0][0]} {_mean_std([h[1] for h in hard])}" if hard else "–"
        recall = [r["recall"] for r in done if math.isfinite(r.get("recall", math.nan))]
        cols = [
            _mean_std([r["accuracy"] for r in done]),
            cls,
            _mean_std(recall) if recall else "–",
            _mean_std([r["fd"] for r in done], 1),
            f"{max(r['spent'] for r in done):.3f}",
            f"{round(sum(r['seconds'] for r in done) / len(done))}",
            f"{len(done)}",
        ]
        lines.append(f"{head} " + " | ".join(cols) + " |")
    return "\n".join(lines)


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sets and short stages (the documented table)")
    ap.add_argument("--datasets", default="medical,digits")
    ap.add_argument("--eps", default="1,10")
    ap.add_argument("--starts", default="scratch,pretrain", help=f"cells' starts, of {', '.join(STARTS)}")
    ap.add_argument(
        "--dpsgd", default="none,all,norm_attention", help=f"cells' DP-SGD, of {', '.join(DPSGD)}"
    )
    ap.add_argument("--out", default="runs/pretraining")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seeds", default="0", help="job seeds, comma-separated (the table: mean ± std)")
    ap.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where the pipeline runs trains and samples"
    )
    ap.add_argument(
        "--pretrain-only", action="store_true", help="only pretrain each dataset's public model (timed)"
    )
    sizes = {
        "n_private": (600, 4000),
        "n_eval": (300, 1000),
        "n_public": (1000, 10000),
        "pretrain_iterations": (200, 4000),
        "n_synthetic": (400, 10000),
        "epochs": (2, 5),
    }
    for key in sizes:
        ap.add_argument(
            "--" + key.replace("_", "-"),
            type=int,
            default=None,
            help=f"default {sizes[key][0]} with --quick, else {sizes[key][1]}",
        )
    ap.add_argument(
        "--warmup-iterations", type=int, default=None, help="spatial warm-up steps (--quick: 150)"
    )
    ap.add_argument(
        "--dpsgd-steps", type=int, default=None, help="DP-SGD steps of the DP-SGD cells (--quick: 10)"
    )
    ap.add_argument("--lora-rank", type=int, default=4)
    ap.add_argument("--selection-groups", type=int, default=16)
    ap.add_argument("--selection-keep", type=float, default=0.5)
    ap.add_argument("--selection-sigma", type=float, default=20.0)
    args = ap.parse_args()
    for key, (quick, full) in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if args.quick:
        args.warmup_iterations = 150 if args.warmup_iterations is None else args.warmup_iterations
        args.dpsgd_steps = 10 if args.dpsgd_steps is None else args.dpsgd_steps
    bad = sorted(set(args.starts.split(",")) - set(STARTS)) + sorted(set(args.dpsgd.split(",")) - set(DPSGD))
    if bad:
        ap.error(f"unknown cell(s) {bad}")
    return args


def main() -> None:
    args = _args()
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    sets = {}
    for kind in args.datasets.split(","):
        private, real_eval, public = _split(kind, args.n_private, args.n_eval, args.n_public)
        pre = _pretrained(out, kind, public, private, args.pretrain_iterations, args.device)
        sets[kind] = (private, real_eval, public, pre)
    if args.pretrain_only:
        return
    for eps in (int(e) for e in args.eps.split(",")):
        for kind, data in sets.items():
            for dpsgd in args.dpsgd.split(","):
                for start in args.starts.split(","):
                    for seed in (int(v) for v in args.seeds.split(",")):
                        rows.append(_cell(out, kind, eps, start, dpsgd, data, args, seed))
                    (out / "results.md").write_text(_table(rows) + "\n")  # a partial table survives a stop
    print(_table(rows))


if __name__ == "__main__":
    main()
