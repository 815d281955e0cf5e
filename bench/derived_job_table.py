"""The table of docs/derived-job.md: what the job derived from public facts does per data kind x size x
epsilon, and what it measured where ``bench/generality.py`` has scored it.

    PYTHONPATH=. python bench/derived_job_table.py > /tmp/table.md
    PYTHONPATH=. python bench/derived_job_table.py --results bench/results/generality.json > /tmp/table.md

Every job figure comes from ``feta_release.job_rules.derive`` (the rules and their cost model); nothing is
trained here. The quality column is filled from ``--results`` (one or more ``generality.json`` files): only
cells of the plain derived job (``--job derived``, no public set, no ``--dpsgd`` override) scored on the
HELD-OUT part (``--mode test``) count, since a validation score is a tuning figure, not a quality claim. A row
with no such cell says "not yet measured".
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from feta_release.errors import ConfigError  # noqa: E402
from feta_release.eval_protocol import mean_std  # noqa: E402
from feta_release.job_rules import DataFacts, derive  # noqa: E402

# (label, side, channels, classes, the generality kind scored at that shape or None)
KINDS: list[tuple[str, int, int, int, str | None]] = [
    ("digits 28x28 grey, 10 classes", 28, 1, 10, "digits"),
    ("medical-like 64x64 grey, 4 classes", 64, 1, 4, "medical"),
    ("RGB 32x32, 10 classes", 32, 3, 10, "rgb"),
    ("RGB 64x64, 10 classes", 64, 3, 10, None),
    ("X-ray 128x128 grey, 2 classes", 128, 1, 2, None),
    ("RGB 32x32, 100 classes", 32, 3, 100, None),
]
SIZES = [300, 500, 4000, 20_000, 100_000]
EPSILONS = [1.0, 10.0]
NOT_MEASURED = "not yet measured"


def load_results(paths: Iterable[Path]) -> dict[str, dict]:
    """The cells of the given ``generality.json`` files that score the plain derived job on held-out images,
    by cell name (a later file's cell replaces an earlier one's of the same name)."""
    cells: dict[str, dict] = {}
    for path in paths:
        try:
            data = json.loads(path.read_text())
            args, found = data["args"], data["cells"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            why = f"not a bench/generality.py result file ({exc}); give the run's generality.json"
            raise SystemExit(f"error: {path}: {why}") from None
        plain = args.get("public") in (None, "None") and args.get("dpsgd") in (None, "None")
        if args.get("job") == "derived" and args.get("mode") == "test" and plain:
            # the run's settings the time figure depends on travel with each cell
            setting = {"threads": args.get("threads", "?"), "n_synthetic": args.get("n_synthetic", "?")}
            cells.update({name: {**cell, "setting": setting} for name, cell in found.items()})
    return cells


def quality(cells: dict[str, dict], kind: str | None, n: int, eps: float) -> str:
    """The release's held-out accuracy over seeds, with the row's real ceiling and DP-SGD anchor beside it
    and the measured training time (against the estimate the row shows)."""
    if kind is None:
        return NOT_MEASURED

    def values(prefix: str, key: str = "acc") -> list[float]:
        return [
            float(c["result"][key])
            for name, c in cells.items()
            if name.startswith(prefix) and key in c.get("result", {})
        ]

    release = values(f"release-{kind}-n{n}-eps{eps:g}-seed")
    if not release:
        return NOT_MEASURED
    m, s = mean_std(release)
    text = f"**{m:.3f} ± {s:.3f}** ({len(release)} seed{'s' if len(release) > 1 else ''})"
    ceiling = values(f"ceiling-{kind}-n{n}-seed")
    anchor = values(f"dpsgd-{kind}-n{n}-eps{eps:g}-seed")
    if ceiling:
        text += f"; ceiling {mean_std(ceiling)[0]:.3f}"
    if anchor:
        text += f"; DP-SGD CNN {mean_std(anchor)[0]:.3f}"
    runs = [c for name, c in cells.items() if name.startswith(f"release-{kind}-n{n}-eps{eps:g}-seed")]
    train_s = [float(c["result"]["train_s"]) for c in runs if "train_s" in c["result"]]
    if train_s:  # `train` as a whole: the job and its synthetic set, at the run's thread count
        setting = runs[0]["setting"]
        text += (
            f"; train + {int(setting['n_synthetic']):,} samples {mean_std(train_s)[0] / 60:.0f} min "
            f"at {setting['threads']} thread(s)"
        )
    return text


def row(label: str, side: int, ch: int, k: int, n: int, eps: float, measured: str) -> str:
    f = DataFacts(size=n, height=side, width=side, channels=ch, n_classes=k, epsilon=eps)
    try:
        d = derive(f)
    except ConfigError as exc:
        why = str(exc).split(" - ")[0].removeprefix("derived job: ")
        return f"| {label} | {n:,} | {eps:g} | refused: {why} | | | | | | |"
    c, fr, m, w = d.cfg.central, d.cfg.frequency, d.cfg.model, d.cfg.warmup
    q = int(side * c.downsample)
    freq = "off" if fr.sigma is None else f"{fr.features}" + (f" ({fr.patch}px patches)" if fr.patch else "")
    sgd = d.cfg.dpsgd_steps(n)
    sgd_text = f"{sgd} x B {d.cfg.for_size(n).dpsgd.batch}" if sgd else "off"
    est = d.estimate
    return (
        f"| {label} | {n:,} | {eps:g} | {q}x{q}, batch {n:,}, clip {c.clip:g}, {c.cells} cell(s) | {freq} | "
        f"{m.channels} ch, {len(m.channel_mult)} levels | {w.spatial_iterations}+{w.polish_iterations} "
        f"steps, {d.cfg.auxgen.restarts}x{d.cfg.auxgen.epochs} aux epochs | {sgd_text} | "
        f"{est.training / 60:.0f} (budget {f.budget / 60:.0f}) + {est.seconds.get('sampling', 0) / 60:.0f} | "
        f"{measured} |"
    )


def table(cells: dict[str, dict]) -> str:
    lines = [
        "| data | N | ε | central query (one pass) | frequency features | model | warm-up | DP-SGD steps | "
        "est. min on 2 CPU cores: training (budget) + sampling N | quality (held-out accuracy) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, side, ch, k, kind in KINDS:
        for n in SIZES:
            for eps in EPSILONS:
                lines.append(row(label, side, ch, k, n, eps, quality(cells, kind, n, eps)))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--results",
        type=Path,
        action="append",
        default=[],
        help="a bench/generality.py result file (.json) whose held-out derived-job cells fill the quality "
        "column; repeat for several",
    )
    args = ap.parse_args(argv)
    sys.stdout.write(table(load_results(args.results)))


if __name__ == "__main__":
    main()
