"""What a site node holds: its verified policy, its data, its ledger and its signing key.

Everything here comes from the node's own configuration (``--node-config``, set by the site's
administrator through ``feta-release node start``); nothing comes from the coordinator.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from feta_release.data.commitment import dataset_commitment, load_secret
from feta_release.data.dataset import check_dataset_memory, check_site_memory
from feta_release.data.loading import LoadOptions, check_cap_for_policy, load_dataset, policy_data
from feta_release.errors import ConfigError, PolicyError
from feta_release.ledger import Ledger
from feta_release.ledger_chain import make_private_dirs
from feta_release.policy.document import (
    check_commitment,
    check_validity,
    check_version,
    load_site_policy,
    open_signed_policy,
)
from feta_release.policy.enforce import resource_cap
from feta_release.privacy_unit import PatientIndex
from feta_release.signing import load_private_key, public_key_pem

from . import ledger_anchor, site_cache

log = logging.getLogger("feta.node")

# --node-config keys (kebab-case like Flower's own).
CFG_DATA = "data-path"
CFG_POLICY = "policy-file"
CFG_TRUSTED = "trusted-policy-key"
CFG_LEDGER = "ledger-path"
CFG_SITE_KEY = "site-key"
CFG_WORK = "work-dir"
CFG_SECRET = "data-secret"  # key of the keyed data commitment (feta_release.data.commitment); never sent
# How files become model-sized images (feta_release.data.LoadOptions); optional, site-side only.
CFG_RESIZE = "data-resize"
CFG_IMAGE_SIZE = "data-image-size"
CFG_WINDOW = "data-window"
CFG_PATIENT_CAP = "data-patient-cap"
# Where DP-SGD and FedSGD rounds compute (`node start --device`; feta_release.training.device); optional, cpu
# when absent. Resolved with torch by the code that computes (this module loads without torch: `node status`).
CFG_DEVICE = "device"
# DP-SGD steps between a round's checkpoints in the work directory (edge.releases.RoundCheckpoint); optional,
# 0 (none) when absent: a round whose process was killed is then computed again from its start, not charged
# again.
CFG_ROUND_CHECKPOINT = "round-checkpoint-every"
# The name of a site opened in this process over images in memory (``hold_site``): ``feta-release train``.
CFG_HELD = "held-site"
REQUIRED = (CFG_DATA, CFG_POLICY, CFG_TRUSTED, CFG_LEDGER, CFG_SITE_KEY, CFG_SECRET)


def verify_policy_file(
    policy_path: str | Path,
    trusted_key: str | Path,
    *,
    dataset_commitment: str | None = None,
    last_seen_version: int | None = None,
) -> Any:
    """The verified ``SitePolicy`` or a ``PolicyError`` naming the rule it breaks."""
    return load_site_policy(
        policy_path,
        [Path(trusted_key)],
        dataset_commitment=dataset_commitment,
        last_seen_version=last_seen_version,
    )


def load_options(node_config: dict[str, Any]) -> Any:
    """The site's ``LoadOptions`` from its node config (the same object ``data inspect`` uses)."""

    def integer(key: str) -> int | None:
        v = node_config.get(key)
        try:
            return int(v) if v not in (None, "", 0, "0") else None
        except (TypeError, ValueError):
            raise ConfigError(f"node config {key} must be an integer, not {v!r}") from None

    return LoadOptions(
        resize=str(node_config.get(CFG_RESIZE) or "refuse"),  # type: ignore[arg-type]
        image_size=integer(CFG_IMAGE_SIZE),
        window=str(node_config.get(CFG_WINDOW) or "auto"),
        patient_cap=integer(CFG_PATIENT_CAP),
    )


def load_site_data(path: str | Path, options: Any = None, declared: Any = None) -> Any:
    ds, _report = load_dataset(Path(path), **(options or LoadOptions()).kwargs(), declared=declared)
    return ds


def load_site_data_report(path: str | Path, options: Any = None, declared: Any = None) -> tuple[Any, Any]:
    """(dataset, ``LoadReport``): the report carries the per-image patient index (private; stays in this
    process). ``declared``: the policy's public class list and image shape, which the data are mapped onto."""
    return load_dataset(Path(path), **(options or LoadOptions()).kwargs(), declared=declared)


def declared_schema(policy: Any, policy_source: str) -> Any:
    """The policy's ``DataDeclaration`` (public class list and image shape), or a ``PolicyError`` saying how
    to re-sign. No fallback to the data: the classes present and the images' majority shape are private, and
    ``hello`` and every release's shape would carry them un-noised."""
    if policy.declared is None:
        raise PolicyError(
            f"{policy_source}: the policy declares no public data schema (dataset.classes and "
            "dataset.image_shape), so the node would have to read them off the images; add both to its "
            "[dataset] (`feta-release policy data-commitment DATA --secret SECRET` drafts them with the "
            "matching commitment), raise version and re-sign with `feta-release policy sign`"
        )
    return policy.declared


def owner_only_dir(path: Path) -> Path:
    """The node's work directory, for the site's account only (0700): its logs may hold tracebacks whose text
    depends on the images, and compute times there track the realised Poisson batch sizes."""
    make_private_dirs(path)  # the folders on the way too: not left to the umask
    os.chmod(path, 0o700)
    return path


@dataclass
class Site:
    policy: Any  # feta_release.policy.document.SitePolicy (verified)
    data: Any  # feta_release.data.ImageDataset
    ledger: Ledger
    key: Any  # Ed25519PrivateKey
    work_dir: Path
    # patient-level DP-SGD (policy dataset.privacy_unit = "patient"): private per-image patient index, with
    # the policy's PUBLIC patient count and cap; None at an image-level site
    patients: Any = None
    # the node config's device NAME (auto/cpu/cuda): edge.clientapp.site_device resolves it
    device: str = "cpu"
    round_checkpoint_every: int = 0  # CFG_ROUND_CHECKPOINT

    @property
    def site_id(self) -> str:
        return str(self.policy.site_id)

    @property
    def n_public(self) -> int:
        """The PUBLIC nominal size of the signed policy: the only size any rate or denominator that leaves the
        site may depend on (the exact count ``data.n`` never does)."""
        return int(self.policy.dataset_size)

    @classmethod
    def open(
        cls,
        node_config: dict[str, Any],
        *,
        new_ledger: bool = False,
        check: Callable[[Any], None] | None = None,
    ) -> Site:
        """Verify the signed policy against the site's trusted key and the data against the policy's keyed
        commitment (recomputed with the site's secret), and refuse a policy older than one this ledger has
        seen. ``new_ledger`` (``node start --new-ledger``): a NEW ledger where the node ran on one that is
        lost (``edge.ledger_anchor.start_new``, logged), once every other check has passed. ``check``: the
        caller's own refusals on the verified policy (``node start``: an app bundle), run on the one object
        the site then runs under, before the ledger is touched."""
        missing = [k for k in REQUIRED if not node_config.get(k)]
        if missing:
            raise ConfigError(
                f"node config lacks {', '.join(missing)}; start the node with `feta-release node start`"
            )
        # the signed policy, read and verified ONCE, first: a node config it refuses is refused before the
        # ledger, the cache or any image is opened. Every later check (the cap here, the data's commitment,
        # the site key, the version floors) and the site itself use this object, never the file read again:
        # a file changed in between (a time-of-check/time-of-use gap) would have one policy checked and
        # another run.
        policy = verify_policy_file(node_config[CFG_POLICY], node_config[CFG_TRUSTED])
        if check is not None:
            check(policy)
        check_node_cap(policy, node_config)
        return cls._opened(
            node_config,
            policy,
            lambda secret, work: _opened_data(node_config, policy, secret, work),
            new_ledger=new_ledger,
        )

    @classmethod
    def in_memory(
        cls, node_config: dict[str, Any], data: Any, patients: Any = None, *, verified: Any = None
    ) -> Site:
        """A site over images already loaded in this process (``feta-release train``: its data are never
        copied onto disk), opened as :meth:`open` opens one: the policy's signature and validity (the file
        read once), the ledger's chain, anchor and key, then the policy's version and its keyed commitment to
        ``data`` (``patients``: their patient index, whose grouping a patient-level commitment binds).
        ``verified``: the ``SitePolicy`` the caller verified from ``node_config``'s policy file (``train``:
        once, the public size of its job taken from it), run under instead of reading the file again."""
        missing = [k for k in REQUIRED if k != CFG_DATA and not node_config.get(k)]
        if missing:
            raise ConfigError(f"site config lacks {', '.join(missing)}")
        ids = None if patients is None else patients.ids
        # read and verified once, as :meth:`open` does (or by the caller, whose job was sized from it); its
        # commitment, validity, site key and version are checked over ``data`` in _opened all the same
        policy = (
            _handed_over(verified, node_config)
            if verified is not None
            else verify_policy_file(node_config[CFG_POLICY], node_config[CFG_TRUSTED])
        )
        return cls._opened(
            node_config,
            policy,
            lambda secret, work: (data, patients, dataset_commitment(data, secret, patients=ids)),
        )

    @classmethod
    def _opened(
        cls,
        node_config: dict[str, Any],
        verified: Any,
        data_of: Callable[[bytes, Path], tuple[Any, Any, str]],
        *,
        new_ledger: bool = False,
    ) -> Site:
        """The one way a site opens: its secret and key, its ledger (chain, anchor, head signature), its
        owner-only work directory, then ``data_of(secret, work)`` (the images, their patient index and the
        keyed commitment recomputed over them) checked against ``verified`` (the ``SitePolicy`` the caller
        read and verified from ``node_config``'s policy file, once); the ledger closed on failure.

        ``new_ledger``: the ledger's anchor (what refuses a deleted or older ledger: ``edge.ledger_anchor``)
        moves to the new ledger only after every check that needs no ledger has passed (the policy, the node
        config, the data and their commitment, the site key) and the new ledger was created, in one write
        (``edge.ledger_anchor.start_new``): a start refused for any of those, or killed part-way, never
        leaves an anchor that names no ledger, so an older copy restored later is still refused."""
        secret = load_secret(node_config[CFG_SECRET])
        key = load_private_key(node_config[CFG_SITE_KEY])
        every = _steps(node_config.get(CFG_ROUND_CHECKPOINT))
        ledger_path = node_config[CFG_LEDGER]
        work_path = Path(str(node_config.get(CFG_WORK) or Path(ledger_path).parent / "work"))
        # before anything is written (node start's preflight, each reopen of the worker, train's site)
        ledger_anchor.refuse_open_folders(ledger_path, work_path)
        ledger: Ledger | None = None
        if new_ledger:
            ledger_anchor.refuse_new_over_existing(ledger_path)  # nothing written; before any image is read
        else:
            ledger = _opened_ledger(ledger_path, key, work_path)  # refused before any image is read
        try:
            work = owner_only_dir(work_path)
            data, patients, commitment = data_of(secret, work)
            policy = _checked_policy(node_config, verified, key, data, commitment)
            # the versions the node's ledgers have seen, a lost one's included (--new-ledger): a replayed
            # older policy is refused before a new ledger is created
            check_version(policy, node_config[CFG_POLICY], ledger_anchor.policy_floor(work_path))
            if ledger is None:
                # created, then recorded in place of the lost one in one write (never a record naming none)
                ledger = ledger_anchor.start_new(ledger_path, work_path, lambda: Ledger(ledger_path, key=key))
            check_version(policy, node_config[CFG_POLICY], ledger.highest_policy_version())
            ledger.observe_policy_version(int(policy.version))
            # the floor each message's app-bundle gate reads (it never opens the ledger): edge.trust
            ledger_anchor.raise_floor(work_path, int(policy.version))
            return cls(
                policy=policy,
                data=data,
                ledger=ledger,
                key=key,
                work_dir=work,
                patients=patients,
                device=str(node_config.get(CFG_DEVICE) or "cpu"),
                round_checkpoint_every=every,
            )
        except BaseException:
            if ledger is not None:
                ledger.close()
            raise


def _handed_over(policy: Any, node_config: dict[str, Any]) -> Any:
    """``policy``, a ``SitePolicy`` the caller says it verified from ``node_config``'s policy file, once its
    own signed envelope verifies against the site's trusted key and opens to this very object. Why: the site
    charges under its caps and states it to the coordinator, so an object read without trusting its signer
    (``read_signed_policy_unverified``) or changed in code must not open it. The envelope is the one the
    caller verified, not the file read again (it may have been replaced since): one signature check."""
    source = str(node_config[CFG_POLICY])
    signed = getattr(policy, "signed", None)
    if signed is None:
        raise PolicyError(
            f"{source}: the policy handed to the site is not the signed policy it was verified from (it "
            "carries no signed envelope); open the site from the signed file"
        )
    again = open_signed_policy(signed, [Path(node_config[CFG_TRUSTED])], source)  # refuses another signer
    if dataclasses.replace(again, signed=signed) != policy:
        raise PolicyError(
            f"{source}: the policy handed to the site is not the signed policy it carries (its fields "
            "differ from the signed body); open the site from the signed file"
        )
    return policy


def _checked_policy(node_config: dict[str, Any], policy: Any, key: Any, data: Any, commitment: str) -> Any:
    """``policy`` (verified once by the caller: signature by the trusted key, validity), once it holds the
    keyed commitment to ``data``, a public schema, is still valid and names this site key: every check of the
    policy but its version, which the ledger keeps (``Site._opened``). The file is not read again."""
    source = str(node_config[CFG_POLICY])
    check_commitment(policy, source, commitment)
    # still valid after the data were read (a decode can take minutes), as the second read used to check
    check_validity(policy, source=source)
    # a site held in memory (`train`) refuses a policy without a public schema as an opened one does
    declared_schema(policy, source)
    if not 0.5 * data.n <= policy.dataset_size <= 2 * data.n:
        # Local log only (never sent): the public nominal size drives every rate and denominator, so a
        # far-off value costs utility (noise is scaled for it), not privacy.
        log.warning(
            "%s: the policy's public nominal size %d is far from the %d images here; noise and rates "
            "are set for the nominal size",
            node_config[CFG_POLICY],
            policy.dataset_size,
            data.n,
        )
    if policy.site_key is not None and policy.site_key != public_key_pem(key):
        raise PolicyError(
            f"{node_config[CFG_SITE_KEY]}: this is not the site key that {node_config[CFG_POLICY]} "
            "names (site_key); a verifier would refuse every attestation it signs"
        )
    return policy


def _opened_ledger(path: str | Path, key: Any, work_path: Path) -> Ledger:
    """The site's ledger, its hash chain and head signature checked against ``key``; never a fresh one where
    this site ran on one (deleted: the spent budget would come back), nor an older copy (a backup)."""
    ledger_anchor.refuse_missing(path, work_path)
    ledger = Ledger(path, key=key)
    try:
        ledger_anchor.refuse_regression(ledger, work_path)
    except BaseException:
        ledger.close()
        raise
    return ledger


def _steps(value: Any) -> int:
    try:
        n = int(value or 0)
    except (TypeError, ValueError):
        n = -1
    if n < 0:
        raise ConfigError(f"node config {CFG_ROUND_CHECKPOINT} must be a number of steps >= 0, not {value!r}")
    return n


def check_node_cap(policy: Any, node_config: dict[str, Any]) -> None:
    """The node config's patient cap (node.toml ``[data] patient_cap``, ``node start --patient-cap``) against
    the signed ``policy``, as ``train --patient-cap`` is checked (``data.loading.check_cap_for_policy``):
    under an image-level policy a cap would drop each patient's images past the first K while DP-SGD samples
    images and every ε stays per image; under a patient-level one only the signed cap is used."""
    cap = load_options(node_config).patient_cap
    check_cap_for_policy(
        policy,
        cap,
        cap_source=f"node.toml [data] patient_cap = {cap} (node start --patient-cap)",
        policy_source=str(node_config[CFG_POLICY]),
    )


def _opened_data(node_config: dict[str, Any], policy: Any, secret: bytes, work: Path) -> tuple[Any, Any, str]:
    """(data as the policy's unit of privacy needs them, their patient index, their keyed commitment), checked
    against the policy by the caller (``policy``: its signature checked, its commitment not yet). From the
    private cache when the site's files are the ones it was written for (every step padded to the public size:
    ``edge.site_cache``), else decoded and hashed (O(N), once: at node start, or after the site's files
    changed) and cached for the next open."""
    # the PUBLIC schema (classes, image shape) the data are mapped onto; a policy without one is refused here,
    # cache or not. What a cached open returns is checked against this policy's commitment by the caller all
    # the same.
    schema = declared_schema(policy, str(node_config[CFG_POLICY]))
    n_public, patient_level = (
        int(policy.dataset_size),
        getattr(policy, "privacy_unit", "image") == "patient",
    )
    # the policy's PUBLIC size and shape: a site too large for this machine is refused before anything is read
    check_dataset_memory(n_public, math.prod(schema.image_shape), f"{node_config[CFG_POLICY]} (dataset.size)")
    _check_worker_memory(policy, n_public, tuple(schema.image_shape), node_config)
    key = site_cache.cache_key(node_config, n_public, policy.digest)
    cached = site_cache.load(work, key, secret)
    if cached is not None and ("patients" in cached) == patient_level:
        data, ids, commitment = site_cache.cached_site(cached)
        patients = None
        if ids is not None:
            patients = PatientIndex(np.asarray(ids), int(policy.patients), int(policy.patient_cap))
            site_cache.padded_grouping(patients.n_patients, int(cached["labels"].shape[0]))
        return data, patients, commitment
    data, report = load_site_data_report(node_config[CFG_DATA], load_options(node_config), schema)
    # the policy's unit decides which images are used (its patient cap) BEFORE the commitment is checked
    data, patients = policy_data(
        policy,
        data,
        report,
        data_source=str(node_config[CFG_DATA]),
        policy_source=str(node_config[CFG_POLICY]),
    )
    # a patient-level policy's commitment binds the grouping too (feta_release.data.commitment): regrouped ids
    # refused
    commitment = dataset_commitment(data, secret, patients=None if patients is None else patients.ids)
    # kept only if no file changed while it was decoded
    if site_cache.cache_key(node_config, n_public, policy.digest) == key:
        try:
            site_cache.save(
                work, key, secret, data, None if patients is None else patients.ids, commitment, n_public
            )
        # every later open decodes again (slower, as before the cache): said, not fatal
        except OSError as exc:
            log.warning(
                "%s: cannot write the site cache (%s); each per-message open decodes the data", work, exc
            )
    return data, patients, commitment


def _check_worker_memory(
    policy: Any, n_public: int, shape: tuple[int, ...], node_config: dict[str, Any]
) -> None:
    """Refuse, before anything is read, a site whose float32 images (its PUBLIC size and declared shape) and
    working memory exceed ``resources.max_worker_memory_mb``: the limit ``edge.resources.limit_memory`` sets
    on the computing processes, where on the same rule (a CPU node, or a limit the policy states) the site
    would fail part-way through an open or a charged release instead."""
    device = str(node_config.get(CFG_DEVICE) or "cpu")
    cap = resource_cap(policy, "max_worker_memory_mb")
    if cap <= 0 or (device != "cpu" and "max_worker_memory_mb" not in policy.resources):
        return
    check_site_memory(
        n_public,
        shape,
        cap,
        f"{node_config[CFG_POLICY]} (dataset.size, dataset.image_shape)",
        "resources.max_worker_memory_mb",
    )


_cached_sites: list[Site] = []


@functools.lru_cache(maxsize=8)
def _cached(items: tuple[tuple[str, Any], ...]) -> Site:
    site = Site.open(dict(items))
    _cached_sites.append(site)
    return site


def site_for(node_config: dict[str, Any]) -> Site:
    """One ``Site`` per node config per process (the in-process harness calls handlers many times;
    behind a real SuperNode each message is a fresh process anyway). A config naming a site held in this
    process (:func:`hold_site`, ``CFG_HELD``) answers with that one."""
    held = node_config.get(CFG_HELD)
    if held:
        if held not in _held:
            raise ConfigError(f"no site {held!r} is open in this process")
        return _held[held]
    return _cached(tuple(sorted((str(k), v) for k, v in node_config.items())))


_held: dict[str, Site] = {}


def hold_site(name: str, site: Site) -> None:
    """Serve ``site`` to every handler whose node config names ``name`` under ``CFG_HELD`` (a site opened
    over images in memory by :meth:`Site.in_memory`)."""
    _held[name] = site


def release_site(name: str) -> None:
    """Stop serving the held site ``name`` and close its ledger."""
    site = _held.pop(name, None)
    if site is not None:
        site.ledger.close()


def forget_sites() -> None:
    """Drop every cached ``Site`` (closing its ledger), so the next ``site_for`` opens and verifies it afresh
    (the warm worker, ``edge.worker``, does this when the policy, keys, data or ledger file changed)."""
    for site in _cached_sites:
        try:
            site.ledger.close()
        except Exception:  # noqa: BLE001 - an already broken connection is being dropped anyway
            pass
    _cached_sites.clear()
    _cached.cache_clear()
