"""DP-SGD throughput: private step vs non-private step of the same denoiser, batch and noise multiplicity.

    python bench/bench_dpsgd.py                       # defaults: cpu-eps1 preset model, B=64, K=4
    python bench/bench_dpsgd.py --batch 16 --k 2 --steps 2 --channels 8   # quick check

Each method runs in its own subprocess so that its peak resident memory (ru_maxrss) is its own.
Methods:
  nonprivate  ordinary batched EDM loss over the B*K rows (micro-batched in ``physical`` examples), Adam
  torchfunc   feta_release.training.dpsgd.DPSGDTrainer: vmap(grad) per-example gradients, chunked
  opacus      Opacus GradSampleModule hooks on the B*K rows, grad_sample averaged over K before clipping
Timings on a shared 2-core machine are approximate (other processes compete for the cores).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

GOAL_RATIO = 2.0  # private time per example <= 2x non-private


def _setup(args):
    import torch

    from feta_release.config import JobConfig, load_preset
    from feta_release.models.edm import build_denoiser
    from feta_release.models.unet import count_parameters

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = load_preset(args.preset) if args.preset else JobConfig().replace(dpsgd={"steps": 1})
    model_over = {"channels": args.channels} if args.channels else {}
    cfg = base.replace(
        model=model_over,
        dpsgd={"batch": args.batch, "steps": args.steps, "noise_multiplicity": args.k,
               "physical_batch": args.physical, "clip": 1.0},
    )
    shape = (1, args.size, args.size)
    model = build_denoiser(cfg.model, shape, 10)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(args.batch, *shape, generator=g) * 2 - 1
    y = torch.randint(0, 10, (args.batch,), generator=g)
    return torch, cfg, model, x, y, shape, count_parameters(model)


def _time_steps(fn, steps: int) -> float:
    fn()  # warm-up (allocations, vmap tracing)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps


def run_one(args) -> dict:
    torch, cfg, model, x, y, shape, n_params = _setup(args)
    from feta_release.models.edm import draw_loss_randomness, edm_loss_from_randomness

    b, k, phys = args.batch, args.k, args.physical
    if args.method == "nonprivate":
        opt = torch.optim.Adam(model.parameters(), lr=3e-4)
        g = torch.Generator().manual_seed(2)

        def step():
            opt.zero_grad()
            for s in range(0, b, phys):
                xs, ys = x[s : s + phys], y[s : s + phys]
                rnd = draw_loss_randomness(xs.shape[0], shape, noise_multiplicity=k, generator=g)
                (edm_loss_from_randomness(model, xs, ys, rnd).sum() / b).backward()
            opt.step()

    elif args.method == "torchfunc":
        from feta_release.training.dpsgd import DPSGDTrainer

        # q = 1 makes the Poisson batch exactly B, so both methods see the same examples per step
        tr = DPSGDTrainer(model, cfg, 1.0, 1.0, torch.Generator().manual_seed(2), image_shape=shape, n_classes=10)

        def step():
            tr.step(x, y)

    elif args.method == "opacus":
        from opacus import GradSampleModule

        gsm = GradSampleModule(model, loss_reduction="sum")
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.Adam(params, lr=3e-4)
        g = torch.Generator().manual_seed(2)

        def step():
            total = [torch.zeros_like(p) for p in params]
            for s in range(0, b, phys):
                xs, ys = x[s : s + phys], y[s : s + phys]
                m = xs.shape[0]
                rnd = draw_loss_randomness(m, shape, noise_multiplicity=k, generator=g)
                # one row per (example, draw): rows of example i are i*k .. i*k+k-1
                loss = edm_loss_from_randomness(gsm, xs, ys, rnd, null_label=model.null_label, sigma_data=model.sigma_data)
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
    else:
        raise SystemExit(f"unknown method {args.method}")

    sec = _time_steps(step, args.steps)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"method": args.method, "sec_per_step": sec, "ex_per_s": b / sec, "peak_rss_mb": rss_mb,
            "params": n_params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu-eps1", help="model sizes from this preset ('' = JobConfig defaults)")
    ap.add_argument("--channels", type=int, default=0, help="override [model] channels")
    ap.add_argument("--size", type=int, default=28)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="noise multiplicity")
    ap.add_argument("--physical", type=int, default=16, help="examples per vectorised chunk")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default="nonprivate,torchfunc,opacus")
    ap.add_argument("--method", help=argparse.SUPPRESS)  # internal: run one method in this process
    args = ap.parse_args()
    if args.method:
        print(json.dumps(run_one(args)))
        return
    rows = []
    for method in args.methods.split(","):
        cmd = [sys.executable, __file__, "--method", method] + [
            a for a in sys.argv[1:] if not a.startswith("--methods")
        ]
        # drop a "--methods X" pair passed as two tokens
        if "--methods" in cmd:
            i = cmd.index("--methods")
            del cmd[i : i + 2]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            err = (res.stderr.strip().splitlines() or ["?"])[-1]
            rows.append({"method": method, "error": err})
            continue
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    base = next((r for r in rows if r.get("method") == "nonprivate" and "error" not in r), None)
    print(f"DP-SGD step, B={args.batch}, K={args.k}, physical={args.physical}, {args.size}px, threads={args.threads}"
          + (f", {rows[0].get('params', 0):,} params" if rows and "params" in rows[0] else ""))
    print(f"{'method':<12} {'s/step':>8} {'ex/s':>8} {'time/ex vs non-private':>24} {'peak RSS MB':>12}")
    for r in rows:
        if "error" in r:
            print(f"{r['method']:<12} failed: {r['error']}")
            continue
        ratio = r["sec_per_step"] / base["sec_per_step"] if base else float("nan")
        met = "met" if ratio <= GOAL_RATIO else "NOT met"
        flag = "" if r["method"] == "nonprivate" else f"  (goal <= 2.0: {met})"
        print(f"{r['method']:<12} {r['sec_per_step']:8.3f} {r['ex_per_s']:8.1f} {ratio:23.2f}x {r['peak_rss_mb']:12.0f}{flag}")
    print("timings on a shared CPU are approximate; peak RSS includes the Python/torch baseline (~300 MB)")


if __name__ == "__main__":
    main()
