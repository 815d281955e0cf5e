"""Quality figures under the fixed evaluation protocol (feta_release/eval_protocol.py, docs/evaluation.md).

    # tuning (validation part of the training split; the held-out part is never read):
    python bench/eval_protocol.py --mode validation --preset cpu-eps1 --out runs/protocol
    # final figures of a configuration chosen on validation (held-out test part, scored once):
    python bench/eval_protocol.py --mode test --preset cpu-eps1,cpu-eps10 --out runs/protocol
    python bench/eval_protocol.py --quick   # 1-minute smoke run of the script itself (tiny preset)

Per preset and seed: run ``train`` (``coordinator.local_run.run_train``) on the mode's training part (job seed
= seed; the site's noise is fresh OS randomness, as every site's), draw ``--n-synthetic`` balanced images,
score accuracy + FD (classifier features) on the mode's real evaluation images. Also per seed: the
release-only baseline (the protocol classifier on augmented copies of that run's released central images) and
the real-data ceiling (the same classifier on the REAL training part). Writes ``results.md`` /
``results.json`` (mean ± std over seeds); finished runs are reused when rerun.
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
    ap.add_argument("--mode", choices=["validation", "test"], default="validation")
    ap.add_argument("--preset", default="cpu-eps1", help="comma-separated presets")
    ap.add_argument("--seeds", default=None, help="comma-separated (default: the protocol's 0,1,2)")
    ap.add_argument("--n-synthetic", type=int, default=None, help="default: the protocol's 10,000")
    ap.add_argument("--set", action="append", default=[], help="section.key=value override (TOML literal)")
    ap.add_argument("--tag", default="", help="name of this configuration in the results (with --set)")
    ap.add_argument("--out", default="runs/protocol")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the pipeline trains and samples (the classifiers stay on the CPU)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: tiny preset, 1 seed, 200 images, 1 epoch"
    )
    ap.add_argument(
        "--lean",
        action="store_true",
        help="exploration only (validation mode): no real-data ceiling, "
        "no FD; accuracy and the release-only baseline only",
    )
    args = ap.parse_args()

    import tomllib

    import torch

    from coordinator.local_run import TrainOptions, run_train
    from feta_release.config import load_preset
    from feta_release.data import ImageDataset, load_embedded
    from feta_release.data.splits import balanced_labels
    from feta_release.eval_protocol import PROTOCOL, format_row, mean_std, protocol_splits, release_only
    from feta_release.evaluation import FD_NAME, accuracy, evaluate, real_ceiling, train_classifier
    from feta_release.training.progress import Reporter

    torch.set_num_threads(args.threads)
    proto = PROTOCOL
    if args.quick:
        proto = replace(proto, n_synthetic=200, classifier_epochs=1, feature_epochs=2, seeds=(0,))
    if args.seeds:
        proto = replace(proto, seeds=tuple(int(s) for s in args.seeds.split(",")))
    if args.n_synthetic:
        proto = replace(proto, n_synthetic=args.n_synthetic)
    if args.lean and args.mode != "validation":
        ap.error("--lean is for exploration: validation mode only (final figures use the whole protocol)")
    train, real = protocol_splits(load_embedded(), args.mode, proto)
    if args.quick:
        train = train.subset(np.arange(0, train.n, 10))
    presets = ["tiny"] if args.quick else args.preset.split(",")
    out = Path(args.out) / args.mode
    print(f"mode {args.mode}: train {train.n}, scored on {real.n} real images; {proto}", flush=True)
    # one FD space for every row
    feature_net = None if args.lean else train_classifier(real, proto.feature_epochs, 0)
    results: dict[str, dict] = {}

    def save() -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"protocol": proto.__dict__, "rows": results}, indent=1))
        lines = [
            f"mode {args.mode}; {proto.n_synthetic} synthetic images; classifier epoch cap "
            f"{proto.classifier_epochs or 'automatic'} (early stopping); {FD_NAME} (not FID)",
            "",
            "| configuration | accuracy (mean ± std) | FD | seeds |",
            "|---|---|---|---|",
        ]
        lines += [format_row(k, r["acc"], r.get("fd")) for k, r in results.items() if r["acc"]]
        (out / "results.md").write_text("\n".join(lines) + "\n")

    ceiling = results.setdefault("real training data (ceiling)", {"acc": []})
    ceilings = {}  # per seed, reused by evaluate(): the classifier trained on the REAL training part
    for seed in () if args.lean else proto.seeds:
        ceilings[seed] = real_ceiling(real, train, seed, epochs=proto.classifier_epochs)
        ceiling["acc"].append(ceilings[seed].accuracy)
    save()
    for name in presets:
        cfg = load_preset(name)
        for kv in args.set:
            key, val_s = kv.split("=", 1)
            sec, k = key.split(".")
            cfg = cfg.replace(**{sec: {k: tomllib.loads(f"v = {val_s}")["v"]}})
        label = name + (f" [{args.tag}]" if args.tag else "")
        row = results.setdefault(label, {"acc": [], "fd": [], "seconds": [], "epsilon": []})
        base = results.setdefault(f"{label}: release-only", {"acc": []})
        for seed in proto.seeds:
            run_dir = out / label.replace(" ", "_").replace("[", "").replace("]", "") / f"seed{seed}"
            t0 = time.perf_counter()
            res = run_train(
                cfg.replace(job={"seed": seed}),
                train,
                run_dir,
                TrainOptions(
                    n_synthetic=proto.n_synthetic, reporter=Reporter(enabled=False), device=args.device
                ),
            )
            z = np.load(run_dir / "synthetic.npz")
            syn = ImageDataset(z["images"], z["labels"], train.class_names, source=str(run_dir))
            assert np.array_equal(np.sort(syn.labels), balanced_labels(proto.n_synthetic, train.n_classes))
            if args.lean:
                acc, fd = accuracy(train_classifier(syn, proto.classifier_epochs, seed), real), float("nan")
            else:
                ev = evaluate(
                    syn,
                    real,
                    seed,
                    classifier_epochs=proto.classifier_epochs,
                    feature_net=feature_net,
                    ceiling=ceilings[seed],
                )
                acc, fd = ev.accuracy, ev.fd
                for k in ("precision", "recall", "density", "coverage"):
                    row.setdefault(k, []).append(getattr(ev, k))
            row["acc"].append(acc), row["epsilon"].append(res.epsilon)
            if not args.lean:
                row["fd"].append(fd)
            row["seconds"].append(round(time.perf_counter() - t0, 1))
            central = run_dir / "released" / "central.npz"
            if central.exists():
                c = np.load(central)
                ro = release_only(c["images"], c["labels"], train.class_names, proto.n_synthetic, seed, proto)
                base["acc"].append(accuracy(train_classifier(ro, proto.classifier_epochs, seed), real))
            print(
                json.dumps(
                    {
                        "preset": label,
                        "seed": seed,
                        "acc": round(acc, 4),
                        "fd": round(fd, 1),
                        "release_only": base["acc"][-1] if base["acc"] else None,
                        "epsilon": round(res.epsilon, 3),
                        "s": row["seconds"][-1],
                    }
                ),
                flush=True,
            )
            save()
    for k, r in results.items():
        if r["acc"]:
            m, s = mean_std(r["acc"])
            print(f"{k}: {m:.3f} ± {s:.3f} ({len(r['acc'])} seeds)")
    print(f"results: {out / 'results.md'}")


if __name__ == "__main__":
    main()
