"""Does the release carry a LOCAL finding? Routes x epsilon x seeds on the medical-like set, a row each.

The medical-like set (``data generate medical``, docs/data-kinds.md) has a class, ``finding``, that differs
from ``normal`` only by a small bright spot at a random place: its class mean is normal's, so a release that
keeps per-class means cannot tell them apart. This sweep scores, per route, epsilon and seed, how well a
classifier trained on the synthetic images recognises each class of real images (the evaluation ResNet,
``feta_release.eval_classifier``), beside the same classifier trained on the real training images (the
ceiling), with recall and coverage (diversity) and precision and density (fidelity) in classifier features.

Routes (each is the job ``feta-release train --data D --epsilon E [--public P] [--dpsgd on]`` derives; the
row writes that job with the row's seed and runs ``feta-release train JOB --data D [--public P]``):

- ``scratch``: no public data (the derived job as it stands).
- ``public``: pretrained on a public set of ANOTHER population (``data generate medical --population B``:
  another hospital's scanner and case mix, the same four class names, so the pretraining is
  class-conditional).
- ``public-dpsgd``: the same, then DP-SGD of the norms, attention and conditioning only (``--dpsgd on``).
- for comparison (``--routes``, not by default; job edits the command line does not make):
  ``scratch-noise-start`` / ``public-noise-start``, the first two with the synthetic set drawn from pure noise
  instead of the derived job's SDEdit start; ``public-nocentral`` / ``public-dpsgd-nocentral``, the public
  routes without training on the released central images (no spatial warm-up, no polish, no central images in
  the frequency warm-up).

Data: population A (seed 1) split by the evaluation protocol (``feta_release.eval_protocol``): ``--mode
validation`` trains on the fit part and scores on the validation part (for choosing), ``--mode test`` trains
on the training part and scores on the held-out part (once, for the chosen route). The public set is
population B (seed 7), disjoint from both.

    # one H100, 16 cores, about 4 minutes (bench/README.md):
    python bench/finding_sweep.py --device cuda --jobs 11 --time-budget 180 --n-synthetic 2000 \
        --classifier-epochs 40 --deadline 230 --out runs/finding/results.jsonl
    # a smoke run on the CPU (tiny sizes, one seed, one epsilon):
    python bench/finding_sweep.py --quick --out runs/finding-quick/results.jsonl

Each finished row is appended to ``--out`` (JSON lines) at once; a rerun skips the rows already there with
the same settings. At the end a table (mean +- std over seeds) is printed and written beside ``--out``
(``.md``). Per row: accuracy overall and per class, the finding class's accuracy over its ceiling, recall /
coverage / precision / density, FD (classifier features), epsilon spent, seconds (training, evaluation), peak
RSS of the row's process and peak GPU memory (``torch.cuda.max_memory_allocated``; 0 on the CPU).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script, sys.path[0] is bench/: the checkout's packages, bench.* too
from bench.generality import child_env  # noqa: E402  # the children's path, the caller's kept after it

ROUTES = ("scratch", "public", "public-dpsgd")
# Comparison routes, not in the default set: a job edit the command line does not make (the synthetic set
# drawn from pure noise instead of the derived SDEdit start), to see whether the start carries or hides the
# finding.
# The "-nocentral" routes keep the pretrained model from being retrained on the released central images (no
# spatial warm-up or polish, no central images mixed into the frequency warm-up): on the CPU at 32 px the
# spatial warm-up turned the pretrained model's anatomy back into the central images' speckled prototypes.
_NO_CENTRAL_WARMUP: dict[str, dict[str, Any]] = {
    "warmup": {"spatial_iterations": 0, "polish_iterations": 0, "frequency_mix_central": False}
}
EXTRA_ROUTES: dict[str, dict[str, dict[str, Any]]] = {
    "public-noise-start": {"sampler": {"start_sigma": None, "start_source": "central"}},
    "scratch-noise-start": {"sampler": {"start_sigma": None, "start_source": "central"}},
    "public-nocentral": _NO_CENTRAL_WARMUP,
    "public-dpsgd-nocentral": _NO_CENTRAL_WARMUP,
}
FINDING = "finding"
PRIVATE_SEED, PUBLIC_SEED = 1, 7  # population A (the site) and B (the public set): different patients


# ------------------------------------------------------------------------------------------------
# data (prepared once by the driver, read by every row)
# ------------------------------------------------------------------------------------------------
def prepare_data(args: argparse.Namespace) -> dict[str, str]:
    """Write the mode's training part, its scored part and the public set as .npz files under ``--work``."""
    from feta_release.data import save_npz
    from feta_release.data.procedural import generate_dataset as generate
    from feta_release.eval_protocol import protocol_splits

    work = Path(args.work)
    tag = f"n{args.n_private}-s{args.image_size}-{args.mode}"
    paths = {
        "train": work / f"private-{tag}-train.npz",
        "eval": work / f"private-{tag}-eval.npz",
        "public": work / f"public-n{args.n_public}-s{args.image_size}.npz",
    }
    if not all(p.exists() for p in paths.values()):
        work.mkdir(parents=True, exist_ok=True)
        full = generate("medical", args.n_private, size=args.image_size, seed=PRIVATE_SEED, population="A")
        train, scored = protocol_splits(full, args.mode)
        save_npz(train, paths["train"])
        save_npz(scored, paths["eval"])
        save_npz(
            generate("medical", args.n_public, size=args.image_size, seed=PUBLIC_SEED, population="B"),
            paths["public"],
        )
    return {k: str(v) for k, v in paths.items()}


def _load(path: str) -> Any:
    from feta_release.data import load_dataset

    return load_dataset(path)[0]


# ------------------------------------------------------------------------------------------------
# one row (runs in its own process)
# ------------------------------------------------------------------------------------------------
def derived_job_file(task: dict, train: Any, public: Any, path: Path) -> list[str]:
    """Derive the route's job exactly as ``train --epsilon`` does (``cli.derive_options.derived_jobs``),
    with the row's seed and the task's overrides, write it to ``path``; returns the job's header notes."""
    from feta_release.cli.derive_options import DeriveRequest, derived_jobs
    from feta_release.job_rules import job_toml

    req = DeriveRequest(
        float(task["eps"]),
        None,
        str(task["time_budget"]),
        None,
        "on" if task["route"].startswith("public-dpsgd") else None,
    )
    notes: list[str] = []
    cfg, _ = derived_jobs(
        req,
        train,
        task["device"],
        train.n,
        None,
        None,
        notes.append,
        public=public if task["route"].startswith("public") else None,
    )
    cfg = cfg.replace(job={"seed": int(task["seed"])}, **EXTRA_ROUTES.get(task["route"], {}))
    for key, value in task["set"].items():
        section, name = key.split(".", 1)
        cfg = cfg.replace(**{section: {name: value}})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(job_toml(cfg))
    return [line for line in "".join(notes).splitlines() if line.startswith("# ")]


def _train(task: dict, job: Path, run_dir: Path) -> dict:
    """``feta-release train JOB --data ... [--public ...]`` in this process; its JSON summary."""
    import contextlib
    import io

    from feta_release.cli import main

    argv = [
        "train",
        str(job),
        "--data",
        task["data"]["train"],
        "--public-size",
        str(task["n_train"]),
        "--out",
        str(run_dir),
        "--synthetic",
        str(task["n_synthetic"]),
        "--no-release",
        "--json",
        "--no-progress",
        "--threads",
        str(task["threads"]),
        "--device",
        task["device"],
    ]
    if task["route"].startswith("public"):
        argv += ["--public", task["data"]["public"], "--public-description", "medical-like population B"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
        except SystemExit as exc:
            if exc.code:
                raise RuntimeError(f"train exited {exc.code}") from None
    text = out.getvalue()
    return json.loads(text[text.rindex("\n{") + 1 :] if "\n{" in text else text[text.index("{") :])


def _finding_ratio(per_class: dict, ceiling: dict | None) -> float | None:
    if not ceiling or not ceiling.get(FINDING):
        return None
    return per_class[FINDING] / ceiling[FINDING]


def run_row(task: dict) -> dict:
    """Train one route at one epsilon and seed, then score its synthetic images on the real scored part."""
    import torch

    from feta_release.data import ImageDataset
    from feta_release.evaluation import evaluate

    torch.set_num_threads(task["threads"])
    train, real = _load(task["data"]["train"]), _load(task["data"]["eval"])
    public = _load(task["data"]["public"])
    run_dir = Path(task["work"]) / "runs" / task["name"]
    t0 = time.perf_counter()
    notes = derived_job_file(task, train, public, run_dir.with_suffix(".toml"))
    summary = _train(task, run_dir.with_suffix(".toml"), run_dir)
    t_train = time.perf_counter() - t0
    with np.load(run_dir / "synthetic.npz") as z:
        syn = ImageDataset(
            z["images"].astype(np.float32),
            z["labels"].astype(np.int64),
            train.class_names,
            source=str(run_dir),
        )
    t1 = time.perf_counter()
    rep = evaluate(
        syn,
        real,
        int(task["seed"]),
        ceiling=False,
        classifier_epochs=task["classifier_epochs"],
        feature_epochs=task["feature_epochs"],
        grid_path=run_dir / "evaluated.png",
        per_class=8,
        device=task["device"],
    )
    gpu = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0.0
    return {
        "accuracy": rep.accuracy,
        "per_class": rep.per_class_accuracy,
        "precision": rep.precision,
        "recall": rep.recall,
        "density": rep.density,
        "coverage": rep.coverage,
        "fd": rep.fd,
        "epsilon_spent": summary.get("epsilon"),
        "train_s": round(t_train, 1),
        "eval_s": round(time.perf_counter() - t1, 1),
        "gpu_peak_mib": round(gpu),
        "job_notes": notes,
        "grid": str(run_dir / "evaluated.png"),
        "warnings": rep.warnings,
    }


def run_ceiling(task: dict) -> dict:
    """The evaluation classifier trained on the REAL training part, scored on the real scored part."""
    import torch

    from feta_release.evaluation import real_ceiling

    torch.set_num_threads(task["threads"])
    train, real = _load(task["data"]["train"]), _load(task["data"]["eval"])
    t0 = time.perf_counter()
    c = real_ceiling(real, train, int(task["seed"]), epochs=task["classifier_epochs"], device=task["device"])
    return {
        "accuracy": c.accuracy,
        "per_class": c.per_class_accuracy,
        "eval_s": round(time.perf_counter() - t0, 1),
        "train_s": 0.0,
        "gpu_peak_mib": 0,
    }


def child_main(task: dict) -> None:
    sys.path.insert(0, str(ROOT))
    row = run_ceiling(task) if task["route"] == "ceiling" else run_row(task)
    row["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(json.dumps(row), flush=True)


# ------------------------------------------------------------------------------------------------
# the driver
# ------------------------------------------------------------------------------------------------
def settings_key(args: argparse.Namespace) -> str:
    """What makes two rows comparable (sizes, iterations, mode, device): rows of other settings are not
    reused."""
    keep = {
        k: getattr(args, k)
        for k in (
            "mode",
            "n_private",
            "n_public",
            "image_size",
            "n_synthetic",
            "time_budget",
            "classifier_epochs",
            "feature_epochs",
            "device",
            "set",
        )
    }
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:12]


def plan_tasks(args: argparse.Namespace, data: dict[str, str], n_train: int) -> list[dict]:
    """The ceiling once per seed, then every route x epsilon x seed (seeds outermost: a stopped sweep has
    every (route, epsilon) cell's first seeds first)."""
    common = {
        "mode": args.mode,
        "data": data,
        "work": str(args.work),
        "device": args.device,
        "threads": args.threads,
        "n_train": n_train,
        "n_synthetic": args.n_synthetic,
        "time_budget": args.time_budget,
        "classifier_epochs": args.classifier_epochs,
        "feature_epochs": args.feature_epochs,
        "set": args.set,
        "settings": settings_key(args),
    }
    tasks = [{**common, "route": "ceiling", "eps": None, "seed": s} for s in args.seeds]
    for seed in args.seeds:
        for eps in args.eps:
            for route in args.routes:
                tasks.append({**common, "route": route, "eps": eps, "seed": seed})
    for t in tasks:
        eps = "" if t["eps"] is None else f"-eps{t['eps']:g}"
        t["name"] = f"{t['route']}{eps}-seed{t['seed']}-{t['settings']}"
    return tasks


def spawn(task: dict, deadline: float) -> dict:
    """One task in a child process: its row with the wall seconds (and the error line of a failed row). A task
    not started by ``deadline`` (``time.monotonic``) is skipped, one still running then is stopped."""
    t0 = time.perf_counter()
    head = {k: task[k] for k in ("route", "eps", "seed", "mode", "device", "settings", "name")}
    if time.monotonic() >= deadline:
        return {**head, "wall_s": 0.0, "error": "not started: the sweep's --deadline had passed"}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--task", json.dumps(task)],
            stdout=out,
            stderr=err,
            text=True,
            env=child_env(),
        )
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = -9
            err.write("\nstopped at the sweep's --deadline\n")
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    head["wall_s"] = round(time.perf_counter() - t0, 1)
    if code != 0:
        return {**head, "error": (stderr.strip().splitlines() or [f"exit {code}"])[-1]}
    return {**head, **json.loads(stdout.strip().splitlines()[-1])}


def _done(out: Path, settings: str) -> dict[str, dict]:
    if not out.exists():
        return {}
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return {r["name"]: r for r in rows if r.get("settings") == settings and "error" not in r}


def _mean_std(values: list[float]) -> str:
    if not values:
        return "-"
    a = np.asarray(values, float)
    return f"{a.mean():.3f} ± {a.std(ddof=1):.3f}" if len(a) > 1 else f"{a[0]:.3f}"


def table(rows: list[dict]) -> str:
    """Mean ± std over seeds per (route, epsilon); the finding class beside its ceiling."""
    ceil = {r["seed"]: r["per_class"] for r in rows if r["route"] == "ceiling" and "per_class" in r}
    lines = [
        "| route | ε | seeds | accuracy | finding | finding / ceiling | normal | recall | coverage | "
        "precision | train s | peak RSS MiB | GPU MiB |",
        "|" + "---|" * 13,
    ]
    if ceil:
        c = list(ceil.values())
        lines.append(
            f"| real training data (ceiling) | - | {len(c)} | "
            f"{_mean_std([r['accuracy'] for r in rows if r['route'] == 'ceiling'])} | "
            f"{_mean_std([x[FINDING] for x in c])} | 1 | {_mean_std([x['normal'] for x in c])} "
            "| | | | | | |"
        )
    cells = sorted(
        {(r["route"], r["eps"]) for r in rows if r["route"] != "ceiling" and "per_class" in r},
        key=lambda k: (k[1], [*ROUTES, *EXTRA_ROUTES].index(k[0])),
    )
    for route, eps in cells:
        rs = [r for r in rows if r["route"] == route and r["eps"] == eps and "per_class" in r]
        ratio = [
            x for x in (_finding_ratio(r["per_class"], ceil.get(r["seed"])) for r in rs) if x is not None
        ]
        lines.append(
            f"| {route} | {eps:g} | {len(rs)} | {_mean_std([r['accuracy'] for r in rs])} | "
            f"{_mean_std([r['per_class'][FINDING] for r in rs])} | {_mean_std(ratio)} | "
            f"{_mean_std([r['per_class']['normal'] for r in rs])} | {_mean_std([r['recall'] for r in rs])} | "
            f"{_mean_std([r['coverage'] for r in rs])} | {_mean_std([r['precision'] for r in rs])} | "
            f"{max(r['train_s'] for r in rs):.0f} | {max(r['peak_rss_mib'] for r in rs)} | "
            f"{max(r['gpu_peak_mib'] for r in rs)} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where each row trains, samples and trains its evaluation classifiers",
    )
    ap.add_argument("--jobs", type=int, default=1, help="rows run in parallel (separate processes)")
    ap.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads per row (default: cores / jobs)"
    )
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--eps", default="1,10")
    ap.add_argument(
        "--routes", default=",".join(ROUTES), help=f"comma-separated of {', '.join([*ROUTES, *EXTRA_ROUTES])}"
    )
    ap.add_argument("--mode", choices=["validation", "test"], default="validation")
    ap.add_argument("--out", default="runs/finding/results.jsonl", help="JSON lines, appended row by row")
    ap.add_argument("--work", default=None, help="data and run folders (default: beside --out)")
    ap.add_argument(
        "--n-private",
        type=int,
        default=5000,
        help="population-A images before the protocol's "
        "split (5,000: 4,000 training images in test mode, 3,200 fit images in validation mode)",
    )
    ap.add_argument("--n-public", type=int, default=4000, help="population-B (public) images")
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--n-synthetic", type=int, default=4000, help="synthetic images per row (balanced)")
    ap.add_argument(
        "--time-budget",
        default="15m",
        help="the derived job's --time-budget (sizes its warm-up, "
        "public pretraining and DP-SGD steps by the cost model for --device)",
    )
    ap.add_argument(
        "--classifier-epochs",
        type=int,
        default=None,
        help="evaluation classifier epoch cap (default: automatic, early stopping)",
    )
    ap.add_argument(
        "--feature-epochs", type=int, default=10, help="feature network epoch cap (recall, coverage)"
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a key of every row's derived job (TOML literal), e.g. public.pretrain_iterations=300",
    )
    ap.add_argument(
        "--deadline",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop after this many seconds: "
        "rows not started are skipped, running ones stopped; finished rows and the table are kept",
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, 28 px, one seed, epsilon 10")
    ap.add_argument("--task", default=None, help=argparse.SUPPRESS)  # one row, in a child process
    args = ap.parse_args(argv)
    if args.quick:
        args.n_private, args.n_public, args.image_size, args.n_synthetic = 400, 300, 28, 200
        args.time_budget, args.classifier_epochs, args.feature_epochs = (
            "240",
            3,
            3,
        )  # 240: DP-SGD gets its 20 steps
        args.seeds, args.eps = "0", "10"
        args.set += [
            "public.pretrain_iterations=20",
            "warmup.spatial_iterations=20",
            "warmup.polish_iterations=10",
            "warmup.frequency_images=200",
            "warmup.frequency_epochs=1",
            "auxgen.epochs=1",
            "auxgen.iterations_per_epoch=5",
            "auxgen.restarts=1",
            "auxgen.keep=1",
        ]
    args.seeds = [int(s) for s in str(args.seeds).split(",")]
    args.eps = [float(e) for e in str(args.eps).split(",")]
    args.routes = [r for r in str(args.routes).split(",") if r]
    bad = [r for r in args.routes if r not in ROUTES and r not in EXTRA_ROUTES]
    if bad:
        ap.error(f"unknown route(s) {bad}; choose from {', '.join([*ROUTES, *EXTRA_ROUTES])}")
    import tomllib

    args.set = {kv.split("=", 1)[0]: tomllib.loads(f"v = {kv.split('=', 1)[1]}")["v"] for kv in args.set}
    args.jobs = max(1, args.jobs)
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    args.work = Path(args.work) if args.work else Path(args.out).parent
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.task is not None:
        child_main(json.loads(args.task))
        return
    sys.path.insert(0, str(ROOT))
    from feta_release.data import load_dataset

    data = prepare_data(args)
    n_train = load_dataset(data["train"])[0].n
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = _done(out, settings_key(args))
    tasks = [t for t in plan_tasks(args, data, n_train) if t["name"] not in done]
    print(
        f"{len(tasks)} row(s) to run ({len(done)} already in {out}), {args.jobs} at a time, "
        f"{args.threads} thread(s) each, on {args.device}",
        flush=True,
    )
    rows = list(done.values())
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        deadline = time.monotonic() + (args.deadline if args.deadline else float("inf"))
        for fut in as_completed([pool.submit(spawn, t, deadline) for t in tasks]):
            row = fut.result()
            rows.append(row)
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(
                json.dumps(
                    {
                        k: row.get(k)
                        for k in (
                            "name",
                            "accuracy",
                            "per_class",
                            "recall",
                            "coverage",
                            "train_s",
                            "wall_s",
                            "error",
                        )
                    }
                ),
                flush=True,
            )
    text = table(rows)
    out.with_suffix(".md").write_text(f"settings {settings_key(args)}: {vars(args)}\n\n{text}\n")
    print(text)


if __name__ == "__main__":
    main()
