"""Starting a site's Flower SuperNode after the site's own checks pass.

Before anything starts: the signed policy is verified against the site's trusted key, the data's
keyed commitment (HMAC under the site's secret) must match the policy, the ledger must not have seen a
newer policy, the FAB gate must be installable on this flwr version. Then Flower's SuperNode runs with the
site's settings in ``--node-config`` (read by the ClientApp as ``context.node_config``; the coordinator cannot
change them) and with our ``flwr-clientapp`` (the FAB allow-list gate, ``edge.trust``) and
``flower-superexec`` first on PATH; its local Runtime API is a Unix socket in a 0700 directory, never a TCP
port (``edge.runtime_api``).
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from feta_release.data.loading import LoadOptions
from feta_release.errors import ConfigError, FetaError, PolicyError
from feta_release.federation.procs import ManagedProcess, flower_env, is_loopback
from feta_release.files import private_dir
from feta_release.policy.document import utc_stamp
from feta_release.signing import refuse_shared_secret_file

from . import channel, ledger_anchor, runtime_api, trust
from .node_state import NodeMonitor
from .site import (
    CFG_DATA,
    CFG_DEVICE,
    CFG_IMAGE_SIZE,
    CFG_LEDGER,
    CFG_PATIENT_CAP,
    CFG_POLICY,
    CFG_RESIZE,
    CFG_ROUND_CHECKPOINT,
    CFG_SECRET,
    CFG_SITE_KEY,
    CFG_TRUSTED,
    CFG_WINDOW,
    CFG_WORK,
    Site,
)

log = logging.getLogger("feta.node")


@dataclass
class NodeSettings:
    data: Path
    policy: Path
    trusted_policy_key: Path
    ledger: Path
    site_key: Path
    data_secret: Path
    superlink: str = "127.0.0.1:9092"
    # Unused: the node's local Runtime API is a private Unix socket (edge.runtime_api), no TCP port. Kept so
    # that node.toml files and scripts that name a port still start.
    port: int = 9101
    root_certificates: Path | None = None
    auth_key: Path | None = None
    insecure: bool = False
    force_insecure: bool = False
    work_dir: Path | None = None
    load: LoadOptions | None = None  # how files become images (same as `data inspect --resize ...`)
    # a warm worker (edge.worker) answers the messages; False: a fresh process per message
    worker: bool = True
    # auto/cpu/cuda: where DP-SGD and FedSGD rounds compute (feta_release.training.device)
    device: str = "cpu"
    new_ledger: bool = False  # start a NEW ledger where the node ran on one (edge.ledger_anchor; logged)
    # DP-SGD steps between a round's checkpoints (edge.releases.RoundCheckpoint)
    round_checkpoint_every: int = 0

    def node_config(self) -> dict[str, str]:
        work = self.work_dir or self.ledger.parent / "work"
        cfg = {
            CFG_DATA: str(self.data.resolve()),
            CFG_POLICY: str(self.policy.resolve()),
            CFG_TRUSTED: str(self.trusted_policy_key.resolve()),
            # its own name as given: a link there stays one for the checks and the creation to refuse
            CFG_LEDGER: str(ledger_anchor.as_given(self.ledger)),
            CFG_SITE_KEY: str(self.site_key.resolve()),
            CFG_WORK: str(Path(work).resolve()),
            CFG_SECRET: str(self.data_secret.resolve()),
        }
        if self.load is not None and self.load != LoadOptions():
            cfg.update(
                {
                    CFG_RESIZE: self.load.resize,
                    CFG_IMAGE_SIZE: str(self.load.image_size or 0),
                    CFG_WINDOW: self.load.window,
                    CFG_PATIENT_CAP: str(self.load.patient_cap or 0),
                }
            )
        # as the load options: a CPU node's config (and its site-data cache key) unchanged
        if self.device != "cpu":
            cfg[CFG_DEVICE] = self.device
        if self.round_checkpoint_every:
            cfg[CFG_ROUND_CHECKPOINT] = str(self.round_checkpoint_every)
        return cfg


def _toml_string(v: str) -> str:
    return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'


def node_config_arg(cfg: dict[str, str]) -> str:
    return " ".join(f"{k}={_toml_string(v)}" for k, v in cfg.items())


def check_transport(s: NodeSettings) -> None:
    if s.insecure:
        if s.root_certificates or s.auth_key:
            raise ConfigError("--insecure cannot be combined with --root-certificates/--auth-key")
        if not is_loopback(s.superlink) and not s.force_insecure:
            raise ConfigError(
                f"refusing --insecure to non-loopback SuperLink {s.superlink}: traffic (model weights, "
                "released statistics) would cross the network unencrypted. Use --root-certificates (TLS) or, "
                "if you really must, add --force-insecure"
            )
        print(
            "WARNING: --insecure: NO TLS and NO node authentication between this site and the coordinator. "
            "Use only for loopback demos.",
            file=sys.stderr,
            flush=True,
        )
    elif s.root_certificates is None:
        raise ConfigError("give --root-certificates CA.crt (TLS) or, for a loopback demo only, --insecure")
    elif s.auth_key is None and not is_loopback(s.superlink):
        # Outside loopback the coordinator binds each site to its registered node key; a node without
        # one could only join a SuperLink that lets anyone in.
        raise ConfigError(
            f"give --auth-key: node authentication is required to reach non-loopback SuperLink "
            f"{s.superlink} (make a key with `feta-release coordinator certs --node SITE` and have "
            "the coordinator register its .pub)"
        )


def check_device(name: str) -> None:
    """``--device`` resolved before anything is opened, written or started (``cuda`` where torch sees no GPU:
    one ConfigError line). torch only for a non-CPU request: a CPU node's supervising process never loads it
    (its worker and per-message ClientApps, which compute, do)."""
    if name != "cpu":
        from feta_release.training.device import resolve_device

        resolve_device(name)


def preflight(s: NodeSettings) -> Site:
    """Everything the node refuses to start without. Returns the opened site (policy verified)."""
    # the path as given, in one line before anything is written (the creation refuses a link put there later)
    ledger_anchor.refuse_link(s.ledger, new_ledger=s.new_ledger)
    check_device(s.device)
    check_transport(s)
    # Flower reads it itself, without this check: whoever reads it joins as this site
    if s.auth_key is not None:
        refuse_shared_secret_file(s.auth_key, "node authentication key")
    trust.check_flower_internals()
    runtime_api.check_runtime_api_internals()
    work = Path(s.node_config()[CFG_WORK])

    # refuses a missing or rolled-back ledger (edge.ledger_anchor); with --new-ledger, resets the anchor only
    # once the policy, the node config and the data have passed. The app-bundle check is decided from the
    # policy alone, on the object the site verified (the file is read once): refused before the ledger or its
    # anchor is touched
    def refuse_no_app_bundle(policy: Any) -> None:
        if not policy.app_bundles:
            raise PolicyError(
                f"{s.policy}: the policy allows no app bundle (app_bundles is empty): nothing could run"
            )

    site = Site.open(s.node_config(), new_ledger=s.new_ledger, check=refuse_no_app_bundle)
    try:
        site.ledger.verify(deep=True)  # also every stored answer's bytes, once per start
        ledger_anchor.record(site.ledger, work)
    except BaseException:
        site.ledger.close()
        raise
    return site


def supernode_command(s: NodeSettings) -> list[str]:
    """Flower's SuperNode with its Runtime API on the private socket (``edge.runtime_api``); ``-P`` as for the
    worker (``start_worker``): no module of the directory the admin started the node from is imported."""
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "edge.runtime_api",
        "supernode",
        "--superlink",
        s.superlink,
        "--node-config",
        node_config_arg(s.node_config()),
    ]
    if s.insecure:
        cmd.append("--insecure")
    else:
        cmd += ["--root-certificates", str(s.root_certificates)]
        if s.auth_key:
            cmd += ["--auth-supernode-private-key", str(s.auth_key)]
    return cmd


WORKER_READY_TIMEOUT = 300.0  # importing torch and opening the site on a loaded 2-core machine


@dataclass
class WorkerChannel:
    """Where the node's per-message ClientApps reach its worker: socket and key file (both 0600, dir 0700)."""

    socket: Path
    key_file: Path

    def env(self) -> dict[str, str]:
        return {channel.ENV_SOCKET: str(self.socket), channel.ENV_KEY: str(self.key_file)}


def new_worker_channel(work: Path) -> WorkerChannel:
    """A fresh channel for this node start: a new random key (the old one, if any, stops working)."""
    state = private_dir(work / "worker", error=channel.WorkerRequestError)
    ch = WorkerChannel(channel.socket_path(state), state / "worker.key")
    channel.write_key(ch.key_file)
    return ch


def start_worker(
    s: NodeSettings, ch: WorkerChannel, env: dict[str, str], work: Path, timeout: float = WORKER_READY_TIMEOUT
) -> ManagedProcess:
    """Start the warm worker (``python -P -m edge.worker``) and wait until it answers on the channel.

    ``-P``: ``python -m`` would put the current directory first on ``sys.path``, so an ``edge/`` package
    another local user planted where the admin started the node (``/tmp``, a shared folder) would run as the
    site account, with its key, secret, ledger and images."""
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "edge.worker",
        "--node-config",
        json.dumps(s.node_config()),
        "--socket",
        str(ch.socket),
        "--key-file",
        str(ch.key_file),
    ]
    proc = ManagedProcess("worker", cmd, env, work / "worker.log", umask=0o077)
    key = channel.read_key(ch.key_file)
    deadline = time.monotonic() + timeout
    while True:
        if not proc.alive():
            raise FetaError(
                f"the node's worker exited (code {proc.proc.returncode}) before it was ready; "
                f"log {proc.log_path}:\n{proc.tail()}"
            )
        try:
            reply, _ = channel.call(ch.socket, key, {"kind": "ping"}, [])
            if reply.get("ok") is True:
                return proc
            raise FetaError(f"the node's worker cannot serve: {reply.get('error')}")
        except channel.WorkerUnavailable:
            if time.monotonic() > deadline:
                proc.stop()
                raise FetaError(
                    f"the node's worker was not ready after {timeout:.0f} s; log {proc.log_path}"
                ) from None
            time.sleep(0.2)


def start_node(
    s: NodeSettings, log_path: Path | None = None, announce: Callable[[str], None] | None = None
) -> ManagedProcess:
    """Preflight, then start the SuperNode as a managed process group (returns at once).

    Its output becomes a plain-text log with UTC timestamps (``log_path``, default ``WORK/supernode.log``) and
    the node's state (``WORK/node-state.json``, shown by ``node status``); ``announce`` gets each state
    change."""
    site = preflight(s)
    work = Path(s.node_config()[CFG_WORK])
    shim_dir = work / "bin"
    trust.write_wrapper(shim_dir)
    runtime_api.write_superexec_shim(shim_dir)
    env = flower_env(
        work / "flwr_home",
        [shim_dir],
        **{
            trust.ENV_ALLOWED: ",".join(site.policy.app_bundles),
            # each message narrows that list to the policy the site runs then (edge.trust.allowed_hashes)
            trust.ENV_POLICY: s.node_config()[CFG_POLICY],
            trust.ENV_TRUSTED: s.node_config()[CFG_TRUSTED],
            trust.ENV_WORK: str(work),
            trust.ENV_LOG: str(work / "trust.log"),
            runtime_api.ENV_SOCKET: str(
                channel.socket_path(
                    private_dir(work / "runtime", error=channel.WorkerRequestError), runtime_api.SOCKET_NAME
                )
            ),
        },
    )
    site.ledger.close()
    worker = None
    if s.worker:
        ch = new_worker_channel(work)
        worker = start_worker(s, ch, env, work)
        env.update(ch.env())
    log_path = log_path or work / "supernode.log"
    monitor = NodeMonitor(s.superlink, work, log_path, ledger=s.ledger, announce=announce)
    try:
        proc = ManagedProcess(
            f"node {site.site_id}", supernode_command(s), env, log_path, on_line=monitor.feed, umask=0o077
        )
    except BaseException:
        if worker is not None:
            worker.stop()
        raise
    if worker is not None:
        proc.companions.append(worker)
    monitor.set_pid(proc.pid)
    proc.monitor = monitor  # type: ignore[attr-defined]
    proc.worker_start = (lambda: start_worker(s, ch, env, work)) if worker is not None else None  # type: ignore[attr-defined]
    return proc


def keep_worker(proc: ManagedProcess) -> None:
    """Restart the node's worker if it died (meanwhile each message is handled in its own process:
    edge.forward). A worker that cannot be restarted is not retried: messages keep running in their own
    processes."""
    restart = getattr(proc, "worker_start", None)
    for i, w in enumerate(proc.companions):
        if w.name != "worker" or w.alive() or restart is None:
            continue
        code = w.proc.returncode
        w.stop()
        _say(
            f"{utc_stamp()} the node's worker exited (code {code}); restarting it (messages meanwhile run in "
            "their own process)"
        )
        try:
            proc.companions[i] = restart()
            _say(f"{utc_stamp()} the node's worker is back (pid {proc.companions[i].pid})")
        except FetaError as exc:
            proc.worker_start = None  # type: ignore[attr-defined]
            _say(
                f"{utc_stamp()} the node's worker could not be restarted; messages run in their own process: "
                f"{exc}"
            )


def _say(line: str) -> None:
    print(line, flush=True)


def run_node(s: NodeSettings) -> int:
    """``feta-release node start``: run in the foreground until Ctrl-C, then stop the whole group."""
    proc = start_node(s, announce=_say)
    _say(
        f"{utc_stamp()} site node started (pid {proc.pid}); plain-text log: {proc.log_path}; "
        "`feta-release node status --config node.toml` shows its state"
    )
    stop = {"flag": False}

    def handler(signum, frame):  # noqa: ANN001
        stop["flag"] = True

    signal.signal(signal.SIGTERM, handler)
    try:
        while not stop["flag"] and proc.alive():
            try:
                proc.proc.wait(1.0)
            except Exception:  # noqa: BLE001 - TimeoutExpired: keep waiting
                keep_worker(proc)
    except KeyboardInterrupt:
        pass
    finally:
        code = proc.proc.poll()
        proc.stop()
        proc.monitor.stopped(code)  # type: ignore[attr-defined]
    if code not in (None, 0):
        print(f"the SuperNode exited with code {code}; last log lines:\n{proc.tail()}", file=sys.stderr)
        return int(code)
    return 0
