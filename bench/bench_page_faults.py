"""Minor page faults and system time of CPU training and sampling, with and without kept freed pages.

    python bench/bench_page_faults.py                               # off vs on, 3 interleaved repeats
    python bench/bench_page_faults.py --settings off,on,tunables:glibc.malloc.mmap_max=0 --repeats 3
    python bench/bench_page_faults.py --size 28 --steps 300 --settings off,on   # the digits' job

Each run is a fresh process doing a short piece of the derived job's own work (``job_rules.derive_job`` for
``--n`` images of ``--size`` px, grey, ``--classes`` classes, epsilon 10, DP-SGD on so that its physical batch
is the job's), phase by phase:

  warmup   ``--steps`` Adam steps of the denoiser at the warm-up's batch (``[warmup] spatial_batch``), as
           the spatial / frequency warm-ups and the polish run them (``training.warmup_loop.train_denoiser``)
  dpsgd    ``--dpsgd-steps`` DP-SGD steps of ``--dpsgd-rows`` rows in the job's physical batches
  aux      ``--aux-iterations`` steps of one aux-generator fit on a random embedding (the job's feature map)
  sample   ``--samples`` images by the job's solver (``models.sampler.generate``, batch 256, as a release
           samples) at ``--sampler-steps`` steps

each built and run once untimed (the first allocations, faulted in once whatever the setting), then timed:
its wall, user and system seconds and minor page faults (``getrusage`` of the process, before and after), then
the whole process's figures and peak RSS (``wait4``). The settings (fresh processes, taken in turn, the
order rotated each repeat, so that a machine's drifting load weighs on all of them):

  off                    ``FETA_KEEP_FREED_PAGES=0``: glibc's own malloc policy
  on                     the process-start setting (``feta_release.allocator``), as every entry point makes it
  tunables:<TUNABLES>    ``GLIBC_TUNABLES=<TUNABLES>`` at exec, the module switched off (e.g.
                         ``glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824``)
  on+<name>=<v>[+...]    the module's setting plus more mallopt options by glibc's name (``M_MMAP_MAX=0``,
                         ``M_ARENA_MAX=2``), set at process start

Printed: per setting and phase the median and [min, max] over the repeats.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASES = ("warmup", "dpsgd", "aux", "sample")
_MALLOPT = {
    "M_TRIM_THRESHOLD": -1,
    "M_TOP_PAD": -2,
    "M_MMAP_THRESHOLD": -3,
    "M_MMAP_MAX": -4,
    "M_ARENA_MAX": -8,
}


def _usage() -> tuple[float, float, float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), r.ru_utime, r.ru_stime, r.ru_minflt


def _timed(fn: Any) -> dict[str, float]:
    w0, u0, s0, f0 = _usage()
    fn()
    w1, u1, s1, f1 = _usage()
    return {"wall": w1 - w0, "user": u1 - u0, "sys": s1 - s0, "minflt": f1 - f0}


def _extra_mallopt(setting: str) -> None:
    """The ``on+NAME=V,...`` options, set after the module's (a bench variant, never the shipped setting)."""
    if not setting.startswith("on+"):
        return
    mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    for item in setting[3:].split("+"):
        name, _, value = item.partition("=")
        if mallopt(_MALLOPT[name], int(value)) != 1:
            raise SystemExit(f"mallopt refused {item}")


def _job(args: argparse.Namespace) -> Any:
    from feta_release.job_rules import DataFacts, derive_job

    return derive_job(DataFacts(args.n, args.size, args.size, 1, args.classes, 10.0, dpsgd="on"))


def _phases(args: argparse.Namespace) -> dict[str, Any]:
    """Every phase in this process, after the setting of ``args.run``: each built and run once untimed (its
    first allocations, which any setting faults in once), then timed."""
    from feta_release import allocator

    allocator.keep_freed_pages()  # what every entry point does first (switched off by the environment)
    _extra_mallopt(args.run)
    import torch

    torch.set_num_threads(args.threads)
    cfg, shape = _job(args), (1, args.size, args.size)
    g = torch.Generator().manual_seed(0)
    pool = torch.rand(512, *shape, generator=g) * 2 - 1
    labels = torch.arange(512) % args.classes
    out: dict[str, Any] = {"setting": allocator.heap_setting().why}  # type: ignore[union-attr]
    build = {
        "warmup": (lambda: _warmup(args, cfg, shape, pool, labels), args.steps),
        "dpsgd": (lambda: _dpsgd(args, cfg, shape, pool, labels), args.dpsgd_steps),
        "aux": (lambda: _aux(args, cfg, shape), args.aux_iterations),
        "sample": (lambda: _sample(args, cfg, shape), 1),
    }
    for name in args.phases.split(","):
        make, n = build[name]
        run = make()
        run(1)
        out[name] = _timed(lambda: run(n))  # noqa: B023 (called at once)
    return out


def _warmup(args: argparse.Namespace, cfg: Any, shape: tuple[int, int, int], pool: Any, labels: Any) -> Any:
    import torch

    from feta_release.stages.context import initial_denoiser
    from feta_release.training.warmup_loop import train_denoiser

    model, b, g = initial_denoiser(cfg, shape, args.classes), cfg.warmup.spatial_batch, torch.Generator()
    g.manual_seed(1)

    def batches() -> Any:
        while True:
            idx = torch.randint(0, pool.shape[0], (b,), generator=g)
            yield pool[idx], labels[idx]

    w, it = cfg.warmup, batches()
    return lambda n: train_denoiser(
        model, it, n, stage="spatial", lr=w.lr, ema_decay=w.ema, label_dropout=0.1, generator=g
    )


def _dpsgd(args: argparse.Namespace, cfg: Any, shape: tuple[int, int, int], pool: Any, labels: Any) -> Any:
    import torch

    from feta_release.stages.context import initial_denoiser
    from feta_release.training.dpsgd import DPSGDTrainer

    model = initial_denoiser(cfg, shape, args.classes)
    rows = args.dpsgd_rows
    x, y = pool[torch.arange(rows) % pool.shape[0]], labels[torch.arange(rows) % pool.shape[0]]
    c = cfg.replace(dpsgd={"batch": rows})
    tr = DPSGDTrainer(
        model, c, 1.0, 1.0, torch.Generator().manual_seed(2), image_shape=shape, n_classes=args.classes
    )
    return lambda n: tr.run(x, y, n)


def _aux(args: argparse.Namespace, cfg: Any, shape: tuple[int, int, int]) -> Any:
    import torch

    from feta_release.mechanisms.feature_map import job_feature_map
    from feta_release.training.frequency import fit_aux_generator

    fmap = job_feature_map(cfg.frequency, shape)
    emb = torch.randn(cfg.frequency.features, args.classes, generator=torch.Generator().manual_seed(3)) * 0.01

    def fit(n: int) -> None:
        c = cfg.replace(auxgen={"epochs": 1, "iterations_per_epoch": n})
        fit_aux_generator(
            emb, fmap, shape, args.classes, c, args.n, generator=torch.Generator().manual_seed(4)
        )

    return fit


def _sample(args: argparse.Namespace, cfg: Any, shape: tuple[int, int, int]) -> Any:
    """``--samples`` images in batches of 256 (the release's), by the job's solver at ``--sampler-steps``."""
    import numpy as np

    from feta_release.models.sampler import generate
    from feta_release.stages.context import initial_denoiser

    model = initial_denoiser(cfg, shape, args.classes)
    sampler = cfg.replace(sampler={"steps": args.sampler_steps}).sampler
    return lambda n: generate(model, np.arange(args.samples) % args.classes, 0, sampler, batch=256)


def _child_env(setting: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("GLIBC_TUNABLES", None)
    if setting == "off" or setting.startswith("tunables:"):
        env["FETA_KEEP_FREED_PAGES"] = "0"
    else:
        env.pop("FETA_KEEP_FREED_PAGES", None)
    if setting.startswith("tunables:"):
        env["GLIBC_TUNABLES"] = setting.partition(":")[2]
    return env


def _run(setting: str, argv: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, *argv, "--run", setting]
    proc = subprocess.Popen(cmd, env=_child_env(setting), stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"setting {setting}: the run failed (exit {os.waitstatus_to_exitcode(status)})")
    row = json.loads(out.strip().splitlines()[-1])
    row["process"] = {
        "user": usage.ru_utime,
        "sys": usage.ru_stime,
        "minflt": usage.ru_minflt,
        "peak_rss_mib": usage.ru_maxrss / 1024,
    }
    return row


def _fmt(values: list[float], unit: str) -> str:
    med = statistics.median(values)
    if unit == "minflt":
        return f"{med:>11,.0f} [{min(values):,.0f}, {max(values):,.0f}]"
    return f"{med:8.2f} [{min(values):.2f}, {max(values):.2f}]"


def _report(settings: list[str], rows: dict[str, list[dict[str, Any]]], phases: list[str]) -> None:
    for s in settings:
        print(f"\n{s}  ({rows[s][0]['setting']}; {len(rows[s])} runs; median [min, max])")
        for ph in [*phases, "process"]:
            figures = [f for f in ("wall", "user", "sys", "minflt", "peak_rss_mib") if f in rows[s][0][ph]]
            cells = [f"{f} {_fmt([r[ph][f] for r in rows[s]], f)}" for f in figures]
            print(f"  {ph:<8} " + "  ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4000, help="public size of the job derived")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--classes", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40, help="warm-up steps")
    ap.add_argument("--dpsgd-steps", type=int, default=2)
    ap.add_argument("--dpsgd-rows", type=int, default=128, help="rows of a DP-SGD step")
    ap.add_argument("--aux-iterations", type=int, default=15)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--sampler-steps", type=int, default=2, help="the job's solver at this many steps")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--settings", default="off,on")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write every run's figures to this file")
    ap.add_argument("--run", help=argparse.SUPPRESS)  # internal: one run of one setting in this process
    args = ap.parse_args()
    if args.run:
        print(json.dumps(_phases(args)))
        return
    argv = [a for a in sys.argv[1:]]
    settings = args.settings.split(",")
    rows: dict[str, list[dict[str, Any]]] = {s: [] for s in settings}
    for r in range(args.repeats):
        for s in settings[r % len(settings) :] + settings[: r % len(settings)]:
            rows[s].append(_run(s, argv))
            print(f"repeat {r + 1} {s}: {json.dumps(rows[s][-1])}", file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    _report(settings, rows, args.phases.split(","))


if __name__ == "__main__":
    main()
