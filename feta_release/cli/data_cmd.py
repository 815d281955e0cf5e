"""``feta-release data``: inspect image datasets."""

from __future__ import annotations

import json

import click

from ..data import LoadOptions, load_dataset
from ..data.inspect import inspect_summary
from .data_options import data_load_options


@click.group()
def data() -> None:
    """Inspect image datasets (image folders, .npz files, the embedded MNIST subset)."""


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
        overview.add_row("patients (unit of privacy)",
                         f"{info['n_patients']:,} (at most {info['max_images_per_patient']} images each)")
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
