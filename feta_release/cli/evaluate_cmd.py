"""``feta-release evaluate``: downstream accuracy and FD (classifier features) of synthetic images."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ..errors import DataError

RUN_FILE = "synthetic.npz"  # what the training pipeline writes into RUN_DIR


def resolve_synthetic(path: str) -> tuple[Path, bool]:
    """(dataset path, is_run_dir): a run directory means its ``synthetic.npz``."""
    p = Path(path)
    if p.is_dir() and (p / RUN_FILE).is_file():
        return p / RUN_FILE, True
    if not p.exists():
        raise DataError(f"{p}: no such file or directory (expected a run directory, an .npz or an image folder)")
    return p, False


@click.command()
@click.argument("synth")
@click.option("--real", "real_path", default=None,
              help="Real held-out data never used in training (folder or .npz). "
                   "Default: the held-out split of the embedded data (20%, seed 0).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Write evaluation.json and samples.png here (default: RUN_DIR/evaluation for a run directory).")
@click.option("--epochs", type=click.IntRange(min=1), default=None, help="Epochs of the classifier trained on SYNTH.")
@click.option("--feature-epochs", type=click.IntRange(min=1), default=None,
              help="Epochs of the feature network trained on the real held-out data.")
@click.option("--image-size", type=click.IntRange(min=8), default=None,
              help="Resize both SYNTH and --real images to this square size (default: sizes must already match).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the classifier and feature-network training.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def evaluate(synth: str, real_path: str | None, out_dir: str | None, epochs: int | None,
             feature_epochs: int | None, image_size: int | None, seed: int, as_json: bool) -> None:
    """Train a classifier on SYNTH, test it on REAL held-out images; FD in classifier features.

    SYNTH is a run directory (containing synthetic.npz), an .npz, or a folder of class sub-folders.
    The classifier and feature network are small CNNs trained on the CPU for a few epochs, so figures
    are comparable only between evaluations with the same real data, seed and epochs.

    \b
    Example:
      feta-release evaluate synthetic/ --real embedded:test --out eval/
    """
    from .. import evaluation as ev
    from ..data import load_dataset, load_embedded, train_heldout_split

    synth_file, is_run = resolve_synthetic(synth)
    # Resizing is never implicit: with --image-size both sets are resized to it, else sizes must match.
    size = {"image_size": image_size, "resize": "resize"} if image_size else {}
    notes: list[str] = []
    synthetic, _ = load_dataset(synth_file, **size)  # type: ignore[arg-type]
    if real_path is None:
        real = train_heldout_split(load_embedded(), 0.2, seed=0)[1]
        if (synthetic.class_names, synthetic.image_shape) != (real.class_names, real.image_shape):
            raise DataError(f"{synth_file}: its classes and image shape are not the embedded digits' (the default "
                            "--real); give --real HELDOUT: real images of the same classes that training never saw")
        if image_size is not None and real.image_shape[1:] != (image_size, image_size):
            raise DataError("--image-size cannot change the embedded data's 28x28; pass --real with your own data")
        notes.append("--real not given: using the held-out split of the embedded data (20%, seed 0; "
                     "valid only if the synthesizer was trained on the matching train split)")
        click.echo(f"note: {notes[-1]}", err=True)
    else:
        real, _ = load_dataset(real_path, **size)  # type: ignore[arg-type]
    ev.check_compatible(synthetic, real)

    out = Path(out_dir) if out_dir else (synth_file.parent / "evaluation" if is_run else None)
    kwargs = {}
    if epochs is not None:
        kwargs["classifier_epochs"] = epochs
    if feature_epochs is not None:
        kwargs["feature_epochs"] = feature_epochs
    report = ev.evaluate(synthetic, real, seed, grid_path=(out / "samples.png") if out else None, **kwargs)
    info = report.to_dict()
    info["notes"] = notes  # already printed on stderr before the (slow) evaluation
    if out is not None:
        info["report_path"] = str(_write_evaluation(out, report, notes))
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        _print_tables(info)


def _write_evaluation(out: Path, report: Any, notes: list[str]) -> Path:
    """``evaluation.json``: the shareable figures (``EvaluationReport.shareable``, for ``report --evaluation``);
    ``evaluation-private.json`` (owner-only): every held-out statistic and the salt that opens the commitment."""
    from ..evaluation import new_commitment_salt
    from ..files import atomic_write_bytes

    out.mkdir(parents=True, exist_ok=True)
    salt = new_commitment_salt()
    private = {**report.to_dict(), "notes": notes, "commitment_salt": salt.hex()}
    atomic_write_bytes(out / "evaluation-private.json", (json.dumps(private, indent=2) + "\n").encode(), private=True)
    path = out / "evaluation.json"
    atomic_write_bytes(path, (json.dumps({**report.shareable(salt), "notes": notes}, indent=2) + "\n").encode())
    return path


def _print_tables(info: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    t = Table(title="evaluation", show_header=False)
    t.add_column("figure", style="bold")
    t.add_column("value", overflow="fold")
    t.add_row("synthetic", f"{escape(info['synthetic_source'])} ({info['n_synthetic']:,} images)")
    t.add_row("real held-out", f"{escape(info['real_source'])} ({info['n_real']:,} images)")
    t.add_row("downstream accuracy", f"{info['accuracy']:.2%} (chance {info['chance_accuracy']:.0%}; "
                                      f"classifier trained {info['classifier_epochs']} epochs on synthetic)")
    t.add_row(info["fd_name"], f"{info['fd']:.2f} (n = {info['n_fd']:,} per side; feature net "
                               f"{info['feature_net_epochs']} epochs on real held-out)")
    t.add_row("seed", str(info["seed"]))
    if info.get("grid_path"):
        t.add_row("sample grid", escape(info["grid_path"]))
    if info.get("report_path"):
        t.add_row("report", escape(info["report_path"]))
    console.print(t)
    pc = Table(title="per class")
    pc.add_column("class")
    pc.add_column("synthetic images", justify="right")
    pc.add_column("real held-out", justify="right")
    pc.add_column("accuracy", justify="right")
    for name in info["class_names"]:
        pc.add_row(escape(name), str(info["synthetic_class_counts"][name]), str(info["real_class_counts"][name]),
                   f"{info['per_class_accuracy'][name]:.1%}")
    console.print(pc)
    for wmsg in info["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(wmsg)}", highlight=False)
