"""``feta-release site``: a hospital site's onboarding kit (keys, node.toml, policy draft)."""

from __future__ import annotations

from pathlib import Path

import click

from feta_release.cli.data_options import data_load_options
from feta_release.data.loading import LoadOptions
from feta_release.signing import fingerprint, load_public_key

from .kit import init_site


@click.group()
def site() -> None:
    """Create a site's onboarding kit."""


@site.command("init")
@click.argument("site_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--data", "data_path", required=True, type=click.Path(exists=True, path_type=Path),
              help="The site's images: a class-per-folder tree (PNG/JPEG/TIFF/DICOM) or a path,label[,patient_id] CSV.")
@click.option("--site-id", required=True, help="This site's id as the coordinator's jobs name it (letters, digits, . _ -).")
@click.option("--superlink", default="127.0.0.1:9092", show_default=True, help="The coordinator's SuperLink host:port.")
@click.option("--coordinator-key", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The coordinator's public key (.pub) to put into the policy draft.")
@click.option("--root-certificates", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The coordinator's CA certificate (TLS), recorded in node.toml.")
@click.option("--app-bundle", "app_bundles", multiple=True, metavar="SHA256",
              help="sha256 of the reviewed app bundle your coordinator runs (it prints it with `feta-release "
                   "coordinator fab-hash`), put into the draft's app_bundles (repeatable).")
@data_load_options
def site_init(site_dir: Path, data_path: Path, site_id: str, superlink: str, coordinator_key: Path | None,
              root_certificates: Path | None, app_bundles: tuple[str, ...], load: LoadOptions | None) -> None:
    """Write SITE_DIR: the site's own keys, node.toml (every node setting) and a policy draft from the data.

    Private keys are generated here and never leave the site; send the coordinator only the two
    public files printed at the end.

    \b
    Example:
      feta-release site init st-mary --data /data/chest.csv --site-id st-mary --resize crop --image-size 64 \\
          --superlink coordinator.example.org:9092 --coordinator-key coordinator.pub --root-certificates ca.crt \\
          --app-bundle 3978b7062480e3f3e8c9b23fcf1d030c3d98fa90355c50980ed8632abcc673a4
    """
    kit = init_site(site_dir, data_path, site_id, load=load, superlink=superlink, coordinator_pub=coordinator_key,
                    root_certificates=root_certificates.resolve() if root_certificates else None,
                    app_bundles=app_bundles)
    if kit.patient_cap:
        unit = f"{kit.n_patients} patients (unit of privacy: the patient, at most {kit.patient_cap} image(s) each)"
    elif kit.n_patients:
        unit = (f"{kit.n_patients} patients known but no --patient-cap: the unit of privacy is one image "
                "(re-run with --patient-cap 1 to protect patients)")
    else:
        unit = "no patient ids (unit of privacy: one image)"
    click.echo(f"site kit for {site_id} in {kit.root}: {kit.n_images} images, {unit}")
    click.echo("send to the coordinator (public keys only):\n  " + "\n  ".join(str(p) for p in kit.coordinator_files))
    click.echo(_dpo_key_words(kit.root / "keys" / "policy-admin.pub"))
    click.echo("next:\n"
               f"  1. review {kit.policy_draft} (coordinator key, app_bundles, budgets, validity window)\n"
               f"  2. feta-release policy sign {kit.policy_draft} --key {kit.root / 'keys/policy-admin.key'} "
               f"--out {kit.root / 'policy.signed.json'}\n"
               f"  3. feta-release node start --config {kit.node_toml}")


def _dpo_key_words(admin_pub: Path) -> str:
    """The key a data-protection officer trusts for this site (``verify --trusted SITE=KEY``): never taken from a
    release, so it is handed over out of band, its fingerprint read out over a second channel."""
    fp = fingerprint(load_public_key(admin_pub))
    return (f"send to your data-protection officer (the key that `feta-release verify` trusts for this site):\n"
            f"  {admin_pub}  fingerprint {fp}\n"
            f"  hand it over in person or through a channel you already trust, and read the fingerprint out over a "
            f"second one (they check it with `feta-release keys show policy-admin.pub`)")
