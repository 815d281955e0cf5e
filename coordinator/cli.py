"""``feta-release coordinator``: run the SuperLink and submit signed jobs to it.

Import boundary (fast CLI start, enforced by tests/house/test_import_boundaries.py): ``.setup``, ``.runner``
and ``.finalize`` pull in Flower or torch and are imported only by the commands that need them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from feta_release.cli.derive_options import parse_duration, run_threads
from feta_release.cli.device_option import device_option
from feta_release.cli.progress_option import progress_option
from feta_release.federation.anchors import AnchorStore, anchors_path
from feta_release.job_rules import derivation_toml
from feta_release.signing import make_node_auth_key

from .derive import derive_federated
from .superlink import SuperLinkSettings, register_node, start_superlink
from .tls import make_certificates


def _home_option(help: str) -> Callable[[Callable[..., Any]], Any]:
    """``--home``: the coordinator's folder that ``coordinator start`` fills (logs, Flower's FLWR_HOME)."""
    return click.option(
        "--home",
        type=click.Path(file_okay=False, path_type=Path),
        default=Path(".feta-coordinator"),
        show_default=True,
        help=help,
    )


def _superlink_options(certificates_required: bool = False) -> Callable[[Callable[..., Any]], Any]:
    """``--superlink HOST:PORT`` and ``--root-certificates``: how a command reaches the SuperLink."""

    def deco(f: Callable[..., Any]) -> Any:
        f = click.option(
            "--root-certificates",
            required=certificates_required,
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            help="The CA certificate of the SuperLink (TLS).",
        )(f)
        return click.option(
            "--superlink", default="127.0.0.1:9092", show_default=True, help="The SuperLink's host:port."
        )(f)

    return deco


@click.group()
def coordinator() -> None:
    """Run the coordinator (Flower SuperLink + ServerApp)."""


@coordinator.command()
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface)."
)
@click.option(
    "--port", type=int, default=9092, show_default=True, help="One port for Fleet, Control and Runtime APIs."
)
@click.option(
    "--database",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("state.db"),
    show_default=True,
    help="SuperLink state: nodes stay registered across a restart.",
)
@click.option(
    "--ssl-certfile",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The SuperLink's TLS certificate (PEM), e.g. certs/server.pem.",
)
@click.option(
    "--ssl-keyfile",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The TLS certificate's private key, e.g. certs/server.key.",
)
@click.option(
    "--ssl-ca-certfile",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The CA certificate the sites trust (ca.crt; send it to every site).",
)
@click.option("--insecure", is_flag=True, help="No TLS (loopback demos only).")
@click.option(
    "--enable-supernode-auth/--no-supernode-auth",
    default=None,
    help="Accept only registered node keys (needs TLS). Default: on unless --host is loopback.",
)
@_home_option("Logs and Flower's FLWR_HOME for the SuperLink.")
def start(
    host: str,
    port: int,
    database: Path,
    ssl_certfile: Path | None,
    ssl_keyfile: Path | None,
    ssl_ca_certfile: Path | None,
    insecure: bool,
    enable_supernode_auth: bool | None,
    home: Path,
) -> None:
    """Run the Flower SuperLink in the foreground until Ctrl-C.

    \b
    Example:
      feta-release coordinator start --host 0.0.0.0 --ssl-certfile certs/server.pem \\
          --ssl-keyfile certs/server.key --ssl-ca-certfile certs/ca.crt --enable-supernode-auth
    """
    s = SuperLinkSettings(
        host=host,
        port=port,
        database=database,
        insecure=insecure,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
        ssl_ca_certfile=ssl_ca_certfile,
        enable_supernode_auth=enable_supernode_auth,
        home=home,
    )
    if insecure:
        click.secho(
            "WARNING: --insecure: no TLS, no node authentication. Loopback demos only.", fg="yellow", err=True
        )
    proc = start_superlink(s)
    click.echo(f"SuperLink listening on {s.address} (pid {proc.pid}); state {database}; log {proc.log_path}")
    try:
        while proc.alive():
            time.sleep(1.0)
        click.echo(f"SuperLink exited (code {proc.proc.returncode}):\n{proc.tail()}", err=True)
    except KeyboardInterrupt:
        pass
    finally:
        proc.stop()


def _job_and_sites(
    job_file: Path | None,
    sites: str | None,
    policies: tuple[Path, ...],
    epsilon: float | None,
    delta: float | None,
    time_budget: str | None,
    device: str,
    out_dir: Path,
) -> tuple[Path, str]:
    """JOB_FILE and --sites as given, or the job derived from the policies (written to OUT/derived-job.toml,
    which a resume derives again to the same job) and their site ids."""
    if job_file is not None:
        if policies or epsilon is not None or delta is not None or time_budget is not None:
            raise click.UsageError(
                "--policy/--epsilon/--delta/--time-budget derive a job: drop them, or JOB_FILE"
            )
        if not sites:
            raise click.UsageError("--sites: name the sites that take part")
        return job_file, sites
    text, ids = _derived_toml(policies, epsilon, delta, time_budget, device, run_threads())
    if sites and sorted(s.strip() for s in sites.split(",") if s.strip()) != sorted(ids):
        raise click.UsageError(
            f"--sites {sites} differs from the sites of the policies given ({', '.join(ids)})"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "derived-job.toml"
    path.write_text(text, "utf-8")
    click.echo(text, nl=False)
    return path, sites or ",".join(ids)


@coordinator.command("fab-hash")
@click.option(
    "--app",
    "app_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="App directory to hash (default: the shipped Flower app).",
)
def fab_hash(app_dir: Path | None) -> None:
    """Print the sha256 of the app bundle (what each site lists in its policy's app_bundles).

    \b
    Example:
      feta-release coordinator fab-hash   # send this sha256 to every site
    """
    from .setup import APP_DIR, app_bundle_hash

    click.echo(app_bundle_hash(app_dir or APP_DIR))


def _derive_options(f: Any) -> Any:
    for opt in reversed(
        [
            click.option(
                "--policy",
                "policies",
                multiple=True,
                type=click.Path(exists=True, dir_okay=False, path_type=Path),
                help="A site's policy (signed JSON or draft), once per site: its public "
                "dataset.size, classes and image_shape are what the job is derived from.",
            ),
            click.option(
                "--epsilon",
                type=click.FloatRange(min=0, min_open=True),
                default=None,
                help="The derived job's per-site budget (capped by each policy's per-job budget).",
            ),
            click.option(
                "--delta",
                type=click.FloatRange(0, 1, min_open=True, max_open=True),
                default=None,
                help="The derived job's delta (default: the presets' 1e-5, below 1 / (10 N) for larger N).",
            ),
            click.option(
                "--time-budget",
                default=None,
                metavar="DURATION",
                help="Training time the derived job is sized for (900, 15m, 1h; default as `train`).",
            ),
        ]
    ):
        f = opt(f)
    return f


def _derived_toml(
    policies: tuple[Path, ...],
    epsilon: float | None,
    delta: float | None,
    time_budget: str | None,
    device: str,
    threads: int,
) -> tuple[str, list[str]]:
    """(the TOML of the job derived from the sites' policies, their site ids), timed at the coordinator's
    ``threads`` (``coordinator.derive.facts_from_policies``)."""
    if not policies or epsilon is None:
        raise click.UsageError("a derived job needs --policy (once per site) and --epsilon; or give JOB_FILE")
    budget = parse_duration(time_budget) if time_budget else None
    d, ids = derive_federated(list(policies), epsilon, delta, budget, device, threads)
    return derivation_toml(d), ids


@coordinator.command("derive-job")
@_derive_options
@click.option(
    "--for-device",
    "for_device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="The device the job is sized for (its model width and time estimate).",
)
@click.option(
    "--for-threads",
    "for_threads",
    type=click.IntRange(min=1),
    default=None,
    help="The coordinator's torch CPU threads the job is timed at (default: torch's default here, what "
    "`coordinator run` uses); the sites' DP-SGD rounds are timed at the same count.",
)
@click.option(
    "--out",
    "out_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the job here (default: print it).",
)
def derive_job_cmd(
    policies: tuple[Path, ...],
    epsilon: float | None,
    delta: float | None,
    time_budget: str | None,
    for_device: str,
    for_threads: int | None,
    out_file: Path | None,
) -> None:
    """Derive a federated job from the sites' public declarations: their summed sizes, common image shape and
    classes, and the smallest per-job budget (feta_release.job_rules; docs/derived-job.md).

    \b
    Example:
      feta-release coordinator derive-job --policy st-mary.signed.json --policy st-luke.signed.json \\
          --epsilon 1 --out job.toml
    """
    text, ids = _derived_toml(policies, epsilon, delta, time_budget, for_device, run_threads(for_threads))
    if out_file is None:
        click.echo(text, nl=False)
        return
    out_file.write_text(text, "utf-8")
    click.echo(f"wrote the job derived for sites {', '.join(ids)} to {out_file}")


@coordinator.command()
@click.argument("job_file", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--sites", default=None, help="Comma-separated site ids that take part (default with --policy: theirs)."
)
@_derive_options
@click.option(
    "--key",
    "key_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The coordinator's Ed25519 private key (signs the job).",
)
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Output + checkpoint directory; running again with the same --out resumes the job.",
)
@_superlink_options()
@click.option("--insecure", is_flag=True, help="No TLS (loopback demos only).")
@click.option("--job-id", default=None, help="Default: JOB name + UTC time (kept in --out for resumes).")
@click.option(
    "--release/--no-release",
    default=True,
    show_default=True,
    help="Also write samples.png, the privacy report and OUT/release (ONNX + signed manifest).",
)
@click.option(
    "--public",
    "public_path",
    default=None,
    help="A PUBLIC image set the coordinator pretrains on before any site's release (read as "
    "`train --public` reads it, at the job's [job] resize/image_size/window); the signed job "
    "names it by sha256, count and shape; the sites never receive it.",
)
@click.option(
    "--public-description", default="", help="What the --public set is (up to 500 characters; in the job)."
)
@click.option(
    "--pretrained",
    "pretrained",
    default=None,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Start from a pretrained model file, named in the signed job by its sha256.",
)
@device_option("the coordinator's warm-up, FedAvg/FedSGD steps and sampling")
@progress_option("the job's streamed progress lines (rounds, sites)")
def run(
    job_file: Path | None,
    sites: str | None,
    policies: tuple[Path, ...],
    epsilon: float | None,
    delta: float | None,
    time_budget: str | None,
    key_path: Path,
    out_dir: Path,
    superlink: str,
    root_certificates: Path | None,
    insecure: bool,
    job_id: str | None,
    release: bool,
    public_path: str | None,
    public_description: str,
    pretrained: Path | None,
    device: str,
    progress: bool,
) -> None:
    """Sign JOB_FILE for the given sites and run it on the SuperLink, streaming progress. Without JOB_FILE the
    job is derived from the sites' policies (--policy per site, --epsilon) and kept in OUT/derived-job.toml.

    \b
    Example:
      feta-release coordinator run job.toml --sites st-mary,st-luke --key coordinator.key \\
          --out runs/job-1 --superlink coordinator.example.org:9092 --root-certificates certs/ca.crt
      feta-release coordinator run --policy st-mary.signed.json --policy st-luke.signed.json --epsilon 1 \\
          --key coordinator.key --out runs/job-2 --superlink coordinator.example.org:9092 --root-certificates certs/ca.crt
    """  # noqa: E501
    from .runner import PublicOption, coordinator_device, run_signed_job, sign_or_resume

    dev = coordinator_device(device)  # an absent GPU: refused before anything is signed, written or submitted
    job_file, sites = _job_and_sites(job_file, sites, policies, epsilon, delta, time_budget, dev, out_dir)
    public = PublicOption(public_path, public_description, pretrained)  # read here and by the ServerApp only
    signed_path = sign_or_resume(
        job_file, [s.strip() for s in sites.split(",") if s.strip()], key_path, out_dir, job_id, public
    )
    summary = run_signed_job(
        signed_path,
        key_path,
        out_dir,
        superlink,
        insecure=insecure,
        root_certificates=root_certificates,
        on_line=click.echo if progress else None,
        device=dev,
        public=public,
    )
    click.echo(
        json.dumps(
            {
                k: summary[k]
                for k in ("job_id", "site_epsilon", "site_unit", "rounds", "skipped", "timings")
                if k in summary  # (a summary written before site_unit)
            },
            indent=2,
        )
    )
    if release:
        from .finalize import build_release, job_log, privacy_report, sample_grid

        # the release's stages in the job's progress.jsonl, streamed as the job's lines were
        sink = job_log(
            out_dir, "release", (lambda ev: click.echo(f"release: {ev['message']}")) if progress else None
        )
        privacy_report(out_dir, sink)
        sample_grid(out_dir, device=dev, sink=sink)
        click.echo(
            f"release written to {build_release(out_dir, key_path, sink=sink)}; report "
            f"{out_dir / 'privacy_report.txt'}"
        )


@coordinator.command()
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder for ca.crt, server.pem/.key and nodes/ (private keys mode 0600).",
)
@click.option(
    "--host",
    "hosts",
    multiple=True,
    default=("127.0.0.1", "localhost"),
    show_default=True,
    help="SuperLink host names / IPs for the certificate's SANs (repeat).",
)
@click.option("--node", "nodes", multiple=True, help="Also make a node-auth key for this site (repeat).")
def certs(out_dir: Path, hosts: tuple[str, ...], nodes: tuple[str, ...]) -> None:
    """Make a test CA, a SuperLink certificate and node-auth keys (pilots/tests; use your PKI in production).

    \b
    Example:
      feta-release coordinator certs --out certs --host coordinator.example.org --node st-mary
    """
    paths = make_certificates(out_dir, hosts)
    for n in nodes:
        make_node_auth_key(out_dir / "nodes", n)
    click.echo("\n".join(f"{k}: {v}" for k, v in paths.items()))
    if nodes:
        click.echo(
            f"node keys in {out_dir / 'nodes'}; register each with "
            "`feta-release coordinator register NODE.pub --name SITE`"
        )


@coordinator.command()
@click.argument("public_key", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--name", required=True, help="Site id of the node.")
@_superlink_options(certificates_required=True)
@_home_option("The coordinator's home (as given to `coordinator start`).")
def register(public_key: Path, name: str, superlink: str, root_certificates: Path, home: Path) -> None:
    """Register a site's node-auth public key with the SuperLink (needs --enable-supernode-auth).

    \b
    Example:
      feta-release coordinator register st-mary-node-auth.pub --name st-mary \\
          --superlink 127.0.0.1:9092 --root-certificates certs/ca.crt
    """
    register_node(public_key, name, home / "cli_home", superlink, root_certificates=root_certificates)
    click.echo(f"registered {public_key} as {name}")


@coordinator.command("accept-ledger")
@click.option("--site", required=True, help="The site id whose new ledger to accept.")
@click.option(
    "--ledger-id", required=True, help="The new ledger's id (named in the refusal of the site's hello)."
)
@click.option(
    "--key",
    "key_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The coordinator's private key (its ledger-anchors.json is beside it).",
)
def accept_ledger(site: str, ledger_id: str, key_path: Path) -> None:
    """Accept a site's NEW ledger after it lost its old one for good (`node start --new-ledger` there).

    The old ledger's attested lifetime spend stays counted in every later plan of the site; the acceptance is
    logged in ledger-anchors.json. Never accept a new ledger for a site that could restore its latest one.

    \b
    Example:
      feta-release coordinator accept-ledger --site st-mary --ledger-id 3f2a... --key coordinator.key
    """
    click.echo(AnchorStore(anchors_path(key_path)).accept(site, ledger_id))
