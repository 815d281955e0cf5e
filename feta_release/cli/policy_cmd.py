"""``feta-release keys|policy|job``: Ed25519 keys, signed site policies, signed coordinator jobs."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import click

from ..errors import PolicyError
from .trust_options import TRUSTED_METAVAR, deprecated_alias, merged_option, trusted_for_policy

if TYPE_CHECKING:
    from ..policy.partial import PartialCheck


# -- passphrases -----------------------------------------------------------------------------------


def _passphrase_options(f):  # type: ignore[no-untyped-def]
    f = click.option("--passphrase-prompt", is_flag=True, help="Ask for the key passphrase on the terminal.")(
        f
    )
    f = click.option(
        "--passphrase-file",
        type=click.Path(dir_okay=False, path_type=Path),
        help="File holding the key passphrase (first line; trailing newline ignored).",
    )(f)
    return f


def _passphrase(file: Path | None, prompt: bool, *, confirm: bool = False) -> bytes | None:
    if file and prompt:
        raise click.UsageError("give --passphrase-file or --passphrase-prompt, not both")
    if file:
        try:
            text = file.read_bytes().splitlines()
        except OSError as exc:
            raise PolicyError(f"{file}: cannot read passphrase file: {exc.strerror}") from None
        if not text or not text[0]:
            raise PolicyError(f"{file}: passphrase file is empty")
        return text[0]
    if prompt:
        return click.prompt("passphrase", hide_input=True, confirmation_prompt=confirm).encode("utf-8")
    return None


def _load_signing_key(path: Path, pp_file: Path | None, pp_prompt: bool):  # type: ignore[no-untyped-def]
    from .. import signing

    mode = path.stat().st_mode if path.exists() else 0
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        click.secho(
            f"warning: {path} is readable by other users (mode {stat.S_IMODE(mode):o}); "
            f"run: chmod 600 {path}",
            fg="yellow",
            err=True,
        )
    return signing.load_private_key(path, _passphrase(pp_file, pp_prompt))


# -- sign commands (policy sign, job sign) ----------------------------------------------------------


def _signing_key_option(help: str) -> Callable[[Callable[..., Any]], Any]:
    """``--key``: the private key a sign command signs with (read by :func:`_load_signing_key`)."""
    return click.option(
        "--key", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path), help=help
    )


def _signed_out_option(what: str, source: str) -> Callable[[Callable[..., Any]], Any]:
    """``--out``: the file a sign command writes, by default :func:`_signed_target`'s."""
    return click.option(
        "--out",
        type=click.Path(dir_okay=False, path_type=Path),
        help=f"Signed {what} file (default: {source} with suffix .signed.json).",
    )


def _signed_target(out: Path | None, source: Path) -> Path:
    """Where a sign command writes: ``--out``, else the source file with suffix .signed.json."""
    return out or source.with_suffix(".signed.json")


# -- keys ------------------------------------------------------------------------------------------


@click.group()
def keys() -> None:
    """Generate and show Ed25519 signing keys."""


@keys.command("generate")
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory for NAME.key (private, mode 0600) and NAME.pub.",
)
@click.option("--name", default="signing", show_default=True, help="Base name of the key files.")
@_passphrase_options
def keys_generate(out_dir: Path, name: str, passphrase_file: Path | None, passphrase_prompt: bool) -> None:
    """Generate an Ed25519 key pair and print its fingerprint.

    \b
    Example:
      feta-release keys generate --out keys --name coordinator
    """
    from .. import signing

    pp = _passphrase(passphrase_file, passphrase_prompt, confirm=True)
    priv, pub = signing.generate_keypair(out_dir, name=name, passphrase=pp)
    fp = signing.fingerprint(signing.load_public_key(pub))
    click.echo(fp)
    click.echo(
        f"private key: {priv} (mode {stat.S_IMODE(os.stat(priv).st_mode):o}"
        f"{', passphrase-protected' if pp else ''})",
        err=True,
    )
    click.echo(f"public key:  {pub}", err=True)


@keys.command("show")
@click.argument("key", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--pem", is_flag=True, help="Also print the public key PEM (to paste into a policy's coordinators)."
)
@click.option(
    "--full",
    is_flag=True,
    help="Print the full 64-hex sha256 of the key (what a policy's coordinators "
    "may name instead of the PEM).",
)
@_passphrase_options
def keys_show(
    key: Path, pem: bool, full: bool, passphrase_file: Path | None, passphrase_prompt: bool
) -> None:
    """Print the fingerprint of a public (.pub) or private (.key) key file.

    \b
    Example:
      feta-release keys show keys/coordinator.pub --pem
    """
    from .. import signing

    if b"PRIVATE KEY" in key.read_bytes()[:64]:
        k = _load_signing_key(key, passphrase_file, passphrase_prompt).public_key()
    else:
        k = signing.load_public_key(key)
    click.echo(signing.full_fingerprint(k) if full else signing.fingerprint(k))
    if pem:
        click.echo(signing.public_key_pem(k), nl=False)


# -- policy ----------------------------------------------------------------------------------------


@click.group()
def policy() -> None:
    """Sign, verify and show site privacy policies."""


@policy.command("sign")
@click.argument("policy_file", metavar="POLICY", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_signing_key_option("The site's private policy key.")
@_signed_out_option("policy", "POLICY")
@click.option(
    "--accept-risk",
    "accept_risk",
    multiple=True,
    type=click.Choice(["job-epsilon", "lifetime-epsilon", "delta", "expired"]),
    help="Sign although the review refuses this value (per-job ε above 10, lifetime ε above 20, δ not below "
    "1/N, an expired window); it is then printed as a "
    "warning (repeatable).",
)
@_passphrase_options
def policy_sign(
    policy_file: Path,
    key: Path,
    out: Path | None,
    accept_risk: tuple[str, ...],
    passphrase_file: Path | None,
    passphrase_prompt: bool,
) -> None:
    """Validate POLICY (TOML or JSON) and write it signed: {"policy": ..., "signature": ...}.

    \b
    Example:
      feta-release policy sign policy.toml --key keys/policy-admin.key --out policy.signed.json
    """
    from edge.kit import review_or_refuse

    from .. import signing
    from ..policy import read_policy_document, sign_policy, write_signed_policy

    doc = read_policy_document(policy_file)
    for w in review_or_refuse(doc, str(policy_file), accept=set(accept_risk)):
        click.secho(f"warning: {w}", fg="yellow", err=True)
    k = _load_signing_key(key, passphrase_file, passphrase_prompt)
    target = _signed_target(out, policy_file)
    write_signed_policy(target, sign_policy(doc, k))
    click.echo(f"signed policy {doc['site_id']} v{doc['version']} by {signing.fingerprint(k)} -> {target}")


def _data_commitment(
    path: Path, secret: Path, create: bool = False, patient_cap: int | None = None, declared: Any = None
) -> tuple[str, int, bool, int | None]:
    """(keyed commitment, exact count, secret created, exact patient count). The exact counts are for the
    site's own eyes only. ``patient_cap``: the images a patient-level policy's node uses (the first K of each
    patient). ``declared``: the policy's public class list and image shape, which the node maps its data
    onto."""
    from ..data import load_dataset
    from ..data.commitment import dataset_commitment, ensure_secret, load_secret
    from ..data.loading import patient_grouping

    ds, report = load_dataset(path, patient_cap=patient_cap, declared=declared)
    key, created = ensure_secret(secret) if create else (load_secret(secret), False)
    # a patient-level policy binds the patient grouping too (the node's PatientIndex): regrouped ids are
    # refused
    return dataset_commitment(ds, key, patients=patient_grouping(report)), ds.n, created, report.n_patients


def _signed_dataset(signed: Path) -> tuple[int | None, Any]:
    """(patient cap of a patient-level policy, declared data schema) of a signed policy, read before it is
    verified, only to load the data the way its node does; the policy is verified right after."""
    from ..data.declared import DataDeclaration
    from ..policy.envelope import read_json

    ds = (read_json(signed, "signed policy").get("policy") or {}).get("dataset") or {}
    cap = ds.get("patient_cap") if ds.get("privacy_unit") == "patient" else None
    return cap, DataDeclaration.from_dataset_table(ds)


@policy.command("verify")
@click.argument("signed", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--trusted",
    "trusted",
    multiple=True,
    required=True,
    metavar=TRUSTED_METAVAR,
    help="The site administrator's public key(s) allowed to sign site policies, as ADMIN.pub or "
    "SITE_ID=ADMIN.pub (repeatable).",
)
@click.option(
    "--data",
    type=click.Path(exists=True, path_type=Path),
    help="Check the policy's keyed data commitment against this data (needs --secret).",
)
@click.option(
    "--secret",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The site's data secret (the key of the commitment; it never leaves the site).",
)
@click.option("--now", help="Check the validity window at this ISO 8601 UTC time instead of now.")
@click.option("--min-version", type=int, help="Refuse a policy older than this version (replay check).")
def policy_verify(
    signed: Path,
    trusted: tuple[str, ...],
    data: Path | None,
    secret: Path | None,
    now: str | None,
    min_version: int | None,
) -> None:
    """Verify a signed policy as a node would at start; exit non-zero naming the rule if refused.

    \b
    Example:
      feta-release policy verify policy.signed.json --trusted keys/policy-admin.pub \\
          --data /data/labels.csv --secret keys/data.secret
    """
    from ..errors import ConfigError
    from ..policy import load_site_policy
    from ..policy.document import format_time

    fp = None
    if data is not None:
        if secret is None:
            raise ConfigError("--data needs --secret: the policy holds a keyed commitment, not a plain hash")
        cap, declared = _signed_dataset(signed)
        fp, n, _, _ = _data_commitment(data, secret, patient_cap=cap, declared=declared)
    pol = load_site_policy(
        signed,
        trusted_for_policy(trusted, signed),
        now=now,
        dataset_commitment=fp,
        last_seen_version=min_version,
    )
    click.echo(
        f"OK: policy {pol.site_id} v{pol.version} signed by {pol.signer}, valid "
        f"{format_time(pol.not_before)} .. {format_time(pol.expires)}"
    )
    if data is not None:
        click.echo(
            f"dataset commitment matches ({n} images here; policy's public nominal size {pol.dataset_size})"
        )


@policy.command("show")
@click.argument("signed", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--trusted",
    multiple=True,
    metavar=TRUSTED_METAVAR,
    help="Also verify against these site administrator public keys, as ADMIN.pub or SITE_ID=ADMIN.pub "
    "(otherwise the signature is only checked against the key it embeds).",
)
def policy_show(signed: Path, trusted: tuple[str, ...]) -> None:
    """Pretty-print a signed policy with its signer fingerprint and validity window.

    \b
    Example:
      feta-release policy show policy.signed.json --trusted keys/policy-admin.pub
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ..policy import open_signed_policy
    from ..policy.document import format_time, read_signed_policy_unverified, utc_now
    from ..policy.envelope import read_json

    if trusted:
        pol = open_signed_policy(
            read_json(signed, "signed policy"), trusted_for_policy(trusted, signed), str(signed)
        )
        trust = "[green]verified against a trusted key[/]"
    else:
        pol, _ = read_signed_policy_unverified(signed)
        trust = "[yellow]intact, signer NOT checked against a trusted key (use --trusted)[/]"
    now = utc_now()
    state = (
        "[green]valid now[/]"
        if pol.not_before <= now < pol.expires
        else "[red]expired[/]"
        if now >= pol.expires
        else "[red]not yet valid[/]"
    )
    console = Console()
    console.print(f"[bold]site {pol.site_id}[/] policy version {pol.version}")
    console.print(f"signer: {pol.signer}  ({trust})")
    console.print(f"valid:  {format_time(pol.not_before)} .. {format_time(pol.expires)}  {state}")
    console.print(
        f"dataset: keyed commitment {pol.dataset_commitment}, public nominal size N={pol.dataset_size}"
    )
    d = pol.declared
    console.print(
        "declared data schema: "
        + (
            escape(f"classes {list(d.class_names)}, image_shape {list(d.image_shape)}")
            if d is not None
            else "none (a node refuses this policy: re-sign it with dataset.classes and dataset.image_shape)"
        )
    )
    console.print(
        f"budget: lifetime ε={pol.lifetime_epsilon:g} δ={pol.lifetime_delta:g}; per job "
        f"ε={pol.job_epsilon:g} δ={pol.job_delta:g}; accountant {pol.accountant}"
    )
    table = Table("mechanism", "allowed", "min σ", "caps")
    for m in pol.mechanisms.values():
        table.add_row(
            m.name,
            "yes" if m.allowed else "no",
            "" if m.min_sigma is None else f"{m.min_sigma:g}",
            ", ".join(f"{k}={v:g}" for k, v in m.caps.items()),
        )
    console.print(table)
    console.print("coordinators: " + (", ".join(sorted(pol.coordinator_fingerprints())) or "none"))
    console.print("app bundles: " + (", ".join(b[:16] + "…" for b in pol.app_bundles) or "none"))
    if pol.document.get("description"):
        console.print(f"description: {escape(str(pol.document['description']))}")


@policy.command("data-commitment")
@click.argument("data", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--secret",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The site's data secret; created (256 bits from the OS, mode 0600) if it does not exist. "
    "Keep it on the site: the node needs it, nobody else may have it.",
)
@click.option(
    "--patient-cap",
    type=click.IntRange(min=1),
    default=None,
    metavar="K",
    help="Patient-level privacy: commit to the first K images of each patient (the node's data under a "
    'policy with privacy_unit = "patient", patient_cap = K) and print those fields too.',
)
@click.option(
    "--class",
    "classes",
    multiple=True,
    metavar="NAME",
    help="Declare the public class list (repeat, in label order; classes without images are fine). "
    "Default: the classes present in DATA, sorted, as a draft to review.",
)
@click.option(
    "--image-shape",
    metavar="C,H,W",
    default=None,
    help="Declare the public image shape, e.g. 1,64,64 (channels 1 or 3). Default: the data's majority "
    "shape, as a draft to review.",
)
def policy_data_commitment(
    data: Path, secret: Path, patient_cap: int | None, classes: tuple[str, ...], image_shape: str | None
) -> None:
    """Print the [dataset] table of a policy: the keyed commitment to DATA as the node maps it onto the
    declared classes and image shape, a suggested public size, and that declaration.

    \b
    Example:
      feta-release policy data-commitment /data/labels.csv --secret keys/data.secret
      feta-release policy data-commitment /data/labels.csv --secret keys/data.secret --patient-cap 5
      feta-release policy data-commitment /data/labels.csv --secret keys/data.secret \\
          --class benign --class malignant --class sarcoma --image-shape 1,64,64
    """
    from ..data.commitment import suggest_public_size

    declared = _declaration(data, classes, image_shape)
    fp, n, created, n_patients = _data_commitment(
        data, secret, create=True, patient_cap=patient_cap, declared=declared
    )
    if created:
        click.echo(f"# created data secret {secret} (mode 0600); back it up on this site only", err=True)
    click.echo(
        f'commitment = "{fp}"\n# PUBLIC nominal size: every rate and denominator that leaves the site uses '
        "it."
        f"\n# Suggested: the count rounded to 2 significant digits; the exact count ({n}) must not be "
        f"published.\nsize = {suggest_public_size(n)}"
    )
    if patient_cap is not None and n_patients:
        click.echo(
            f'privacy_unit = "patient"\n# PUBLIC nominal number of patients (the exact count stays here)\n'
            f"patients = {suggest_public_size(n_patients)}\npatient_cap = {patient_cap}"
        )
    click.echo(declared.toml_lines().rstrip("\n"))


def _declaration(data: Path, classes: tuple[str, ...], image_shape: str | None) -> Any:
    """The admin's declaration: ``--class``/``--image-shape`` where given, else drafted from the data."""
    from ..data import load_dataset
    from ..data.declared import DataDeclaration
    from ..errors import ConfigError

    shape = None
    if image_shape is not None:
        try:
            shape = tuple(int(v) for v in image_shape.split(","))
        except ValueError:
            raise ConfigError(
                f"--image-shape {image_shape!r}: give channels,height,width, e.g. 1,64,64"
            ) from None
    if classes and shape is not None:
        return DataDeclaration(classes, shape)
    draft = DataDeclaration.draft_from(load_dataset(data)[0])
    return DataDeclaration(classes or draft.class_names, shape or draft.image_shape)


# -- job -------------------------------------------------------------------------------------------


@click.group()
def job() -> None:
    """Sign and verify coordinator job files."""


@job.command("sign")
@click.argument("job_file", metavar="JOB.toml", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_signing_key_option("The coordinator's private key.")
@click.option("--job-id", required=True, help="Unique job id (letters, digits, . _ -).")
@click.option(
    "--sites", help="Comma-separated site ids the job runs on (default: [federation] sites of JOB.toml)."
)
@_signed_out_option("job", "JOB")
@_passphrase_options
def job_sign(
    job_file: Path,
    key: Path,
    job_id: str,
    sites: str | None,
    out: Path | None,
    passphrase_file: Path | None,
    passphrase_prompt: bool,
) -> None:
    """Sign a job: {"job": {job_id, coordinator, config, sites, created}, "signature": ...}.

    \b
    Example:
      feta-release job sign job.toml --key coordinator.key --job-id job-1 --sites st-mary,st-luke
    """
    from ..config import load_job
    from ..policy import sign_job
    from ..policy.envelope import write_json

    cfg = load_job(job_file)
    site_list = [s.strip() for s in sites.split(",") if s.strip()] if sites else list(cfg.federation.sites)
    if not site_list:
        raise click.UsageError(f"{job_file} has no [federation] sites; give --sites a,b,c")
    k = _load_signing_key(key, passphrase_file, passphrase_prompt)
    signed = sign_job(cfg, k, job_id, site_list)
    target = _signed_target(out, job_file)
    write_json(target, signed)
    click.echo(
        f"signed job {job_id} for sites {', '.join(site_list)} by {signed['job']['coordinator']} -> {target}"
    )


@job.command("verify")
@click.argument("signed", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--coordinator",
    "coordinators",
    multiple=True,
    metavar="COORDINATOR.pub",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Coordinator public key(s) to accept (repeatable).",
)
@click.option(
    "--policy",
    "policy_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Instead: check as the node of this signed site policy would.",
)
@click.option(
    "--trusted",
    multiple=True,
    metavar=TRUSTED_METAVAR,
    help="The site administrator's public key(s) that sign site policies, as ADMIN.pub or "
    "SITE_ID=ADMIN.pub (with --policy; repeatable).",
)
@deprecated_alias("--policy-trusted", "--trusted", multiple=True)
def job_verify(
    signed: Path,
    coordinators: tuple[Path, ...],
    policy_file: Path | None,
    trusted: tuple[str, ...],
    trusted_deprecated: tuple[str, ...],
) -> None:
    """Verify a signed job against coordinator keys, or against a site's signed policy.

    With --policy, a secure-aggregation job can be judged only in its Gaussian form (no data at hand): the
    command then prints "PASSED IN THE GAUSSIAN FORM ONLY" and exits 8, not 0; `policy check --data` is the
    full check. Exit statuses: docs/secure-aggregation.md, "Exit status of the checks".

    \b
    Example:
      feta-release job verify job.signed.json --coordinator coordinator.pub
      feta-release job verify job.signed.json --policy policy.signed.json --trusted keys/policy-admin.pub
    """
    from ..policy import load_site_policy, verify_job, verify_job_with_keys
    from ..policy.envelope import read_json
    from ..policy.partial import gaussian_form_only, secure_aggregation_job

    trusted = merged_option(trusted, trusted_deprecated)
    doc = read_json(signed, "signed job")
    if policy_file is not None:
        if not trusted:
            raise click.UsageError("--policy needs --trusted ADMIN.pub (the key that signs site policies)")
        pol = load_site_policy(policy_file, trusted_for_policy(trusted, policy_file))
        res = _admit_or_refuse(pol, doc, signed)  # the node's own checks, every request of the job
        j = verify_job(doc, pol, str(signed))
        details = (
            f"coordinator {j.signer}; sites {', '.join(j.sites)}; created {j.created.isoformat()}; "
            f"sha256 {j.digest}"
        )
        # no data at hand: the Gaussian form only (reviews L5, F5): exit 8, not 0
        if secure_aggregation_job(doc):
            raise PartialCheckExit(
                gaussian_form_only(
                    f"job {j.job_id} accepted by site {pol.site_id} policy v{pol.version}",
                    res.job_epsilon,
                    pol.job_delta,
                    pol.accountant,
                ),
                details,
            )
        click.echo(f"OK: job {j.job_id} accepted by site {pol.site_id} policy v{pol.version}")
    elif trusted:
        # --trusted once named coordinator keys here; never let a key meant for one role be trusted for
        # another.
        raise click.UsageError(
            "--trusted names the site administrator's key(s), used with --policy; give a "
            "coordinator's key with --coordinator COORDINATOR.pub"
        )
    elif coordinators:
        j = verify_job_with_keys(doc, list(coordinators), str(signed))
        click.echo(f"OK: job {j.job_id}")
    else:
        raise click.UsageError(
            "give --coordinator COORDINATOR.pub, or --policy SIGNED_POLICY --trusted ADMIN.pub"
        )
    click.echo(
        f"coordinator {j.signer}; sites {', '.join(j.sites)}; created {j.created.isoformat()}; "
        f"sha256 {j.digest}"
    )


def _admit_or_refuse(
    pol,
    signed_job,
    source: Path,
    ledger: Path | None = None,  # type: ignore[no-untyped-def]
    data_shape: tuple[tuple[int, int, int], int] | None = None,
):
    """Run the node's enforcement (edge.admission.admit) and exit non-zero listing every failing rule."""
    from edge.admission import admit

    job_ev, life_ev = [], []
    if ledger is not None:
        from feta_release.accounting import events_from_list
        from feta_release.ledger import Ledger

        with Ledger(ledger) as led:
            life_ev = events_from_list([e for r in led.requests() for e in r["events"]])
            jid = signed_job.get("job", {}).get("job_id") if isinstance(signed_job, dict) else None
            job_ev = events_from_list(led.job_events(jid)) if jid else []
    res = admit(
        pol, signed_job, source=str(source), job_events=job_ev, lifetime_events=life_ev, data_shape=data_shape
    )
    if not res.accepted:
        from ..policy.errors import JobRefused

        raise JobRefused(
            f"REFUSED: site {pol.site_id} policy v{pol.version} refuses job {res.job_id or source}",
            res.failures,
            site=pol.site_id,
        )
    return res


@policy.command("check")
@click.argument(
    "signed_policy", metavar="POLICY", type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@click.argument("signed_job", metavar="JOB", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--trusted",
    "trusted",
    multiple=True,
    required=True,
    metavar=TRUSTED_METAVAR,
    help="Public key(s) allowed to sign this site's policy, as ADMIN.pub or SITE_ID=ADMIN.pub (repeatable).",
)
@click.option(
    "--ledger",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The site's ledger: also count what the site has already spent.",
)
@click.option(
    "--data",
    "data_path",
    type=click.Path(exists=True, path_type=Path),
    help="The site's data (only its image shape and classes are read): a secure-aggregation job is then "
    "judged as the node charges it (Skellam events, FedSGD included), not in its Gaussian form.",
)
def policy_check(
    signed_policy: Path,
    signed_job: Path,
    trusted: tuple[str, ...],
    ledger: Path | None,
    data_path: Path | None,
) -> None:
    """Would this site's node serve JOB? Runs the node's own checks and lists EVERY rule that fails.

    Exit 0: ACCEPTED; 6: REFUSED; 8: a secure-aggregation job without --data, PASSED IN THE GAUSSIAN FORM ONLY
    (not a full check: give --data). All statuses: docs/secure-aggregation.md, "Exit status of the checks".

    \b
    Example:
      feta-release policy check policy.signed.json job.signed.json --trusted keys/policy-admin.pub
    """
    from ..policy import load_site_policy
    from ..policy.envelope import read_json
    from ..policy.partial import gaussian_form_only, secure_aggregation_job

    pol = load_site_policy(signed_policy, trusted_for_policy(trusted, signed_policy))
    shape = None
    # the node's shape: the policy's public declaration
    if data_path is not None and pol.declared is not None:
        shape = (tuple(pol.declared.image_shape), int(pol.declared.n_classes))
    elif data_path is not None:
        from ..data import load_dataset

        ds, _ = load_dataset(data_path)
        shape = (tuple(int(v) for v in ds.image_shape), int(ds.n_classes))
    doc = read_json(signed_job, "signed job")
    res = _admit_or_refuse(pol, doc, signed_job, ledger, shape)  # type: ignore[arg-type]
    if secure_aggregation_job(doc) and shape is None:  # reviews L5, F5: a partial pass exits 8, never 0
        raise PartialCheckExit(
            gaussian_form_only(
                f"site {pol.site_id} policy v{pol.version}, job {res.job_id}",
                res.job_epsilon,
                pol.job_delta,
                pol.accountant,
            )
        )
    form = (
        " in the Skellam form the node charges, worst-case cap included"
        if secure_aggregation_job(doc)
        else ""
    )
    click.echo(
        f"ACCEPTED: site {pol.site_id} policy v{pol.version} admits job {res.job_id} "
        f"(planned ε={res.job_epsilon:.4g} at δ={pol.job_delta:g}, {pol.accountant}{form})"
    )


class PartialCheckExit(click.ClickException):
    """A ``PartialCheck`` as the CLI reports it: its line on STDOUT (a verdict, not an error: no "Error:"
    prefix) and exit status 8, the same under ``feta-release`` (``cli.main``) and click's standalone mode
    (tests)."""

    # = feta_release.policy.partial.PARTIAL_CHECK_EXIT (tests/policy/test_partial_check_exit.py checks it),
    # not imported here: the policy package loads at module top only when a command needs it (the keys
    # commands start fast)
    exit_code = 8

    def __init__(self, check: PartialCheck, details: str = "") -> None:
        super().__init__(check.line() + (f"\n{details}" if details else ""))

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(self.message, file=file)
