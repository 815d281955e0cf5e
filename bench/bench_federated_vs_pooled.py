"""Federated release over secure aggregation vs the single-site pooled run, same protocol.

    nohup nice -n 5 .venv/bin/python bench/bench_federated_vs_pooled.py > bench/results/fedpool-run.log 2>&1 &
    .venv/bin/python bench/bench_federated_vs_pooled.py --quick     # smoke run (tiny preset, 1 seed, minutes)

Same split as the evaluation protocol (feta_release/eval_protocol.py, ``test`` mode): the embedded 4,000
training images, the 1,000 held-out images scored once. Same job config (``--preset``, default
``cpu-eps1-nodpsgd``: the whole epsilon on the central + frequency releases, no DP-SGD), same epsilon.

- pooled: ``train`` (``coordinator.local_run.run_train``: the node's handlers and the coordinator's driver,
  one site) on all 4,000 images;
- federated: the in-process harness (feta_release/federation/harness.py: every message through Flower's wire
  encoding, the node's full release protocol, signed policies and ledgers) with 3 sites over the demo's split
  of the same 4,000 (``split_sites(train, 3, seed=0)``, public sizes by the demo's rule), the preset adapted
  by ``coordinator.demo.demo_config`` (rates kept, so q is the preset's), secure aggregation
  (``--per-site-noise``: the old mode). Site noise is fresh OS randomness in both arms (a node takes no seed).

Both arms draw ``n_synthetic`` balanced images from their final model with BOTH samplers -- the primary
comparison is sampler against sampler:

- ``noise``: pure-noise sampling (the model file's sampler, from ``[sampler] sigma_max``; seeds
  ``seed_from(job seed, "synthetic", start)``, batches of 256);
- ``sdedit``: SDEdit (``[sampler] start_sigma``) from the arm's RELEASED central images
  (``released/central.npz`` of its job directory: the site's own, or the coordinator's combination of the
  sites', securely summed), drawn by ``release.jobdir.synthetic_set`` with the job seed -- post-processing of
  released values, no privacy cost. For the pooled arm this is train's ``synthetic.npz`` itself; for the
  federated arm the same function on the coordinator's job directory.

Each is scored with the protocol's classifier (SmallCNN, 5 epochs, seed = run seed) and FD (classifier
features) on the held-out images, plus the release-only baseline (augmented copies of the released/combined
central images). Writes the JSON after every step (a stopped run keeps its finished seeds) and prints mean ±
std (ddof 1). Two streams in parallel (one per arm, separate ``--out``), then one table::

    .venv/bin/python bench/bench_federated_vs_pooled.py --arms pooled --threads 1 --out A.json ...
    .venv/bin/python bench/bench_federated_vs_pooled.py --arms federated --threads 1 --out B.json ...
    .venv/bin/python bench/bench_federated_vs_pooled.py --merge A.json B.json --out merged.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def job_config(preset: str, quick: bool) -> Any:
    """The job both arms run (the quick run: the tiny preset with the nodpsgd preset's central/DP-SGD
    choices)."""
    from feta_release.config import load_preset

    if not quick:
        return load_preset(preset)
    return load_preset("tiny").replace(
        privacy={"epsilon": 1.0},
        central={"rate": 1.0, "cells": 2, "stretch": True},
        dpsgd={"steps": 0},
        warmup={"polish_iterations": 3},
        sampler={"start_sigma": 0.5},
    )


def pooled_run(cfg: Any, train: Any, out: Path, n_synthetic: int, seed: int) -> tuple[Any, dict[str, Any]]:
    """``train`` on all training images: (synthetic sets, info)."""
    from coordinator.local_run import TrainOptions, run_train
    from feta_release.training.progress import Reporter

    rcfg = cfg.replace(job={"seed": seed})
    res = run_train(rcfg, train, out, TrainOptions(n_synthetic=n_synthetic, reporter=Reporter(enabled=False)))
    syn = {"noise": sample_model(out, rcfg, train, n_synthetic)}
    if rcfg.sampler.start_sigma is not None:  # train's synthetic.npz IS the SDEdit set (jobdir.synthetic_set)
        syn["sdedit"] = _synthetic(out, train)
    return syn, {"epsilon": res.epsilon, "central": _released_central(out)}


def federated_config(cfg: Any, site_size: int, seed: int, secure: bool, n_sites: int) -> Any:
    """``cfg`` adapted to ``n_sites`` sites of public size ``site_size`` by the demo's rule
    (``coordinator.demo.demo_config``): sampling rates kept (each site's batch = rate x its public size),
    DP-SGD steps as rounds x local_steps (none for a preset without DP-SGD), the demo's federation section."""
    steps = cfg.dpsgd_steps(site_size * n_sites)
    rounds, local = (0, 1) if steps == 0 else (4, max(1, steps // 4))
    sized, n_ref = cfg.for_size(site_size), 4000  # presets without a rate are written for 4,000 images
    central_b = (
        sized.central.batch if cfg.central.rate is not None else int(cfg.central.batch / n_ref * site_size)
    )
    dpsgd_b = sized.dpsgd.batch if cfg.dpsgd.rate is not None else round(cfg.dpsgd.batch / n_ref * site_size)
    return cfg.replace(
        job={"seed": seed},
        central={"batch": max(1, min(site_size, central_b))},
        dpsgd={"batch": max(1, min(site_size, dpsgd_b)), "steps": rounds * local},
        federation={
            "sites": [f"site-{chr(ord('a') + i)}" for i in range(n_sites)],
            "min_sites": 2,
            "rounds": rounds,
            "local_steps": local,
            "round_timeout": 900.0,
            "secure_aggregation": secure,
        },
    )


def federated_run(
    cfg: Any, train: Any, out: Path, n_synthetic: int, seed: int, secure: bool, n_sites: int = 3
) -> tuple[Any, dict[str, Any]]:
    """The federated job over the in-process harness, then sampling as the pooled arm does (``train``'s
    ``synthetic.npz`` is ``release.jobdir.synthetic_set`` of its job directory)."""
    import shutil

    from coordinator.setup import prepare_federation, sign_job_file
    from edge.clientapp import app
    from feta_release.data.splits import split_sites
    from feta_release.federation.harness import HarnessNode, InProcessGrid
    from feta_release.federation.job import run_job
    from feta_release.release.jobdir import synthetic_set
    from feta_release.signing import load_private_key

    shutil.rmtree(out, ignore_errors=True)  # fresh keys, policies and ledgers for every run
    parts = split_sites(train, n_sites, seed=0)  # the demo's split rule
    fed = prepare_federation(
        out / "federation", {f"site-{chr(ord('a') + i)}": p for i, p in enumerate(parts)}
    )
    fcfg = federated_config(cfg, min(s.size for s in fed.sites), seed, secure, n_sites)
    signed, _ = sign_job_file(fed, fcfg, f"fedpool-{seed}")
    grid = InProcessGrid({100 + i: HarnessNode(app, s.node_config()) for i, s in enumerate(fed.sites)})
    res = run_job(
        grid,
        signed,
        out / "job",
        coordinator_key=load_private_key(fed.coordinator_key),
        wait_timeout=30,
        poll_interval=0.05,
    )
    syn = {"noise": sample_model(out / "job", fcfg, train, n_synthetic)}
    if fcfg.sampler.start_sigma is not None:  # as train draws its synthetic.npz
        synthetic_set(out / "job", n_synthetic, fcfg.job.seed)
        syn["sdedit"] = _synthetic(out / "job", train)
    eps = {sid: att["statement"]["epsilon"] for sid, att in res.attestations.items()}
    worst = {
        sid: (att["statement"].get("secure_aggregation") or {}).get("worst_case_epsilon")
        for sid, att in res.attestations.items()
    }
    return syn, {
        "epsilon": max(eps.values()),
        "site_epsilon": eps,
        "worst_case_epsilon": worst,
        "public_sizes": [s.size for s in fed.sites],
        "timings": res.timings,
        "central": _released_central(out / "job"),
    }


def _released_central(job: Path) -> tuple[Any, Any]:
    """The central images a job directory released (the site's own, or the coordinator's combination)."""
    with np.load(job / "released" / "central.npz") as c:
        return c["images"], c["labels"]


def _synthetic(job: Path, train: Any) -> Any:
    """A job directory's ``synthetic.npz`` (``release.jobdir.synthetic_set``) as a data set."""
    from feta_release.data import ImageDataset

    with np.load(job / "synthetic.npz") as z:
        return ImageDataset(z["images"], z["labels"], train.class_names, source=str(job))


def sample_model(job: Path, cfg: Any, train: Any, n: int) -> Any:
    """``n`` balanced samples of a job directory's model from pure noise (the model file's sampler), seeds
    ``seed_from(job seed, "synthetic", start)`` in batches of 256, the same rule for both arms."""
    import torch

    from feta_release.data import ImageDataset
    from feta_release.models.sampler import generate
    from feta_release.release.jobdir import load_model
    from feta_release.stages.context import seed_from

    model = load_model(job)
    model.eval()
    k = train.n_classes
    labels = np.tile(np.arange(k, dtype=np.int64), math.ceil(n / k))[:n]
    out = []
    with torch.no_grad():
        for start in range(0, n, 256):
            part = labels[start : start + 256]
            imgs, _ = generate(model, part, seed_from(cfg.job.seed, "synthetic", start), cfg.sampler)
            out.append(imgs.numpy().astype(np.float32))
    return ImageDataset(np.concatenate(out), labels, train.class_names, source=str(job))


def score(
    syn: dict[str, Any], central: tuple[Any, Any], real: Any, seed: int, proto: Any, feature_net: Any
) -> dict[str, float]:
    """Protocol accuracy + FD of each sampler's synthetic set, and the release-only baseline of the central
    images."""
    from feta_release.eval_protocol import release_only
    from feta_release.evaluation import accuracy, evaluate, train_classifier

    row: dict[str, float] = {}
    for sampler, data in syn.items():
        ev = evaluate(data, real, seed, classifier_epochs=proto.classifier_epochs, feature_net=feature_net)
        row[f"acc_{sampler}"], row[f"fd_{sampler}"] = float(ev.accuracy), float(ev.fd)
    ro = release_only(central[0], central[1], real.class_names, proto.n_synthetic, seed, proto)
    row["release_only"] = float(accuracy(train_classifier(ro, proto.classifier_epochs, seed), real))
    return row


def _ms(runs: list[dict[str, Any]], key: str, fmt: str) -> str:
    from feta_release.eval_protocol import mean_std

    vals = [r[key] for r in runs if key in r]
    if not vals:
        return "–"
    m, s = mean_std(vals)
    return f"{m:{fmt}} ± {s:{fmt}}" if len(vals) > 1 else f"{m:{fmt}}"


def table(rows: dict[str, list[dict[str, Any]]]) -> str:
    """Per-seed rows, then mean ± std (ddof 1) per arm: both samplers, release-only, ε, wall time, load."""
    lines = [
        "| arm | seed | acc, pure noise | FD, pure noise | acc, SDEdit | FD, SDEdit | release-only | "
        "ε per site (worst case) | wall | load (start-end) |",
        "|---" * 10 + "|",
    ]
    for arm, runs in rows.items():
        for r in sorted(runs, key=lambda r: r["seed"]):
            worst = [w for w in (r.get("worst_case_epsilon") or {}).values() if w is not None]
            eps = f"{r['epsilon']:.3f}" + (f" ({max(worst):.3f})" if worst else "")
            load = r.get("load", {})
            lines.append(
                f"| {arm} | {r['seed']} | {_ms([r], 'acc_noise', '.3f')} | {_ms([r], 'fd_noise', '.0f')} | "
                f"{_ms([r], 'acc_sdedit', '.3f')} | {_ms([r], 'fd_sdedit', '.0f')} | "
                f"{_ms([r], 'release_only', '.3f')} | {eps} | {r['seconds'] / 60:.1f} min | "
                f"{load.get('start', float('nan')):.1f}-{load.get('end', float('nan')):.1f} |"
            )
        if len(runs) > 1:
            lines.append(
                f"| **{arm}, mean ± std** | {','.join(str(r['seed']) for r in runs)} | "
                f"{_ms(runs, 'acc_noise', '.3f')} | {_ms(runs, 'fd_noise', '.0f')} | "
                f"{_ms(runs, 'acc_sdedit', '.3f')} | {_ms(runs, 'fd_sdedit', '.0f')} | "
                f"{_ms(runs, 'release_only', '.3f')} | ≤ {max(r['epsilon'] for r in runs):.3f} | | |"
            )
    return "\n".join(lines)


def _but_seeds(protocol: dict[str, Any]) -> dict[str, Any]:
    """The protocol without its seed list: streams that ran different seeds (``--seeds 2``) of one protocol
    merge."""
    return {k: v for k, v in protocol.items() if k != "seeds"}


def merge(paths: list[str], out: Path) -> dict[str, Any]:
    """One document (and table) from the JSON files of parallel streams (same preset and protocol; the seeds
    may differ: the merged protocol's seeds are the union, each arm's rows sorted by seed, a seed kept once
    per arm)."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    doc: dict[str, Any] = {k: v for k, v in docs[0].items() if k not in ("rows", "table")}
    doc["rows"], doc["merged_from"] = {}, [str(p) for p in paths]
    for d in docs:
        if (d["preset"], _but_seeds(d["protocol"])) != (doc["preset"], _but_seeds(doc["protocol"])):
            raise SystemExit(f"{paths}: different preset/protocol, not merged")
        for arm, runs in d["rows"].items():
            have = doc["rows"].setdefault(arm, [])
            have += [r for r in runs if r["seed"] not in {h["seed"] for h in have}]
    for runs in doc["rows"].values():
        runs.sort(key=lambda r: r["seed"])
    doc["protocol"] = {
        **doc["protocol"],
        "seeds": sorted({r["seed"] for rs in doc["rows"].values() for r in rs}),
    }
    doc["table"] = table(doc["rows"])
    out.write_text(json.dumps(doc, indent=1, default=str))
    print(doc["table"], flush=True)
    return doc


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from feta_release.data import load_embedded
    from feta_release.eval_protocol import PROTOCOL, protocol_splits
    from feta_release.evaluation import train_classifier

    torch.set_num_threads(args.threads)
    proto = PROTOCOL
    if args.quick:
        proto = replace(proto, n_synthetic=200, classifier_epochs=1, feature_epochs=1, seeds=(0,))
    if args.seeds:
        proto = replace(proto, seeds=tuple(int(s) for s in args.seeds.split(",")))
    train, real = protocol_splits(load_embedded(), "test", proto)
    if args.quick:
        train = train.subset(np.arange(0, train.n, 10))
    cfg = job_config(args.preset, args.quick)
    arms = [a for a in args.arms.split(",") if a]
    if not arms or set(arms) - {"pooled", "federated"}:
        raise SystemExit(f"--arms {args.arms!r}: comma-separated 'pooled' and/or 'federated'")
    fed_arm = "federated (3 sites, " + ("secure aggregation)" if args.secure else "per-site noise)")
    doc: dict[str, Any] = {
        "preset": "tiny (quick)" if args.quick else args.preset,
        "protocol": proto.__dict__,
        "train": train.n,
        "scored_on": real.n,
        "rows": {("pooled (1 site)" if a == "pooled" else fed_arm): [] for a in arms},
    }
    out = Path(args.out)
    t0 = time.perf_counter()
    # one FD space for both arms (the protocol's)
    feature_net = train_classifier(real, proto.feature_epochs, 0)
    print(f"train {train.n}, held-out {real.n}; feature net {time.perf_counter() - t0:.0f} s", flush=True)
    for seed in proto.seeds:
        for arm in arms:
            name = "pooled (1 site)" if arm == "pooled" else fed_arm
            t0, load0 = time.perf_counter(), os.getloadavg()[0]
            run_dir = Path(args.runs) / arm / f"seed{seed}"
            if arm == "pooled":
                syn, info = pooled_run(cfg, train, run_dir, proto.n_synthetic, seed)
            else:
                syn, info = federated_run(cfg, train, run_dir, proto.n_synthetic, seed, args.secure)
            row = {
                "seed": seed,
                **score(syn, info.pop("central"), real, seed, proto, feature_net),
                **info,
                "seconds": round(time.perf_counter() - t0, 1),
                "threads": args.threads,
                "load": {"start": load0, "end": os.getloadavg()[0]},
            }
            doc["rows"][name].append(row)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(doc, indent=1, default=str))
            print(
                json.dumps({"arm": name, **{k: v for k, v in row.items() if k != "timings"}}, default=str),
                flush=True,
            )
    doc["table"] = table(doc["rows"])
    out.write_text(json.dumps(doc, indent=1, default=str))
    print(doc["table"], flush=True)
    return doc


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu-eps1-nodpsgd")
    ap.add_argument("--seeds", default=None, help="comma-separated (default: the protocol's 0,1,2)")
    ap.add_argument("--arms", default="federated,pooled", help="comma-separated, run in this order per seed")
    ap.add_argument(
        "--per-site-noise",
        dest="secure",
        action="store_false",
        help="the federation without secure aggregation (each site adds the full noise to its own release)",
    )
    ap.add_argument("--out", default=None, help="results JSON (default bench/results/fedpool-<preset>.json)")
    ap.add_argument("--runs", default=None, help="run directories (default runs/fedpool[-quick])")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: tiny preset, 400 images, 1 seed, 200 samples"
    )
    ap.add_argument(
        "--merge", nargs="+", default=None, help="merge these results JSON files into --out (no run)"
    )
    args = ap.parse_args(argv)
    if args.merge:
        if not args.out:
            ap.error("--merge needs --out")
        return merge(args.merge, Path(args.out))
    tag = "quick" if args.quick else args.preset + ("" if args.secure else "-per-site")
    args.out = args.out or str(ROOT / "bench" / "results" / f"fedpool-{tag}.json")
    args.runs = args.runs or str(ROOT / "runs" / f"fedpool-{tag}")
    return run(args)


if __name__ == "__main__":
    main()
