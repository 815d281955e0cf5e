"""``feta-release evaluate``: downstream accuracy beside a real-data ceiling, FD and
precision/recall/density/coverage of synthetic images against real held-out images."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ..errors import DataError
from .progress_option import progress_option

RUN_FILE = "synthetic.npz"  # what the training pipeline writes into RUN_DIR
REPORT_FILE = "evaluation.json"


def resolve_synthetic(path: str) -> tuple[Path, bool]:
    """(dataset path, is_run_dir): a run directory means its ``synthetic.npz``."""
    p = Path(path)
    if p.is_dir() and (p / RUN_FILE).is_file():
        return p / RUN_FILE, True
    if not p.exists():
        raise DataError(
            f"{p}: no such file or directory (expected a run directory, an .npz or an image folder)"
        )
    return p, False


def default_out_dir(synth_file: Path, is_run: bool) -> Path:
    """Where the report goes without --out: RUN_DIR/evaluation for a run directory, else a sibling
    ``NAME-evaluation`` folder beside the .npz or image folder (never inside an image folder, where it would
    be read as one more class next time)."""
    if is_run:
        return synth_file.parent / "evaluation"
    return synth_file.parent / f"{synth_file.stem if synth_file.is_file() else synth_file.name}-evaluation"


@click.command()
@click.argument("synth")
@click.option(
    "--real",
    "real_path",
    default=None,
    help="Real held-out images never used in training (folder or .npz). Default: the held-out split of "
    "the embedded data (20%, seed 0).",
)
@click.option(
    "--real-train",
    "real_train_path",
    default=None,
    help="Real training images (disjoint from --real) for the real-data ceiling: the same classifier "
    "trained on them, scored on --real. Default: the embedded training split when --real is not "
    "given; otherwise the ceiling is cross-fitted on two halves of --real.",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Folder for evaluation.json and samples.png. Default: RUN_DIR/evaluation for a run directory, "
    "else NAME-evaluation beside the .npz or image folder.",
)
@click.option(
    "--epochs",
    type=click.IntRange(min=1),
    default=None,
    help="Epoch cap of the classifiers (on SYNTH and for the ceiling); they stop earlier once their "
    "validation loss stops falling. Default: automatic (about 2,500 steps, 20 to 150 epochs).",
)
@click.option(
    "--feature-epochs",
    type=click.IntRange(min=1),
    default=None,
    help="Epoch cap of the feature network trained on the real held-out images (early stopping below "
    "it). Default: automatic.",
)
@click.option(
    "--image-size",
    type=click.IntRange(min=8),
    default=None,
    help="Resize SYNTH, --real and --real-train to this square size (default: sizes must already match).",
)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Seed of the validation splits, the augmentation and the networks' training.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@progress_option("a progress bar per network trained (epochs, validation accuracy)")
def evaluate(
    synth: str,
    real_path: str | None,
    real_train_path: str | None,
    out_dir: str | None,
    epochs: int | None,
    feature_epochs: int | None,
    image_size: int | None,
    seed: int,
    as_json: bool,
    progress: bool,
) -> None:
    """Score synthetic images against REAL held-out images, beside a real-data ceiling.

    SYNTH is a run directory (containing synthetic.npz), an .npz, or a folder of class sub-folders.

    \b
    - accuracy: a small ResNet (global max + mean pooling, so small local findings
      count) trained on SYNTH, early-stopped on 10 % of SYNTH, tested on --real;
    - ceiling: the same classifier trained on real images (--real-train, or
      cross-fitted halves of --real), tested on real images it never saw;
    - FD (classifier features, not FID), precision/recall and density/coverage
      (k = 5) in the features of the same network trained on --real.
    Warnings name figures resting on too few images or unconverged networks.
    evaluation.json is always written (see --out).

    \b
    Example:
      feta-release evaluate run/ --real heldout/ --real-train train/ --out eval/
    """
    from .. import evaluation as ev
    from ..training.progress import Reporter

    synth_file, is_run = resolve_synthetic(synth)
    synthetic, real, real_train, notes = _load(synth_file, real_path, real_train_path, image_size)
    out = Path(out_dir) if out_dir else default_out_dir(synth_file, is_run)
    report = ev.evaluate(
        synthetic,
        real,
        seed,
        real_train=real_train,
        classifier_epochs=epochs,
        feature_epochs=feature_epochs,
        grid_path=out / "samples.png",
        reporter=Reporter(enabled=progress),
    )
    info = report.to_dict()
    info["notes"] = notes  # already printed on stderr before the (slow) evaluation
    try:
        info["report_path"] = str(_write_evaluation(out, report, notes))
    except OSError as exc:
        raise DataError(
            f"{out}: cannot write {REPORT_FILE} ({exc.strerror}); pass --out with a writable folder"
        ) from exc
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        _print_tables(info)


def _write_evaluation(out: Path, report: Any, notes: list[str]) -> Path:
    """``evaluation.json``: the shareable figures (``EvaluationReport.shareable``, for ``report
    --evaluation``); ``evaluation-private.json`` (owner-only): every held-out statistic and the salt that
    opens the commitment."""
    from ..evaluation import new_commitment_salt
    from ..files import atomic_write_bytes

    out.mkdir(parents=True, exist_ok=True)
    salt = new_commitment_salt()
    private = {**report.to_dict(), "notes": notes, "commitment_salt": salt.hex()}
    atomic_write_bytes(
        out / "evaluation-private.json", (json.dumps(private, indent=2) + "\n").encode(), private=True
    )
    path = out / "evaluation.json"
    atomic_write_bytes(
        path, (json.dumps({**report.shareable(salt), "notes": notes}, indent=2) + "\n").encode()
    )
    return path


def _load(
    synth_file: Path, real_path: str | None, real_train_path: str | None, image_size: int | None
) -> tuple:
    """(synthetic, real held-out, real training or None, notes) as ImageDatasets checked against each
    other."""
    from .. import evaluation as ev
    from ..data import load_dataset, load_embedded, train_heldout_split

    # Resizing is never implicit: with --image-size every set is resized to it, else sizes must match.
    size = {"image_size": image_size, "resize": "resize"} if image_size else {}
    notes: list[str] = []
    real_train = None
    if real_path is None:
        real_train, real = train_heldout_split(load_embedded(), 0.2, seed=0)
        head = load_dataset(synth_file, **size)[0]  # type: ignore[arg-type]
        if (head.class_names, head.image_shape) != (real.class_names, real.image_shape):
            raise DataError(
                f"{synth_file}: its classes and image shape are not the embedded digits' (the default "
                "--real); give --real HELDOUT: real images of the same classes that training never saw"
            )
        if image_size is not None and real.image_shape[1:] != (image_size, image_size):
            raise DataError(
                "--image-size cannot change the embedded data's 28x28; pass --real with your own data"
            )
        notes.append(
            "--real not given: using the held-out split of the embedded data (20%, seed 0; valid only if "
            "the synthesizer was trained on the matching train split, which the ceiling is trained on)"
        )
        click.echo(f"note: {notes[-1]}", err=True)
    else:
        real, _ = load_dataset(real_path, **size)  # type: ignore[arg-type]
    if real_train_path is not None:
        real_train, _ = load_dataset(real_train_path, **size)  # type: ignore[arg-type]
    synthetic, _ = load_dataset(synth_file, **size)  # type: ignore[arg-type]
    ev.check_compatible(synthetic, real)
    if real_train is not None:
        ev.check_compatible(real_train, real)
        if {*map(bytes, real_train.images)} & {*map(bytes, real.images)}:
            raise DataError(
                f"{real_train.source}: --real-train shares images with --real {real.source}; the "
                "ceiling must be scored on images its classifier never saw"
            )
    return synthetic, real, real_train, notes


def _pct(v: float | None) -> str:
    return "–" if v is None or v != v else f"{v:.1%}"


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
    t.add_row(
        "downstream accuracy",
        f"{_pct(info['accuracy'])} (chance {info['chance_accuracy']:.0%}; classifier "
        f"trained on synthetic, {info['classifier_epochs']} epochs)",
    )
    t.add_row(
        "real-data ceiling",
        f"{_pct(info['ceiling_accuracy'])} ({escape(info['ceiling_protocol'] or 'none')})",
    )
    fd_n = (
        f"n = {info['n_fd']:,} per side; features: {info['feature_dim']}-d, network trained on real held-out"
    )
    t.add_row(info["fd_name"], f"{info['fd']:.2f} ({fd_n})")
    t.add_row(
        "precision / recall",
        f"{info['precision']:.3f} / {info['recall']:.3f} (fidelity / diversity, k = {info['prdc_k']})",
    )
    t.add_row("density / coverage", f"{info['density']:.3f} / {info['coverage']:.3f}")
    t.add_row("seed", str(info["seed"]))
    if info.get("grid_path"):
        t.add_row("sample grid", escape(info["grid_path"]))
    t.add_row("report", escape(info["report_path"]))
    console.print(t)
    pc = Table(title="per class (accuracy on real held-out images)")
    for col in ("class", "synthetic images", "real held-out", "accuracy", "ceiling"):
        pc.add_column(col, justify="left" if col == "class" else "right")
    for name in info["class_names"]:
        pc.add_row(
            escape(name),
            str(info["synthetic_class_counts"][name]),
            str(info["real_class_counts"][name]),
            _pct(info["per_class_accuracy"][name]),
            _pct(info["ceiling_per_class_accuracy"].get(name)),
        )
    console.print(pc)
    for wmsg in info["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(wmsg)}", highlight=False)
