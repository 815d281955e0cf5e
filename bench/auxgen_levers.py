"""Aux-generator levers on finished validation runs: refit the generator to the run's RELEASED frequency statistic
with other ``[auxgen]`` settings (post-processing: no new privacy cost), then score on the validation part

Variant keys: ``[auxgen]`` keys, ``f.KEY`` ([frequency]), ``guide=L`` (a class-guided fit, see ``_guide``), ``init=S``
(the fit's generator seeded with S instead of the job's public "auxgen" one: another start of the same fit). Each
row also gives the fit's final loss (mean over its last epoch), a function of the release alone.

- ``aux``: the protocol classifier trained on N aux-generator images alone (how much of the frequency release the
  generator turns into images);
- ``ensemble`` (with --ensemble): after the variants, the classifier on N images drawn evenly from ALL the variants'
  generators (member j draws every k-th of the class-sorted labels, so each member covers every class), and from the
  two with the lowest final loss (choosing by loss costs no epsilon: a function of the release alone);
- ``mix`` (with --sdedit): the run's own denoiser, SDEdit from the preset's mix of aux and central starts, with the
  refit generator's images as the aux half (the denoiser itself was warmed up on the run's original generator).

    python bench/auxgen_levers.py --run runs/e10/protocol/validation/cpu-eps10-nodpsgd/seed0 --seed 0 \
        --variants "base:;e10:epochs=10;e10w64:epochs=10,width=64" --out bench/results/auxgen-s0.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np


def _variant(job, spec: str):
    """``name:key=value,...`` -> (name, job with those [auxgen] values; ``f.key`` sets a [frequency] value)."""
    name, _, kv = spec.partition(":")
    aux: dict = {}
    freq: dict = {}
    extra = {"guide": 0.0, "init": -1}
    for item in filter(None, kv.split(",")):
        k, v = item.split("=")
        if k in extra:
            extra[k] = type(extra[k])(v)
        elif k.startswith("f."):
            freq[k[2:]] = float(v) if k[2:] in ("bandwidth2", "sigma") else int(v)
        else:
            aux[k] = float(v) if k in ("lr", "gamma") else int(v)
    return name, job.replace(auxgen=aux, frequency=freq), extra


def _guide(central, fit, seed: int, weight: float):
    """``weight`` x cross-entropy of a classifier trained on 10,000 augmented copies of the RELEASED central images
    (the release-only baseline's classifier; post-processing): pulls each aux image toward its own class."""
    import torch

    from feta_release.eval_protocol import release_only
    from feta_release.evaluation import train_classifier

    net = train_classifier(release_only(*central, fit.class_names, 10_000, seed), 5, seed)
    for p in net.parameters():
        p.requires_grad_(False)
    return lambda x, y: weight * torch.nn.functional.cross_entropy(net(x.clamp(0, 1)), y)


def _embedding(fit, job, rel, seed: int) -> np.ndarray:
    """The run's released embedding, or (other [frequency] features / bandwidth / patch map at the SAME sigma, so the
    same epsilon) a fresh release of the validation fit part with benchmark noise seed ``seed``."""
    from feta_release.mechanisms.frequency import frequency_statistics

    f = job.frequency
    same_map = int(rel["patch"]) if "patch" in rel.files else 0, int(rel["stride"]) if "stride" in rel.files else 1
    if (f.features == int(rel["features"]) and f.bandwidth2 == float(rel["bandwidth2"])
            and (f.patch, f.stride) == same_map):
        return rel["embedding"]
    out, _ = frequency_statistics(fit.images, fit.labels, fit.n_classes, features=f.features, sigma=float(rel["sigma"]),
                                  bandwidth2=f.bandwidth2, seed=f.seed, n_public=int(rel["n_public"]),
                                  rng=np.random.default_rng(5_000 + seed), patch=f.patch, stride=f.stride)
    return out.embedding


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, type=Path)
    ap.add_argument("--variants", required=True, help="name:key=value,...;...  ([auxgen] keys)")
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sdedit", action="store_true", help="also score the run's denoiser from mix starts")
    ap.add_argument("--ensemble", action="store_true", help="also score mixtures of the variants' generators")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    from feta_release.config import JobConfig
    from feta_release.data import ImageDataset, load_embedded
    from feta_release.eval_protocol import balanced_labels, protocol_splits
    from feta_release.evaluation import accuracy, train_classifier
    from feta_release.models.sampler import generate
    from feta_release.release.jobdir import load_model
    from feta_release.stages.synthesis import aux_taken, release_starts
    from feta_release.mechanisms.feature_map import job_feature_map
    from feta_release.stages.context import public_generator
    from feta_release.training.frequency import aux_draw, aux_iterations, fit_aux_generator

    torch.set_num_threads(args.threads)
    fit, val = protocol_splits(load_embedded(), "validation")
    job = JobConfig.from_dict(json.loads((args.run / "job.json").read_text("utf-8")), str(args.run / "job.json"))
    rel = np.load(args.run / "released" / "frequency.npz")
    c = np.load(args.run / "released" / "central.npz")
    central = (c["images"].astype(np.float32), c["labels"].astype(np.int64))
    model = load_model(args.run) if args.sdedit else None
    labels = np.asarray(balanced_labels(args.n, fit.n_classes))
    rows = []
    members = []
    for spec in args.variants.split(";"):
        name, vjob, extra = _variant(job, spec)
        guide, init = extra["guide"], extra["init"]
        t0 = time.perf_counter()
        emb = _embedding(fit, vjob, rel, args.seed)
        # as stages.freq_warmup.fit_aux does (same map, same public generator), unless init= gives another start
        fmap = job_feature_map(vjob.frequency, fit.image_shape)
        res = fit_aux_generator(emb, fmap, fit.image_shape, fit.n_classes, vjob, int(rel["n_public"]),
                                generator=(torch.Generator().manual_seed(init) if init >= 0
                                           else public_generator(vjob, "auxgen")),
                                guide=_guide(central, fit, args.seed, guide) if guide else None, return_result=True)
        aux = res.generator
        members.append(aux)
        t_fit = time.perf_counter() - t0
        x = aux_draw(aux, labels, torch.Generator().manual_seed(88 + args.seed))
        syn = ImageDataset(x.numpy(), labels, fit.class_names, source=name)
        row = {"variant": name, "guide": guide, "init": init,
               "final_loss": float(np.mean(res.losses[-aux_iterations(vjob, int(rel["n_public"])):])),
               "auxgen": vjob.auxgen.__dict__, "features": vjob.frequency.features,
               "patch": vjob.frequency.patch, "stride": vjob.frequency.stride,
               "bandwidth2": vjob.frequency.bandwidth2, "fit_s": round(t_fit, 1),
               "aux_acc": round(accuracy(train_classifier(syn, 5, args.seed), val), 4)}
        if model is not None:
            from feta_release.config import SamplerSection

            init = release_starts(central, labels, job, torch.Generator().manual_seed(77 + args.seed))
            take = torch.from_numpy(aux_taken(labels, "mix"))
            init[take] = x[take]
            cfg = replace(SamplerSection(), solver="heun", steps=8, sigma_max=job.sampler.start_sigma or 0.7)
            imgs, _ = generate(model, labels, 1_000 + args.seed, cfg, init=init)
            syn = ImageDataset(imgs.numpy().astype(np.float32), labels, fit.class_names, source=name)
            row["mix_acc"] = round(accuracy(train_classifier(syn, 5, args.seed), val), 4)
        row["s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps({"run": str(args.run), "n": args.n, "rows": rows}, indent=1))
    if args.ensemble and len(members) > 1:
        by_loss = sorted(range(len(members)), key=lambda i: rows[i]["final_loss"])
        for name, pick in (("ensemble-all", list(range(len(members)))), ("ensemble-2-lowest", by_loss[:2])):
            row = _ensemble_row(name, [members[i] for i in pick], labels, fit, val, args.seed)
            row["members"] = [rows[i]["variant"] for i in pick]
            rows.append(row)
            print(json.dumps(row), flush=True)
            Path(args.out).write_text(json.dumps({"run": str(args.run), "n": args.n, "rows": rows}, indent=1))


def _ensemble_row(name: str, gens, labels: np.ndarray, fit, val, seed: int) -> dict:
    """The protocol classifier on images drawn evenly from ``gens`` (member j: labels[j::k], class-sorted labels)."""
    import torch

    from feta_release.data import ImageDataset
    from feta_release.evaluation import accuracy, train_classifier
    from feta_release.training.frequency import aux_draw

    g = torch.Generator().manual_seed(88 + seed)
    k = len(gens)
    x = np.zeros((len(labels), *fit.image_shape), np.float32)
    for j, gen in enumerate(gens):
        x[j::k] = aux_draw(gen, labels[j::k], g).numpy()
    syn = ImageDataset(x, labels, fit.class_names, source=name)
    return {"variant": name, "aux_acc": round(accuracy(train_classifier(syn, 5, seed), val), 4)}


if __name__ == "__main__":
    main()
