"""``feta-release export | verify | synthesize``.

``verify`` and ``synthesize`` must run where torch is not installed (a data-protection office, a downstream
user): this module imports nothing heavy at import time, and only ``export`` reaches torch, lazily.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ..errors import ConfigError, ReleaseError
from .progress_option import progress_option
from .trust_options import release_trust_options, release_trust_roots


def _print_verification(res, explain: bool = False, what: str = "release") -> None:  # type: ignore[no-untyped-def]
    """The verdict FIRST (one line), then one line per site, then what needs reading (warnings, notes); every
    check and each site's meaning only with ``explain``."""
    from ..release.summary import site_summaries, trust_assumption, verdict_line

    click.echo(verdict_line(res, what))
    sites = site_summaries(res)
    for s in sites:
        click.echo("  " + s.line())
    if sites:
        click.echo("trust: " + trust_assumption(sites))
    for c in res.checks:
        if c.status in ("fail", "warn") or (explain and c.status == "note"):
            click.echo(f"{c.status.upper()} {c.name}: {c.detail}")
    if not explain:
        click.echo("(--explain: every check and what each figure means; --json: machine-readable)")
        return
    click.echo("")
    for c in res.checks:
        if c.status == "pass":
            click.echo(f"PASS {c.name}: {c.detail}")
    if res.ok and res.manifest:
        from ..release.verify import describe_site

        for s in res.manifest["sites"]:
            click.echo("\n" + describe_site(s))


VERIFICATION_JSON_HELP = (
    "Print the result as JSON: verdict, check counts, per-site figures and caps, every check."
)


def _verdict_options(json_help: str = VERIFICATION_JSON_HELP) -> Callable[[Callable[..., Any]], Any]:
    """``--json`` and ``--explain``: how a command that verifies prints its verdict
    (:func:`_show_verification`)."""

    def deco(f: Callable[..., Any]) -> Any:
        f = click.option(
            "--explain",
            is_flag=True,
            help="After the verdict and the per-site lines, print every check and what each figure means.",
        )(f)
        return click.option("--json", "as_json", is_flag=True, help=json_help)(f)

    return deco


@click.command("export")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--coordinator-key",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="Private key that signs the manifest (default: RUN_DIR/keys/coordinator.key, the one `train` made).",
)
@click.option(
    "--solver",
    type=click.Choice(["euler", "heun"]),
    default=None,
    help="Override the job's [sampler] solver.",
)
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Override the job's [sampler] steps.")
def export(run_dir: Path, coordinator_key: str | None, solver: str | None, steps: int | None) -> None:
    """Build RUN_DIR/release, the signed ONNX generator release, from the job directory RUN_DIR (a `train` run
    or a coordinator's job: its signed job, the sites' attestations and policies, model.pt).

    \b
    Example:
      feta-release export runs/cpu-eps1 --steps 18 --solver heun
      feta-release export demo-out/job --coordinator-key coordinator/coordinator.key
    """
    from ..release.jobdir import build_release
    from ..signing import sha256_file

    key = Path(coordinator_key) if coordinator_key else run_dir / "keys" / "coordinator.key"
    if not key.is_file():
        raise ReleaseError(
            f"{key}: no coordinator key; give --coordinator-key KEY (the key that signed the job)"
        )
    if not (run_dir / "signed_job.json").is_file() or not (run_dir / "attestations.json").is_file():
        raise ReleaseError(
            f"{run_dir}: not a finished job directory (no signed_job.json / attestations.json); finish the "
            "run first (`feta-release train` with the same options resumes it)"
        )
    over = {k: v for k, v in (("solver", solver), ("steps", steps)) if v is not None}
    path = build_release(run_dir, key, sampler=over)
    click.echo(f"release written to {path} (generator sha256 {sha256_file(path / 'generator.onnx')[:16]}…)")


@click.command("verify")
@click.argument("release_dir", type=click.Path(path_type=Path))
@release_trust_options()
@_verdict_options()
@click.option(
    "--public",
    "public_path",
    default=None,
    help="The public pretraining set the job names ([public]): checked against its sha256.",
)
def verify(
    release_dir: Path,
    trusted: tuple[str, ...],
    coordinators: tuple[str, ...],
    as_json: bool,
    explain: bool,
    public_path: str | None,
) -> None:
    """Verify RELEASE_DIR offline: hashes, signatures by role, every site present, recomputed ε, policy caps.

    \b
    Example:
      feta-release verify release --trusted st-mary=st-mary-admin.pub --trusted st-luke=st-luke-admin.pub
    """
    from ..release.verify import verify_release

    res = verify_release(release_dir, release_trust_roots(trusted, coordinators), public=public_path)
    _report_verification(res, as_json, explain, f"release {release_dir}")


def _report_verification(res, as_json: bool, explain: bool, what: str, kind: str = "release") -> None:  # type: ignore[no-untyped-def]
    """Print a verification (verdict first, or JSON) and fail with its reason: `verify` and
    `verify-synthetic`."""
    _show_verification(res, as_json, explain, kind)
    if not res.ok:
        raise ReleaseError(f"{what} did not verify: {res.reason()}")


def _show_verification(res, as_json: bool, explain: bool, kind: str = "release") -> None:  # type: ignore[no-untyped-def]
    if as_json:
        import json

        from ..release.summary import summary_dict

        click.echo(json.dumps(summary_dict(res, kind), indent=2, ensure_ascii=False))
    else:
        _print_verification(res, explain, kind)


def _parse_counts(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(
            f"--per-class must be comma-separated integers, e.g. 100,100,100; got {text!r}"
        ) from None


@click.command("synthesize")
@click.option(
    "--release", "release_dir", required=True, type=click.Path(path_type=Path), help="Release directory."
)
@click.option("--num", type=int, default=None, help="Number of images (split evenly over classes).")
@click.option(
    "--per-class", default=None, help="Images per class, comma-separated, in the manifest's class order."
)
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="New output directory.")
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Noise seed of the generator (same seed, same images).",
)
@click.option(
    "--batch", type=int, default=64, show_default=True, help="Images per generator call (memory bound)."
)
@click.option(
    "--threads", type=int, default=None, help="onnxruntime intra-op threads (default: available cores)."
)
@release_trust_options()
@progress_option("a progress bar while generating")
@click.option(
    "--key",
    "key",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="Your private key (Ed25519 PEM): signs certificate.json so anyone can check the folder.",
)
@click.option(
    "--signer", "signer", default=None, help="Your name in the certificate (default: the key file's name)."
)
@click.option(
    "--from",
    "source",
    type=click.Choice(["noise", "release"]),
    default=None,
    help="Start each image from pure noise, or (SDEdit) from an augmented released central image of its "
    "class shipped in the release. Default: what the signed release's sampler says.",
)
@_verdict_options(
    "Print the result as JSON: the release's verdict, per-site figures and caps, and what was written."
)
def synthesize(
    release_dir: Path,
    num: int | None,
    per_class: str | None,
    out: Path,
    seed: int,
    batch: int,
    threads: int | None,
    trusted: tuple[str, ...],
    coordinators: tuple[str, ...],
    progress: bool,
    key: str | None,
    signer: str | None,
    source: str | None,
    as_json: bool,
    explain: bool,
) -> None:
    """Verify a release, then generate PNGs per class + certificate.json with onnxruntime only.

    \b
    Example:
      feta-release synthesize --release release --num 1000 --out synthetic \\
          --trusted st-mary=st-mary-admin.pub --key me.key --signer 'DPO St Mary'
    """
    from ..release.synthesize import synthesize as run
    from ..release.verify import verify_release
    from ..signing import load_private_key

    keys = release_trust_roots(trusted, coordinators)
    priv = load_private_key(key) if key else None
    res = verify_release(release_dir, keys)
    if not res.ok:
        _show_verification(res, as_json, explain)
        raise ReleaseError(f"release {release_dir} refused, nothing written: {res.reason()}")
    report = run(
        release_dir,
        out,
        keys,
        num=num,
        per_class=_parse_counts(per_class),
        seed=seed,
        batch=batch,
        threads=threads,
        progress=progress,
        verification=res,
        key=priv,
        signer_name=signer or (Path(key).stem if key else None),
        source=source,
    )
    _print_synthesized(res, report, priv is not None, as_json, explain)


def _print_synthesized(res, report, signed: bool, as_json: bool, explain: bool) -> None:  # type: ignore[no-untyped-def]
    """The release's verdict first, then what was written (or all of it as JSON)."""
    assert res.manifest is not None
    src = res.manifest["generator"]["sampler"].get("start_source", "central")
    what = (
        {
            "centra"
            "l": "the release's noisy central images (SDEdit; already-charged DP outputs, post-processing)",
            "aux": "the release's aux-generator images (SDEdit; post-processing of the frequency release)",
            "mix": "the release's aux-generator and noisy central images, alternating (SDEdit; "
            "post-processing of the releases)",
        }.get(src, src)
        if report.source == "release"
        else "pure noise"
    )
    rate = report.n_images / report.seconds if report.seconds > 0 else float("inf")
    written = {
        "images": report.n_images,
        "out_dir": str(report.out_dir),
        "certificate": str(report.certificate),
        "certificate_signed": signed,
        "started_from": what,
        "seconds": report.seconds,
    }
    if as_json:
        import json

        from ..release.summary import summary_dict

        click.echo(json.dumps({**summary_dict(res), "synthesized": written}, indent=2, ensure_ascii=False))
        return
    _print_verification(res, explain)
    click.echo(
        f"{report.n_images} images in {report.seconds:.1f} s ({rate:.1f} images/s, {report.threads} threads) "
        f"-> {report.out_dir}"
    )
    click.echo("started from: " + what)
    click.echo(
        f"certificate: {report.certificate}"
        + ("" if signed else " (UNSIGNED: give --key KEY so that verify-synthetic can check it)")
    )


@click.command("verify-synthetic")
@click.argument("synthetic_dir", type=click.Path(path_type=Path))
@click.option(
    "--certificate-key",
    "cert_keys",
    multiple=True,
    type=click.Path(dir_okay=False),
    metavar="KEY.pub",
    help="Public key of whoever ran synthesize (signs certificate.json); repeatable.",
)
@release_trust_options(
    "A site's administrator public key (signs its policy), to re-verify the release; repeat per site.",
    "Optional: pin the release's coordinator key.",
)
@click.option(
    "--release",
    "release_dir",
    default=None,
    type=click.Path(path_type=Path),
    help="The release the images came from (default: the path recorded in the certificate).",
)
@_verdict_options()
def verify_synthetic(
    synthetic_dir: Path,
    cert_keys: tuple[str, ...],
    trusted: tuple[str, ...],
    coordinators: tuple[str, ...],
    release_dir: Path | None,
    as_json: bool,
    explain: bool,
) -> None:
    """Check SYNTHETIC_DIR against its signed certificate: every image re-hashed, nothing added or missing,
    and the release it came from re-verified.

    \b
    Example:
      feta-release verify-synthetic synthetic --certificate-key dpo.pub --trusted st-mary=st-mary-admin.pub
    """
    from ..release.certificate import verify_synthetic as check
    from ..signing import load_public_key

    if not cert_keys:
        raise ConfigError(
            "give --certificate-key KEY.pub: the public key of whoever ran synthesize (it signs "
            "certificate.json); the release's keys go in --trusted SITE_ID=ADMIN_KEY.pub"
        )
    res = check(
        synthetic_dir,
        release_trust_roots(trusted, coordinators),
        [load_public_key(p) for p in cert_keys],
        release_dir,
    )
    _report_verification(res, as_json, explain, f"synthetic folder {synthetic_dir}", "synthetic folder")
