"""DP-SGD throughput: private step vs non-private step of the same denoiser, batch and noise multiplicity.

    python bench/bench_dpsgd.py                       # defaults: cpu-eps1 preset model, B=64, K=4, 2 threads
    python bench/bench_dpsgd.py --batch 250 --k 1 --physical 84   # the cpu-eps1 preset's own batch, K and chunk
    python bench/bench_dpsgd.py --batch 16 --k 2 --rounds 2 --channels 8   # quick check
    python bench/bench_dpsgd.py --derived 4000 --size 64 --classes 4 --rounds 4   # the derived job's own step
    python bench/bench_dpsgd.py --device cuda --preset paper-mnist --batch 512 --k 32 --physical 64 \
        --methods nonprivate,hooks --rounds 3   # a GPU machine: the paper's model, K and chunk

The RATIO is timed in ONE process that interleaves the methods' steps (round i runs every method once, the
order rotated each round), so that the load of a shared machine weighs on the private and the non-private
steps alike; it is the sum of the private steps' wall time over the sum of the non-private ones' (also in
process CPU time, which other processes disturb less). On ``--device cuda`` every step ends with a device
synchronisation (so the host clock times the GPU work) and the memory column is the GPU's peak allocation.
Peak resident memory (ru_maxrss) is measured for each method in its own
subprocess, so that each figure is that method's own.
Methods:
  nonprivate  ordinary batched EDM loss over the B*K rows (micro-batched in ``physical`` examples), Adam
  hooks       DPSGDTrainer, [dpsgd] per_example = "hooks": per-example gradients from one batched backward
              (training/ghost_clip.py), clip, noise, Adam, EMA
  torchfunc   DPSGDTrainer, per_example = "vmap": vmap(grad) per-example gradients, chunked (the former
              default)
  opacus      Opacus GradSampleModule hooks on the B*K rows, grad_sample averaged over K before clipping
A method may name what it trains (``[dpsgd] trainable``) after a colon: ``hooks:lora``, ``nonprivate:lora``,
``hooks:norm_attention`` (default ``all``); its ratio is taken against ``nonprivate:<the same>`` when that is
among the methods (the same trained parameters without privacy), else against ``nonprivate``.

``--derived N``: the model, noise multiplicity, physical batch and step rows of the job ``train`` derives for
N images of ``--size`` px (grey, ``--classes`` classes, ``--epsilon``) with DP-SGD on
(``job_rules.derive_job``); the step's rows are its PADDED rows (``job_rules.dpsgd_step_rows``), what every
step of that job runs whatever its Poisson draw; ``--physical`` given with it replaces only the physical batch
(``--derived 4000 --size 28 --physical 128 --rounds 1 --steps 1 --threads 1``: the peak RSS of each method at
another physical batch):

    python bench/bench_dpsgd.py --methods nonprivate,hooks,nonprivate:norm_attention,hooks:norm_attention,\
        nonprivate:lora,hooks:lora --rounds 4   # DP-SGD's cost per trained subset
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

# Time the code of THIS checkout: run as a script, sys.path[0] is bench/ and ``feta_release`` would otherwise
# be whichever copy the venv installed (another checkout's, where several share one venv).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GOAL_RATIO = 1.15  # private time per example <= 1.15x non-private (docs/evaluation.md, "DP-SGD step cost")


def _derived(args):
    """The job ``train`` derives for ``--derived`` images (None without), and ``args`` set to its step."""
    if not args.derived:
        args.physical = args.physical or 16
        return None
    from feta_release.job_rules import DataFacts, derive_job, dpsgd_step_rows

    facts = DataFacts(args.derived, args.size, args.size, 1, args.classes, args.epsilon, dpsgd="on")
    cfg = derive_job(facts)
    args.batch, args.k = dpsgd_step_rows(cfg, facts), cfg.dpsgd.noise_multiplicity
    args.physical = args.physical or cfg.dpsgd.physical_batch  # a given --physical wins (same step rows)
    return cfg


def _setup(args):
    import torch

    from feta_release.config import JobConfig, load_preset
    from feta_release.models.edm import build_denoiser
    from feta_release.models.unet import count_parameters

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = _derived(args) or (
        load_preset(args.preset) if args.preset else JobConfig().replace(dpsgd={"steps": 1})
    )
    model_over = {"channels": args.channels} if args.channels else {}
    cfg = base.replace(
        model=model_over,
        dpsgd={
            "batch": args.batch,
            "steps": args.steps,
            "noise_multiplicity": args.k,
            "physical_batch": args.physical,
            "clip": 1.0,
        },
    )
    shape = (1, args.size, args.size)
    dev = torch.device(args.device)
    model = build_denoiser(cfg.model, shape, args.classes).to(dev)
    g = torch.Generator().manual_seed(1)
    x = (torch.rand(args.batch, *shape, generator=g) * 2 - 1).to(dev)
    y = torch.randint(0, args.classes, (args.batch,), generator=g).to(dev)
    return torch, cfg, model, x, y, shape, count_parameters(model)


def _synced(torch, step):
    """``step`` followed by a device synchronisation on CUDA (kernels are asynchronous: time the work, not the
    launches)."""
    if not torch.cuda.is_available():
        return step

    def run():
        step()
        torch.cuda.synchronize()

    return run


def _randomness(torch, m, shape, k, g, dev):
    """The loss randomness drawn on the CPU (the same stream on any device, as the trainer does), then
    moved."""
    from feta_release.models.edm import LossRandomness, draw_loss_randomness

    r = draw_loss_randomness(m, shape, noise_multiplicity=k, generator=g)
    return LossRandomness(r.noise.to(dev), r.sigma.to(dev), r.drop.to(dev))


def _make_step(method: str, args, torch, cfg, model, x, y, shape):
    """One logical step of ``method`` on ``model`` (a closure), at batch B = len(x) and K = args.k."""
    from feta_release.models.edm import edm_loss_from_randomness

    b, k, phys = args.batch, args.k, args.physical
    method, _, trainable = method.partition(":")
    trainable = trainable or "all"
    if method == "nonprivate":
        from feta_release.models.trainable import set_trainable

        set_trainable(model, trainable, args.lora_rank)  # the same trained subset, no privacy
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-4)
        g = torch.Generator().manual_seed(2)

        def step():
            opt.zero_grad()
            for s in range(0, b, phys):
                xs, ys = x[s : s + phys], y[s : s + phys]
                rnd = _randomness(torch, xs.shape[0], shape, k, g, x.device)
                (edm_loss_from_randomness(model, xs, ys, rnd).sum() / b).backward()
            opt.step()

        return _synced(torch, step)
    if method in ("hooks", "torchfunc"):
        from feta_release.training.dpsgd import DPSGDTrainer

        engine = "hooks" if method == "hooks" else "vmap"
        c = cfg.replace(dpsgd={"per_example": engine, "trainable": trainable, "lora_rank": args.lora_rank})
        # q = 1 makes the Poisson batch exactly B, so every method sees the same examples per step
        tr = DPSGDTrainer(
            model, c, 1.0, 1.0, torch.Generator().manual_seed(2), image_shape=shape, n_classes=args.classes
        )
        assert tr.engine == engine
        return _synced(torch, lambda: tr.step(x, y))
    if method == "opacus":
        return _synced(torch, _opacus_step(args, torch, model, x, y, shape))
    raise SystemExit(f"unknown method {method}")


def _opacus_step(args, torch, model, x, y, shape):
    from opacus import GradSampleModule

    from feta_release.models.edm import edm_loss_from_randomness

    b, k, phys = args.batch, args.k, args.physical
    gsm = GradSampleModule(model, loss_reduction="sum")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=3e-4)
    g = torch.Generator().manual_seed(2)

    def step():
        total = [torch.zeros_like(p) for p in params]
        for s in range(0, b, phys):
            xs, ys = x[s : s + phys], y[s : s + phys]
            m = xs.shape[0]
            rnd = _randomness(torch, m, shape, k, g, x.device)
            # one row per (example, draw): rows of example i are i*k .. i*k+k-1
            loss = edm_loss_from_randomness(
                gsm, xs, ys, rnd, null_label=model.null_label, sigma_data=model.sigma_data
            )
            (loss.sum() * k).backward()  # grad_sample of row r = d(loss_r)/d theta with loss_r = row loss
            gs = [p.grad_sample.reshape(m, k, *p.shape).mean(1) for p in params]
            norms = torch.stack([v.flatten(1).pow(2).sum(1) for v in gs]).sum(0).sqrt()
            f = (1.0 / (norms + 1e-12)).clamp(max=1.0)
            for t, v in zip(total, gs):
                t += torch.einsum("b,b...->...", f, v)
            for p in params:
                p.grad_sample = None
                p.grad = None
        for p, t in zip(params, total):
            p.grad = (t + torch.randn_like(t)) / b
        opt.step()

    return step


def run_one(args) -> dict:
    """Peak memory (and a standalone time) of ONE method in this process."""
    torch, cfg, model, x, y, shape, n_params = _setup(args)
    step = _make_step(args.method, args, torch, cfg, model, x, y, shape)
    step()  # warm-up (allocations, vmap tracing)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sec = (time.perf_counter() - t0) / args.steps
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.device == "cuda":  # the GPU's own peak, which bounds the physical batch there
        rss_mb = torch.cuda.max_memory_allocated() / 2**20
    return {"method": args.method, "sec_per_step": sec, "peak_rss_mb": rss_mb, "params": n_params}


def run_interleaved(args) -> dict:
    """Every method's step once per round, the order rotated each round; wall and CPU seconds per method."""
    import copy

    torch, cfg, model, x, y, shape, n_params = _setup(args)
    methods = args.methods.split(",")
    steps = {m: _make_step(m, args, torch, cfg, copy.deepcopy(model), x, y, shape) for m in methods}
    for m in methods:
        steps[m]()  # warm-up
    wall = {m: [] for m in methods}
    cpu = {m: [] for m in methods}
    for r in range(args.rounds):
        for m in methods[r % len(methods) :] + methods[: r % len(methods)]:
            w0, c0 = time.perf_counter(), time.process_time()
            steps[m]()
            wall[m].append(time.perf_counter() - w0)
            cpu[m].append(time.process_time() - c0)
    return {"wall": wall, "cpu": cpu, "params": n_params}


def _subprocess(extra: list[str]) -> dict:
    argv = [a for a in sys.argv[1:]]
    cmd = [sys.executable, __file__, *argv, *extra]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        return {"error": (res.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def _report(args, inter: dict, mem: dict[str, dict]) -> None:
    methods = args.methods.split(",")
    print(
        f"DP-SGD step on {args.device}, B={args.batch}, K={args.k}, physical={args.physical}, {args.size}px, "
        f"threads={args.threads}, "
        f"{inter['params']:,} params, {args.rounds} interleaved rounds"
    )
    mem_name = "GPU peak MB" if args.device == "cuda" else "peak RSS MB"
    print(
        f"{'method':<26} {'s/step':>8} {'ex/s':>8} {'time/ex vs non-private':>23} {'(CPU time)':>11} "
        f"{mem_name:>12}"
    )
    for m in methods:
        w, c = inter["wall"][m], inter["cpu"][m]
        sec = sum(w) / len(w)
        base = _baseline(m, methods)
        ratio, ratio_c = sum(w) / sum(inter["wall"][base]), sum(c) / sum(inter["cpu"][base])
        rss = mem.get(m, {}).get("peak_rss_mb")
        rss_s = f"{rss:12.0f}" if rss else f"{'not run' if args.no_memory else 'failed':>12}"
        flag = (
            ""
            if m.startswith("nonprivate")
            else (f"  (vs {base}; goal <= {GOAL_RATIO}: {'met' if ratio <= GOAL_RATIO else 'NOT met'})")
        )
        print(f"{m:<26} {sec:8.3f} {args.batch / sec:8.1f} {ratio:22.2f}x {ratio_c:10.2f}x {rss_s}{flag}")
    print(
        "ratio = sum of the method's step wall times / the non-private ones', steps interleaved in one "
        "process; peak RSS of each method alone in its own process (includes the Python/torch baseline, ~300 "
        "MB)"
    )


def _baseline(method: str, methods: list[str]) -> str:
    """The non-private step a method is compared with: the same trained subset when timed, else all."""
    trainable = method.partition(":")[2]
    same = f"nonprivate:{trainable}" if trainable else "nonprivate"
    return same if same in methods else "nonprivate"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--preset", default="cpu-eps1", help="model sizes from this preset ('' = JobConfig defaults)"
    )
    ap.add_argument("--channels", type=int, default=0, help="override [model] channels")
    ap.add_argument("--derived", type=int, default=0, help="the step of the job derived for N images (above)")
    ap.add_argument("--classes", type=int, default=10, help="classes of the --derived job")
    ap.add_argument("--epsilon", type=float, default=10.0, help="epsilon of the --derived job")
    ap.add_argument("--size", type=int, default=28)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="noise multiplicity")
    ap.add_argument(
        "--physical", type=int, default=0, help="examples per chunk (default 16, or the derived job's)"
    )
    ap.add_argument("--rounds", type=int, default=6, help="interleaved rounds (each runs every method once)")
    ap.add_argument("--steps", type=int, default=2, help="steps per method in its memory subprocess")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--lora-rank", type=int, default=4, help="[dpsgd] lora_rank of the :lora methods")
    ap.add_argument("--no-memory", action="store_true", help="time only (no per-method memory subprocesses)")
    ap.add_argument("--methods", default="nonprivate,hooks,torchfunc,opacus")
    ap.add_argument("--method", help=argparse.SUPPRESS)  # internal: one method's memory in this process
    ap.add_argument("--interleave", action="store_true", help=argparse.SUPPRESS)  # internal: the timed rounds
    args = ap.parse_args()
    _derived(args)  # the report's B, K and physical batch (each subprocess derives them again)
    if "nonprivate" not in args.methods.split(","):
        args.methods = "nonprivate," + args.methods
    if args.method:
        print(json.dumps(run_one(args)))
        return
    if args.interleave:
        print(json.dumps(run_interleaved(args)))
        return
    inter = _subprocess(["--interleave", "--methods", args.methods])
    if "error" in inter:
        raise SystemExit(f"interleaved timing failed: {inter['error']}")
    mem = {} if args.no_memory else {m: _subprocess(["--method", m]) for m in args.methods.split(",")}
    _report(args, inter, mem)


if __name__ == "__main__":
    main()
