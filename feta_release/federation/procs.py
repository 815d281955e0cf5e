"""Starting and stopping Flower processes: each in its own process group, always cleaned up.

Flower processes spawn children (a SuperNode starts ``flower-superexec``, which starts one
``flwr-clientapp`` per message); signalling only the parent would leave those behind. Every
process here is started in a new session and stopped by signalling its whole group.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from ..errors import ConfigError, FetaError


def venv_bin() -> Path:
    """Directory of this interpreter's console scripts (flower-superlink, flwr, ...)."""
    return Path(sys.executable).parent


def flower_env(flwr_home: Path, extra_path: Sequence[Path] = (), **extra: str) -> dict[str, str]:
    """Environment for a Flower process: an explicit FLWR_HOME (never the user's ~/.flwr) and PATH."""
    env = dict(os.environ)
    env["FLWR_HOME"] = str(flwr_home)
    env["PATH"] = os.pathsep.join([*map(str, extra_path), str(venv_bin()), env.get("PATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    flwr_home.mkdir(parents=True, exist_ok=True)
    return env


class ManagedProcess:
    """A child process in its own process group, with its output in a log file.

    With ``on_line``, the output goes through a pipe instead: a reader thread hands every line to ``on_line``,
    which keeps the log itself (e.g. plain text with timestamps: edge.node_state.NodeMonitor)."""

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        env: dict[str, str],
        log_path: Path,
        cwd: Path | None = None,
        on_line: Callable[[str], None] | None = None,
        umask: int | None = None,
    ):
        """``umask``: the child's file-creation mask (a site node passes 0o077: files its handlers write, e.g.
        logs and compute times, are readable by the site's account only); its log file gets the same mode."""
        self.name = name
        self.cmd = list(cmd)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        if umask is not None:
            os.chmod(log_path, 0o666 & ~umask)
        self._reader: threading.Thread | None = None
        # Processes that belong to this one and stop with it (a site node's warm worker: edge.launch).
        self.companions: list[ManagedProcess] = []
        try:
            self.proc = subprocess.Popen(
                self.cmd,
                env=env,
                cwd=cwd,
                stdout=self._log if on_line is None else subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                umask=-1 if umask is None else umask,
            )
        except FileNotFoundError:
            self._log.close()
            raise FetaError(
                f"cannot start {name}: {cmd[0]} not found (is flwr installed in this environment?)"
            ) from None
        if on_line is not None:
            self._reader = threading.Thread(
                target=self._read, args=(on_line,), name=f"{name} output", daemon=True
            )
            self._reader.start()

    def _read(self, on_line: Callable[[str], None]) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                on_line(raw.decode("utf-8", errors="replace"))
            except Exception:  # noqa: BLE001 - keep draining: a full pipe would block the child's next write
                continue

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the whole group, then SIGKILL what is left, then every descendant that left the group: the
        SuperLink's ``flower-superexec`` starts its own session, and the ServerApp it spawned outlived both
        (seen: an orphaned ``flwr-serverapp`` kept training for 50 minutes after a demo had stopped)."""
        family = _descendants(self.proc.pid)
        self._stop_group(timeout)
        for companion in self.companions:
            companion.stop(timeout)
        _kill_all(family, 5.0)
        # the group is gone, so the pipe is at its end: let the reader finish its lines
        if self._reader is not None:
            self._reader.join(5.0)
        self._log.close()

    def _stop_group(self, timeout: float) -> None:
        try:
            pgid = os.getpgid(self.proc.pid)
        except ProcessLookupError:
            pgid = None
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            if pgid is None:
                break
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            # The leader is gone; children of the group may still linger: kill them too.
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        if pgid is not None:  # give the kernel (and init's reaping of orphans) a moment to clear the group
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and group_alive(pgid):
                time.sleep(0.1)

    def tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text("utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _kill_all(family: list[psutil.Process], timeout: float) -> None:
    for child in family:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(family, timeout=timeout)


def kill_tree(pid: int, timeout: float = 10.0) -> None:
    """SIGKILL ``pid``, its process group and every descendant (also those that started their own session): a
    crash, as a power cut or the OOM killer would leave it; ``ManagedProcess.stop`` is the orderly stop."""
    family = _descendants(pid)
    try:
        os.killpg(os.getpgid(pid), signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    _kill_all(family, timeout)


def group_alive(pgid: int) -> bool:
    """True while any process of the group exists that is not a zombie."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for d in Path("/proc").iterdir() if Path("/proc").exists() else []:
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return not Path("/proc").exists()


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, timeout: float, proc: ManagedProcess | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise FetaError(
                f"{proc.name} exited (code {proc.proc.returncode}) before listening on {host}:{port}; "
                f"log {proc.log_path}:\n{proc.tail()}"
            )
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise FetaError(f"nothing listens on {host}:{port} after {timeout:.0f} s")


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"address {address!r} must be host:port")
    return host.strip("[]"), int(port)
