"""The table of docs/derived-job.md: what the job derived from public facts does per data kind x size x
epsilon.

    PYTHONPATH=. python bench/derived_job_table.py > /tmp/table.md

Every figure comes from ``feta_release.job_rules.derive`` (the rules and their cost model); nothing is trained
here. Quality is left "not yet measured" for a benchmark to fill.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from feta_release.errors import ConfigError  # noqa: E402
from feta_release.job_rules import DataFacts, derive  # noqa: E402

KINDS = [
    ("digits 28x28 grey, 10 classes", 28, 1, 10),
    ("RGB 64x64, 10 classes", 64, 3, 10),
    ("X-ray 128x128 grey, 2 classes", 128, 1, 2),
    ("RGB 32x32, 100 classes", 32, 3, 100),
]
SIZES = [300, 4000, 20_000, 100_000]
EPSILONS = [1.0, 10.0]


def row(kind: str, side: int, ch: int, k: int, n: int, eps: float) -> str:
    f = DataFacts(size=n, height=side, width=side, channels=ch, n_classes=k, epsilon=eps)
    try:
        d = derive(f)
    except ConfigError as exc:
        why = str(exc).split(" - ")[0].removeprefix("derived job: ")
        return f"| {kind} | {n:,} | {eps:g} | refused: {why} | | | | | | |"
    c, fr, m, w = d.cfg.central, d.cfg.frequency, d.cfg.model, d.cfg.warmup
    q = int(side * c.downsample)
    freq = "off" if fr.sigma is None else f"{fr.features}" + (f" ({fr.patch}px patches)" if fr.patch else "")
    sgd = d.cfg.dpsgd_steps(n)
    sgd_text = f"{sgd} x B {d.cfg.for_size(n).dpsgd.batch}" if sgd else "off"
    est = d.estimate
    return (
        f"| {kind} | {n:,} | {eps:g} | {q}x{q}, batch {n:,}, clip {c.clip:g}, {c.cells} cell(s) | {freq} | "
        f"{m.channels} ch, {len(m.channel_mult)} levels | {w.spatial_iterations}+{w.polish_iterations} "
        f"steps, {d.cfg.auxgen.restarts}x{d.cfg.auxgen.epochs} aux epochs | {sgd_text} | "
        f"{est.training / 60:.0f} (budget {f.budget / 60:.0f}) + {est.seconds.get('sampling', 0) / 60:.0f} | "
        "not yet measured |"
    )


def main() -> None:
    print(
        "| data | N | ε | central query (one pass) | frequency features | model | warm-up | DP-SGD steps | "
        "est. min on 2 CPU cores: training (budget) + sampling N | quality |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kind, side, ch, k in KINDS:
        for n in SIZES:
            for eps in EPSILONS:
                print(row(kind, side, ch, k, n, eps))


if __name__ == "__main__":
    main()
