"""Benchmark of the DP mechanisms on the embedded data (not a timed test: figures are printed).

* Frequency statistics: images/s of the streamed RFF embedding (phi(x) (outer) onehot summed over chunks) vs a
  plain float32 GEMM of the same shape (N x D @ D x F/2, the projection the embedding cannot avoid) in the
  same run.  Goal: >= 0.5 of the GEMM rate.  Peak memory: process max RSS, plus torch's own allocation profile
  (tracemalloc sees only Python allocations, so the streamed buffer size is also reported analytically).
* Central images: images/s of the mean and mode queries (Poisson sampling + per-class sums/histograms +
  noise).

    python bench/bench_mechanisms.py [--features 10000] [--chunk 512] [--n 5000] [--threads 1] [--repeat 3]

Timings on a shared or busy machine are approximate; the GEMM baseline runs in the same process, same threads,
so the ratio is the meaningful figure.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from feta_release.mechanisms.central import central_images  # noqa: E402
from feta_release.mechanisms.frequency import embedding_sum, rff_frequencies  # noqa: E402


def load_data(n: int) -> tuple[np.ndarray, np.ndarray, str]:
    path = ROOT / "feta_release" / "data" / "embedded" / "mnist_5k.npz"
    if path.exists():
        with np.load(path) as z:
            images = z["images"][:n].astype(np.float32) / 255.0
            labels = z["labels"][:n].astype(np.int64)
        return images, labels, f"embedded MNIST ({path.name})"
    g = np.random.default_rng(0)
    return (
        g.random((n, 1, 28, 28), dtype=np.float32),
        g.integers(0, 10, n),
        "SYNTHETIC random data of the embedded data's shape (embedded file not found)",
    )


def best_time(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: first-call allocations and thread-pool start-up are not what we measure
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--features", type=int, default=10000)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--n", type=int, default=5000, help="images used (at most the embedded 5,000)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    images, labels, source = load_data(args.n)
    n, d = images.shape[0], int(np.prod(images.shape[1:]))
    k = int(labels.max()) + 1
    omega = rff_frequencies(d, args.features, 105.0, 1234)
    rss_before = max_rss_mib()

    t_rff = best_time(lambda: embedding_sum(images, labels, k, omega, args.chunk), args.repeat)
    rss_after_rff = max_rss_mib()

    flat = torch.from_numpy(images.reshape(n, d))

    def gemm() -> None:
        # Same shape and chunking as the embedding's projection, so both stream the same operands.
        for s in range(0, n, args.chunk):
            flat[s : s + args.chunk] @ omega

    t_gemm = best_time(gemm, args.repeat)
    t_gemm_full = best_time(lambda: flat @ omega, args.repeat)

    rounds = 5
    batch = max(1, n // 10)
    t_mean = best_time(
        lambda: central_images(
            images,
            labels,
            k,
            kind="mean",
            rounds=rounds,
            batch=batch,
            sigma=5.0,
            n_public=n,
            rng=np.random.default_rng(0),
        ),
        args.repeat,
    )
    t_mode = best_time(
        lambda: central_images(
            images,
            labels,
            k,
            kind="mode",
            rounds=rounds,
            batch=batch,
            sigma=5.0,
            n_public=n,
            rng=np.random.default_rng(0),
        ),
        args.repeat,
    )

    # float32 buffers reused across chunks: projection (F/2) and phi = [cos, sin] (F)
    chunk_buffer_mib = min(args.chunk, n) * args.features * 4 * 1.5 / 2**20
    full_buffer_mib = n * args.features * 4 / 2**20
    out = {
        "images": n,
        "dim": d,
        "features": args.features,
        "chunk": args.chunk,
        "threads": args.threads,
        "rff_images_per_s": n / t_rff,
        "gemm_images_per_s": n / t_gemm,
        "gemm_unchunked_images_per_s": n / t_gemm_full,
        "rff_over_gemm": t_gemm / t_rff,
        "central_mean_images_per_s": n * rounds / t_mean,
        "central_mode_images_per_s": n * rounds / t_mode,
        "peak_rss_mib": rss_after_rff,
        "rss_growth_during_rff_mib": rss_after_rff - rss_before,
        "chunk_buffers_mib_approx": chunk_buffer_mib,
        "unstreamed_n_x_features_mib": full_buffer_mib,
    }
    if args.json:
        print(json.dumps({"data": source, **out}, indent=2))
        return out
    print(
        f"data: {source}; N = {n}, D = {d}, F = {args.features}, chunk = {args.chunk}, torch threads = "
        f"{args.threads}"
    )
    rows = [
        ("RFF embedding (streamed)", f"{out['rff_images_per_s']:,.0f} img/s"),
        ("float32 GEMM N x D @ D x F/2 (same chunks)", f"{out['gemm_images_per_s']:,.0f} img/s"),
        ("float32 GEMM (one call)", f"{out['gemm_unchunked_images_per_s']:,.0f} img/s"),
        ("RFF / GEMM rate (goal >= 0.5)", f"{out['rff_over_gemm']:.2f}"),
        (
            f"central mean query ({rounds} rounds, q = {batch / n:.2g})",
            f"{out['central_mean_images_per_s']:,.0f} img/s",
        ),
        (
            f"central mode query ({rounds} rounds, q = {batch / n:.2g})",
            f"{out['central_mode_images_per_s']:,.0f} img/s",
        ),
        ("peak RSS (process)", f"{out['peak_rss_mib']:.0f} MiB"),
        ("RSS growth during RFF", f"{out['rss_growth_during_rff_mib']:.0f} MiB"),
        ("streamed buffers (approx.)", f"{chunk_buffer_mib:.0f} MiB"),
        ("an N x F buffer would be", f"{full_buffer_mib:.0f} MiB"),
    ]
    width = max(len(a) for a, _ in rows)
    for a, b in rows:
        print(f"  {a:<{width}}  {b:>16}")
    print("timings are best-of-repeat wall clock; on a shared machine they are approximate")
    return out


if __name__ == "__main__":
    main()
