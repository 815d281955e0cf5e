"""``feta-release node``: run a site node (Flower SuperNode) and inspect its privacy ledger.

Import boundary (fast CLI start, enforced by tests/house/test_import_boundaries.py): ``.launch`` pulls in
Flower and is imported only by ``node start``; ``node status`` and ``--help`` run without Flower or torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from feta_release.accounting import per_unit
from feta_release.cli.data_options import data_load_options
from feta_release.cli.device_option import device_option
from feta_release.cli.trust_options import (
    TRUSTED_METAVAR,
    deprecated_alias,
    merged_option,
    trusted_for_policy,
)
from feta_release.data.loading import LoadOptions
from feta_release.errors import ConfigError
from feta_release.ledger import Ledger
from feta_release.signing import load_private_key, load_public_key

from .kit import read_node_toml
from .node_state import read_state
from .site import verify_policy_file


@click.group()
def node() -> None:
    """Run and inspect a site node (Flower SuperNode)."""


def _unit_line(s: dict) -> str:
    """What every ε below is per: the verified policy's unit, or (no policy) that the figures compose the
    events as if each protected one image, less than one patient can lose at a patient-level site (said
    loudly where the ledger holds patient-level DP-SGD)."""
    if s.get("unit") == "patient":
        return "unit: ε per PATIENT (all of one patient's images), as the site's policy caps it"
    if s.get("unit") == "image":
        return "unit: ε per image, as the site's policy caps it"
    return (
        "unit: NOT known (no policy given): the ε below compose the events as if each protected one image, "
        + (
            "LESS than one patient can lose at this patient-level site (it holds patient-level DP-SGD)"
            if s.get("patient_events")
            else "less than one patient can lose if the site is patient-level"
        )
        + "; give --policy and --trusted (or --config) for the figures its caps bound"
    )


@node.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="node.toml from `feta-release site init`: ledger, work dir, site key and policy from it.",
)
@click.option(
    "--ledger",
    "ledger_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The site's privacy ledger (SQLite).",
)
@click.option(
    "--policy",
    "policy_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Signed policy: also show ε left against its caps.",
)
@click.option(
    "--trusted",
    "trusted",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    metavar="ADMIN.pub",
    help="The site administrator's public key, which must have signed the policy (with --policy).",
)
@deprecated_alias(
    "--trusted-policy-key", "--trusted", type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@click.option(
    "--site-key",
    "site_key",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The site's key (public .pub or private .key): also check the ledger head's signature.",
)
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="The node's work directory (default: next to the ledger), where it publishes its state.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(
    config_path: Path | None,
    ledger_path: Path | None,
    policy_path: Path | None,
    trusted: Path | None,
    trusted_deprecated: Path | None,
    site_key: Path | None,
    work_dir: Path | None,
    as_json: bool,
) -> None:
    """Say what the node is doing (connecting / connected / refused, why / serving job X / stopped), then
    verify the ledger's hash chain and print it: per job, per mechanism, ε spent (and left).

    \b
    Example:
      feta-release node status --config st-mary/node.toml
      feta-release node status --ledger st-mary/ledger.sqlite --site-key st-mary/keys/site-signing.pub --json
    """
    trusted = merged_option(trusted, trusted_deprecated)
    if config_path is not None:
        cfg = read_node_toml(config_path)
        ledger_path = ledger_path or cfg["ledger"]
        work_dir = work_dir or cfg.get("work_dir")
        site_key = site_key or cfg["site_key"]
        if policy_path is None and trusted is None:
            policy_path, trusted = cfg["policy"], cfg["trusted_policy_key"]
    if ledger_path is None:
        raise click.UsageError("give --config node.toml or --ledger LEDGER")
    state = read_state(work_dir or Path(ledger_path).parent / "work")
    if not as_json:
        click.echo(_state_line(state))
    if not ledger_path.exists():
        raise ConfigError(f"{ledger_path}: no ledger here (a node creates it on its first release)")
    budget = None
    if policy_path is not None and Path(policy_path).exists():
        if trusted is None:
            raise click.UsageError(
                "--policy needs --trusted ADMIN.pub (the site administrator's key) to verify it"
            )
        budget = verify_policy_file(policy_path, trusted)
    pub = _public_key(site_key) if site_key is not None else None
    with Ledger(ledger_path, verify_key=pub, deep=True) as led:
        summary = led.summary(budget)
        summary["integrity"] = (
            "chain and signed head verified"
            if pub is not None
            else "chain verified; head signature NOT checked (give --site-key)"
        )
    summary["node"] = state
    if as_json:
        click.echo(json.dumps(summary, indent=2, sort_keys=True))
        return
    _print_summary(summary)


def _state_line(state: dict | None) -> str:
    if state is None:
        return "node: no state published here (the node was not started with this work directory)"
    line = f"node: {state['state']}: {state['detail']} (since {state['since']})"
    if not state["running"] and state["state"] != "stopped":
        line += "; its process is no longer running"
    return line


def _public_key(path: Path):  # noqa: ANN202 - Ed25519PublicKey
    """A public key from a public PEM or (its public half) a private one."""
    data = path.read_bytes()
    return load_public_key(path) if b"PUBLIC KEY" in data else load_private_key(path).public_key()


@node.command("migrate-ledger")
@click.option(
    "--ledger",
    "ledger_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The ledger to chain and sign (rewritten in place).",
)
@click.option(
    "--site-key",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The site's Ed25519 private key (signs the ledger head).",
)
def migrate_ledger(ledger_path: Path, site_key: Path) -> None:
    """Chain and sign a ledger written by an older feta-release (trusting its rows as they are now).

    \b
    Example:
      feta-release node migrate-ledger --ledger st-mary/ledger.sqlite --site-key st-mary/keys/site-signing.key
    """
    n = Ledger.migrate(ledger_path, load_private_key(site_key))
    click.echo(f"{ledger_path}: {n} row(s) chained; head signed by the site key; mode 0600")


def _print_summary(s: dict) -> None:
    con = Console()
    left = s["lifetime_epsilon_left"]
    con.print(
        f"[bold]ledger[/] {escape(str(s['ledger']))}  accountant={s['accountant']}  δ={s['delta']:g}  "
        f"policy version seen={s['policy_version']}"
    )
    con.print(f"integrity: {s['integrity']}")
    con.print(_unit_line(s))
    # without a policy the figures compose the events as if each protected one image (the unit line says
    # what that means at a patient-level site)
    per = per_unit(s.get("unit") or "image")
    con.print(
        f"lifetime ε {per} spent [bold]{s['lifetime_epsilon_spent']:.4f}[/]"
        + (f", left {left:.4f}" if left is not None else "")
    )
    t = Table("job", "mechanism", "events", f"ε {per} spent", f"ε {per} left (job)")
    for job_id, j in s["jobs"].items():
        for m, info in j["mechanisms"].items():
            ev = "; ".join(
                (f"σ={e['sigma']:.3g}" if "sigma" in e else f"secure sum μ={e['mu']:.3g}")
                + f" q={e['q']:.3g} steps={e['steps']}"
                + (" per patient" if e.get("unit") == "patient" else "")
                for e in info["events"]
            )
            t.add_row(job_id, m, ev, f"{info['epsilon_spent']:.4f}", "")
        jl = j["epsilon_left"]
        t.add_row(
            job_id,
            "[bold]total[/]",
            f"{j['requests']} request(s)",
            f"[bold]{j['epsilon_spent']:.4f}[/]",
            "" if jl is None else f"{jl:.4f}",
        )
    con.print(t)


@node.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="node.toml from `feta-release site init` holding every setting below; options given here override "
    "it.",
)
@click.option(
    "--data",
    "data_path",
    type=click.Path(exists=True, path_type=Path),
    help="The site's images (folder, labels .csv or .npz).",
)
@click.option(
    "--policy",
    "policy_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The site's signed policy.",
)
@click.option(
    "--trusted",
    "trusted",
    metavar=TRUSTED_METAVAR,
    help="The site administrator's public key, which must have signed the site's policy (ADMIN.pub or "
    "SITE_ID=ADMIN.pub).",
)
@deprecated_alias("--trusted-policy-key", "--trusted")
@click.option(
    "--ledger",
    "ledger_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The site's privacy ledger (SQLite; created on first use).",
)
@click.option(
    "--site-key",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The site's Ed25519 private key (signs its spend attestations).",
)
@click.option(
    "--data-secret",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The site's data secret (mode 0600; made by `feta-release policy data-commitment`).",
)
@click.option(
    "--superlink", default="127.0.0.1:9092", show_default=True, help="Coordinator SuperLink host:port."
)
@click.option(
    "--port",
    type=int,
    default=9101,
    hidden=True,
    help="Unused: the node's local Runtime API is a Unix socket only the site's account can reach.",
)
@click.option(
    "--root-certificates",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="CA certificate of the SuperLink (TLS).",
)
@click.option(
    "--auth-key",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="This node's authentication private key (OpenSSH EC), registered at the SuperLink.",
)
@click.option("--insecure", is_flag=True, help="No TLS. Loopback demos only.")
@click.option(
    "--force-insecure", is_flag=True, help="Allow --insecure to a non-loopback SuperLink (dangerous)."
)
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Node state (default: next to the ledger).",
)
@click.option(
    "--worker/--no-worker",
    default=True,
    show_default=True,
    help="Answer messages from a warm worker process that loads torch and the site once (restarted if it "
    "dies); --no-worker: a fresh process per message, as Flower runs it (slower).",
)
@click.option(
    "--new-ledger",
    is_flag=True,
    help="Start a NEW privacy ledger where this node ran on one that is lost (logged; the coordinator "
    "refuses it until its admin accepts it). Never needed on a first start.",
)
@click.option(
    "--round-checkpoint-every",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="DP-SGD steps between a round's checkpoints in the work directory (0: none). A round whose node "
    "was killed after its charge is finished when it is asked again, from the last checkpoint or from "
    "its start; it is never charged twice.",
)
@device_option("this site's DP-SGD and FedSGD rounds")
@data_load_options
@click.pass_context
def start(ctx: click.Context, config_path: Path | None, load: LoadOptions | None, **given: object) -> None:
    """Verify this site's signed policy and data, then run its Flower SuperNode (until Ctrl-C).

    \b
    Example:
      feta-release node start --config st-mary/node.toml
    """
    from .launch import NodeSettings, check_device, run_node

    names = {
        "data_path": "data",
        "policy_path": "policy",
        "trusted": "trusted_policy_key",
        "trusted_deprecated": "trusted_policy_key",
        "ledger_path": "ledger",
    }
    if given.get("trusted") is not None:
        given.pop("trusted_deprecated", None)
    settings: dict = {}
    if config_path is not None:
        settings = read_node_toml(config_path)
    for param, value in given.items():
        explicit = ctx.get_parameter_source(param) == click.core.ParameterSource.COMMANDLINE
        if explicit or (
            param not in settings and names.get(param, param) not in settings and value is not None
        ):
            settings[names.get(param, param)] = value
    if load is not None:  # the flags given replace those of node.toml's [data], the others stay
        settings["load"] = load.over(settings.get("load") or LoadOptions())
    flags = {"trusted_policy_key": "--trusted"}
    missing = [
        flags.get(k, f"--{k.replace('_', '-')}")
        for k in ("data", "policy", "trusted_policy_key", "ledger", "site_key", "data_secret")
        if not settings.get(k)
    ]
    if missing:
        raise ConfigError(
            f"node start needs {', '.join(missing)} (or --config node.toml from `feta-release site init`)"
        )
    # before any file is read, as the node's preflight does
    check_device(str(settings.get("device") or "cpu"))
    if isinstance(settings["trusted_policy_key"], str):  # from the command line: FILE or SITE_ID=FILE
        settings["trusted_policy_key"] = trusted_for_policy(
            settings["trusted_policy_key"], Path(settings["policy"])
        )[0]
    raise SystemExit(run_node(NodeSettings(**settings)))
