"""The ``feta-release`` command line.

Sub-commands are imported lazily (click's documented LazyGroup pattern): ``synthesize`` must run
where only onnxruntime, numpy and Pillow exist, and ``--help`` should not pay for importing torch.
"""

from __future__ import annotations

import importlib
import sys

import click

from ..allocator import keep_freed_pages
from ..errors import FetaError

# name -> "module:attribute"; each module owns one command or group.
COMMANDS: dict[str, str] = {
    "data": "feta_release.cli.data_cmd:data",
    "privacy": "feta_release.cli.privacy_cmd:privacy",
    "train": "feta_release.cli.train_cmd:train",
    "preset": "feta_release.cli.preset_cmd:preset",
    "evaluate": "feta_release.cli.evaluate_cmd:evaluate",
    "keys": "feta_release.cli.policy_cmd:keys",
    "policy": "feta_release.cli.policy_cmd:policy",
    "job": "feta_release.cli.policy_cmd:job",
    "node": "edge.cli:node",
    "site": "edge.site_cli:site",
    "coordinator": "coordinator.cli:coordinator",
    "demo": "coordinator.demo:demo",
    "export": "feta_release.cli.release_cmd:export",
    "verify": "feta_release.cli.release_cmd:verify",
    "synthesize": "feta_release.cli.release_cmd:synthesize",
    "verify-synthetic": "feta_release.cli.release_cmd:verify_synthetic",
    "report": "feta_release.cli.report_cmd:report",
    "audit": "feta_release.cli.audit_cmd:audit",
}

HELP = {
    "data": "Inspect and convert image datasets.",
    "privacy": "Plan and account privacy budgets.",
    "train": "Train a synthesizer on one site's data (whole FETA-Pro pipeline).",
    "preset": "List, show and export the shipped job files (presets).",
    "evaluate": "Measure utility and fidelity of synthetic images.",
    "keys": "Generate and show Ed25519 signing keys.",
    "policy": "Sign, verify and show site privacy policies.",
    "job": "Sign and verify coordinator job files.",
    "node": "Run and inspect a site node (Flower SuperNode).",
    "site": "Create a hospital site's onboarding kit (keys, node.toml, policy draft).",
    "coordinator": "Run the coordinator (Flower SuperLink + ServerApp).",
    "demo": "Run the whole federated release on the embedded data.",
    "export": "Build the signed ONNX generator release of a job directory (a train run).",
    "verify": "Verify a release directory offline.",
    "synthesize": "Generate a synthetic dataset from a release with onnxruntime only.",
    "verify-synthetic": "Check a synthetic folder against its signed certificate and its release.",
    "report": "Write one self-contained HTML release report for a data-protection officer.",
    "audit": "Empirical privacy audit: measured ε lower bounds beside the claimed ε.",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            if getattr(exc, "name", None) in ("torch", "flwr", "opacus") or isinstance(exc, AttributeError):
                raise click.ClickException(f"command {name!r} is unavailable: {exc}") from exc
            raise

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Short help comes from HELP so that listing commands imports none of them.
        with formatter.section("Commands"):
            formatter.write_dl([(n, HELP.get(n, "")) for n in self.list_commands(ctx)])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="feta-release")
def cli() -> None:
    """Release a differentially private synthetic image dataset without images leaving their site."""


def main(argv: list[str] | None = None) -> None:
    keep_freed_pages()  # before any tensor: every step reuses the last one's pages (feta_release.allocator)
    try:
        cli.main(args=argv, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except FetaError as exc:
        click.secho(f"error: {exc}", fg="red", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
