"""Generality: one table of what a release is worth on other data than digits.

Rows: data kind (the embedded digits; the procedural medical-like radiographs; the procedural RGB objects, see
docs/data-kinds.md) x training size (``--sizes``, default 500, 4,000, 20,000) x ε (``--eps``, default 1, 10).
Columns (accuracy on REAL held-out images, mean ± std over ``--seeds``):

- real ceiling: the project's evaluation classifier (``feta_release.evaluation.train_classifier``) trained on
  the real training part; it does not depend on ε (computed once per data kind and size, shown in both ε
  rows);
- release-only: the same classifier on augmented copies of the run's released central images
  (``feta_release.eval_protocol.release_only``): what the release gives without its generator;
- DP-SGD CNN: a GroupNorm CNN trained DIRECTLY on the real training part with DP-SGD (Opacus) at the same (ε,
  δ) (bench/dpsgd_classifier.py): the anchor a synthetic release should approach;
- release (pipeline): ``feta-release train`` on the training part (the job given by ``--job``), its synthetic
  images scored by the evaluation classifier; beside it the ε the run's ledger spent;
- time (the sum of the row's cells; the ceiling's counted in the first ε row) and peak RSS (the largest of the
  row's processes, children included).

Splits are the project's protocol (feta_release/eval_protocol.py): the generated set holds size / 0.8 images,
its held-out 20 % (seed 0) is scored once; ``--mode validation`` scores the validation part inside train
instead (for tuning; the held-out part is then never read). δ is the project's job default (1e-5) unless
``--delta``. The digits hold 5,000 images, so their 20,000 row is marked n/a.

``--public KIND:N`` pretrains every release on a generated PUBLIC set (``data generate KIND``, N images at the
kind's image size, seed 7: ``strokes`` for the digits, ``medical`` population B for the medical-like set; it is
never the data scored) through ``train --public``; ``--dpsgd on|off`` asks the derived job for or against its
DP-SGD stage (``train --dpsgd``). Both change the cells' names, so their rows sit beside the plain ones in the
same ``--out``:

    python bench/generality.py --kinds digits --sizes 4000 --eps 1 --methods release --job derived \
        --public strokes:10000 --dpsgd on --mode validation     # public pretraining, then DP-SGD

``--job`` picks the pipeline's job: ``auto`` (default: ``train --data PATH --epsilon E`` when the installed
``train`` has ``--epsilon``, else the shipped preset ``cpu-eps1`` / ``cpu-eps10`` nearest the row's ε, with
[privacy] epsilon/delta set to the row's), ``derived`` (always ``--epsilon E``), ``preset:NAME`` (NAME may
contain ``{eps}``, e.g. ``preset:cpu-eps{eps}``) or a job ``.toml`` path; a preset or file gets the row's ε, δ
and the seed.

Each cell (one method, data kind, size, ε, seed) runs in its own process, so its time and peak RSS are its
own; results are saved after every cell and a rerun with the same ``--out`` skips the cells already done.

Commands (the full table takes hours on 2 CPU cores; run it on a GPU machine with ``--device cuda`` for the
pipeline and ``--classifier-device cuda`` for the evaluation classifiers, ``--jobs N`` cells at once; the
DP-SGD anchor stays on the CPU):

    python bench/generality.py                                   # the whole table -> bench/results/generality.*
    python bench/generality.py --kinds medical --sizes 4000 --eps 10 --seeds 0   # one row, one seed
    python bench/generality.py --methods ceiling,dpsgd           # the cheap columns only
    python bench/generality.py --job preset:cpu-eps{eps} --device cuda
    python bench/generality.py --sizes 4000 --methods ceiling,release --job derived --device cuda \
        --classifier-device cuda --jobs 6 --priority medical:10,digits:1,rgb:10   # those rows first
    python bench/generality.py --quick                           # smoke run -> bench/results/generality-quick.*
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("digits", "medical", "rgb")
METHODS = ("ceiling", "dpsgd", "release")
DIGITS_TRAIN_MAX = 4000  # the 5,000 shipped digits: 4,000 in the protocol's train part


# ------------------------------------------------------------------------------------------------
# one cell (runs in a child process)
# ------------------------------------------------------------------------------------------------
def _splits(cell: dict) -> tuple[Any, Any]:
    from dpsgd_classifier import load_kind

    from feta_release.eval_protocol import protocol_splits

    kind = "embedded" if cell["kind"] == "digits" else cell["kind"]
    return protocol_splits(load_kind(kind, cell["size"], size=cell.get("image_size")), cell["mode"])


def _classifier_scores(train: Any, test: Any, cell: dict) -> tuple[float, dict[str, float]]:
    """(accuracy, per-class accuracy) of the project's evaluation classifier trained on ``train`` and scored
    on ``test``, through its public names (whatever its architecture and stopping rule); it trains on
    ``cell["classifier_device"]`` where it takes a device."""
    import inspect

    from feta_release import evaluation as ev

    kw: dict[str, Any] = {"seed": cell["seed"]}
    params = inspect.signature(ev.train_classifier).parameters
    if cell.get("classifier_epochs") is not None and "epochs" in params:
        kw["epochs"] = cell["classifier_epochs"]
    if cell.get("classifier_device", "cpu") != "cpu" and "device" in params:
        kw["device"] = cell["classifier_device"]
    net = ev.train_classifier(train, **kw)
    return float(ev.accuracy(net, test)), ev.per_class_accuracy(net, test)


def _cell_ceiling(cell: dict) -> dict:
    train, test = _splits(cell)
    acc, per_class = _classifier_scores(train, test, cell)
    return {"acc": acc, "per_class": per_class}


def _cell_dpsgd(cell: dict) -> dict:
    from dpsgd_classifier import dpsgd_anchor

    train, test = _splits(cell)
    kw = {"epochs": cell["dpsgd_epochs"]} if cell.get("dpsgd_epochs") else {}
    res = dpsgd_anchor(train, test, epsilon=cell["eps"], delta=cell["delta"], seed=cell["seed"], **kw)
    return {
        "acc": res.accuracy,
        "epsilon": res.epsilon,
        "noise_multiplier": res.noise_multiplier,
        "steps": res.steps,
    }


def _cell_release(cell: dict) -> dict:
    from feta_release.data import ImageDataset, save_npz
    from feta_release.eval_protocol import release_only

    train, test = _splits(cell)
    run_dir = Path(cell["work"]) / "runs" / _cell_name(cell)
    data = save_npz(train, run_dir.parent / f"{_cell_name(cell)}-train.npz")
    route = _route_args(cell, train)
    cmd = [
        sys.executable,
        "-m",
        "feta_release",
        "train",
        *cell["job_args"],
        "--data",
        str(data),
        *route,
        "--out",
        str(run_dir),
        "--synthetic",
        str(cell["n_synthetic"]),
        "--no-release",
        "--json",
        "--no-progress",
        "--threads",
        str(cell["threads"]),
        "--device",
        cell["device"],
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
    train_s = time.perf_counter() - t0
    summary = json.loads(proc.stdout[proc.stdout.index("{") :])
    z = np.load(run_dir / "synthetic.npz")
    syn = ImageDataset(
        z["images"].astype(np.float32), z["labels"].astype(np.int64), train.class_names, source=str(run_dir)
    )
    acc, per_class = _classifier_scores(syn, test, cell)
    summary_file = run_dir / "job_summary.json"  # the job's own per-stage wall times
    stages = json.loads(summary_file.read_text()).get("timings", {}) if summary_file.exists() else {}
    out = {
        "acc": acc,
        "per_class": per_class,
        "epsilon": summary["epsilon"],
        "train_s": round(train_s, 1),
        "stage_seconds": {k: round(v, 1) for k, v in stages.items()},
    }
    central = run_dir / "released" / "central.npz"
    if central.exists():  # the job released central images: the release-only floor is free
        c = np.load(central)
        ro = release_only(c["images"], c["labels"], train.class_names, cell["n_synthetic"], cell["seed"])
        out["release_only"] = _classifier_scores(ro, test, cell)[0]
    return out


def _route_args(cell: dict, train: Any) -> list[str]:
    """``train``'s arguments for the cell's route: ``--dpsgd`` and a generated public set (``--public``)."""
    args = ["--dpsgd", cell["dpsgd"]] if cell.get("dpsgd") else []
    if not cell.get("public"):
        return args
    from feta_release.data import save_npz
    from feta_release.data.procedural import generate_dataset

    kind, n = cell["public"].split(":")
    side = int(train.image_shape[-1])
    path = Path(cell["work"]) / "public" / f"{kind}-{n}-{side}px.npz"
    if not path.exists():  # a function of kind, size and the public seed only: one file for every cell
        extra = {"population": "B"} if kind == "medical" else {}
        path.parent.mkdir(parents=True, exist_ok=True)
        save_npz(generate_dataset(kind, int(n), size=side, seed=7, **extra), path)
    return [*args, "--public", str(path), "--public-description", f"generated {kind} images ({n}, seed 7)"]


def child_env() -> dict[str, str]:
    """This tree first on the children's path, the caller's path after it (e.g. wheels installed beside a
    machine's own packages with ``pip install --target``)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def run_cell(cell: dict) -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "bench"))  # bench/dpsgd_classifier.py, the anchor and the data loader

    torch.set_num_threads(cell["threads"])
    return {"ceiling": _cell_ceiling, "dpsgd": _cell_dpsgd, "release": _cell_release}[cell["method"]](cell)


def _cell_name(cell: dict) -> str:
    eps = "" if cell["method"] == "ceiling" else f"-eps{cell['eps']:g}"
    route = route_suffix(cell.get("public"), cell.get("dpsgd")) if cell["method"] == "release" else ""
    return f"{cell['method']}-{cell['kind']}-n{cell['size']}{eps}{route}-seed{cell['seed']}"


def route_suffix(public: str | None, dpsgd: str | None) -> str:
    """The part of a release cell's name that says its route (``--public``, ``--dpsgd``); empty for the
    plain derived or preset job."""
    return (f"-public-{public.replace(':', '')}" if public else "") + (f"-dpsgd-{dpsgd}" if dpsgd else "")


# ------------------------------------------------------------------------------------------------
# the driver
# ------------------------------------------------------------------------------------------------
def _spawn(cell: dict) -> tuple[dict, float, float]:
    """(result, seconds, peak RSS in MiB of the cell's process and its children) of one cell in a child
    process."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--cell", json.dumps(cell)],
            stdout=out,
            stderr=err,
            text=True,
            env=child_env(),
        )
        # wait4, not Popen.wait: it also returns the child's resource usage (output goes to files, so no pipe
        # fills)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = code = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    seconds = time.perf_counter() - t0
    rss_mib = usage.ru_maxrss / 1024  # Linux: KiB; the largest of the child and the descendants it waited for
    if code != 0:
        return {"error": (stderr.strip().splitlines() or [f"exit {code}"])[-1]}, seconds, rss_mib
    return json.loads(stdout.strip().splitlines()[-1]), seconds, rss_mib


def train_has_epsilon() -> bool:
    """Whether the installed ``feta-release train`` takes ``--epsilon`` (the derived job, no preset)."""
    proc = subprocess.run(
        [sys.executable, "-m", "feta_release", "train", "--help"],
        capture_output=True,
        text=True,
        env=child_env(),
    )
    return "--epsilon" in proc.stdout


def job_args(job: str, eps: float, delta: float, seed: int, work: Path, derived: bool) -> list[str]:
    """The ``train`` arguments that select the job of one cell (see the module docstring for ``--job``)."""
    if job == "derived" or (job == "auto" and derived):
        return ["--epsilon", f"{eps:g}"]
    from feta_release.config import load_job, load_preset
    from feta_release.job_rules import job_toml

    if job == "auto":
        cfg = load_preset("cpu-eps1" if eps < 3.0 else "cpu-eps10")  # nearer in log scale
    elif job.startswith("preset:"):
        cfg = load_preset(job.removeprefix("preset:").format(eps=f"{eps:g}"))
    else:
        cfg = load_job(job)
    cfg = cfg.replace(privacy={"epsilon": float(eps), "delta": float(delta)}, job={"seed": seed})
    path = work / "jobs" / f"{cfg.job.name}-eps{eps:g}-seed{seed}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(job_toml(cfg))  # the library's writer: load_job reads it back to the same job
    return [str(path)]


def plan_cells(args: argparse.Namespace, derived: bool) -> list[dict]:
    """Every cell of the table, in row order; the ceiling once per (kind, size, seed)."""
    common = {
        "mode": args.mode,
        "delta": args.delta,
        "threads": args.threads,
        "device": args.device,
        "n_synthetic": args.n_synthetic,
        "work": str(args.work),
        "classifier_epochs": args.classifier_epochs,
        "dpsgd_epochs": args.dpsgd_epochs,
        "classifier_device": args.classifier_device,
        "public": args.public,
        "dpsgd": args.dpsgd,
    }
    cells = []
    for kind in args.kinds:
        for size in args.sizes:
            if kind == "digits" and size > DIGITS_TRAIN_MAX:
                continue
            image_size = args.image_size if kind != "digits" else None
            for eps in args.eps:
                for method in args.methods:
                    if method == "ceiling" and eps != args.eps[0]:
                        continue
                    for seed in args.seeds:
                        cell = {
                            **common,
                            "kind": kind,
                            "size": size,
                            "eps": eps,
                            "seed": seed,
                            "method": method,
                            "image_size": image_size,
                        }
                        if method == "release":
                            cell["job_args"] = job_args(args.job, eps, args.delta, seed, args.work, derived)
                        cells.append(cell)
    return sorted(cells, key=lambda c: _priority(c, args)) if args.priority else cells


def _priority(cell: dict, args: argparse.Namespace) -> int:
    """A cell's rank under ``--priority kind:eps,...``: the listed rows first, in that order (a kind's ceiling
    with its first listed row), then the rest; the sort is stable, so seeds keep their order within a row."""
    for rank, (kind, eps) in enumerate(args.priority):
        if cell["kind"] == kind and (cell["method"] == "ceiling" or cell["eps"] == eps):
            return rank
    return len(args.priority)


def _fmt(values: list[float]) -> str:
    from feta_release.eval_protocol import mean_std

    if not values:
        return "–"
    m, s = mean_std(values)
    return f"{m:.3f} ± {s:.3f} ({len(values)})"


def table(results: dict, args: argparse.Namespace) -> str:
    """The markdown table of the cells done so far."""
    head = [
        "data",
        "n train",
        "ε",
        "real ceiling",
        "release-only",
        "DP-SGD CNN (Opacus)",
        "release (pipeline)",
        "pipeline ε spent",
        "time",
        "peak RSS",
    ]
    lines = [
        f"Accuracy on real {'held-out' if args.mode == 'test' else 'validation'} images, mean ± std (seeds); "
        f"δ = {args.delta:g}; job {args.job}; {args.n_synthetic} synthetic images per run"
        + (f"; public pretraining on {args.public}" if args.public else "")
        + (f"; train --dpsgd {args.dpsgd}" if args.dpsgd else "")
        + ".",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for kind in args.kinds:
        for size in args.sizes:
            for eps in args.eps:
                if kind == "digits" and size > DIGITS_TRAIN_MAX:
                    lines.append(
                        f"| {kind} | {size:,} | {eps:g} | n/a: the embedded digits hold 5,000 images |"
                        + " |" * (len(head) - 4)
                    )
                    continue
                lines.append(_row(results, kind, size, eps, args))
    lines += _per_class_lines(results, args)
    errors = [f"- {name}: {r['result']['error']}" for name, r in results.items() if "error" in r["result"]]
    return (
        "\n".join(
            lines
            + (["", "Cells that failed (rerun the same command to retry them):", *errors] if errors else [])
        )
        + "\n"
    )


def _per_class_lines(results: dict, args: argparse.Namespace) -> list[str]:
    """Per-class accuracy of the release beside the real ceiling's (mean over seeds): a class the release
    loses (the medical set's few-pixel ``finding``) shows here while the overall accuracy hides it."""
    lines = []
    for kind in args.kinds:
        for size in args.sizes:
            ceil = _class_means(results, f"ceiling-{kind}-n{size}-seed")
            for eps in args.eps:
                route = route_suffix(args.public, args.dpsgd)
                rel = _class_means(results, f"release-{kind}-n{size}-eps{eps:g}{route}-seed")
                if rel:
                    parts = [
                        f"{c} {m:.2f}" + (f" ({ceil[c]:.2f})" if c in ceil else "") for c, m in rel.items()
                    ]
                    lines.append(f"- {kind}, {size:,}, ε = {eps:g}: " + ", ".join(parts))
    head = ["", "Per-class accuracy of the release (real ceiling in brackets), mean over seeds:", ""]
    return head + lines if lines else []


def _class_means(results: dict, prefix: str) -> dict[str, float]:
    rows = [
        r["result"]["per_class"]
        for k, r in results.items()
        if k.startswith(prefix) and "per_class" in r["result"]
    ]
    return {c: float(np.nanmean([row[c] for row in rows])) for c in rows[0]} if rows else {}


def _row(results: dict, kind: str, size: int, eps: float, args: argparse.Namespace) -> str:
    first_eps = args.eps[0]

    def cells(method: str, e: float) -> list[dict]:
        route = route_suffix(args.public, args.dpsgd) if method == "release" else ""
        prefix = f"{method}-{kind}-n{size}" + ("" if method == "ceiling" else f"-eps{e:g}") + route + "-seed"
        return [r for k, r in results.items() if k.startswith(prefix) and "error" not in r["result"]]

    ceiling, dpsgd, release = cells("ceiling", first_eps), cells("dpsgd", eps), cells("release", eps)
    mine = dpsgd + release + (ceiling if eps == first_eps else [])
    acc = lambda rows, key="acc": [r["result"][key] for r in rows if key in r["result"]]  # noqa: E731
    spent = acc(release, "epsilon")
    return (
        "| "
        + " | ".join(
            [
                kind,
                f"{size:,}",
                f"{eps:g}",
                _fmt(acc(ceiling)),
                _fmt(acc(release, "release_only")),
                _fmt(acc(dpsgd)),
                _fmt(acc(release)),
                f"{max(spent):.3g}" if spent else "–",
                f"{sum(r['seconds'] for r in mine):.0f} s" if mine else "–",
                f"{max(r['rss_mib'] for r in mine):.0f} MiB" if mine else "–",
            ]
        )
        + " |"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, from {', '.join(KINDS)}")
    ap.add_argument("--sizes", default="500,4000,20000", help="training sizes, comma-separated")
    ap.add_argument("--eps", default="1,10", help="target epsilons, comma-separated")
    ap.add_argument("--seeds", default=None, help="comma-separated (default: the protocol's 0,1,2)")
    ap.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}"
    )
    ap.add_argument("--job", default="auto", help="auto | derived | preset:NAME | JOB.toml (see above)")
    ap.add_argument("--mode", choices=["test", "validation"], default="test")
    ap.add_argument("--delta", type=float, default=None, help="default: the project's job default")
    ap.add_argument("--n-synthetic", type=int, default=None, help="default: the protocol's 10,000")
    ap.add_argument(
        "--image-size", type=int, default=None, help="side of generated images (default: the kind's)"
    )
    ap.add_argument("--classifier-epochs", type=int, default=None, help="default: the evaluator's own")
    ap.add_argument("--dpsgd-epochs", type=int, default=None, help="default: bench/dpsgd_classifier.py's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the pipeline trains")
    ap.add_argument(
        "--classifier-device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the evaluation classifiers train (ceiling, release, release-only)",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="cells run at once (each its own process; on a GPU "
        "machine several share the GPU); their times then include the others' load",
    )
    ap.add_argument(
        "--public", default=None, help="KIND:N: pretrain on N generated public images (strokes, medical)"
    )
    ap.add_argument("--dpsgd", choices=["auto", "on", "off"], default=None, help="train --dpsgd (derived)")
    ap.add_argument("--priority", default="", help="rows to run first, in order, e.g. medical:10,digits:1")
    ap.add_argument("--out", default=None, help="result files' stem (default bench/results/generality)")
    ap.add_argument("--work", default="runs/generality", help="data and run directories")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 300 training images, the tiny preset, one "
        "seed, 1 classifier epoch, 1 DP-SGD epoch, 100 synthetic images, 32x32 medical images",
    )
    ap.add_argument("--cell", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from feta_release.config import PrivacySection
    from feta_release.eval_protocol import PROTOCOL

    if args.quick:
        # tiny: >= 100 images
        args.sizes, args.job, args.image_size = "300", "preset:tiny", args.image_size or 32
        args.seeds, args.n_synthetic = args.seeds or "0", args.n_synthetic or 100
        args.classifier_epochs, args.dpsgd_epochs = args.classifier_epochs or 1, args.dpsgd_epochs or 1
        args.work = args.work + "-quick"
    args.kinds, args.methods = args.kinds.split(","), args.methods.split(",")
    bad = sorted(set(args.kinds) - set(KINDS)) + sorted(set(args.methods) - set(METHODS))
    if bad:
        ap.error(f"unknown kind(s) or method(s) {bad}")
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.eps = [float(e) for e in args.eps.split(",")]
    args.seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else list(PROTOCOL.seeds)
    args.delta = args.delta if args.delta is not None else PrivacySection().delta
    args.n_synthetic = args.n_synthetic or PROTOCOL.n_synthetic
    args.out = Path(
        args.out or ROOT / "bench" / "results" / ("generality-quick" if args.quick else "generality")
    )
    args.work = Path(args.work)
    args.priority = [(k, float(e)) for k, e in (r.split(":") for r in args.priority.split(",") if r)]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.cell is not None:
        print(json.dumps(run_cell(json.loads(args.cell))), flush=True)
        return
    json_path, md_path = args.out.with_suffix(".json"), args.out.with_suffix(".md")
    results: dict = json.loads(json_path.read_text())["cells"] if json_path.exists() else {}
    cells = plan_cells(args, derived=args.job == "auto" and "release" in args.methods and train_has_epsilon())
    todo = [c for c in cells if _cell_name(c) not in results or "error" in results[_cell_name(c)]["result"]]
    print(f"{len(cells)} cells, {len(todo)} to run, {args.jobs} at once; results -> {md_path}", flush=True)
    # threads only wait on the cells' child processes; results are written here, one cell at a time
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        running = {pool.submit(_spawn, cell): cell for cell in todo}  # started in the planned order
        for done in as_completed(running):
            cell, (result, seconds, rss) = running[done], done.result()
            name = _cell_name(cell)
            results[name] = {
                "result": result,
                "seconds": round(seconds, 1),
                "rss_mib": round(rss),
                "job_args": cell.get("job_args"),
            }
            print(json.dumps({"cell": name, **results[name]}), flush=True)
            json_path.parent.mkdir(parents=True, exist_ok=True)
            saved = {"cells": results, "args": {k: str(v) for k, v in vars(args).items()}}
            json_path.write_text(json.dumps(saved, indent=1))
            md_path.write_text(table(results, args))
    md_path.write_text(table(results, args))
    print(md_path.read_text())


if __name__ == "__main__":
    main()
