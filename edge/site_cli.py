"""``feta-release site``: a hospital site's onboarding kit (keys, node.toml, policy draft)."""

from __future__ import annotations

from pathlib import Path

import click

from feta_release.cli.data_options import data_load_options
from feta_release.cli.trust_options import site_file
from feta_release.data.loading import LoadOptions
from feta_release.errors import ConfigError
from feta_release.signing import fingerprint, load_public_key

from .kit import AdminKey, init_site


@click.group()
def site() -> None:
    """Create a site's onboarding kit."""


@site.command("init")
@click.argument("site_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--data",
    "data_path",
    required=True,
    type=click.Path(exists=True, path_type=Path),
    help="The site's images: a class-per-folder tree (PNG/JPEG/TIFF/DICOM) or a path,label[,patient_id] CSV.",
)
@click.option(
    "--site-id",
    required=True,
    help="This site's id as the coordinator's jobs name it (letters, digits, . _ -).",
)
@click.option(
    "--superlink", default="127.0.0.1:9092", show_default=True, help="The coordinator's SuperLink host:port."
)
@click.option(
    "--coordinator-key",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The coordinator's public key (.pub) to put into the policy draft.",
)
@click.option(
    "--root-certificates",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The coordinator's CA certificate (TLS), recorded in node.toml.",
)
@click.option(
    "--app-bundle",
    "app_bundles",
    multiple=True,
    metavar="SHA256",
    help="sha256 of the reviewed app bundle your coordinator runs (it prints it with `feta-release "
    "coordinator fab-hash`), put into the draft's app_bundles (repeatable).",
)
@click.option(
    "--peer",
    "peers",
    multiple=True,
    metavar="SITE_ID=FILE",
    help="Another site of the federation and its keys/site-signing.pub (its admin sends it), pinned in the "
    "draft's [secure_aggregation] peers so that its noise share counts (repeatable).",
)
@click.option(
    "--admin-key-elsewhere",
    is_flag=True,
    help="Write no policy-admin private key here: it is made and kept on another (offline) machine; the "
    "draft says how to sign there and what to bring back.",
)
@click.option(
    "--admin-passphrase-prompt",
    is_flag=True,
    help="Encrypt the policy-admin key made here with a passphrase asked on the terminal.",
)
@click.option(
    "--admin-passphrase-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Encrypt the policy-admin key made here with the passphrase in this file (first line).",
)
@data_load_options
def site_init(
    site_dir: Path,
    data_path: Path,
    site_id: str,
    superlink: str,
    coordinator_key: Path | None,
    root_certificates: Path | None,
    app_bundles: tuple[str, ...],
    peers: tuple[str, ...],
    admin_key_elsewhere: bool,
    admin_passphrase_prompt: bool,
    admin_passphrase_file: Path | None,
    load: LoadOptions | None,
) -> None:
    """Write SITE_DIR: the site's own keys, node.toml (every node setting) and a policy draft from the data.

    Private keys are generated here and never leave the site; send the coordinator only the two
    public files printed at the end.

    \b
    Example:
      feta-release site init st-mary --data /data/chest.csv --site-id st-mary --resize crop --image-size 64 \\
          --superlink coordinator.example.org:9092 --coordinator-key coordinator.pub --root-certificates ca.crt \\
          --app-bundle 3978b7062480e3f3e8c9b23fcf1d030c3d98fa90355c50980ed8632abcc673a4
    """  # noqa: E501
    admin = _admin_key(admin_key_elsewhere, admin_passphrase_prompt, admin_passphrase_file)
    kit = init_site(
        site_dir,
        data_path,
        site_id,
        load=load,
        superlink=superlink,
        coordinator_pub=coordinator_key,
        root_certificates=root_certificates.resolve() if root_certificates else None,
        app_bundles=app_bundles,
        peers=dict(site_file(p, "--peer") for p in peers),
        admin_key=admin,
    )
    if kit.patient_cap:
        unit = (
            f"{kit.n_patients} patients (unit of privacy: the patient, at most {kit.patient_cap} image(s) "
            "each)"
        )
    elif kit.n_patients:
        unit = (
            f"{kit.n_patients} patients known but no --patient-cap: the unit of privacy is one image "
            f"(to protect patients, run site init again into a NEW folder with --patient-cap 1; {kit.root} "
            "already holds this kit)"
        )
    else:
        unit = "no patient ids (unit of privacy: one image)"
    click.echo(f"site kit for {site_id} in {kit.root}: {kit.n_images} images, {unit}")
    click.echo(
        "send to the coordinator (public keys only):\n  " + "\n  ".join(str(p) for p in kit.coordinator_files)
    )
    admin_pub = kit.root / "keys" / "policy-admin.pub"
    if admin_pub.exists():  # with --admin-key-elsewhere it is made off the node and brought back later
        click.echo(_dpo_key_words(admin_pub))
    click.echo(
        f"next:\n  1. review {kit.policy_draft} (coordinator key, app_bundles, budgets, validity window, "
        "[secure_aggregation] peers)"
    )
    signed = kit.root / "policy.signed.json"
    if kit.admin_key is None:
        click.echo(
            f"  2. on the offline machine that keeps the policy-admin key (made there once with "
            f"`feta-release keys generate --out admin-keys --name policy-admin --passphrase-prompt`):\n"
            f"       feta-release policy sign policy.toml --key admin-keys/policy-admin.key "
            f"--passphrase-prompt --out policy.signed.json\n"
            f"     bring back only policy.signed.json (to {signed}) and policy-admin.pub (to "
            f"{kit.root / 'keys/policy-admin.pub'})"
        )
    else:
        pp = " --passphrase-prompt" if admin.passphrase else ""
        click.echo(
            f"  2. feta-release policy sign {kit.policy_draft} --key {kit.admin_key}{pp} --out {signed}"
        )
    click.echo(f"  3. feta-release node start --config {kit.node_toml}")


def _admin_key(elsewhere: bool, prompt: bool, file: Path | None) -> AdminKey:
    """The policy-admin key's keeping, from the command line (a passphrase only for a key made here)."""
    if elsewhere and (prompt or file):
        raise click.UsageError("--admin-key-elsewhere writes no admin key here: drop --admin-passphrase-*")
    if prompt and file:
        raise click.UsageError("give --admin-passphrase-file or --admin-passphrase-prompt, not both")
    pp = None
    if file is not None:
        lines = file.read_bytes().splitlines()
        if not lines or not lines[0]:
            raise ConfigError(f"{file}: passphrase file is empty; put the passphrase on its first line")
        pp = lines[0]
    elif prompt:
        pp = click.prompt(
            "passphrase for the policy-admin key", hide_input=True, confirmation_prompt=True
        ).encode("utf-8")
    return AdminKey(elsewhere=elsewhere, passphrase=pp)


def _dpo_key_words(admin_pub: Path) -> str:
    """The key a data-protection officer trusts for this site (``verify --trusted SITE=KEY``): never taken
    from a release, so it is handed over out of band, its fingerprint read out over a second channel."""
    fp = fingerprint(load_public_key(admin_pub))
    return (
        f"send to your data-protection officer (the key that `feta-release verify` trusts for this site):\n"
        f"  {admin_pub}  fingerprint {fp}\n"
        f"  hand it over in person or through a channel you already trust, and read the fingerprint out over "
        f"a second one (they check it with `feta-release keys show policy-admin.pub`)"
    )
