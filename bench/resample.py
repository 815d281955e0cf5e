"""Re-draw a trained run's synthetic set under other ``[sampler]`` settings and score each on the evaluation
protocol's real images: sampler choices compared on one trained model, nothing retrained.

Sampling is post-processing of the release (the trained model and its released central images), so a sweep
here spends no epsilon; the choice must still be made on the protocol's VALIDATION part only
(``--mode validation``), the held-out part scored once with the setting chosen.

    PYTHONPATH=. python bench/resample.py --run RUN --kind digits --size 4000 --mode validation \\
        --set guidance=1.0 --set start_sigma=0.8 --set start_source=mix,start_sigma=0.7 --out results.jsonl

``RUN`` is a ``train`` output folder (``bench/generality.py`` keeps one per cell under ``--work``); each
``--set`` (``KEY=VALUE[,KEY=VALUE]`` of ``[sampler]``) is drawn alone, after the signed job's own setting, and
one JSON line per setting is appended to ``--out``: accuracy and per-class accuracy of the evaluation
classifier trained on the drawn set.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_setting(text: str) -> dict[str, Any]:
    """``key=value[,key=value...]`` of ``[sampler]`` -> one setting {key: value, ...}, each value read as JSON
    where it parses (numbers, null), else as a string (``start_source=mix``)."""
    setting: dict[str, Any] = {}
    for part in text.split(","):
        key, sep, raw = part.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {text!r}: expected KEY=VALUE[,KEY=VALUE] of [sampler], e.g. guidance=1")
        try:
            setting[key] = json.loads(raw)
        except json.JSONDecodeError:
            setting[key] = raw
    return setting


def aux_pool_for(run: Path, setting: dict[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """A setting that starts from the aux generator's pool (``start_source`` aux or mix) on a run that shipped
    none: the pool the job would have shipped (images, labels), from the run's own frequency release (the aux
    generator is fitted to the NOISED release with public randomness: post-processing). Kept in memory and
    handed to ``synthetic_set``: nothing is written into the run's ``released/`` folder, which a later
    release build reads. None where the setting needs no pool or the run shipped one."""
    from feta_release.config import JobConfig
    from feta_release.federation.warmup import fitted_aux
    from feta_release.release.jobdir import load_model
    from feta_release.release.jobfiles import RELEASED_AUX
    from feta_release.stages.freq_warmup import aux_pool

    if setting.get("start_source") not in ("aux", "mix") or (run / RELEASED_AUX).exists():
        return None
    states = sorted((run / "state").glob("frequency_*.npz"))
    if len(states) != 1:
        raise SystemExit(
            f"{run}: start_source {setting['start_source']!r} needs the aux generator's pool, and the run "
            f"has no {RELEASED_AUX} and {len(states)} frequency releases in {run / 'state'} (one site's "
            "frequency_<site>.npz is needed); use a one-site run or one that shipped the pool"
        )
    site = states[0].stem.removeprefix("frequency_")
    cfg = JobConfig.from_dict(json.loads((run / "signed_job.json").read_text("utf-8"))["job"]["config"])
    model = load_model(run)
    with np.load(states[0]) as z:
        freq = {site: {k: z[k] for k in z.files}}
    aux = fitted_aux(freq, {site: 1}, cfg, tuple(model.image_shape), int(model.n_classes), "cpu")
    images, labels = aux_pool(aux, cfg)
    return np.asarray(images, np.float32), np.asarray(labels, np.int64)


def score_setting(run: Path, setting: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from generality import _classifier_scores, _splits

    from feta_release.data import ImageDataset
    from feta_release.release.jobdir import synthetic_set

    pool = aux_pool_for(run, setting)
    t0 = time.perf_counter()
    path = synthetic_set(run, args.num, args.sample_seed, sampler=setting, name="resampled.npz", aux=pool)
    drawn_s = time.perf_counter() - t0
    cell = {"kind": args.kind, "size": args.size, "mode": args.mode, "seed": args.seed}
    train, test = _splits(cell)
    z = np.load(path)
    syn = ImageDataset(z["images"], z["labels"].astype(np.int64), train.class_names, source=str(path))
    acc, per_class = _classifier_scores(syn, test, cell)
    return {
        "run": str(run),
        "sampler": setting,
        "mode": args.mode,
        "acc": acc,
        "per_class": per_class,
        "sample_s": round(drawn_s, 1),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True, help="a train output folder")
    p.add_argument("--kind", default="digits", help="the run's data kind (bench/generality.py)")
    p.add_argument("--size", type=int, default=4000)
    p.add_argument("--mode", choices=("validation", "test"), default="validation")
    p.add_argument("--seed", type=int, default=0, help="the evaluation classifier's seed (the cell's seed)")
    p.add_argument("--sample-seed", type=int, default=0, help="the synthetic set's noise seed")
    p.add_argument("--num", type=int, default=10000)
    p.add_argument("--set", dest="settings", action="append", default=[], type=parse_setting)
    p.add_argument("--no-baseline", action="store_true", help="skip the signed job's own setting")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = ([] if args.no_baseline else [{}]) + args.settings
    for setting in settings:
        row = score_setting(args.run, setting, args)
        print(json.dumps(row), flush=True)
        with args.out.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
