"""Stage-by-stage diagnosis of a preset on a VALIDATION part of the embedded training split.

    python bench/diagnose_stages.py --preset cpu-eps1 --out runs/diag/eps1 [--variants base,mix,...]

Split: embedded data -> ``train_heldout_split(.., 0.2, seed=0)`` (4,000 train / 1,000 held-out, the held-out part
is NEVER touched here) -> the 4,000 again split 80/20 (seed 1) into 3,200 "fit" images (what the mechanisms see)
and 800 "validation" images (what accuracy is measured on). The full preset's privacy plan is computed for
N = 3,200 so every stage spends what it would in a real run.

After every stage the current denoiser draws ``--n-eval`` balanced images, a SmallCNN (the evaluation protocol's
classifier) trains on them and is scored on the validation images. Also scored: the released central images
alone (augmented copies, the "release-only" baseline) and the aux generator's images alone.
Writes ``diag.json`` (one row per measurement) and grids per stage to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import numpy as np
import torch


def split():
    from feta_release.data import load_embedded, train_heldout_split

    train, _heldout = train_heldout_split(load_embedded(), 0.2, seed=0)
    fit, val = train_heldout_split(train, 0.2, seed=1)
    return fit, val


def score_images(images, labels, val, epochs: int, seed: int = 0, augment: bool = False) -> float:
    from feta_release.data import ImageDataset
    from feta_release.evaluation import accuracy, train_classifier

    ds = ImageDataset(np.asarray(images, np.float32), np.asarray(labels, np.int64), val.class_names, source="eval")
    net = train_classifier(ds, epochs, seed, augment=augment)
    return accuracy(net, val)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu-eps1")
    ap.add_argument("--out", default="runs/diag")
    ap.add_argument("--n-eval", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--variants", default="base,mix")
    ap.add_argument("--guidance", default="0,2")
    ap.add_argument("--set", action="append", default=[], help="section.key=value override (TOML literal)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-dpsgd", action="store_true")
    ap.add_argument("--dpsgd-from", default="", help="comma-separated starts (spatial, freq-VARIANT); default: all")
    ap.add_argument("--dpsgd-variants", default="", help="comma-separated RATE:STEPS DP-SGD settings, each planned "
                    "anew (sigma re-calibrated to the same total epsilon); default: the preset's")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import tomllib

    from feta_release.config import load_preset
    from feta_release.mechanisms.central import central_images, postprocess_central
    from feta_release.mechanisms.frequency import frequency_statistics, rff_frequencies
    from feta_release.models.edm import build_denoiser
    from feta_release.models.sampler import generate
    from feta_release.planning import plan as privacy_plan
    from feta_release.training.augment import rand_augment
    from feta_release.training.dpsgd import DPSGDTrainer
    from feta_release.training.frequency import fit_aux_generator, frequency_warmup, generate_aux_images
    from feta_release.training.spatial import spatial_warmup
    from feta_release.viz import save_grid

    cfg = load_preset(args.preset)
    for kv in args.set:
        key, val_s = kv.split("=", 1)
        sec, k = key.split(".")
        cfg = cfg.replace(**{sec: {k: tomllib.loads(f"v = {val_s}")["v"]}})
    fit, val = split()
    cfg = cfg.for_size(fit.n)  # preset sampling rates -> batches for the fit part's public size
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    t_all = time.perf_counter()

    def log(stage: str, **kw) -> None:
        row = {"stage": stage, "t": round(time.perf_counter() - t_all, 1), **kw}
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / "diag.json").write_text(json.dumps(rows, indent=1))

    def eval_model(stage: str, model, all_guidance: bool = False) -> None:
        ws = [float(g) for g in args.guidance.split(",")] if all_guidance else [0.0]
        for w in ws:
            t0 = time.perf_counter()
            scfg = cfg.sampler.__class__(**{**cfg.sampler.__dict__, "guidance": w})
            labels = np.tile(np.arange(fit.n_classes), args.n_eval // fit.n_classes + 1)[: args.n_eval]
            imgs, _ = generate(model, labels, 1234, scfg)
            acc = score_images(imgs.numpy(), labels, val, args.epochs)
            save_grid(imgs.numpy()[:200], labels[:200], out / f"{stage}-w{w:g}.png", per_class=8,
                      n_classes=fit.n_classes)
            log(stage, guidance=w, val_acc=round(acc, 4), eval_s=round(time.perf_counter() - t0, 1))

    plan = privacy_plan(cfg, fit.n)
    log("plan", stages={s.stage: round(s.epsilon, 3) for s in plan.stages}, sigma_sgd=plan.noise_multiplier,
        total=plan.epsilon)
    rng = np.random.default_rng(99)
    c = cfg.central
    rel, _ = central_images(fit.images, fit.labels, fit.n_classes, kind=c.kind, rounds=c.rounds, batch=c.batch,
                            sigma=c.sigma, clip=c.clip, downsample=c.downsample, bins=c.bins, n_public=fit.n, rng=rng)
    cimg, clab = postprocess_central(rel, stretch=c.stretch)
    save_grid(cimg, clab, out / "01-central.png", per_class=c.rounds, n_classes=fit.n_classes)
    reps = max(1, args.n_eval // len(clab))
    aug, _ = rand_augment(torch.from_numpy(np.repeat(cimg, reps, 0)), n_ops=2, magnitude_max=cfg.warmup.augment_magnitude,
                          generator=torch.Generator().manual_seed(0))
    log("release-only", val_acc=round(score_images(aug.numpy(), np.repeat(clab, reps), val, args.epochs), 4))

    torch.manual_seed(0)
    den = build_denoiser(cfg.model, fit.image_shape, fit.n_classes)
    t0 = time.perf_counter()
    spatial_warmup(den, cimg, clab, cfg, generator=torch.Generator().manual_seed(1))
    log("spatial-train", seconds=round(time.perf_counter() - t0, 1))
    eval_model("02-spatial", den, all_guidance=True)
    after_spatial = copy.deepcopy(den.state_dict())

    f = cfg.frequency
    starts = {"spatial": after_spatial}
    if f.sigma is not None:
        relf, _ = frequency_statistics(fit.images, fit.labels, fit.n_classes, features=f.features, sigma=f.sigma,
                                       bandwidth2=f.bandwidth2, seed=f.seed, chunk=f.chunk, n_public=fit.n, rng=rng)
        omega = rff_frequencies(int(np.prod(fit.image_shape)), f.features, f.bandwidth2, f.seed)
        t0 = time.perf_counter()
        aux = fit_aux_generator(relf.embedding, omega, fit.image_shape, fit.n_classes, cfg, fit.n,
                                generator=torch.Generator().manual_seed(2))
        aimg, alab = generate_aux_images(aux, cfg.warmup.frequency_images, torch.Generator().manual_seed(3))
        save_grid(aimg.numpy(), alab.numpy(), out / "aux.png", per_class=8, n_classes=fit.n_classes)
        log("aux-only", val_acc=round(score_images(aimg.numpy(), alab.numpy(), val, args.epochs), 4),
            seconds=round(time.perf_counter() - t0, 1))
        for v in args.variants.split(","):
            den.load_state_dict(after_spatial)
            vcfg = cfg
            x, y = aimg, alab
            if v in ("mix", "mixlow"):  # aux images + augmented central images, half and half
                k = len(alab) // len(clab)
                caug, _ = rand_augment(torch.from_numpy(np.repeat(cimg, k, 0)), n_ops=2,
                                       magnitude_max=cfg.warmup.augment_magnitude, generator=torch.Generator().manual_seed(5))
                x = torch.cat([aimg, caug])
                y = torch.cat([alab, torch.from_numpy(np.repeat(clab, k))])
            if v in ("low", "mixlow"):
                vcfg = cfg.replace(warmup={"lr": cfg.warmup.lr / 4})
            t0 = time.perf_counter()
            frequency_warmup(den, x, y, vcfg, generator=torch.Generator().manual_seed(4))
            log(f"freq-train-{v}", seconds=round(time.perf_counter() - t0, 1))
            eval_model(f"03-freq-{v}", den)
            starts[f"freq-{v}"] = copy.deepcopy(den.state_dict())

    if not args.skip_dpsgd and plan.noise_multiplier:
        xr = torch.from_numpy(fit.images) * 2 - 1
        yr = torch.from_numpy(fit.labels)
        wanted = [w for w in args.dpsgd_from.split(",") if w] or list(starts)
        variants = [tuple(v.split(":")) for v in args.dpsgd_variants.split(",") if v] or [(None, None)]
        for rate, steps in variants:
            dcfg = cfg if rate is None else cfg.replace(dpsgd={"rate": float(rate), "steps": int(steps)}).for_size(fit.n)
            dplan = privacy_plan(dcfg, fit.n)
            tag = "" if rate is None else f"-q{rate}-s{steps}"
            log(f"plan{tag}", stages={s.stage: round(s.epsilon, 3) for s in dplan.stages},
                sigma_sgd=dplan.noise_multiplier, total=dplan.epsilon)
            for name in wanted:
                den.load_state_dict(starts[name])
                tr = DPSGDTrainer(den, dcfg, dplan.noise_multiplier, dcfg.dpsgd.batch / fit.n,
                                  torch.Generator().manual_seed(7))
                t0 = time.perf_counter()
                tr.run(xr, yr, dcfg.dpsgd_steps(fit.n))
                log(f"dpsgd-train-from-{name}{tag}", seconds=round(time.perf_counter() - t0, 1))
                eval_model(f"04-dpsgd-from-{name}{tag}", tr.ema_model(), all_guidance=True)
    log("done")


if __name__ == "__main__":
    main()
