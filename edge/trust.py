"""The node's own ``flwr-clientapp``: refuses an app bundle (FAB) whose sha256 is not allowed.

Why: the FAB a coordinator submits is shipped to every node and unpacked FIRST on ``sys.path``,
so its code runs at the site with the site's data and ledger in reach. Flower's
``--trusted-entities`` needs the Flower Hub (unusable air-gapped), so the site keeps its own
allow-list: the ``app_bundles`` hashes of its signed policy.

How: the SuperNode (subprocess isolation) starts ``flower-superexec``, which starts the command
named ``flwr-clientapp`` found on PATH for every message. ``edge.launch`` puts a directory with
our ``flwr-clientapp`` first on PATH; it runs Flower's own ``run_clientapp`` with one change: the
FAB-install function checks the FAB's sha256 against the allow-list BEFORE unpacking it, so no
byte of an untrusted bundle is written or imported. A refusal is logged and answered to the
coordinator as an error reply. This touches a Flower internal (``run_clientapp.install_from_fab``):
flwr is pinned to ``PINNED_FLWR`` and ``check_flower_internals`` fails loudly on any other version.

The allow-list comes from the environment variable ``FETA_ALLOWED_FABS`` (comma-separated
sha256), set by ``feta-release node start`` from the verified policy: the coordinator cannot
change a node's environment.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from pathlib import Path

from feta_release.errors import PolicyError

PINNED_FLWR = "1.41.0"
ENV_ALLOWED = "FETA_ALLOWED_FABS"
ENV_LOG = "FETA_TRUST_LOG"

log = logging.getLogger("feta.trust")


class UntrustedAppError(PolicyError):
    """An app bundle whose hash is not in the site's signed allow-list."""


def fab_hash(fab_bytes: bytes) -> str:
    return hashlib.sha256(fab_bytes).hexdigest()


def allowed_hashes() -> set[str]:
    raw = os.environ.get(ENV_ALLOWED, "")
    return {h.strip().lower() for h in raw.split(",") if h.strip()}


def check_fab(fab_bytes: bytes, allowed: set[str] | None = None) -> str:
    """Return the FAB's sha256 if allowed; raise ``UntrustedAppError`` (and log it) otherwise."""
    h = fab_hash(fab_bytes)
    allow = allowed_hashes() if allowed is None else allowed
    if h not in allow:
        msg = (
            f"refused app bundle sha256={h}: not in this site's allow-list (policy app_bundles: "
            f"{', '.join(sorted(allow)) or 'empty'}); none of its code was unpacked or imported"
        )
        _audit(msg)
        raise UntrustedAppError(msg)
    return h


def _audit(line: str) -> None:
    log.error(line)
    path = os.environ.get(ENV_LOG)
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {line}\n")


def check_flower_internals() -> None:
    import flwr
    from flwr.supernode.runtime import run_clientapp as rc

    if flwr.__version__ != PINNED_FLWR:
        raise PolicyError(
            f"the FAB allow-list gate is built on flwr {PINNED_FLWR} internals, but flwr {flwr.__version__} is "
            "installed; refusing to run app bundles unchecked"
        )
    if not callable(getattr(rc, "install_from_fab", None)):
        raise PolicyError("flwr internals changed: run_clientapp.install_from_fab not found; refusing to start")


def install_gate() -> None:
    """Wrap Flower's FAB installer in the ClientApp runtime with the allow-list check."""
    check_flower_internals()
    from flwr.supernode.runtime import run_clientapp as rc

    original = rc.install_from_fab
    if getattr(original, "__feta_gate__", False):
        return

    def gated_install_from_fab(fab_file, *args, **kwargs):  # type: ignore[no-untyped-def]
        data = fab_file if isinstance(fab_file, bytes) else Path(fab_file).read_bytes()
        check_fab(data)
        return original(fab_file, *args, **kwargs)

    gated_install_from_fab.__feta_gate__ = True  # type: ignore[attr-defined]
    rc.install_from_fab = gated_install_from_fab


def main() -> None:
    """Entry point used as ``flwr-clientapp`` on the node (same arguments as Flower's)."""
    install_gate()
    from flwr.supernode.cli.flwr_clientapp import flwr_clientapp

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
