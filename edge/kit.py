"""A hospital site's onboarding kit: ``feta-release site init`` and the checks before a policy is signed.

``init_site`` writes, into one folder the site administrator owns:
  keys/policy-admin.key|.pub   Ed25519: signs the site policy (keep the private key offline)
  keys/site-signing.key|.pub   Ed25519: the node signs its spend attestations
  keys/node-auth|.pub          EC P-384 (OpenSSH): the node authenticates to the coordinator's SuperLink
  policy.toml                  a policy DRAFT filled from the data (site id, data fingerprint, size, and the
                               public class list and image shape: the admin's declaration, drafted to review)
  node.toml                    every ``node start`` setting (``feta-release node start --config node.toml``)
Private keys are created here and never leave the site: the coordinator receives only the two
``.pub`` files it needs (``node-auth.pub`` to register the node, ``site-signing.pub`` to check
attestations), and the data-protection officer ``policy-admin.pub`` with its fingerprint (the key that
``feta-release verify`` trusts for this site).

``signing_review`` is what ``policy sign`` runs first: it REFUSES a draft that still holds example
values (the shipped example coordinator key, no coordinator at all) and WARNS about values a reviewer
should look at twice (validity window, budgets above common guidance, δ ≥ 1/N, the demo dataset,
no app bundle).
"""

from __future__ import annotations

import datetime as dt
import re
import textwrap
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from feta_release.data.commitment import create_secret, dataset_commitment, load_secret, suggest_public_size
from feta_release.data.declared import DataDeclaration
from feta_release.data.loading import LoadOptions, load_dataset, patient_grouping
from feta_release.errors import ConfigError, PolicyError
from feta_release.job_rules import (
    DPSGD_MIN_SIGMA,
    DRAFT_EPSILON,
    DRAFT_MIN_STEPS,
    DRAFT_SHARE_SITES,
    SiteCaps,
    site_caps,
)
from feta_release.ledger_chain import make_private_dirs
from feta_release.policy.document import _coordinator_fingerprint, format_time, parse_time, utc_now
from feta_release.signing import generate_keypair, load_public_key, make_node_auth_key, public_key_pem

# The key in policies/strict-hospital.toml and policies/research.toml: an example, never a real coordinator.
EXAMPLE_COORDINATOR_FINGERPRINTS = frozenset(
    {"c9dc80267b498549c4fb98b541d69a6212511d9436b00142eb66e24fbe6dd0d2"}
)
# Per-job ε above which signing warns. Common guidance: ε ≤ 1 is strong, single-digit ε is what
# deployed DP systems use (e.g. the US Census 2020 DAS, Apple/Google telemetry); above 10 the formal
# guarantee says little about one patient. The lifetime ceiling allows a few such jobs.
EPSILON_CEILING_JOB = 10.0
EPSILON_CEILING_LIFETIME = 20.0
SITE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SHA256_HEX = re.compile(r"^[0-9a-fA-F]{64}$")


@dataclass(frozen=True)
class Review:
    errors: list[str]
    warnings: list[str]


# Values no reviewed policy should hold unless its administrator says so: ``policy sign`` refuses each, naming
# the risk that ``--accept-risk RISK`` accepts (the line then stays, as a warning).
# (A lifetime budget below the per-job one is refused by the policy's validation itself.)
RISKS = ("job-epsilon", "lifetime-epsilon", "delta", "expired")


def signing_review(
    doc: dict[str, Any], now: dt.datetime | None = None, accept: frozenset[str] | set[str] = frozenset()
) -> Review:
    """What ``policy sign`` refuses (errors) and warns about, one line each naming the field and the fix. A
    risk in ``accept`` is a warning instead of an error."""
    now = now or utc_now()
    errors, warnings = [], []
    coords = list(doc.get("coordinators", []))
    if not coords:
        errors.append(
            "coordinators: empty; paste your coordinator's public key (feta-release keys show "
            "coordinator.pub --pem) so the node can verify its jobs"
        )
    for i, c in enumerate(coords):
        if _coordinator_fingerprint(c) in EXAMPLE_COORDINATOR_FINGERPRINTS:
            errors.append(
                f"coordinators[{i}]: the shipped EXAMPLE coordinator key; replace it with your "
                "coordinator's public key"
            )
    ds = doc.get("dataset", {})
    size = ds.get("nominal_size", ds.get("size"))
    if not size:
        warnings.append("dataset: no public nominal size; sampling rates and sensitivities need it")
    if parse_time(doc["not_before"]) > now and parse_time(doc["expires"]) > now:
        warnings.append(f"not_before: {doc['not_before']} is in the future; a node refuses it until then")
    if not doc.get("app_bundles"):
        warnings.append(
            "app_bundles: empty; the node will refuse to start until you add the sha256 of the "
            "reviewed app bundle your coordinator sends"
        )
    for risk, line in _risks(doc, size, now):
        if risk in accept:
            warnings.append(f"{line} (accepted: --accept-risk {risk})")
        else:
            errors.append(f"{line}; if you mean it, sign with --accept-risk {risk}")
    return Review(errors, warnings)


def _risks(doc: dict[str, Any], size: Any, now: dt.datetime) -> list[tuple[str, str]]:
    """(risk, line) for each value a reviewer must not sign by accident."""
    out = []
    b = doc["budget"]
    job, life = b["per_job"], b["lifetime"]
    if parse_time(doc["expires"]) <= now:
        out.append(
            (
                "expired",
                f"expires: {doc['expires']} is in the past; a node refuses an expired policy: set a "
                "future expires",
            )
        )
    if job["epsilon"] > EPSILON_CEILING_JOB:
        out.append(
            (
                "job-epsilon",
                f"budget.per_job.epsilon = {job['epsilon']:g} is above {EPSILON_CEILING_JOB:g}, "
                "beyond common guidance (ε ≤ 1 strong, single digits in deployed systems)",
            )
        )
    if life["epsilon"] > EPSILON_CEILING_LIFETIME:
        out.append(
            (
                "lifetime-epsilon",
                f"budget.lifetime.epsilon = {life['epsilon']:g} is above "
                f"{EPSILON_CEILING_LIFETIME:g}, beyond common guidance",
            )
        )
    if size and max(job["delta"], life["delta"]) >= 1.0 / float(size):
        out.append(
            (
                "delta",
                f"budget delta = {max(job['delta'], life['delta']):g} is not below 1/N = "
                f"{1 / float(size):.3g}: a mechanism could then reveal a whole record; use δ well below "
                "1/N",
            )
        )
    return out


def review_or_refuse(
    doc: dict[str, Any],
    source: str,
    now: dt.datetime | None = None,
    accept: frozenset[str] | set[str] = frozenset(),
) -> list[str]:
    """Raise ``PolicyError`` listing every error; return the warnings."""
    r = signing_review(doc, now, accept)
    if r.errors:
        raise PolicyError(f"{source}: refusing to sign:\n  " + "\n  ".join(r.errors))
    return r.warnings


# -- site init ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kit:
    root: Path
    node_toml: Path
    policy_draft: Path
    coordinator_files: tuple[Path, ...]  # the only files that go to the coordinator
    n_images: int
    n_patients: int | None
    patient_cap: int | None
    admin_pub: Path | None = None  # keys/policy-admin.pub (None: it is made elsewhere and copied here later)
    admin_key: Path | None = None  # keys/policy-admin.key (None: kept off the node)


@dataclass(frozen=True)
class AdminKey:
    """Where the policy-admin key lives. ``elsewhere``: no private key is written into the kit; the admin
    makes it on another machine (``keys generate --passphrase-prompt``), signs there and brings only the
    signed policy and the ``.pub``. Otherwise it is made here, encrypted with ``passphrase`` when one is
    given."""

    elsewhere: bool = False
    passphrase: bytes | None = None

    def install(self, keys: Path) -> Path | None:
        if self.elsewhere:
            keys.mkdir(parents=True, exist_ok=True)
            return None
        return generate_keypair(keys, "policy-admin", passphrase=self.passphrase)[1]

    def private_path(self, keys: Path) -> Path | None:
        return None if self.elsewhere else keys / "policy-admin.key"

    def sign_hint(self) -> str:
        if self.elsewhere:
            return (
                "# The policy-admin key is NOT on this node. On the offline machine that holds it:\n"
                "#   feta-release keys generate --out admin-keys --name policy-admin --passphrase-prompt  "
                "(once)\n#   feta-release policy sign policy.toml --key admin-keys/policy-admin.key "
                "--passphrase-prompt --out policy.signed.json\n"
                "# then copy back only policy.signed.json and admin-keys/policy-admin.pub (to "
                "keys/policy-admin.pub)."
            )
        pp = " --passphrase-prompt" if self.passphrase else ""
        return (
            "# Review every value, then sign it (better on an offline machine: move keys/policy-admin.key "
            f"there):\n#   feta-release policy sign policy.toml --key keys/policy-admin.key{pp} --out "
            "policy.signed.json"
        )


def _peer_pems(site_id: str, peers: Mapping[str, Path]) -> dict[str, str]:
    """The other sites' site-signing keys as PEM, by site id (refused: a bad id, this site itself, a bad
    key)."""
    out: dict[str, str] = {}
    for sid, path in peers.items():
        if not SITE_ID.match(sid) or sid == site_id:
            raise ConfigError(
                f"--peer {sid}={path}: give another site's id (letters, digits, . _ -) and its "
                "keys/site-signing.pub"
            )
        out[sid] = public_key_pem(load_public_key(Path(path)))
    return out


def _toml_str(v: str) -> str:
    return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'


def init_site(
    root: Path,
    data: Path,
    site_id: str,
    *,
    load: Any = None,
    superlink: str = "127.0.0.1:9092",
    coordinator_pub: Path | None = None,
    root_certificates: Path | None = None,
    app_bundles: tuple[str, ...] = (),
    peers: Mapping[str, Path] | None = None,
    admin_key: AdminKey | None = None,
) -> Kit:
    """Write the kit (see the module docstring); refuses to overwrite an existing kit.

    ``peers``: the other sites' site-signing public keys (site id -> .pub), pinned in the draft's
    ``[secure_aggregation] peers``. ``admin_key``: how the policy-admin key is kept (default: made here, no
    passphrase)."""
    if not SITE_ID.match(site_id):
        raise ConfigError(f"site id {site_id!r}: use letters, digits, . _ - (at most 64)")
    peer_pems = _peer_pems(site_id, peers or {})
    admin_key = admin_key or AdminKey()
    bad = [h for h in app_bundles if not SHA256_HEX.match(h)]
    if bad:
        raise ConfigError(
            f"--app-bundle {bad[0]!r}: not a sha256 (64 hex digits); your coordinator prints it with "
            "`feta-release coordinator fab-hash`"
        )
    root = Path(root)
    if (root / "node.toml").exists() or (root / "keys").exists():
        raise ConfigError(f"{root}: already holds a site kit (node.toml or keys/); choose an empty folder")
    opts = load or LoadOptions()
    ds, report = load_dataset(data, **opts.kwargs())  # the same reading the node will do
    coord_pem = public_key_pem(load_public_key(coordinator_pub)) if coordinator_pub else None
    keys = root / "keys"
    # the node's ledger lies in the kit's folder: made for this account only (node start refuses a ledger
    # folder others can write), whatever the umask
    make_private_dirs(keys)
    admin_pub = admin_key.install(keys)
    _, site_pub = generate_keypair(keys, "site-signing")
    _, auth_pub = make_node_auth_key(keys, "node-auth")
    draft = root / "policy.toml"
    unit = (
        f"one PATIENT (at most {opts.patient_cap} image(s) each, node.toml [data] patient_cap)"
        if opts.patient_cap
        else "one image (no --patient-cap; see `feta-release privacy plan --patient-cap`)"
    )
    # Keyed commitment (never a plain hash) and a rounded PUBLIC size: the exact count stays here.
    commitment = dataset_commitment(
        ds, load_secret(create_secret(keys / "data.secret")), patients=patient_grouping(report)
    )  # the node's grouping under the cap
    site_pem = public_key_pem(load_public_key(site_pub))
    # the data's own classes and shape, as a PROPOSAL the admin reviews and signs (the node then uses only the
    # signed declaration); loading with it changes nothing, so the commitment above is the one the node
    # recomputes
    fields = _unit_fields(opts, report) + DataDeclaration.draft_from(ds).toml_lines()
    patients = suggest_public_size(int(report.n_patients)) if opts.patient_cap and report.n_patients else None
    draft.write_text(
        _policy_draft(
            site_id,
            commitment,
            suggest_public_size(ds.n),
            coord_pem,
            site_pem,
            unit,
            tuple(h.lower() for h in app_bundles),
            fields,
            peer_pems,
            admin_key.sign_hint(),
            shape=tuple(ds.image_shape),
            n_classes=ds.n_classes,
            patients=patients,
        ),
        "utf-8",
    )
    node = root / "node.toml"
    node.write_text(_node_toml(site_id, Path(data).resolve(), opts, superlink, root_certificates), "utf-8")
    return Kit(
        root,
        node,
        draft,
        (auth_pub, keys / "site-signing.pub"),
        ds.n,
        report.n_patients,
        opts.patient_cap,
        admin_pub,
        admin_key.private_path(keys),
    )


def _unit_fields(opts: Any, report: Any) -> str:
    """The policy draft's unit of privacy: with a patient cap (patient ids known) the PATIENT, with the PUBLIC
    (rounded) number of patients, so federated DP-SGD samples and clips whole patients."""
    if not opts.patient_cap or not report.n_patients:
        return ""
    return (
        f'privacy_unit = "patient"  # DP-SGD samples whole patients at q = batch / patients\n'
        f"patients = {suggest_public_size(int(report.n_patients))}  # PUBLIC nominal number of patients "
        f"(rounded)\npatient_cap = {int(opts.patient_cap)}  # at most this many images per patient "
        "(node.toml [data])\n"
    )


def _secure_aggregation_table(peers: Mapping[str, str]) -> str:
    """The draft's trust assumption for secure-aggregation jobs (the default for >= 2 sites)."""
    head = """
# Secure aggregation (a multi-site job's default): each site adds a SHARE of the noise, sigma / sqrt(n sites).
# peers: the other sites' keys/site-signing.pub, by site id (`site init --peer SITE=FILE`). With NO peer pinned a
# coordinator could stand in for every other site, so no other site's share counts: this site's epsilon is then that
# of its own share alone (about n times the job's), and a job sized for n sites is refused. max_colluders: how many
# of the pinned sites may collude with the coordinator (their shares do not count either).
[secure_aggregation]
max_colluders = 0
"""  # noqa: E501
    if not peers:
        return head + "# [secure_aggregation.peers]\n# st-luke = '''-----BEGIN PUBLIC KEY-----...'''\n"
    return (
        head
        + "[secure_aggregation.peers]\n"
        + "".join(f"{_toml_str(s)} = '''{pem}'''\n" for s, pem in sorted(peers.items()))
    )


def _derived_lines(caps: SiteCaps, n: int, shape: tuple[int, ...], n_classes: int) -> str:
    """The draft's comment on the job the rules derive for this site at its per-job budget (what the caps
    admit), or why that job is refused."""
    side = "x".join(str(v) for v in (shape[1], shape[2], shape[0]))
    head = (
        "# The caps below come from this site's public facts by the derived job's rules\n"
        "# (feta_release/job_rules.py site_caps, docs/derived-job.md). The job they admit at the per-job\n"
        "# budget:\n"
        f"#   feta-release privacy plan --size {n} --shape {side} --classes {n_classes} --epsilon "
        f"{DRAFT_EPSILON:g} --declared-size\n"
    )
    if caps.job is None:
        why = textwrap.wrap("is refused at this budget: " + caps.floor.replace("\n", " "), 106)
        return head + "".join(f"# {line}\n" for line in why)
    cfg = caps.job.cfg
    freq = (
        "off"
        if cfg.frequency.sigma is None
        else f"sigma {cfg.frequency.sigma:g} with {cfg.frequency.features} features"
    )
    steps = cfg.dpsgd_steps(n)
    return (
        head
        + f"# central sigma {cfg.central.sigma:g} (one pass), frequency {freq}, DP-SGD "
        + (f"{steps} steps" if steps else "off")
        + ".\n"
    )


def _caps_toml(caps: SiteCaps, n: int, shape: tuple[int, ...], patients: int | None) -> str:
    """The draft's mechanism caps and memory limit (:func:`site_caps`), each with the rule it comes from."""
    side, unit_count = "x".join(str(v) for v in shape), "patients" if patients else "images"
    return f"""# min_sigma is checked against THIS site's noise share: under secure aggregation sigma / sqrt(n sites). The
# epsilon budgets above are the guarantee; min_sigma only refuses a release with almost no noise: the sigma
# one full-data release needs to spend the per-job epsilon alone, over sqrt({DRAFT_SHARE_SITES}) (a share of a
# secure sum of up to {DRAFT_SHARE_SITES} sites).
[mechanisms.central]
allowed = true
min_sigma = {caps.min_sigma:g}
max_rounds = 10
max_batch = {caps.central_max_batch}  # one pass over the public size

[mechanisms.frequency]
allowed = true
min_sigma = {caps.min_sigma:g}
max_features = {caps.max_features}  # the rules' most features

[mechanisms.dpsgd]
allowed = true
min_sigma = {DPSGD_MIN_SIGMA:g}
max_steps = {caps.dpsgd_max_steps}  # 20 epochs of the rules' batch (at least {DRAFT_MIN_STEPS})
max_batch = {caps.dpsgd_max_batch}  # the rules' batch: a quarter of the {unit_count}, in [256, 4096]
max_clip = 1.0

# What one job may make this node allocate. max_worker_memory_mb: the site's float32 images
# ({n:,} x {side} x 4 bytes) + 1 GiB working memory, rounded up, at least the default.
[resources]
max_worker_memory_mb = {caps.max_worker_memory_mb}
"""  # noqa: E501


def _policy_draft(
    site_id: str,
    commitment: str,
    n: int,
    coordinator_pem: str | None,
    site_pem: str,
    unit: str = "one image",
    app_bundles: tuple[str, ...] = (),
    unit_fields: str = "",
    peers: Mapping[str, str] | None = None,
    sign_hint: str = "",
    *,
    shape: tuple[int, ...] = (1, 28, 28),
    n_classes: int = 10,
    patients: int | None = None,
) -> str:
    """The policy draft's text; its budgets' delta, mechanism caps and memory limit from :func:`site_caps` of
    the site's public facts (size, image shape, classes, unit of privacy)."""
    caps = site_caps(n, (int(shape[0]), int(shape[1]), int(shape[2])), n_classes, patients)
    start = utc_now().replace(microsecond=0, second=0)
    coords = (
        f'[\n  """{coordinator_pem}""",\n]'
        if coordinator_pem
        else "[]  # REQUIRED: paste `feta-release keys show coordinator.pub --pem`"
    )
    hint = sign_hint or AdminKey().sign_hint()
    return (
        f"""# Site policy DRAFT written by `feta-release site init`.
{hint}
# Signing refuses while this draft still lacks a coordinator key or holds the example one.
version = 1
site_id = {_toml_str(site_id)}
description = "written by feta-release site init; edit"
not_before = {format_time(start)}
expires = {format_time(start + dt.timedelta(days=365))}
accountant = "rdp"
# Coordinator public keys allowed to sign jobs for this site.
coordinators = {coords}
# sha256 of the reviewed Flower app bundle(s) your coordinator runs (it publishes the hash). Empty: nothing runs.
app_bundles = [{", ".join(_toml_str(h) for h in app_bundles)}]
# The ONLY key whose spend attestations a verifier accepts for this site (keys/site-signing.pub).
site_key = '''{site_pem}'''

[dataset]
commitment = {_toml_str(commitment)}  # HMAC of the data as node.toml reads it (keys/data.secret)
# PUBLIC nominal size N: rates are q = batch / N. DRAFTED as the exact count rounded to 2 significant digits, which
# is still a function of the exact count: publish a figure you would state anyway (e.g. your data inventory's).
size = {n}
{unit_fields}
# Unit of privacy: {unit}.
# delta: the presets' 1e-5 up to 10,000 images, below 1 / (10 N) beyond (job_rules.default_delta).
[budget.lifetime]
epsilon = {4 * DRAFT_EPSILON:g}
delta = {caps.delta:g}
[budget.per_job]
epsilon = {DRAFT_EPSILON:g}
delta = {caps.delta:g}

"""  # noqa: E501
        + _derived_lines(caps, n, shape, n_classes)
        + "\n"
        + _caps_toml(caps, n, shape, patients)
        + _secure_aggregation_table(peers or {})
    )


def _node_toml(site_id: str, data: Path, opts: Any, superlink: str, root_certificates: Path | None) -> str:
    ca = (
        _toml_str(str(root_certificates))
        if root_certificates
        else '""  # REQUIRED: the ca.crt your coordinator sends'
    )
    return f"""# Node settings for site {site_id}: feta-release node start --config node.toml
# Relative paths are relative to this file. Command-line options override values here.
[node]
data = {_toml_str(str(data))}
policy = "policy.signed.json"
trusted_policy_key = "keys/policy-admin.pub"
site_key = "keys/site-signing.key"
data_secret = "keys/data.secret"
auth_key = "keys/node-auth"
ledger = "ledger.sqlite"
work_dir = "work"
superlink = {_toml_str(superlink)}
root_certificates = {ca}

# How files become model-sized images: the same options as `feta-release data inspect`.
[data]
resize = {_toml_str(opts.resize)}
image_size = {opts.image_size or 0}
window = {_toml_str(opts.window)}
# At most this many images per patient (0: no cap; the unit of privacy is then one image).
patient_cap = {opts.patient_cap or 0}
"""


# node.toml's [node] keys whose values are files or folders (resolved against the file's own folder)
PATH_KEYS = {
    "data",
    "policy",
    "trusted_policy_key",
    "site_key",
    "data_secret",
    "auth_key",
    "ledger",
    "work_dir",
    "root_certificates",
}
NODE_KEYS = PATH_KEYS | {"superlink", "port", "insecure", "force_insecure", "worker", "device"}


def read_node_toml(path: Path) -> dict[str, Any]:
    """``NodeSettings`` keyword arguments from a node.toml (paths resolved against its folder)."""
    try:
        doc = tomllib.loads(Path(path).read_text("utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: node config not found; create one with `feta-release site init`"
        ) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    extra = sorted(set(doc) - {"node", "data"})
    node, data = doc.get("node", {}), doc.get("data", {})
    extra += sorted(f"node.{k}" for k in set(node) - NODE_KEYS)
    extra += sorted(f"data.{k}" for k in set(data) - {"resize", "image_size", "window", "patient_cap"})
    if extra:
        raise ConfigError(f"{path}: unknown setting(s) {', '.join(extra)}")
    base = Path(path).resolve().parent
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k == "ledger":
            # not resolved here: a link at its name or on its way is refused, never followed, by `node start`
            # (edge.ledger_anchor.refuse_link), whose node config then resolves its folder (as_given)
            out[k] = base / v if v else None
        elif k in PATH_KEYS:
            out[k] = (base / v).resolve() if v else None
        else:
            out[k] = v
    missing = [
        k
        for k in ("data", "policy", "trusted_policy_key", "ledger", "site_key", "data_secret")
        if not out.get(k)
    ]
    if missing:
        raise ConfigError(f"{path}: [node] lacks {', '.join(missing)}")
    size = int(data.get("image_size") or 0) or None
    cap = int(data.get("patient_cap") or 0) or None
    out["load"] = LoadOptions(
        resize=data.get("resize", "refuse"),
        image_size=size,
        window=data.get("window", "auto"),
        patient_cap=cap,
    )
    return out
