"""A large site end to end: throughput (images/s) and peak memory (RSS) of every site-side stage.

Each stage runs in a process of its own and its peak resident set is read from the kernel (``os.wait4``'s
``ru_maxrss`` of that process), so numpy and torch buffers are counted (tracemalloc sees neither):

  generate   ``data generate medical`` into an .npz (8-bit pixels)
  inspect    ``data inspect`` of it
  init       ``site init`` (keys, node.toml, the policy draft with the data's keyed commitment)
  open       the node's first open (``node start``'s preflight): decode, verify the commitment, write the site
             cache
  reopen     a per-message open: the site from its cache
  central    the central-images release, padded to the public size (``edge.padded_releases``)
  frequency  the frequency release, padded likewise
  dpsgd      one DP-SGD round (``edge.releases.dpsgd_round``, ``--steps`` local steps of the quick model)

A stage that refuses (a site too large for the memory limit) prints its one line and the bench says so.

Sizes above the generator's 128 px (``--size 256``): ``generate`` writes only ``SMALL_SITE`` real images (128
px medical images, each pixel repeated to the side) and the signed policy declares the public size ``--n``;
the node's open then refuses the site before reading it, naming the bytes its float32 images and working
memory need against the policy's ``resources.max_worker_memory_mb`` (or, first, ``FETA_MAX_DATASET_MB``).

Usage:  python bench/site_scale.py [--n 100000] [--size 64] [--quick] [--stages open,central] [--keep DIR]
        python bench/site_scale.py --n 20000 --size 128            (128 px: at most 40,960 images fit 2.5 GiB)
        python bench/site_scale.py --size 256 --memory-mb 100000 --stages generate,init,open
``--quick``: n = 5,000 (a smoke run). Run it niced on a shared machine. Every stage process keeps freed pages
mapped from its start, as the node's processes do (``feta_release.allocator``); ``FETA_KEEP_FREED_PAGES=0`` in
the environment measures glibc's own policy instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STAGES = ("generate", "inspect", "init", "open", "reopen", "central", "frequency", "dpsgd")
GENERATOR_SIDE = 128  # the largest side `data generate medical` draws
SMALL_SITE = 200  # real images written for a side above it (the policy declares --n)
QUICK_MODEL = {"channels": 8, "channel_mult": [1], "num_res_blocks": 1, "attn_resolutions": []}


def job_config(steps: int) -> Any:
    from feta_release.config import JobConfig

    return JobConfig.from_dict(
        {
            "job": {"name": "site-scale", "seed": 0},
            "privacy": {"epsilon": 10.0, "delta": 1e-5},
            "central": {
                "kind": "mean",
                "rounds": 2,
                "batch": 1000,
                "sigma": 5.0,
                "clip": 8.0,
                "downsample": 0.25,
            },
            "frequency": {"features": 400, "sigma": 10.0},
            "model": QUICK_MODEL,
            "dpsgd": {"batch": 32, "steps": steps, "physical_batch": 16, "noise_multiplicity": 1},
            "federation": {"rounds": 1, "local_steps": steps},
        }
    )


def _cli(*args: str) -> None:
    from feta_release.cli import main

    main(list(args))  # the console script's entry: a refusal is its one line and exit code


def _node_config(work: Path) -> dict[str, Any]:
    return dict(json.loads((work / "node_config.json").read_text()))


def _site(work: Path) -> Any:
    from edge.site import Site

    return Site.open(_node_config(work))


def stage(name: str, work: Path, n: int, size: int, steps: int) -> int:
    """Run one stage in this process; returns the images it processed."""
    data = work / "site.npz"
    if name == "generate" and size > GENERATOR_SIDE:
        _large_side(data, min(n, SMALL_SITE), size)
    elif name == "generate":
        _cli("data", "generate", "medical", "--n", str(n), "--size", str(size), "--out", str(data))
    elif name == "inspect":
        _cli("data", "inspect", str(data), "--json")
    elif name == "init":
        shutil.rmtree(work / "kit", ignore_errors=True)
        _cli("site", "init", str(work / "kit"), "--data", str(data), "--site-id", "st-scale")
        _federation(work, data, n)  # the signed policy a node opens against (not timed as its own stage)
    elif name in ("open", "reopen"):
        if name == "open":
            shutil.rmtree(Path(_node_config(work)["work-dir"]), ignore_errors=True)
        _site(work).ledger.close()
    else:
        _release(name, _site(work), steps)
    return n


def _large_side(path: Path, n: int, size: int) -> None:
    """``n`` medical images of 128 px, each pixel repeated to ``size`` (a multiple of 128), as an .npz."""
    import numpy as np

    from feta_release.data import save_npz
    from feta_release.data.dataset import ImageDataset
    from feta_release.data.procedural import generate_dataset as generate

    small = generate("medical", n, size=GENERATOR_SIDE)
    k = size // GENERATOR_SIDE
    images = np.repeat(np.repeat(small.images, k, axis=2), k, axis=3)
    save_npz(ImageDataset(images, small.labels, small.class_names, f"medical at {size} px"), path)


def _federation(work: Path, data: Path, n: int) -> None:
    from coordinator.setup import prepare_federation

    shutil.rmtree(work / "fed", ignore_errors=True)
    fed = prepare_federation(work / "fed", {"st-scale": data}, public_sizes={"st-scale": n}, pin_peers=False)
    cfg = fed.site("st-scale").node_config()
    cfg["work-dir"] = str(work / "node-work")
    (work / "node_config.json").write_text(json.dumps(cfg))


def _release(name: str, site: Any, steps: int) -> None:
    import numpy as np
    import torch

    from edge.padded_releases import padded
    from edge.releases import dpsgd_round, release_central, release_frequency
    from feta_release.models import build_denoiser
    from feta_release.planning import stage_events

    cfg, rng = job_config(steps), np.random.default_rng(0)
    if name == "central":
        padded(release_central, site.data, cfg, site.n_public, rng)
    elif name == "frequency":
        padded(release_frequency, site.data, cfg, site.n_public, rng)
    else:
        event = [
            e for e in stage_events(cfg, site.n_public, federated=True, rounds=[steps]) if e.stage == "dpsgd"
        ][0]
        model = build_denoiser(cfg.model, site.data.image_shape, site.data.n_classes)
        weights = {k: v.numpy() for k, v in model.state_dict().items()}
        dpsgd_round(site.data, cfg, weights, event, torch.Generator().manual_seed(0), site.n_public)
    site.ledger.close()


def measure(name: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--stage",
        name,
        "--work",
        str(work),
        "--n",
        str(args.n),
        "--size",
        str(args.size),
        "--steps",
        str(args.steps),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FETA_MAX_DATASET_MB": str(args.memory_mb)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    last = out.strip().splitlines()[-1] if out.strip() else ""
    return {
        "stage": name,
        "rc": rc,
        "seconds": round(seconds, 2),
        "images_per_s": round(args.n / seconds, 1),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
        "said": last[:300],
    }


def _one_stage(args: argparse.Namespace) -> None:
    """A stage in this process; a refusal is its one line (as the command line prints it) and exit code."""
    from feta_release.allocator import keep_freed_pages
    from feta_release.errors import FetaError

    keep_freed_pages()  # as the node's worker does at its start (FETA_KEEP_FREED_PAGES=0: glibc's own policy)

    try:
        stage(args.stage, Path(args.work), args.n, args.size, args.steps)
    except FetaError as exc:
        print(f"error: {exc}")
        sys.exit(exc.exit_code)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=1, help="local DP-SGD steps of the dpsgd stage")
    ap.add_argument("--quick", action="store_true", help="n = 5,000")
    ap.add_argument(
        "--memory-mb",
        type=int,
        default=2560,
        help="FETA_MAX_DATASET_MB of every stage: the float32 images' limit (the rest of 4 GB is headroom)",
    )
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--keep", help="work directory to use and keep (default: a temporary one)")
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stage:
        _one_stage(args)
        return
    if args.quick:
        args.n = 5_000
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="site-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"site of {args.n:,} images at {args.size}x{args.size} in {work}")
    try:
        for name in args.stages.split(","):
            row = measure(name, work, args)
            print(json.dumps(row), flush=True)
            if row["rc"]:
                print(f"stage {name} stopped (exit {row['rc']}): {row['said']}")
                break
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
