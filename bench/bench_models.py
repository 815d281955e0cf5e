"""Denoiser and auxiliary-generator throughput: examples/s of one non-private forward+backward+Adam step.

    python bench/bench_models.py                     # default (paper) 28px UNet and a small CPU config
    python bench/bench_models.py --batch 16 --steps 2   # quick check

Also prints the parameter counts and the sampling cost (images/s of a Heun sampler at the given steps).
Timings on a shared 2-core machine are approximate (other processes compete for the cores).
"""

from __future__ import annotations

import argparse
import time

CONFIGS = {
    "default": {},
    "small": {"channels": 16, "channel_mult": (1, 2), "num_res_blocks": 1, "attn_resolutions": ()},
    "small-attn7": {"channels": 16, "channel_mult": (1, 2, 2), "num_res_blocks": 1, "attn_resolutions": (7,)},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5, help="timed training steps (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sample-steps", type=int, default=18)
    ap.add_argument("--configs", default="default,small,small-attn7")
    args = ap.parse_args()

    import torch

    from feta_release.config import ModelSection
    from feta_release.models import AuxGenerator, build_denoiser, count_parameters, edm_loss, sample

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"threads={args.threads} batch={args.batch} (shared machine: figures approximate)")
    for name in args.configs.split(","):
        d = build_denoiser(ModelSection(**CONFIGS[name]), (1, 28, 28), 10)
        opt = torch.optim.Adam(d.parameters(), lr=3e-4)
        x = torch.rand(args.batch, 1, 28, 28, generator=g) * 2 - 1
        y = torch.randint(0, 10, (args.batch,), generator=g)

        def step(d=d, x=x, y=y, opt=opt) -> None:  # bound now: the closure is timed inside this iteration
            loss = edm_loss(d, x, y, generator=g).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

        step()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        train_rate = args.batch * args.steps / (time.perf_counter() - t0)
        d.eval()
        noise = torch.randn(args.batch, 1, 28, 28, generator=g)
        t0 = time.perf_counter()
        sample(d, y, noise, solver="heun", steps=args.sample_steps)
        sample_rate = args.batch / (time.perf_counter() - t0)
        print(
            f"unet {name:12s} params={count_parameters(d):>9,d}  train {train_rate:7.1f} ex/s  "
            f"sample(heun,{args.sample_steps}) {sample_rate:6.2f} img/s"
        )
    for width in (64, 32):
        gen = AuxGenerator(1, 28, 10, width=width)
        opt = torch.optim.Adam(gen.parameters(), lr=1e-3)
        z = torch.randn(args.batch, 60, generator=g)
        y = torch.randint(0, 10, (args.batch,), generator=g)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = gen(z, y).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        rate = args.batch * args.steps / (time.perf_counter() - t0)
        print(f"auxgen width={width:<3d}      params={count_parameters(gen):>9,d}  train {rate:7.1f} ex/s")


if __name__ == "__main__":
    main()
