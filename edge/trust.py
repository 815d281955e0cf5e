"""The node's own ``flwr-clientapp``: refuses an app bundle (FAB) whose sha256 is not allowed.

Why: the FAB a coordinator submits is shipped to every node and unpacked FIRST on ``sys.path``,
so its code runs at the site with the site's data and ledger in reach. Flower's
``--trusted-entities`` needs the Flower Hub (unusable air-gapped), so the site keeps its own
allow-list: the ``app_bundles`` hashes of its signed policy.

Flower then loads the ClientApp from a directory derived from ``fab_id``/``fab_version``/hash that
the SuperLink sends beside the bundle; ``check_app_identity`` checks those (plain names, the bundle's
own id/version/hash, a directory directly under FLWR_HOME/apps) and ``check_installed`` checks that
the directory holds exactly the bundle's files before anything is imported.

How: the SuperNode (subprocess isolation) starts ``flower-superexec``, which starts the command
named ``flwr-clientapp`` found on PATH for every message. ``edge.launch`` puts a directory with
our ``flwr-clientapp`` first on PATH; it runs Flower's own ``run_clientapp`` with one change: the
FAB-install function checks the FAB's sha256 against the allow-list BEFORE unpacking it, so no
byte of an untrusted bundle is written or imported. A refusal is logged and answered to the
coordinator as an error reply. This touches a Flower internal (``run_clientapp.install_from_fab``):
flwr is pinned to ``PINNED_FLWR`` and ``check_flower_internals`` fails loudly on any other version.

A node started with a warm worker (``edge.worker``) also wraps the ClientApp loader: once both gates passed,
the allowed bundle's ``edge.clientapp:app`` is replaced by the thin ``edge.forward.app``, which hands the
message to the worker (the same ClientApp, loaded once); any other allowed bundle loads as Flower would.

The allow-list comes from the environment variable ``FETA_ALLOWED_FABS`` (comma-separated
sha256), set by ``feta-release node start`` from the verified policy: the coordinator cannot
change a node's environment. It is narrowed, at every message, to the ``app_bundles`` of the signed
policy the site runs now (``FETA_POLICY_FILE``, verified by ``FETA_TRUSTED_KEY`` and not older than the
versions the node has seen, ``FETA_NODE_WORK``): a bundle the site's administrator removed by re-signing
the policy is refused from the next message on, without a restart (:func:`allowed_hashes`).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import sys
import time
import zipfile
from pathlib import Path
from typing import NoReturn

import flwr
from flwr.common.config import (
    get_fab_config,
    get_flwr_home,
    get_metadata_from_config,
    get_project_config,
    get_project_dir,
)
from flwr.common.constant import APP_DIR
from flwr.supernode.cli.flwr_clientapp import flwr_clientapp
from flwr.supernode.runtime import run_clientapp as rc

from feta_release.allocator import keep_freed_pages
from feta_release.errors import FetaError, PolicyError
from feta_release.policy.document import check_version, load_site_policy

from . import forward, ledger_anchor, runtime_api
from .public_errors import public_error

PINNED_FLWR = "1.42.0"
ENV_ALLOWED = "FETA_ALLOWED_FABS"
ENV_LOG = "FETA_TRUST_LOG"
# the site's signed policy, its trusted key and the node's work folder (the policy versions seen): the
# allow-list of every message is narrowed to the app_bundles of the policy verified from these now
ENV_POLICY = "FETA_POLICY_FILE"
ENV_TRUSTED = "FETA_TRUSTED_KEY"
ENV_WORK = "FETA_NODE_WORK"

log = logging.getLogger("feta.trust")


class UntrustedAppError(PolicyError):
    """An app bundle whose hash is not in the site's signed allow-list."""


def fab_hash(fab_bytes: bytes) -> str:
    return hashlib.sha256(fab_bytes).hexdigest()


def started_hashes() -> set[str]:
    """The allow-list ``node start`` verified (the policy's app_bundles at start: ``FETA_ALLOWED_FABS``)."""
    raw = os.environ.get(ENV_ALLOWED, "")
    return {h.strip().lower() for h in raw.split(",") if h.strip()}


def current_hashes() -> tuple[set[str], int] | None:
    """(app_bundles, version) of the signed policy the site runs NOW (``FETA_POLICY_FILE``: signature by the
    trusted key, validity window, a version not older than the node has seen), read for this message; None
    where the node's environment names no policy. A file that does not verify now refuses every bundle
    (``UntrustedAppError``): the site would refuse to open under it too."""
    path = os.environ.get(ENV_POLICY)
    if not path:
        return None
    try:
        pol = load_site_policy(path, [Path(os.environ.get(ENV_TRUSTED, ""))])
        work = os.environ.get(ENV_WORK)
        if work:
            check_version(pol, path, ledger_anchor.policy_floor(work))
    except FetaError as exc:
        _deny("refused every app bundle: the site's signed policy does not verify now", f" ({exc})")
    return {h.strip().lower() for h in pol.app_bundles}, int(pol.version)


def allowed_hashes() -> set[str]:
    """The bundles this message may run: those ``node start`` verified that the policy the site runs now
    still lists (:func:`current_hashes`).

    Why narrowed and never widened by the file read here: a site's administrator who re-signs the policy to
    remove a bundle expects the running node to stop running it at once, while this allow-list was fixed at
    start (the warm worker reopens the site under the new policy, but this process decides what code runs,
    before the worker sees the message). The check here is lighter than a site open (no data commitment, no
    site key: this process never opens the site), so the file it reads may take a bundle away but not add
    one; adding one takes a restart, which verifies the policy in full (:func:`check_fab` says so)."""
    start = started_hashes()
    now = current_hashes()
    return start if now is None else start & now[0]


def check_fab(fab_bytes: bytes, allowed: set[str] | None = None) -> str:
    """Return the FAB's sha256 if allowed (``allowed``, else :func:`allowed_hashes`); raise
    ``UntrustedAppError`` (and log it) otherwise."""
    h = fab_hash(fab_bytes)
    if allowed is None:
        start, now = started_hashes(), current_hashes()
        if now is not None and h in start and h not in now[0]:
            _deny(
                f"refused app bundle sha256={h}: the site's signed policy (version {now[1]}) no longer lists "
                "it in app_bundles (the one the node started under did); none of its code was unpacked or "
                "imported"
            )
        if now is not None and h in now[0] and h not in start:
            _deny(
                f"refused app bundle sha256={h}: the site's signed policy (version {now[1]}) lists it, the "
                "one the node started under did not; restart the node (`feta-release node start`) to run "
                "it; none of its code was unpacked or imported"
            )
        allow = start if now is None else start & now[0]
    else:
        allow = allowed
    if h not in allow:
        msg = (
            f"refused app bundle sha256={h}: not in this site's allow-list (policy app_bundles: "
            f"{', '.join(sorted(allow)) or 'empty'}); none of its code was unpacked or imported"
        )
        _audit(msg)
        raise UntrustedAppError(msg)
    return h


def _deny(public: str, detail: str = "") -> NoReturn:
    """Refuse the bundle: the full line (``detail`` may name local paths) in the node's trust log, the public
    part in the refusal the coordinator gets."""
    _audit(public + detail)
    raise UntrustedAppError(public)


def _audit(line: str) -> None:
    log.error(line)
    path = os.environ.get(ENV_LOG)
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {line}\n")


def check_flower_internals() -> None:
    if flwr.__version__ != PINNED_FLWR:
        raise PolicyError(
            f"the FAB allow-list gate is built on flwr {PINNED_FLWR} internals, but flwr {flwr.__version__} "
            "is installed; refusing to run app bundles unchecked"
        )
    for name in ("install_from_fab", "pull_task_input", "get_project_dir", "get_load_client_app_fn"):
        if not callable(getattr(rc, name, None)):
            raise PolicyError(f"flwr internals changed: run_clientapp.{name} not found; refusing to start")


# Plain names only: Flower builds the app directory as FLWR_HOME/apps/<publisher>.<name>.<version>.<hash8>.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}")
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+_-]{0,63}")


def _refuse(msg: str) -> None:
    _audit(msg)  # the full line (paths included) in the node's own trust log
    raise public_error(UntrustedAppError(msg), where="app bundle")  # the error reply names no local path


def check_app_identity(
    fab_id: str,
    fab_version: str,
    fab_hash: str,
    fab_bytes: bytes,
    flwr_home: Path,
    allowed: set[str] | None = None,
) -> Path:
    """The directory Flower will load the ClientApp from, if every part of it is what the allow-list means.

    Flower loads from ``get_project_dir(run.fab_id, run.fab_version, fab.hash_str)``: three strings
    the SuperLink sends BESIDE the bundle. The bytes being allowed is not enough: a ``fab_version``
    with ``/../`` escapes FLWR_HOME, and a mismatching id/version/hash points at another (older,
    no longer allowed) installed app. So: the bytes' sha256 is allowed, the hash sent is that sha256,
    the id and version sent are the bundle's own (its pyproject.toml), all are plain names, and the
    resulting directory is a direct child of FLWR_HOME/apps.
    """
    h = check_fab(fab_bytes, allowed)
    what = f"app bundle sha256={h}"
    if not isinstance(fab_hash, str) or fab_hash.lower() != h:
        _refuse(f"refused {what}: the run names hash {fab_hash!r}, not the bundle's own; nothing was loaded")
    parts = fab_id.split("/") if isinstance(fab_id, str) else []
    if (
        len(parts) != 2
        or not all(_NAME.fullmatch(x) for x in parts)
        or not isinstance(fab_version, str)
        or not _VERSION.fullmatch(fab_version)
        or ".." in fab_version
    ):
        _refuse(
            f"refused {what}: fab_id {fab_id!r} / fab_version {fab_version!r} are not plain names "
            "(path characters could make Flower load code from elsewhere); nothing was loaded"
        )
    try:
        own_id, own_version = get_metadata_from_config(get_fab_config(fab_bytes))
    except Exception as exc:  # noqa: BLE001 - any unreadable bundle is refused
        _refuse(f"refused {what}: its pyproject.toml cannot be read ({exc}); nothing was loaded")
    if (own_id, own_version) != (fab_id, fab_version):
        _refuse(
            f"refused {what}: the run names {fab_id} {fab_version} but the bundle is {own_id} {own_version}; "
            "nothing was loaded"
        )
    apps = (Path(flwr_home) / APP_DIR).resolve()
    target = get_project_dir(fab_id, fab_version, fab_hash)
    if target.resolve().parent != apps or target.parent.resolve() != apps:
        _refuse(f"refused {what}: Flower would load it from {target}, outside {apps}; nothing was loaded")
    return target


def bundle_files(fab_bytes: bytes) -> dict[str, str]:
    """{relative path: sha256} of the files a bundle installs (its signed-by-hash CONTENT list)."""
    with zipfile.ZipFile(io.BytesIO(fab_bytes)) as z:
        content = z.read(".info/CONTENT").decode("utf-8")
    out = {}
    for line in content.strip().splitlines():
        rel, digest, _size = line.rsplit(",", 2)
        out[rel] = digest
    return out


def check_installed(app_dir: Path, fab_bytes: bytes) -> None:
    """The installed directory holds exactly the bundle's files, byte for byte.

    Flower skips installing when the directory already exists and then imports whatever is there;
    a file changed or added in it (an extra module shadows any import: the directory is first on
    ``sys.path``) would run unchecked. Bytecode caches (``__pycache__``) are Python's own.
    """
    want = bundle_files(fab_bytes)
    have = {}
    for f in Path(app_dir).rglob("*"):
        rel = f.relative_to(app_dir).as_posix()
        if "__pycache__" in f.relative_to(app_dir).parts or f.is_dir():
            continue
        if f.is_symlink():
            _refuse(f"refused app directory {app_dir}: {rel} is a link; nothing was loaded")
        have[rel] = hashlib.sha256(f.read_bytes()).hexdigest()
    if have != want:
        diff = sorted(set(have) ^ set(want)) + sorted(k for k in set(have) & set(want) if have[k] != want[k])
        _refuse(
            f"refused app directory {app_dir}: it differs from the allowed bundle ({', '.join(diff[:5])}); "
            "nothing was loaded. Delete the directory so the node reinstalls the bundle"
        )


def install_gate() -> None:
    """Wrap the two Flower steps that decide what code runs: the task input and the FAB install."""
    check_flower_internals()
    if not getattr(rc.pull_task_input, "__feta_gate__", False):
        original_pull = rc.pull_task_input

        def gated_pull_task_input(client, *args, **kwargs):  # type: ignore[no-untyped-def]
            message, context, run, fab = original_pull(client, *args, **kwargs)
            _current.clear()
            try:
                _current["dir"] = check_app_identity(
                    run.fab_id, run.fab_version, fab.hash_str, fab.content, get_flwr_home()
                )
                _current["fab"] = fab.content
            except UntrustedAppError as exc:
                # Raised at the install step instead (the very next one, before anything is unpacked): only
                # there does Flower hold the message it needs to send the refusal back to the coordinator.
                _current["refusal"] = exc
            return message, context, run, fab

        gated_pull_task_input.__feta_gate__ = True  # type: ignore[attr-defined]
        rc.pull_task_input = gated_pull_task_input
    if not getattr(rc.install_from_fab, "__feta_gate__", False):
        original_install = rc.install_from_fab

        def gated_install_from_fab(fab_file, *args, **kwargs):  # type: ignore[no-untyped-def]
            if isinstance(_current.get("refusal"), UntrustedAppError):
                raise _current["refusal"]  # type: ignore[misc]
            data = fab_file if isinstance(fab_file, bytes) else Path(fab_file).read_bytes()
            check_fab(data)  # before a single byte is unpacked
            if _current.get("fab") != data:
                _refuse(
                    "refused app bundle: it is not the one whose identity was checked; nothing was loaded"
                )
            path = original_install(fab_file, *args, **kwargs)
            if Path(path).resolve() != Path(_current["dir"]).resolve():
                _refuse(f"refused app bundle: installed at {path}, but Flower will load {_current['dir']}")
            check_installed(Path(path), data)
            return path

        gated_install_from_fab.__feta_gate__ = True  # type: ignore[attr-defined]
        rc.install_from_fab = gated_install_from_fab
    _install_worker_hand_off()


def _names_our_clientapp(app_dir: object) -> bool:
    """True when the checked, installed bundle's ClientApp component is feta-release's own
    (edge.clientapp:app)."""
    try:
        ref = get_project_config(Path(str(app_dir)))["tool"]["flwr"]["app"]["components"]["clientapp"]
    except Exception:  # noqa: BLE001 - Flower's own loader reports an unreadable bundle
        return False
    return bool(ref == forward.CLIENTAPP_REF)


def _install_worker_hand_off() -> None:
    """Load the thin forwarding ClientApp (``edge.forward``) instead of ``edge.clientapp:app`` when the node
    runs a warm worker (``edge.worker``). Runs only after the two gates above passed for this message's
    bundle: the loader is called after the install step, and ``_current["dir"]`` is the directory whose
    identity and files were checked. Any other allowed bundle (e.g. the benchmark's ping app) loads as Flower
    would."""
    if getattr(rc.get_load_client_app_fn, "__feta_gate__", False):
        return
    original = rc.get_load_client_app_fn

    def gated_get_load_client_app_fn(*args, **kwargs):  # type: ignore[no-untyped-def]
        load = original(*args, **kwargs)

        def _load(fab_id: str, fab_version: str, fab_hash: str):  # type: ignore[no-untyped-def]
            checked = _current.get("dir")
            if (
                forward.worker_configured()
                and checked is not None
                and _names_our_clientapp(checked)
                and get_project_dir(fab_id, fab_version, fab_hash).resolve() == Path(str(checked)).resolve()
            ):
                return forward.app
            return load(fab_id, fab_version, fab_hash)

        return _load

    gated_get_load_client_app_fn.__feta_gate__ = True  # type: ignore[attr-defined]
    rc.get_load_client_app_fn = gated_get_load_client_app_fn


# What the task input of this process (one message per flwr-clientapp process) was checked to be.
_current: dict[str, object] = {}


def main() -> None:
    """Entry point used as ``flwr-clientapp`` on the node (Flower's arguments; the task token comes in the
    environment and the Runtime API is the node's private socket: ``edge.runtime_api``)."""
    # without a warm worker this process trains, under the policy's data limit: feta_release.allocator
    keep_freed_pages(under_data_limit=True)
    install_gate()
    runtime_api.client_side()
    flwr_clientapp()


def write_wrapper(bin_dir: str | Path) -> Path:
    """Write the ``flwr-clientapp`` shim that ``edge.launch`` puts first on the node's PATH."""
    d = Path(bin_dir)
    d.mkdir(parents=True, exist_ok=True)
    shim = d / "flwr-clientapp"
    shim.write_text(f"#!{sys.executable}\nfrom edge.trust import main\nmain()\n", encoding="utf-8")
    shim.chmod(0o755)
    return shim


if __name__ == "__main__":
    main()
