"""``feta-release preset``: list, show and export the job files shipped with the package."""

from __future__ import annotations

import re
from pathlib import Path

import click

from ..config import load_preset, preset_names, preset_text
from ..errors import ConfigError

MEASURED = "# Measured:"


def preset_header(text: str) -> list[str]:
    """The comment lines before a preset's first section, without their '# '."""
    lines = []
    for line in text.splitlines():
        if line.startswith("["):
            break
        if line.startswith("#"):
            lines.append(line)
    return lines


def summary(name: str) -> tuple[str, str]:
    """(one-line description, the measured figure its header states or ''): the header's first sentence."""
    head = preset_header(preset_text(name))
    measured = next((h.removeprefix(MEASURED).strip() for h in head if h.startswith(MEASURED)), "")
    prose = " ".join(h.lstrip("#").strip() for h in head if not h.startswith(MEASURED))
    first = re.split(r"(?<!e\.g)(?<!i\.e)\. |: ", prose)[0].strip()
    return (first[:117] + "...") if len(first) > 120 else first, measured


@click.group()
def preset() -> None:
    """The shipped job files: list them, show one, export one to edit (then `train JOB_FILE`)."""


@preset.command("list")
def list_presets() -> None:
    """One line per preset: its description and the figure its header states (if any).

    Without --preset, `train` derives a job from your data instead (the recommended way).

    \b
    Example:
      feta-release preset list
    """
    click.echo(
        "Presets are tuned to the embedded 28x28 digits (slant cells, clips and sizes included); for other "
        "data let `train --epsilon E` derive the job from it (docs/derived-job.md)."
    )
    for name in preset_names():
        desc, measured = summary(name)
        click.echo(f"{name:<18} {desc}")
        click.echo(f"{'':<18} measured: {measured or 'no figure in its header'}")


@preset.command("show")
@click.argument("name")
def show(name: str) -> None:
    """Print preset NAME's job file (its header comments say what it was tuned on).

    \b
    Example:
      feta-release preset show cpu-eps10-nodpsgd
    """
    click.echo(preset_text(name), nl=False)


@preset.command("export")
@click.argument("name")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Overwrite FILE.")
def export(name: str, file: Path, force: bool) -> None:
    """Write preset NAME to FILE, to edit and run with `feta-release train FILE`.

    \b
    Example:
      feta-release preset export cpu-eps1-nodpsgd my-job.toml
    """
    text = preset_text(name)
    load_preset(name)  # a shipped preset always validates; checked before anything is written
    if file.exists() and not force:
        raise ConfigError(f"{file}: exists; give --force to overwrite it, or another file name")
    try:
        file.write_text(text, "utf-8")
    except OSError as exc:
        raise ConfigError(f"{file}: cannot write: {exc.strerror}") from None
    click.echo(f"wrote preset {name} to {file}")
