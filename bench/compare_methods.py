"""Method comparison on the embedded data: DPDM vs DP-FETA vs FETA-Pro vs FETA-Pro (frequency only).

    python bench/compare_methods.py                 # full: eps 1 and 10, 4 methods, 3 seeds (hours on 2 cores)
    python bench/compare_methods.py --quick         # smoke run: tiny models, 1 seed, small data (minutes)
    python bench/compare_methods.py --eps 1 --seeds 0,1,2 --out runs/compare

Fixed split: ``train_heldout_split(load_embedded(), 0.2, seed=0)`` (4,000 train / 1,000 held-out). Every run
trains on the train part only; accuracy and FD (classifier features) are measured on the held-out part,
which no run (and no tuning) ever sees. All methods of one epsilon share the preset's DP-SGD compute (same
batch, steps, noise multiplicity, model); only the warm-up stages differ (``[job] method``), and each
method's DP-SGD sigma is calibrated for what its warm-up left of the budget. Runs are resumable: a
finished run directory is reused, so an interrupted comparison continues where it stopped.

Prints a table of accuracy and FD (mean +- std over seeds) and the epsilon of each stage (alone) and total,
and writes ``results.json`` + ``results.md`` to ``--out``.
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

METHODS = [
    ("dpdm", "DPDM (no warm-up)"),
    ("dp-feta", "DP-FETA (central)"),
    ("feta-pro", "FETA-Pro"),
    ("feta-pro-freq", "FETA-Pro freq-only"),
]


def _mean_std(xs: list[float]) -> str:
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.3g}"
    return f"{statistics.mean(xs):.3g} ± {statistics.stdev(xs):.2g}"


_TRAIN = None


def _training_split(quick: bool):
    from feta_release.data import load_embedded, train_heldout_split

    train, heldout = train_heldout_split(load_embedded(), 0.2, seed=0)
    if quick:
        rng = np.random.default_rng(0)
        idx = np.concatenate(
            [rng.choice(np.flatnonzero(train.labels == c), 40, replace=False) for c in range(10)]
        )
        train = train.subset(np.sort(idx))
    return train, heldout


def _worker_init(data_args: tuple) -> None:
    global _TRAIN
    _TRAIN = _training_split(*data_args)[0]


def _train_one(spec: tuple) -> tuple[float, float | None, int]:
    """Train (or reuse, when complete) one run; returns (seconds, DP-SGD sigma, DP-SGD steps trained)."""
    import torch

    from coordinator.local_run import TrainOptions, run_train
    from feta_release.config import JobConfig
    from feta_release.training.progress import Reporter

    cfg_dict, run_dir, n_syn, _seed, threads = spec
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    res = run_train(
        JobConfig.from_dict(cfg_dict),
        _TRAIN,
        run_dir,
        TrainOptions(n_synthetic=n_syn, grid_per_class=4, reporter=Reporter(enabled=False)),
    )  # the site's noise: fresh OS randomness, as every site's (the job seed fixes the public draws)
    return time.perf_counter() - t0, res.dpsgd_sigma, res.dpsgd_steps_trained


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: tiny preset, 1 seed, 400 training images"
    )
    ap.add_argument("--eps", default="1,10", help="comma-separated epsilons (presets cpu-eps1 / cpu-eps10)")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2; --quick: 0)")
    ap.add_argument("--methods", default=",".join(m for m, _ in METHODS))
    ap.add_argument("--out", default="runs/compare", help="where run directories and results go")
    ap.add_argument(
        "--synthetic", type=int, default=None, help="synthetic images per run (default: train size)"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch threads in all (split between workers)")
    ap.add_argument(
        "--workers",
        type=int,
        default=1,
        help="runs trained at once, each with threads/workers torch threads (2 workers x 1 thread "
        "trained ~2x faster than 1 x 2 threads on 2 cores: these small models scale badly)",
    )
    args = ap.parse_args()

    import torch

    from feta_release.config import load_preset
    from feta_release.data import ImageDataset
    from feta_release.evaluation import FD_NAME, evaluate, real_ceiling, train_classifier

    torch.set_num_threads(args.threads)
    train, heldout = _training_split(args.quick)
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2")).split(",")]
    epsilons = [float(e) for e in args.eps.split(",")]
    methods = args.methods.split(",")
    # Epoch caps (early stopping below them); None: the evaluator's automatic cap.
    clf_epochs, feat_epochs = (1, 3) if args.quick else (None, None)
    n_syn = args.synthetic if args.synthetic is not None else (200 if args.quick else train.n)
    out = Path(args.out) / ("quick" if args.quick else "full")
    print(
        f"train {train.n} images, held-out {heldout.n}; seeds {seeds}; synthetic {n_syn} per run; out {out}"
    )

    # One feature network for every FD: trained once on the held-out images (as feta_release.evaluation does).
    feature_net = train_classifier(heldout, feat_epochs, 0)
    # the same classifier on the real training images
    ceiling = real_ceiling(heldout, train, 0, epochs=clf_epochs)
    print(f"real-data ceiling: {ceiling.accuracy:.3f} ({ceiling.protocol})")
    rows = []
    t_all = time.perf_counter()
    jobs = []
    for eps in epsilons:
        base = load_preset("tiny") if args.quick else load_preset(f"cpu-eps{eps:g}")
        base = base.replace(privacy={"epsilon": eps})
        for method in methods:
            for seed in seeds:
                jobs.append(
                    (
                        eps,
                        method,
                        seed,
                        base.replace(job={"method": method, "seed": seed}),
                        out / f"eps{eps:g}" / method / f"seed{seed}",
                    )
                )
    threads = max(1, args.threads // max(1, args.workers))

    def spec(i: int) -> tuple:
        _, _, seed, cfg, run_dir = jobs[i]
        return cfg.to_dict(), str(run_dir), n_syn, seed, threads

    trained: dict[int, tuple[float, float | None, int]] = {}  # job index -> _train_one's result

    def record(i: int, result: tuple[float, float | None, int]) -> None:
        trained[i] = result
        eps, method, seed = jobs[i][:3]
        print(
            f"  trained eps {eps:g} {method:<14} seed {seed} in {result[0]:.0f} s "
            f"({len(trained)}/{len(jobs)}, {time.perf_counter() - t_all:.0f} s so far)",
            flush=True,
        )

    if args.workers > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        # Most expensive first (all warm-ups), so the last runs to finish are short ones.
        cost = {"feta-pro": 0, "feta-pro-freq": 1, "dp-feta": 2, "dpdm": 3}
        order = sorted(range(len(jobs)), key=lambda i: cost.get(jobs[i][1], 9))
        with ProcessPoolExecutor(
            args.workers,
            mp_context=mp.get_context("spawn"),
            initializer=_worker_init,
            initargs=((args.quick,),),
        ) as pool:
            futs = {pool.submit(_train_one, spec(i)): i for i in order}
            for f in as_completed(futs):
                record(futs[f], f.result())
    else:
        _worker_init((args.quick,))
        for i in range(len(jobs)):
            record(i, _train_one(spec(i)))
    for i, (eps, method, seed, _cfg, run_dir) in enumerate(jobs):
        seconds, dpsgd_sigma, dpsgd_steps = trained[i]
        # the site's signed spend, as the run's privacy report states it
        (privacy,) = json.loads((run_dir / "privacy_report.json").read_text())["sites"].values()
        z = np.load(run_dir / "synthetic.npz")
        syn = ImageDataset(
            z["images"], z["labels"], tuple(str(c) for c in z["class_names"]), source=str(run_dir)
        )
        ev = evaluate(
            syn,
            heldout,
            seed=seed,
            classifier_epochs=clf_epochs,
            feature_epochs=feat_epochs,
            feature_net=feature_net,
            ceiling=ceiling,
        )
        summary = json.loads((run_dir / "job_summary.json").read_text())
        row = {
            "epsilon_target": eps,
            "method": method,
            "seed": seed,
            "accuracy": ev.accuracy,
            "fd": ev.fd,
            "ceiling_accuracy": ev.ceiling_accuracy,
            "precision": ev.precision,
            "recall": ev.recall,
            "density": ev.density,
            "coverage": ev.coverage,
            "epsilon": privacy["epsilon_total"],
            "per_stage_epsilon": privacy["epsilon_by_stage_alone"],
            "dpsgd_sigma": dpsgd_sigma,
            "dpsgd_steps": dpsgd_steps,
            "stage_seconds": summary.get("timings", {}),
            "train_seconds": seconds,
        }
        rows.append(row)
        print(
            f"  eps {eps:g} {method:<14} seed {seed}: acc {ev.accuracy:.3f}  FD {ev.fd:.1f}  "
            f"eps {privacy['epsilon_total']:.3f}",
            flush=True,
        )

    lines = [
        f"| target ε | method | accuracy (mean ± std) | {FD_NAME} | ε central | ε frequency | ε DP-SGD | ε "
        "total | DP-SGD σ | seeds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for eps in epsilons:
        for method in methods:
            rs = [r for r in rows if r["epsilon_target"] == eps and r["method"] == method]
            if not rs:
                continue
            pse = rs[0]["per_stage_epsilon"]
            label = dict(METHODS).get(method, method)
            lines.append(
                f"| {eps:g} | {label} | {_mean_std([r['accuracy'] for r in rs])} | "
                f"{_mean_std([r['fd'] for r in rs])} | {pse.get('central', 0):.3f} | "
                f"{pse.get('frequency', 0):.3f} | {pse.get('dpsgd', 0):.3f} | {rs[0]['epsilon']:.3f} | "
                f"{rs[0]['dpsgd_sigma'] or 0:.3f} | {len(rs)} |"
            )
    table = "\n".join(lines)
    print()
    print(table)
    print(
        f"\nper-stage ε is each stage alone (composition is sub-additive); ε total is the whole history at "
        f"δ = 1e-5. Held-out: {heldout.n} real images never used in training. Total "
        f"{time.perf_counter() - t_all:.0f} s."
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    (out / "results.md").write_text(table + "\n")
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}")


if __name__ == "__main__":
    sys.exit(main())
