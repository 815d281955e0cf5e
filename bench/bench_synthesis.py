"""Synthesis speed: onnxruntime generator vs the PyTorch sampler on the same model, at equal quality.

What it measures, in one run on the same weights and the same noise:
  * images/s of each configuration (engine x solver x steps x precision x ORT settings) at a given batch and
    thread count (first call excluded: it pays for allocation and ORT's graph optimisation);
  * quality: max |pixel diff| to the baseline's images for the same noise (the samplers are deterministic ODE
    solvers, so this isolates solver/precision error) and FD (classifier features, feta_release.evaluation)
    against real held-out images, with a bootstrap standard deviation as its noise; a configuration is of
    "equal quality" when its FD is within 2 combined bootstrap sd of the baseline's;
  * peak memory of `synthesize` for growing N in fresh processes (flat in N => N = 60,000 needs the same).

Usage (the lead's full run; minutes on 2 free cores):
  python bench/bench_synthesis.py --run RUN_DIR --n 1000 --batch 100 --threads 2 --memory 500,2000,8000
Without --run, a UNet of --channels width is trained non-privately on the embedded MNIST for --pretrain-steps
(benchmark only: speed does not depend on the weights, but quality comparisons need a model that draws
digits).
Quick check that it works: python bench/bench_synthesis.py --channels 8 --pretrain-steps 20 --n 20 --batch 10 \
    --configs torch-euler50,ort-heun18 --memory 20,60
Timings on the shared 2-core development machine are approximate (other jobs compete for the cores).
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class Config:
    name: str
    engine: str  # "torch" | "ort"
    solver: str
    steps: int
    quant: str = "fp32"  # "fp32" | "int8-dynamic"
    optimize: bool = True
    threads: int | None = None  # None: --threads

    @property
    def nfe(self) -> int:
        return self.steps if self.solver == "euler" else 2 * self.steps - 1


CONFIGS = {
    c.name: c
    for c in [
        Config("torch-euler50", "torch", "euler", 50),
        Config("torch-heun18", "torch", "heun", 18),
        Config("ort-euler50", "ort", "euler", 50),
        Config("ort-heun18", "ort", "heun", 18),
        Config("ort-heun18-noopt", "ort", "heun", 18, optimize=False),
        Config("ort-heun18-1thread", "ort", "heun", 18, threads=1),
        Config("ort-heun18-int8", "ort", "heun", 18, quant="int8-dynamic"),
        Config("ort-heun12", "ort", "heun", 12),
        Config("ort-heun8", "ort", "heun", 8),
        Config("ort-heun6", "ort", "heun", 6),
        Config("torch-euler20", "torch", "euler", 20),  # the CPU presets' release sampler
        Config("ort-euler20", "ort", "euler", 20),
        Config("ort-heun10", "ort", "heun", 10),
        Config("ort-heun50", "ort", "heun", 50),  # 99 NFE: an accurate ODE solution to measure solver error
    ]
}
DEFAULT = (
    "torch-euler50,torch-heun18,ort-euler50,ort-heun18,ort-heun18-noopt,ort-heun18-1thread,ort-heun18-int8,"
    "ort-heun12"
)


def get_model(args):
    import torch

    from feta_release.config import ModelSection
    from feta_release.data import load_embedded
    from feta_release.models.edm import build_denoiser, edm_loss

    if args.run:  # a job directory (a `train` RUN_DIR or a coordinator's --out): its released model
        from feta_release.release.jobdir import load_model

        den = load_model(Path(args.run))
        names = json.loads((Path(args.run) / "job_summary.json").read_text("utf-8"))["class_names"]
        return den, [str(c) for c in names], f"trained run {args.run}"
    data = load_embedded()
    den = build_denoiser(ModelSection(channels=args.channels), data.image_shape, data.n_classes)
    if args.pretrain_steps:
        # Non-private pre-training, only so that quality comparisons have digits to compare.
        opt = torch.optim.Adam(den.parameters(), lr=args.lr)
        rng = np.random.default_rng(0)
        g = torch.Generator().manual_seed(0)
        t0 = time.perf_counter()
        for step in range(args.pretrain_steps):
            idx = rng.choice(data.n, args.pretrain_batch, replace=False)
            x = torch.from_numpy(data.images[idx]) * 2 - 1
            y = torch.from_numpy(data.labels[idx])
            loss = edm_loss(den, x, y, generator=g).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 100 == 0 or step == args.pretrain_steps - 1:
                print(
                    f"  pretrain step {step}: loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
    else:
        # A freshly built UNet has zero-initialised output layers, i.e. D(x) = c_skip x: every solver then
        # solves the same linear ODE and quality columns would be vacuous. Perturb the weights instead.
        with torch.no_grad():
            for p in den.parameters():
                p.add_(torch.randn_like(p) * 0.02)
    n_params = sum(p.numel() for p in den.parameters())
    what = f"UNet channels={args.channels} ({n_params / 1e6:.2f}M params), " + (
        f"{args.pretrain_steps} non-private steps" if args.pretrain_steps else "random weights (untrained)"
    )
    return den.eval(), list(data.class_names), what


def build_ort(den_onnx, cfg: Config, classes, shape, threads):
    from feta_release.release.onnx_export import SamplerSettings, build_generator
    from feta_release.release.synthesize import make_session

    if cfg.quant == "int8-dynamic":
        import onnx
        from onnxruntime.quantization import QuantType, quantize_dynamic

        with tempfile.TemporaryDirectory() as d:
            src, dst = Path(d) / "den.onnx", Path(d) / "den_q.onnx"
            onnx.save(den_onnx, src)
            quantize_dynamic(src, dst, weight_type=QuantType.QInt8)
            den_onnx = onnx.load(dst)
    gen = build_generator(den_onnx, SamplerSettings(solver=cfg.solver, steps=cfg.steps), classes, shape)
    sess = make_session(gen.SerializeToString(), threads=cfg.threads or threads, optimize=cfg.optimize)
    return lambda noise, labels: sess.run(["images"], {"noise": noise, "labels": labels})[0]


def build_torch(den, cfg: Config, threads):
    import torch

    from feta_release.models.sampler import sample

    def run(noise, labels):
        torch.set_num_threads(cfg.threads or threads)
        return sample(
            den, torch.from_numpy(labels), torch.from_numpy(noise), solver=cfg.solver, steps=cfg.steps
        ).numpy()

    return run


def timed(run, noise, labels, batch, warm=True):
    if warm:
        run(noise[:batch], labels[:batch])  # warm-up: allocation, ORT graph optimisation
    out = []
    t0 = time.perf_counter()
    for s in range(0, len(noise), batch):
        out.append(run(noise[s : s + batch], labels[s : s + batch]))
    dt = time.perf_counter() - t0
    return np.concatenate(out), len(noise) / dt


def fd_with_sd(feat_real, feat_fake, reps=20, seed=0):
    from feta_release.evaluation import frechet_distance_from_features

    fd = frechet_distance_from_features(feat_real, feat_fake)
    rng = np.random.default_rng(seed)
    boots = [
        frechet_distance_from_features(
            feat_real[rng.integers(0, len(feat_real), len(feat_real))],
            feat_fake[rng.integers(0, len(feat_fake), len(feat_fake))],
        )
        for _ in range(reps)
    ]
    return fd, float(np.std(boots))


MEM_SCRIPT = """
import resource, sys, json
from pathlib import Path
from feta_release.release.synthesize import synthesize
from feta_release.signing import load_public_key
rel, out, n, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
trust = {"a": load_public_key(sys.argv[5])}  # role-bound: the site administrator's key for site "a"
rep = synthesize(rel, out, trust, num=n, batch=batch, progress=False)
# VmHWM (peak RSS of this process image): unlike ru_maxrss it is not inherited from the forking parent.
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"n": n, "peak_rss_mib": hwm / 1024, "images_per_s": n / rep.seconds,
                  "torch_loaded": "torch" in sys.modules}))
"""


def memory_run(den_onnx, classes, shape, ns, batch, steps):
    """Peak RSS of `synthesize` (verify + generate + PNGs + certificate) in a fresh process per N.

    The release is role-complete (signed policy naming the site key, signed job, final attestation), built by
    the same helpers the tests use, so the role-bound verify inside `synthesize` accepts it.
    """
    sys.path.insert(0, str(REPO))
    from feta_release.release.export_run import assemble_release
    from feta_release.release.manifest import site_record
    from feta_release.release.onnx_export import SamplerSettings
    from tests.support.release import attest, new_keys, signed_job, signed_policy

    rows = []
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        keys = new_keys()
        policy, job = signed_policy(keys, "a"), signed_job(keys.coordinator, "bench", ["a"])
        rel = assemble_release(
            d / "rel",
            denoiser=den_onnx,
            classes=classes,
            image_shape=shape,
            sampler=SamplerSettings(solver="euler", steps=steps),
            job_id="bench",
            config=job["job"]["config"],
            sites=[site_record(attest(keys, "a", job, policy))],
            coordinator_key=keys.coordinator,
            signed_policies={"a": policy},
            signed_job=job,
            enforce_policy=False,
        )
        admin_pub = keys.pub_files(d / "keys")[2]
        for n in ns:
            proc = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    MEM_SCRIPT,
                    str(rel),
                    str(d / f"out{n}"),
                    str(n),
                    str(batch),
                    admin_pub,
                ],
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
            if proc.returncode:
                raise SystemExit(proc.stderr)
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", help="trained run directory (model.pt, job_summary.json, ...)")
    ap.add_argument(
        "--channels", type=int, default=32, help="UNet width without --run (32: the 1.4M default)"
    )
    ap.add_argument("--pretrain-steps", type=int, default=0)
    ap.add_argument("--pretrain-batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--n", type=int, default=256, help="images per configuration")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--rounds", type=int, default=3, help="interleaved timing rounds (best and median reported)"
    )
    ap.add_argument("--configs", default=DEFAULT, help=f"comma list of: {', '.join(CONFIGS)}")
    ap.add_argument("--no-fd", action="store_true", help="skip the FD quality check")
    ap.add_argument(
        "--reference",
        default=None,
        help="config whose images are the accurate ODE solution (e.g. ort-heun50); adds each "
        "configuration's solver error |x - x_ref| next to its difference from the baseline",
    )
    ap.add_argument(
        "--memory", default="", help="comma list of N for the peak-memory runs, e.g. 500,2000,8000"
    )
    ap.add_argument(
        "--memory-steps", type=int, default=2, help="sampler steps for memory runs (memory is per batch)"
    )
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from feta_release.release.onnx_export import export_denoiser

    den, classes, what = get_model(args)
    shape = den.image_shape
    t0, cpu0 = time.perf_counter(), time.process_time()
    den_onnx = export_denoiser(den, shape)
    # CPU: fair on a busy machine
    export_s = {"wall": time.perf_counter() - t0, "cpu": time.process_time() - cpu0}
    print(
        f"denoiser export: {export_s['wall']:.2f} s wall, {export_s['cpu']:.2f} s CPU "
        f"({len(den_onnx.graph.node)} nodes)"
    )
    rng = np.random.default_rng(1234)
    noise = rng.standard_normal((args.n, *shape), dtype=np.float32)
    labels = (np.arange(args.n) % len(classes)).astype(np.int64)
    print(
        f"model: {what}; n={args.n} batch={args.batch} threads={args.threads} "
        f"(cores available: {len(os.sched_getaffinity(0))}; shared machine: timings approximate)"
    )

    feat_real = feature_net = None
    if not args.no_fd:
        from feta_release.data import load_embedded, train_heldout_split
        from feta_release.evaluation import extract_features, train_classifier

        data = load_embedded()
        if data.image_shape != shape:
            print("  FD skipped: the embedded data's image shape differs from the model's")
        else:
            _, held = train_heldout_split(data, 0.2, 0)
            feature_net = train_classifier(held, 20, 0)
            sub = np.random.default_rng(0).choice(held.n, min(held.n, args.n), replace=False)
            feat_real = extract_features(feature_net, held.images[sub])

    ref_imgs = None
    if args.reference:
        cfg = CONFIGS[args.reference]
        run = (
            build_torch(den, cfg, args.threads)
            if cfg.engine == "torch"
            else build_ort(den_onnx, cfg, classes, shape, args.threads)
        )
        ref_imgs = np.concatenate(
            [run(noise[s : s + args.batch], labels[s : s + args.batch]) for s in range(0, args.n, args.batch)]
        )
    # Build every runner first, then time them in interleaved rounds (A B C A B C ...): on a shared machine
    # the load changes by the minute, and interleaving exposes every configuration to the same conditions.
    # Reported: the best round (least disturbed) and the median round.
    cfgs = [CONFIGS[name.strip()] for name in args.configs.split(",")]
    runners = {
        c.name: (
            build_torch(den, c, args.threads)
            if c.engine == "torch"
            else build_ort(den_onnx, c, classes, shape, args.threads)
        )
        for c in cfgs
    }
    images, rates = {}, {c.name: [] for c in cfgs}
    for rnd in range(args.rounds):
        for c in cfgs:
            imgs, ips = timed(runners[c.name], noise, labels, args.batch, warm=(rnd == 0))
            images.setdefault(c.name, imgs)
            rates[c.name].append(ips)
        print(
            f"  round {rnd + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in rates.items()),
            flush=True,
        )
    results = []
    base_name = cfgs[0].name
    base_imgs, base_ips = images[base_name], max(rates[base_name])
    for c in cfgs:
        imgs = images[c.name]
        ips = max(rates[c.name])
        row = {
            "config": c.name,
            "engine": c.engine,
            "solver": c.solver,
            "steps": c.steps,
            "nfe": c.nfe,
            "quant": c.quant,
            "optimize": c.optimize,
            "threads": c.threads or args.threads,
            "batch": args.batch,
            "images_per_s": ips,
            "images_per_s_median": float(np.median(rates[c.name])),
            "rounds": rates[c.name],
            "speedup": ips / base_ips,
            "max_abs_diff_vs_baseline": float(np.abs(imgs - base_imgs).max()),
            "mean_abs_diff_vs_baseline": float(np.abs(imgs - base_imgs).mean()),
        }
        if ref_imgs is not None:
            row["mean_abs_err_vs_reference"] = float(np.abs(imgs - ref_imgs).mean())
        if feat_real is not None:
            from feta_release.evaluation import extract_features

            row["fd"], row["fd_sd"] = fd_with_sd(feat_real, extract_features(feature_net, imgs))
        results.append(row)
        print(json.dumps(row), flush=True)

    print()
    hdr = (
        f"{'config':22} {'NFE':>4} {'img/s':>7} {'median':>7} {'speedup':>7} {'max|Δ|':>7} {'mean|Δ|':>8} "
        f"{'err_ref':>8} {'FD ± sd':>14} equal?"
    )
    print(hdr)
    b = results[0]
    for r in results:
        fd = f"{r['fd']:.1f} ± {r['fd_sd']:.1f}" if "fd" in r else "-"
        eq = "-"
        if "fd" in r:
            eq = "yes" if abs(r["fd"] - b["fd"]) <= 2 * np.hypot(r["fd_sd"], b["fd_sd"]) else "NO"
        err = f"{r['mean_abs_err_vs_reference']:8.4f}" if "mean_abs_err_vs_reference" in r else f"{'-':>8}"
        print(
            f"{r['config']:22} {r['nfe']:>4} {r['images_per_s']:7.2f} {r['images_per_s_median']:7.2f} "
            f"{r['speedup']:6.2f}x {r['max_abs_diff_vs_baseline']:7.3f} "
            f"{r['mean_abs_diff_vs_baseline']:8.4f} {err} {fd:>14} {eq}"
        )
    out = {"model": what, "n": args.n, "export_s": export_s, "results": results}

    if args.memory:
        ns = [int(v) for v in args.memory.split(",")]
        mem = memory_run(den_onnx, classes, shape, ns, args.batch, args.memory_steps)
        print("\npeak RSS of `synthesize` in a fresh process (verify + generate + PNG + certificate):")
        for m in mem:
            print(
                f"  N = {m['n']:>7}: {m['peak_rss_mib']:.1f} MiB ({m['images_per_s']:.0f} images/s at "
                f"{args.memory_steps} steps; torch imported: {m['torch_loaded']})"
            )
        growth = (
            (mem[-1]["peak_rss_mib"] - mem[0]["peak_rss_mib"]) / max(1, mem[-1]["n"] - mem[0]["n"]) * 1024
        )
        print(
            f"  growth: {growth:.2f} KiB per image -> N = 60,000 projected "
            f"{mem[-1]['peak_rss_mib'] + growth * (60000 - mem[-1]['n']) / 1024:.0f} MiB"
        )
        out["memory"] = mem
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
    print(f"(bench process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")
