"""The cost of the stages the time estimate (``job_rules.estimate``) has no training-pass rate for: the torch
sampler that draws the synthetic set and the grids, the ONNX export of the generator, the aux-generator images
of the frequency warm-up set and the cell prototypes, on the derived job of each image shape.

For each shape it builds the derived job's denoiser (16 channels, its levels) and aux generator at their public
initialisation (speed does not depend on the weights) and times, on ``--threads`` threads:
  * sampling: ``models.generate`` with the derived sampler (SDEdit starts) of ``--small`` and ``--large``
    images (one call each, after a warm-up call); the difference over the image difference is the seconds per
    image, divided by the denoiser calls per image (Heun: 2 steps - 1) and the image values x width factor it
    is the per-call rate ``job_rules.SAMPLING_SECONDS_PER_VALUE``;
  * export: ``export_denoiser`` + ``build_generator`` (the signed release's generator);
  * aux images: ``generate_aux_images`` of ``--large`` images and RandAugment of as many central copies;
  * prototypes: k-means of 256 aux images into 4 cells, one class;
  * aux fit: ``fit_aux_generator`` of ``--aux-steps`` steps through the job's feature map; its CPU seconds per
    step, image of the batch and image PIXEL (``aux_fit_cpu_per_image_pixel_s``) is the per-pixel rate
    ``job_rules.AUX_STEP_SECONDS_PER_PIXEL`` assumes equal at every shape (``--threads 1 --repeats 2
    --aux-steps 5`` on shared cores: 3.3e-6 at 28x28x1, 3.7e-6 at 28x28x3, 3.6e-6 at 64x64x1).
Each figure is the fastest of ``--repeats`` runs. The process keeps freed pages mapped as ``train`` does
(``feta_release.allocator``; ``FETA_KEEP_FREED_PAGES=0`` measures glibc's own policy, whose page faults made a
64 px aux-fit step cost 1.9x as much per pixel as a 28 px one: 6.8e-6 s against 3.9e-6).

Usage (2 free cores; a few minutes):
  nice python bench/release_cost.py --threads 2 --shapes 28x1,28x3,64x1,64x3 --out bench/results/release_cost.json
"""  # noqa: E501

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from feta_release.allocator import keep_freed_pages  # noqa: E402
from feta_release.config import JobConfig  # noqa: E402
from feta_release.job_rules import DataFacts, derive, sampler_calls, width_factor  # noqa: E402
from feta_release.mechanisms.feature_map import job_feature_map  # noqa: E402
from feta_release.models import generate  # noqa: E402
from feta_release.models.auxgen import AuxGenerator  # noqa: E402
from feta_release.release.onnx_export import SamplerSettings, build_generator, export_denoiser  # noqa: E402
from feta_release.stages.context import initial_denoiser  # noqa: E402
from feta_release.stages.prototypes import PER_CLASS, kmeans  # noqa: E402
from feta_release.training.augment import rand_augment  # noqa: E402
from feta_release.training.frequency import aux_draw, fit_aux_generator, generate_aux_images  # noqa: E402

CLASSES = 4


REPEATS = [3]  # --repeats: each figure is the fastest of this many runs (the cores are shared: the least
#               disturbed run is the closest to the cost itself)


CPU: dict[str, float] = {}  # the last timed call's CPU seconds (all threads): robust to other processes


def _seconds(fn: Any) -> float:
    """The fastest wall-clock seconds of ``fn`` over the repeats; its CPU seconds (the least of the repeats,
    user + system of every thread) in ``CPU["last"]``."""
    best, cpu = float("inf"), float("inf")
    for _ in range(REPEATS[0]):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        best, cpu = min(best, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    CPU["last"] = cpu
    return best


def _sampling(cfg: JobConfig, shape: tuple[int, int, int], small: int, large: int) -> dict[str, float]:
    model = initial_denoiser(cfg, shape, CLASSES).eval()
    starts = torch.rand((max(large, 8), *shape))
    # the synthetic set's SDEdit draw: the schedule from start_sigma (the calls per image are the same)
    scfg = dataclasses.replace(cfg.sampler, sigma_max=cfg.sampler.start_sigma or cfg.sampler.sigma_max)

    def draw(n: int) -> None:
        generate(model, np.arange(n) % CLASSES, 0, scfg, init=starts[:n])

    draw(8)  # allocation and first-call costs
    t_small = _seconds(lambda: draw(small))
    c_small = CPU["last"]
    t_large = _seconds(lambda: draw(large))
    c_large = CPU["last"]
    per_image, cpu_image = (t_large - t_small) / (large - small), (c_large - c_small) / (large - small)
    unit = sampler_calls(cfg) * int(np.prod(shape)) * width_factor(cfg)  # calls x values x width, an image
    export_s = _seconds(lambda: _export(model, cfg, shape))
    return {
        "small_s": t_small,
        "large_s": t_large,
        "per_image_s": per_image,
        "calls_per_image": sampler_calls(cfg),
        "per_call_value_width_s": per_image / unit,
        "cpu_per_image_s": cpu_image,
        "cpu_per_call_value_width_s": cpu_image / unit,
        "export_s": export_s,
        "export_cpu_s": CPU["last"],
    }


def _export(model: Any, cfg: JobConfig, shape: tuple[int, int, int]) -> None:
    den = export_denoiser(model, shape)
    build_generator(den, SamplerSettings.from_config(cfg.sampler), [str(k) for k in range(CLASSES)], shape)


def _aux(cfg: JobConfig, shape: tuple[int, int, int], n: int) -> dict[str, float]:
    a = cfg.auxgen
    torch.manual_seed(0)
    gen = AuxGenerator(shape[0], shape[1], CLASSES, z_dim=a.z_dim, width=a.width).eval()
    g = torch.Generator().manual_seed(0)
    draw_s = _seconds(lambda: generate_aux_images(gen, n, g))
    draw_cpu = CPU["last"]
    src = torch.rand((n, *shape))
    w = cfg.warmup

    def augment() -> None:
        for i in range(0, n, 256):
            rand_augment(
                src[i : i + 256], n_ops=w.augment_ops, magnitude_max=w.augment_magnitude, generator=g
            )

    aug_s = _seconds(augment)
    aug_cpu = CPU["last"]
    images = aux_draw(gen, np.zeros(PER_CLASS, np.int64), g).reshape(PER_CLASS, -1).numpy().astype(np.float64)
    kmeans_s = _seconds(lambda: kmeans(images, 4, np.random.default_rng(0)))
    values = int(np.prod(shape))
    return {
        "aux_images_s": draw_s,
        "augment_s": aug_s,
        "aux_set_per_image_value_s": (draw_s + aug_s) / (2 * n * values),
        "aux_set_cpu_per_image_value_s": (draw_cpu + aug_cpu) / (2 * n * values),
        "kmeans_one_class_s": kmeans_s,
        "kmeans_per_image_cell_value_s": kmeans_s / (PER_CLASS * 4 * values),
        "kmeans_cpu_per_image_cell_value_s": CPU["last"] / (PER_CLASS * 4 * values),
    }


def _aux_fit(cfg: JobConfig, shape: tuple[int, int, int], steps: int) -> dict[str, float]:
    """Fits of 1 and of 1 + ``steps`` steps (one epoch) through the job's feature map to a random embedding:
    their difference is ``steps`` steps without the fit's setup."""
    fmap = job_feature_map(cfg.frequency, shape)
    emb = torch.randn((fmap.features, CLASSES), generator=torch.Generator().manual_seed(0)) * 0.01

    def fit(n: int) -> None:
        one = cfg.replace(auxgen={"epochs": 1, "iterations_per_epoch": n})
        fit_aux_generator(emb, fmap, shape, CLASSES, one, 4000, generator=torch.Generator().manual_seed(0))

    fit(1)  # the first fit of a shape pays torch's first calls of its kernels
    short = _seconds(lambda: fit(1))
    short_cpu = CPU["last"]
    step_s = (_seconds(lambda: fit(1 + steps)) - short) / steps
    per = steps * cfg.auxgen.batch * shape[1] * shape[2]
    return {"aux_fit_step_s": step_s, "aux_fit_cpu_per_image_pixel_s": (CPU["last"] - short_cpu) / per}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="28x1,28x3,64x1,64x3", help="SIDExCHANNELS, comma-separated")
    ap.add_argument("--small", type=int, default=8)
    ap.add_argument("--large", type=int, default=40)
    ap.add_argument("--aux-steps", type=int, default=4, help="steps of the timed aux fit")
    ap.add_argument("--repeats", type=int, default=3, help="each figure: the fastest of this many runs")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    keep_freed_pages()  # as every command that trains or samples does first (FETA_KEEP_FREED_PAGES=0: off)
    torch.set_num_threads(args.threads)
    REPEATS[0] = args.repeats
    rows = []
    for spec in args.shapes.split(","):
        side, ch = (int(v) for v in spec.split("x"))
        shape = (ch, side, side)
        facts = DataFacts(size=4000, height=side, width=side, channels=ch, n_classes=CLASSES, epsilon=10.0)
        cfg = derive(facts).cfg
        row = {"shape": spec, "threads": args.threads, "width_factor": width_factor(cfg)}
        row.update(_sampling(cfg, shape, args.small, args.large))
        row.update(_aux(cfg, shape, args.large))
        row.update(_aux_fit(cfg, shape, args.aux_steps))
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2) + "\n", "utf-8")


if __name__ == "__main__":
    main()
