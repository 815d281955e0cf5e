"""``feta-release report``: the self-contained HTML release report (no torch: runs on a verifier's
install)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..errors import ConfigError, ReleaseError
from .trust_options import release_trust_options, release_trust_roots


def _read_json(path: Path | None, what: str, kind_hint: str) -> dict[str, Any] | None:
    if path is None:
        return None
    import json

    try:
        doc = json.loads(path.read_text("utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"{path}: the {what} is not valid JSON ({exc}); give the file {kind_hint} wrote"
        ) from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: the {what} must be a JSON object; give the file {kind_hint} wrote")
    return doc


@click.command("report")
@click.argument("release_dir", type=click.Path(path_type=Path))
@click.option(
    "--out", "out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="HTML file to write."
)
@release_trust_options()
@click.option(
    "--evaluation",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="evaluation.json from `feta-release evaluate` (utility figures).",
)
@click.option(
    "--audit",
    "audit",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="audit.json from `feta-release audit` (claimed ε vs measured lower bound).",
)
@click.option(
    "--per-class", type=int, default=8, show_default=True, help="Sample images per class in the grid."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Noise seed of the sample grid.")
def report(
    release_dir: Path,
    out: Path,
    trusted: tuple[str, ...],
    coordinators: tuple[str, ...],
    evaluation: Path | None,
    audit: Path | None,
    per_class: int,
    seed: int,
) -> None:
    """Verify RELEASE_DIR and write one self-contained HTML report for a data-protection officer.

    \b
    Example:
      feta-release report release --out report.html --trusted st-mary=st-mary-admin.pub \\
          --coordinator coordinator.pub --audit audit.json
    """
    from ..release.report import write_report

    if not 1 <= per_class <= 64:
        raise ConfigError(f"--per-class must be between 1 and 64, got {per_class}")
    ev = _read_json(evaluation, "evaluation", "`feta-release evaluate`")
    au = _read_json(audit, "audit", "`feta-release audit`")
    if au is not None and not isinstance(au.get("audits"), list):
        raise ConfigError(f'{audit}: no "audits" list; give the audit.json that `feta-release audit` wrote')
    path, res = write_report(
        release_dir,
        out,
        release_trust_roots(trusted, coordinators),
        evaluation=ev,
        audit=au,
        per_class=per_class,
        seed=seed,
    )
    if not res.ok:  # the page is written (it shows why), but a script must not read this as success
        raise ReleaseError(
            f"report written to {path}, but release {release_dir} did not verify: {res.reason()}"
        )
    click.echo(f"report written to {path}: release VERIFIED")
