"""Why does the diffusion model score below its own release? Stage levers of a no-DP-SGD preset, one run.

    python bench/fidelity_levers.py --preset cpu-eps1-nodpsgd --out bench/results/q5-levers.json --threads 1

Validation part only (fit 3,200 / validation 800 of the protocol's training split; the held-out part is never
loaded). ONE central release and ONE frequency release (the preset's settings, planned at N = 3,200), then, each
scored by the protocol classifier (5 epochs) on ``--n-eval`` balanced images:

- ``release``: augmented copies of the released central images (the release-only baseline);
- ``S``: after the preset's spatial warm-up; ``S+long``: that many more spatial steps at lr / 4 (under-fitting?);
- ``F``: the preset's frequency warm-up (aux + augmented central images) from ``S`` (the preset's model);
- ``F+central``: ``F`` fine-tuned on augmented central images only at lr / 4 (forgetting / aux dilution?);
- ``w1``: guidance 1 on the best model; ``heun16``: 16 sampler steps (sampler?);
- ``sdedit-<from>-<sigma>``: denoise-from-noised images: augmented central (or aux) images + N(0, sigma^2) noise,
  the model's Heun steps from sigma down to 0 (post-processing of released images; no privacy cost);
- ``mix``: half diffusion samples, half augmented central images.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import numpy as np
import torch


def _sdedit(model, x01: torch.Tensor, labels: torch.Tensor, sigma0: float, steps: int, seed: int) -> torch.Tensor:
    """Heun from ``x + N(0, sigma0^2)`` (model range) down to 0 on the Karras schedule below ``sigma0``."""
    from feta_release.models.sampler import karras_sigmas, sampler_step

    g = torch.Generator().manual_seed(seed)
    t = karras_sigmas(steps, 0.002, sigma0)
    out = []
    model.eval()
    with torch.no_grad():
        for s in range(0, len(labels), 256):
            x = x01[s:s + 256] * 2 - 1
            x = x + torch.randn(x.shape, generator=g) * t[0]
            y = labels[s:s + 256]
            for i in range(steps):
                x = sampler_step(model, x, t[i], t[i + 1], y, heun=i < steps - 1)
            out.append(((x + 1) / 2).clamp(0, 1))
    return torch.cat(out)


def main() -> None:  # noqa: C901 - a linear experiment log
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu-eps1-nodpsgd")
    ap.add_argument("--set", action="append", default=[], help="section.key=value override (TOML literal)")
    ap.add_argument("--out", default="bench/results/q5-levers.json")
    ap.add_argument("--n-eval", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sigmas", default="0.5,1.0,2.0")
    ap.add_argument("--skip", default="", help="comma-separated levers to skip (long,fc,w1,heun16,aux)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    skip = set(args.skip.split(","))

    import tomllib

    from feta_release.config import load_preset
    from feta_release.data import ImageDataset, load_embedded
    from feta_release.eval_protocol import PROTOCOL, protocol_splits, release_only
    from feta_release.evaluation import accuracy, train_classifier
    from feta_release.mechanisms.central import central_images, postprocess_central
    from feta_release.mechanisms.frequency import frequency_statistics, rff_frequencies
    from feta_release.models.edm import build_denoiser
    from feta_release.models.sampler import generate
    from feta_release.training.frequency import fit_aux_generator, frequency_warmup, generate_aux_images
    from feta_release.training.spatial import spatial_warmup
    from feta_release.viz import save_grid

    cfg = load_preset(args.preset)
    for kv in args.set:
        key, val_s = kv.split("=", 1)
        sec, k = key.split(".")
        cfg = cfg.replace(**{sec: {k: tomllib.loads(f"v = {val_s}")["v"]}})
    fit, val = protocol_splits(load_embedded(), "validation")
    cfg = cfg.for_size(fit.n)
    out = Path(args.out)
    grids = out.with_suffix("")
    grids.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    t_all = time.perf_counter()
    n = args.n_eval
    labels = torch.from_numpy(np.tile(np.arange(fit.n_classes), n // fit.n_classes + 1)[:n])

    def score(name: str, imgs: torch.Tensor, lab: torch.Tensor, **kw) -> float:
        ds = ImageDataset(imgs.numpy().astype(np.float32), lab.numpy().astype(np.int64), fit.class_names, source=name)
        acc = accuracy(train_classifier(ds, PROTOCOL.classifier_epochs, 0), val)
        save_grid(ds.images[:200], ds.labels[:200], grids / f"{name}.png", per_class=8, n_classes=fit.n_classes)
        rows.append({"lever": name, "acc": round(acc, 4), "t": round(time.perf_counter() - t_all, 1), **kw})
        print(json.dumps(rows[-1]), flush=True)
        out.write_text(json.dumps({"preset": args.preset, "set": args.set, "rows": rows}, indent=1))
        return acc

    def sampled(model, steps: int = 0, w: float = 0.0) -> torch.Tensor:
        s = cfg.sampler
        scfg = s.__class__(**{**s.__dict__, "guidance": w, "steps": steps or s.steps})
        return generate(model, labels, 1234, scfg)[0]

    def central_aug(seed: int, count: int = n) -> tuple[torch.Tensor, torch.Tensor]:
        ro = release_only(cimg, clab, fit.class_names, count, seed)
        perm = torch.randperm(count, generator=torch.Generator().manual_seed(seed))  # class-mixed order for halves
        return torch.from_numpy(ro.images)[perm], torch.from_numpy(ro.labels)[perm]

    rng = np.random.default_rng(10_000)
    c = cfg.central
    rel, _ = central_images(fit.images, fit.labels, fit.n_classes, kind=c.kind, rounds=c.rounds, batch=c.batch,
                            sigma=c.sigma, clip=c.clip, downsample=c.downsample, bins=c.bins, n_public=fit.n, rng=rng,
                            cells=c.cells)
    cimg, clab = postprocess_central(rel, stretch=c.stretch)
    cimg, clab = cimg.astype(np.float32), clab.astype(np.int64)
    caug, caug_lab = central_aug(0)
    score("release", caug, caug_lab)

    torch.manual_seed(0)
    den = build_denoiser(cfg.model, fit.image_shape, fit.n_classes)
    spatial_warmup(den, cimg, clab, cfg, generator=torch.Generator().manual_seed(1))
    after_s = copy.deepcopy(den.state_dict())
    score("S", sampled(den), labels)
    models = {"S": after_s}
    if "long" not in skip:
        spatial_warmup(den, cimg, clab, cfg.replace(warmup={"lr": cfg.warmup.lr / 4}),
                       generator=torch.Generator().manual_seed(11))
        models["S+long"] = copy.deepcopy(den.state_dict())
        score("S+long", sampled(den), labels)

    f = cfg.frequency
    relf, _ = frequency_statistics(fit.images, fit.labels, fit.n_classes, features=f.features, sigma=f.sigma,
                                   bandwidth2=f.bandwidth2, seed=f.seed, chunk=f.chunk, n_public=fit.n, rng=rng)
    omega = rff_frequencies(int(np.prod(fit.image_shape)), f.features, f.bandwidth2, f.seed)
    aux = fit_aux_generator(relf.embedding, omega, fit.image_shape, fit.n_classes, cfg, fit.n,
                            generator=torch.Generator().manual_seed(2))
    aimg, alab = generate_aux_images(aux, cfg.warmup.frequency_images, torch.Generator().manual_seed(3))
    den.load_state_dict(after_s)
    mixc, mixl = central_aug(5, len(alab))  # as many augmented central images as aux images (frequency_mix_central)
    x = torch.cat([aimg, mixc])
    y = torch.cat([alab, mixl])
    frequency_warmup(den, x, y, cfg, generator=torch.Generator().manual_seed(4))
    models["F"] = copy.deepcopy(den.state_dict())
    score("F", sampled(den), labels)
    if "fc" not in skip:
        spatial_warmup(den, cimg, clab, cfg.replace(warmup={"lr": cfg.warmup.lr / 4, "spatial_iterations": 500}),
                       generator=torch.Generator().manual_seed(12))
        models["F+central"] = copy.deepcopy(den.state_dict())
        score("F+central", sampled(den), labels)

    best = max((r for r in rows if r["lever"] in models), key=lambda r: r["acc"])["lever"]
    den.load_state_dict(models[best])
    print(f"best model: {best}", flush=True)
    if "w1" not in skip:
        score(f"{best}-w1", sampled(den, w=1.0), labels)
    if "heun16" not in skip:
        score(f"{best}-heun16", sampled(den, steps=16), labels)
    src, src_lab = central_aug(7)
    for sig in (float(s) for s in args.sigmas.split(",")):
        for name in dict.fromkeys([best, "S"]):
            den.load_state_dict(models[name])
            score(f"sdedit-central-{name}-{sig:g}", _sdedit(den, src, src_lab, sig, 6, 9), src_lab)
    if "aux" not in skip:
        den.load_state_dict(models[best])
        ai, al = generate_aux_images(aux, n, torch.Generator().manual_seed(8))
        score(f"sdedit-aux-{best}-1", _sdedit(den, ai, al, 1.0, 6, 9), al)
    den.load_state_dict(models[best])
    half = n // 2
    score(f"mix-{best}", torch.cat([sampled(den)[:half], caug[half:]]), torch.cat([labels[:half], caug_lab[half:]]))
    print(f"done {time.perf_counter() - t_all:.0f} s", flush=True)


if __name__ == "__main__":
    main()
