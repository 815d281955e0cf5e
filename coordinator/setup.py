"""Preparing a federation on one machine: site data, keys, signed policies, a signed job.

Used by ``feta-release demo`` and by the tests; a real deployment does each step at its own site
(``data``, ``keys generate``, ``policy sign``) and the coordinator only signs the job.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flwr.cli.build import build_fab_from_disk

from edge.site import CFG_DATA, CFG_LEDGER, CFG_POLICY, CFG_SECRET, CFG_SITE_KEY, CFG_TRUSTED
from feta_release.data.commitment import create_secret, dataset_commitment, load_secret, suggest_public_size
from feta_release.data.dataset import save_npz
from feta_release.data.declared import DataDeclaration
from feta_release.data.loading import cap_loaded, load_dataset, patient_grouping
from feta_release.ledger_chain import make_private_dirs
from feta_release.policy.document import make_policy, sign_policy, write_signed_policy
from feta_release.policy.jobs import sign_job
from feta_release.signing import generate_keypair, load_private_key, load_public_key, public_key_pem

APP_DIR = Path(__file__).resolve().parent / "flower_app"


def app_bundle_hash(app_dir: Path = APP_DIR) -> str:
    """sha256 of the FAB ``flwr run`` builds from ``app_dir`` (deterministic: fixed zip timestamps)."""
    return hashlib.sha256(build_fab_from_disk(app_dir)).hexdigest()


@dataclass
class SiteFiles:
    site_id: str
    data: Path
    policy: Path
    policy_pub: Path
    site_key: Path
    ledger: Path
    size: int  # the PUBLIC nominal size of the site's policy (not the exact count)
    commitment: str  # keyed (HMAC) commitment to the data, as in the policy
    data_secret: Path  # the key of that commitment: stays on the site (mode 0600)

    def node_config(self) -> dict[str, str]:
        return {
            CFG_DATA: str(self.data),
            CFG_POLICY: str(self.policy),
            CFG_TRUSTED: str(self.policy_pub),
            CFG_LEDGER: str(self.ledger),
            CFG_SITE_KEY: str(self.site_key),
            CFG_SECRET: str(self.data_secret),
        }


@dataclass
class Federation:
    root: Path
    coordinator_key: Path
    coordinator_pub: Path
    sites: list[SiteFiles] = field(default_factory=list)

    def site(self, site_id: str) -> SiteFiles:
        return next(s for s in self.sites if s.site_id == site_id)


def prepare_federation(
    root: str | Path,
    datasets: dict[str, Any],
    *,
    app_hashes: list[str] | None = None,
    policy_overrides: dict[str, dict[str, Any]] | None = None,
    public_sizes: dict[str, int] | None = None,
    pin_peers: bool = True,
) -> Federation:
    """Write each site's data (.npz), keys, data secret, and a signed policy allowing the coordinator key and
    the app. A site's public nominal size is ``public_sizes[site]`` or its count rounded to 2 significant
    digits. ``pin_peers``: each policy pins the other sites' keys (``secure_aggregation.peers``), as their
    admins would. A ``datasets`` value may be a data path (a folder or a ``path,label,patient_id`` CSV) used
    as it is; a site whose ``policy_overrides`` hold ``patient_level=(P, K)`` commits to its data with the
    patient cap K, as its node loads it. A site's public data schema (``dataset.classes``/``image_shape``) is
    ``policy_overrides[site]["declared"]`` (a ``DataDeclaration``) or, as ``site init`` drafts it for the
    admin, its data's own classes and shape."""
    root = Path(root)
    # first, before a key's folder is made under the umask: the folders above each site's ledger are made
    # for this account only (a node refuses a ledger below a folder others can write)
    make_private_dirs(root / "sites")
    coord_key, coord_pub = generate_keypair(root / "coordinator", "coordinator")
    fed = Federation(root, coord_key, coord_pub)
    hashes = app_hashes if app_hashes is not None else [app_bundle_hash()]
    # each site's folder holds its node's ledger: made for its account only, as a node requires
    site_keys = {
        sid: generate_keypair(make_private_dirs(root / "sites" / sid / "keys"), "site") for sid in datasets
    }
    pems = {sid: public_key_pem(load_public_key(pub)) for sid, (_, pub) in site_keys.items()}
    for site_id, ds in datasets.items():
        d = root / "sites" / site_id
        data_path = Path(ds) if isinstance(ds, (str, Path)) else save_npz(ds, d / "data.npz")
        over = dict((policy_overrides or {}).get(site_id, {}))
        loaded, report = load_dataset(data_path, declared=over.get("declared"))  # as the node maps it
        over.setdefault("declared", DataDeclaration.draft_from(loaded))
        if over.get("patient_level") and report.patients is not None:  # the images the node will use
            loaded = cap_loaded(loaded, report, int(over["patient_level"][1]))
        policy_key, policy_pub = generate_keypair(d / "keys", "policy-admin")
        site_key, site_pub = site_keys[site_id]
        over.setdefault("app_bundles", hashes)
        over.setdefault("site_key", load_public_key(site_pub))
        if pin_peers:
            sa = dict(over.get("secure_aggregation") or {})
            sa.setdefault("peers", {s: pem for s, pem in pems.items() if s != site_id})
            over["secure_aggregation"] = sa
        secret = create_secret(d / "keys" / "data.secret")
        commitment = dataset_commitment(loaded, load_secret(secret), patients=patient_grouping(report))
        size = int((public_sizes or {}).get(site_id) or suggest_public_size(loaded.n))
        doc = make_policy(site_id, commitment, size, [load_public_key(coord_pub)], **over)
        signed = sign_policy(doc, load_private_key(policy_key))
        pol_path = write_signed_policy(d / "policy.signed.json", signed)
        fed.sites.append(
            SiteFiles(
                site_id, data_path, pol_path, policy_pub, site_key, d / "ledger.db", size, commitment, secret
            )
        )
    return fed


def sign_job_file(
    fed: Federation, cfg: Any, job_id: str, sites: list[str] | None = None, out: Path | None = None
) -> tuple[dict[str, Any], Path]:

    signed = sign_job(
        cfg, load_private_key(fed.coordinator_key), job_id, sites or [s.site_id for s in fed.sites]
    )
    path = out or (fed.root / f"{job_id}.signed.json")
    path.write_text(json.dumps(signed, indent=2), "utf-8")
    return signed, path
