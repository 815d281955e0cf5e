"""One DP-SGD call against one non-private call of the derived job's model, interleaved in one process.

    python bench/bench_dpsgd_call.py                # derived 28 px job, its physical batch (64), 1 thread
    python bench/bench_dpsgd_call.py --rounds 100 --physical 32 --threads 2

A call is what a step repeats ``rows / physical_batch`` times: the non-private forward/backward of one
physical batch (batched weight gradients), against the private one (``ghost_clip.hook_grads``, the clip in
place, the addition into the step's total, as ``training.dpsgd.clipped_gradient_sum`` runs them). Each round
runs both once, the order rotated; the figure is the median over rounds of each round's private /
non-private CPU time (paired: a round's calls are a fraction of a second apart, so a shared machine's load
weighs on both), with its quartiles. A full step (``bench_dpsgd.py``) adds the Poisson draw,
the noise, Adam and the EMA, a few ms a step; on a loaded 2-core machine its 3-round ratios spread by
±0.1, which this per-call figure resolves to ~±0.01.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's feta_release


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--derived", type=int, default=4000, help="the job derived for N images")
    ap.add_argument("--size", type=int, default=28)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--epsilon", type=float, default=10.0)
    ap.add_argument("--physical", type=int, default=0, help="examples a call (0: the derived job's)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()

    import torch

    from feta_release.allocator import keep_freed_pages
    from feta_release.job_rules import DataFacts, derive_job
    from feta_release.models.edm import (
        EDMLoss,
        build_denoiser,
        draw_loss_randomness,
        edm_loss_from_randomness,
    )
    from feta_release.training.dpsgd import clip_and_sum
    from feta_release.training.ghost_clip import hook_grads

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    keep_freed_pages()  # as a job does
    facts = DataFacts(args.derived, args.size, args.size, 1, args.classes, args.epsilon, dpsgd="on")
    cfg = derive_job(facts)
    shape = (1, args.size, args.size)
    k = cfg.dpsgd.noise_multiplicity
    b = args.physical or cfg.dpsgd.physical_batch
    model = build_denoiser(cfg.model, shape, args.classes).train()
    loss = EDMLoss(shape, args.classes, k, cfg.model.label_dropout, sigma_data=model.sigma_data)
    g = torch.Generator().manual_seed(1)
    x, y = torch.rand(b, *shape, generator=g) * 2 - 1, torch.randint(0, args.classes, (b,), generator=g)
    rand = loss.draw(b, g)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    total = {n: torch.zeros_like(p) for n, p in named}

    def nonprivate() -> None:
        r = draw_loss_randomness(b, shape, noise_multiplicity=k, generator=g)
        (edm_loss_from_randomness(model, x, y, r).sum() / b).backward()
        for _, p in named:
            p.grad = None

    def private() -> None:
        grads, _ = hook_grads(model, loss, x, y, rand)
        summed, _ = clip_and_sum(grads, 1.0, in_place=True)
        for n in total:
            total[n] += summed[n]

    forms: dict[str, Callable[[], None]] = {"nonprivate": nonprivate, "private": private}
    names = list(forms)
    for n in names:  # warm-up: allocations, oneDNN kernels
        forms[n]()
        forms[n]()
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            c0 = time.process_time()
            forms[n]()
            cpu[n].append(time.process_time() - c0)
    print(
        f"one call of {b} examples, K = {k}, {args.size} px, {args.threads} thread(s), {args.rounds} rounds "
        f"(CPU ms; ratio: median over rounds of private / the same round's non-private, [quartiles])"
    )
    for n in names:
        pr = sorted(a / c for a, c in zip(cpu[n], cpu["nonprivate"], strict=True))
        q = len(pr) // 4
        print(
            f"  {n:<11} median {statistics.median(cpu[n]) * 1e3:7.1f}  min {min(cpu[n]) * 1e3:7.1f}  "
            f"ratio {statistics.median(pr):.3f} [{pr[q]:.3f}, {pr[-q - 1]:.3f}]"
        )


if __name__ == "__main__":
    main()
