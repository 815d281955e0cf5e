"""``feta-release data``: inspect image datasets and generate procedural ones."""

from __future__ import annotations

import json

import click

from ..data import LoadOptions, load_dataset
from ..data.inspect import inspect_summary
from .data_options import data_load_options


@click.group()
def data() -> None:
    """Inspect image datasets (image folders, .npz files, the embedded MNIST subset); generate procedural
    ones."""


@data.command()
@click.argument("path", required=False, default="embedded")
@data_load_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def inspect(path: str, load: LoadOptions | None, as_json: bool) -> None:
    """Show size, classes, per-class counts, image shape, fingerprint and problems of PATH.

    PATH is a folder with one sub-folder per class (PNG/JPEG/BMP/TIFF/DICOM), a .csv with columns
    path,label[,patient_id], an .npz (arrays images, labels[, class_names]), or omitted / 'embedded'
    for the MNIST subset shipped with the package. Unusable data is an error (exit code 3) that lists
    EVERY problem found, one line per file, with the fix.

    \b
    Example:
      feta-release data inspect /data/chest --resize crop --image-size 64 --window bits:12
    """
    ds, report = load_dataset(path, **(load or LoadOptions()).kwargs())
    info = inspect_summary(ds, report)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    _print_tables(info)


@data.command()
@click.argument("kind", metavar="KIND")
@click.option("--n", "n", type=int, default=1000, show_default=True, help="Number of images.")
@click.option(
    "--size",
    type=int,
    default=None,
    help="Side length in pixels (medical 28..128, default 64; rgb 16..128, default 32; strokes 16..128, "
    "default 28).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="The same seed gives the same images.")
@click.option(
    "--population",
    default="A",
    show_default=True,
    help="medical only: A, or B (another hospital: other contrast, noise, gamma and class balance).",
)
@click.option(
    "--out",
    "out",
    required=True,
    help="An .npz file (uint8 pixels), or a new folder: images/<class>/*.png and labels.csv.",
)
def generate(kind: str, n: int, size: int | None, seed: int, population: str, out: str) -> None:
    """Generate a labelled image set offline: KIND is medical, rgb or strokes (see docs/data-kinds.md).

    medical: chest-radiograph-like grey images, classes normal, finding (a small local spot only), effusion,
    opacity. rgb: coloured textured shapes on cluttered backgrounds, 10 classes (shape x warm/cool colour).
    strokes: grey pen strokes (line, arc, loop, curve) on black: public pretraining data for digits (`train
    --public`). The result loads with `data inspect`, `train --data` and `evaluate --real` (an .npz keeps the
    class order; a folder or labels.csv lists its classes by name, sorted).

    \b
    Example:
      feta-release data generate medical --n 5000 --size 64 --seed 1 --out chest.npz
      feta-release data generate medical --n 5000 --population B --seed 2 --out public.npz
      feta-release data generate rgb --n 2000 --out shapes/
      feta-release data generate strokes --n 5000 --out strokes.npz
    """
    from ..data.procedural import checked_size, generate_dataset, write_dataset

    checked_size(kind, n, size, population)  # every argument checked before any work
    ds = generate_dataset(kind, n, size=size, seed=seed, population=population)
    path = write_dataset(ds, out)
    counts = ", ".join(f"{c} {k}" for c, k in zip(ds.class_names, ds.class_counts()))
    c, h, w = ds.image_shape
    click.echo(f"{path}: {ds.n} {kind} images, {c}x{h}x{w}, seed {seed} ({counts})")


def _print_tables(info: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    c, h, w = info["image_shape"]
    overview = Table(title=f"dataset {escape(info['source'])}", show_header=False)
    overview.add_column("field", style="bold")
    overview.add_column("value", overflow="fold")
    overview.add_row("kind", info["kind"])
    overview.add_row("images", f"{info['n']:,}")
    overview.add_row("classes", str(info["n_classes"]))
    overview.add_row("image shape (C, H, W)", f"({c}, {h}, {w}) - {'greyscale' if c == 1 else 'RGB'}")
    overview.add_row("pixel mean / std", f"{info['pixel_mean']:.4f} / {info['pixel_std']:.4f}")
    overview.add_row("fingerprint (sha256)", info["fingerprint"])
    overview.add_row("skipped files", str(info["n_skipped"]))
    overview.add_row("resized images", str(info["n_resized"]))
    if info["n_patients"] is not None:
        overview.add_row(
            "patients (unit of privacy)",
            f"{info['n_patients']:,} (at most {info['max_images_per_patient']} "
            f"image{'' if info['max_images_per_patient'] == 1 else 's'} each)",
        )
    for what, k in info["conversions"].items():
        overview.add_row("converted", escape(f"{k} x {what}"))
    console.print(overview)

    counts = Table(title="images per class")
    counts.add_column("#", justify="right")
    counts.add_column("class")
    counts.add_column("images", justify="right")
    counts.add_column("share", justify="right")
    for i, (name, k) in enumerate(info["class_counts"].items()):
        counts.add_row(str(i), escape(name), f"{k:,}", f"{k / info['n']:.1%}")
    console.print(counts)

    if info["warnings"]:
        console.print("[bold yellow]problems found:[/]")
        for wmsg in info["warnings"]:
            console.print(f"  [yellow]-[/] {escape(wmsg)}", highlight=False)
    else:
        console.print("[green]no problems found[/]")
