"""Running the coordinator's Flower SuperLink, and submitting a run to it with ``flwr run``.

The SuperLink keeps its state in a database (``--database``) so nodes stay registered across a
restart (``database=None``: Flower's in-memory state, for the demo, which never outlives its SuperLink and
which, on a loaded machine, lost runs to SQLite's "database is locked" answered as HTTP 500),
and never installs an app's dependencies at run time
(``--disable-runtime-dependency-installation``): the sites run only what is installed.
``flwr`` is always called with an explicit ``FLWR_HOME`` whose ``config.toml`` names this SuperLink;
without it the CLI silently falls back to a local simulation.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from feta_release.errors import ConfigError, FetaError
from feta_release.federation.procs import ManagedProcess, flower_env, is_loopback, wait_for_port

FEDERATION = "feta"


@dataclass
class SuperLinkSettings:
    host: str = "127.0.0.1"
    port: int = 9092
    database: Path | None = Path("state.db")
    insecure: bool = False
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    ssl_ca_certfile: Path | None = None
    # None: on unless the SuperLink listens on loopback only (then every node is on this machine).
    enable_supernode_auth: bool | None = None
    home: Path = Path(".feta-coordinator")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def node_auth(self) -> bool:
        """Whether nodes must authenticate with a registered key (on by default outside loopback)."""
        if self.enable_supernode_auth is None:
            return not is_loopback(self.address)
        if not self.enable_supernode_auth and not is_loopback(self.address):
            raise ConfigError(
                f"refusing to run the SuperLink on {self.address} without node authentication: any "
                "machine that reaches the port could join as a site. Drop --no-supernode-auth and "
                "register each site's node key (`feta-release coordinator register`)"
            )
        return self.enable_supernode_auth


def superlink_command(s: SuperLinkSettings) -> list[str]:
    cmd = [
        "flower-superlink",
        "--host",
        s.host,
        "--port",
        str(s.port),
        "--disable-runtime-dependency-installation",
    ]
    if s.database is not None:
        cmd += ["--database", str(s.database)]
    if s.insecure:
        if any([s.ssl_certfile, s.ssl_keyfile, s.ssl_ca_certfile]):
            raise ConfigError("--insecure cannot be combined with --ssl-* files")
        if s.enable_supernode_auth:
            raise ConfigError("node authentication needs TLS: drop --insecure and give --ssl-* files")
        if not is_loopback(s.address):
            raise ConfigError(f"refusing --insecure on non-loopback address {s.address}")
        cmd.append("--insecure")
    else:
        if not (s.ssl_certfile and s.ssl_keyfile and s.ssl_ca_certfile):
            raise ConfigError(
                "give --ssl-certfile, --ssl-keyfile and --ssl-ca-certfile (TLS), or --insecure "
                "for a loopback demo"
            )
        cmd += [
            "--ssl-certfile",
            str(s.ssl_certfile),
            "--ssl-keyfile",
            str(s.ssl_keyfile),
            "--ssl-ca-certfile",
            str(s.ssl_ca_certfile),
        ]
        if s.node_auth():
            cmd.append("--enable-supernode-auth")
    return cmd


def start_superlink(s: SuperLinkSettings, log_path: Path | None = None, wait: float = 60.0) -> ManagedProcess:
    s.home.mkdir(parents=True, exist_ok=True)
    if s.database is not None:
        s.database.parent.mkdir(parents=True, exist_ok=True)
    env = flower_env(s.home / "flwr_home")
    proc = ManagedProcess("superlink", superlink_command(s), env, log_path or s.home / "superlink.log")
    try:
        wait_for_port(s.host, s.port, wait, proc)
    except BaseException:
        proc.stop()
        raise
    return proc


def write_flwr_config(
    flwr_home: Path, address: str, *, insecure: bool, root_certificates: Path | None = None
) -> Path:
    """``$FLWR_HOME/config.toml`` naming the SuperLink as federation ``feta``."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    lines = [
        "[superlink]",
        f'default = "{FEDERATION}"',
        "",
        f"[superlink.{FEDERATION}]",
        f'address = "{address}"',
    ]
    if insecure:
        lines.append("insecure = true")
    elif root_certificates is not None:
        lines.append(f'root-certificates = "{Path(root_certificates).resolve()}"')
    path = flwr_home / "config.toml"
    path.write_text("\n".join(lines) + "\n", "utf-8")
    return path


def flwr_run_command(app_dir: Path, run_config: dict[str, str], stream: bool = True) -> list[str]:
    rc = " ".join(f'{k}="{v}"' for k, v in run_config.items())
    cmd = [str(Path(sys.executable).parent / "flwr"), "run", str(app_dir), FEDERATION, "--run-config", rc]
    if stream:
        cmd.append("--stream")
    return cmd


RUN_STARTED = re.compile(r"Successfully started run (\d+)")


class _Lines:
    """Hands each streamed line to ``on_line`` once: a re-attached ``flwr log --stream`` replays the run's log
    from its start, so the first ``seen`` lines of a replay are skipped."""

    def __init__(self, on_line: Callable[[str], None] | None) -> None:
        self.on_line, self.seen = on_line, 0
        self.run_id: int | None = None  # set from the first "Successfully started run N" line

    def replay(self) -> Callable[[str], None]:
        skip = [self.seen]

        def take(line: str) -> None:
            if skip[0] > 0:
                skip[0] -= 1
                return
            self(line)

        return take

    def __call__(self, line: str) -> None:
        self.seen += 1
        m = RUN_STARTED.search(line)
        if m and self.run_id is None:
            self.run_id = int(m.group(1))
        if self.on_line is not None:
            self.on_line(line)


def _stream(
    cmd: list[str], env: dict[str, str], on_line: Callable[[str], None], timeout: float | None
) -> int:
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            on_line(line.rstrip("\n"))
        return proc.wait(timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def run_status(flwr_home: Path, run_id: int) -> str:
    """The run's status as the SuperLink reports it (``running``, ``finished:completed``, ...), or ``""``
    when it cannot be read now (the caller asks again)."""
    cmd = [
        str(Path(sys.executable).parent / "flwr"),
        "list",
        FEDERATION,
        "--run-id",
        str(run_id),
        "--format",
        "json",
    ]
    try:
        r = subprocess.run(cmd, env=flower_env(flwr_home), capture_output=True, text=True, timeout=120)
        runs = json.loads(r.stdout).get("runs", [])
    except (subprocess.TimeoutExpired, ValueError, AttributeError):
        return ""
    return str(runs[0].get("status", "")) if runs else ""


def follow_run(
    run_id: int,
    flwr_home: Path,
    lines: _Lines,
    *,
    poll: float = 5.0,
    give_up_after: float = 600.0,
    status: Callable[[Path, int], str] = run_status,
    reattach: Callable[[int, Path, Callable[[str], None]], int] | None = None,
) -> str:
    """Wait until the run is finished and return its status.  ``flwr run --stream`` also returns (exit 0) when
    the SuperLink's log stream breaks while the ServerApp still runs (seen on a loaded 2-core machine: the
    SuperLink's SQLite state was locked for longer than its busy timeout); then the run is still going and
    stopping the processes would kill a healthy job.  Re-attaches to the log stream meanwhile.  Returns ``""``
    when the SuperLink cannot be asked for ``give_up_after`` seconds in a row."""
    attach = reattach or _reattach
    unknown_since = time.monotonic()
    while True:
        st = status(flwr_home, run_id)
        if st.startswith("finished"):
            return st
        if st:
            unknown_since = time.monotonic()
            attach(run_id, flwr_home, lines.replay())
        elif time.monotonic() - unknown_since > give_up_after:
            return ""
        time.sleep(poll)


def _reattach(run_id: int, flwr_home: Path, on_line: Callable[[str], None]) -> int:
    cmd = [str(Path(sys.executable).parent / "flwr"), "log", str(run_id), FEDERATION, "--stream"]
    return _stream(cmd, flower_env(flwr_home), on_line, None)


def submit(
    app_dir: Path,
    flwr_home: Path,
    run_config: dict[str, str],
    *,
    on_line: Callable[[str], None] | None = None,
    timeout: float | None = None,
    follow: bool = True,
) -> int:
    """``flwr run APP feta --stream`` with FLWR_HOME set; streams output lines to ``on_line``.  With
    ``follow``, returns only once the SuperLink reports the run finished (see :func:`follow_run`)."""
    lines = _Lines(on_line)
    code = _stream(flwr_run_command(app_dir, run_config), flower_env(flwr_home), lines, timeout)
    if code == 0 and follow and lines.run_id is not None:
        follow_run(lines.run_id, flwr_home, lines)
    return code


def check_run_ok(code: int, out_dir: Path) -> None:
    if code != 0:
        raise FetaError(
            f"flwr run exited with code {code}; see the streamed log and {out_dir / 'progress.jsonl'}"
        )


def register_node(
    public_key: Path,
    name: str,
    flwr_home: Path,
    address: str,
    *,
    insecure: bool = False,
    root_certificates: Path | None = None,
) -> None:
    """``flwr supernode register KEY.pub feta --name NAME``: only registered node keys may connect
    to a SuperLink started with ``--enable-supernode-auth``."""
    write_flwr_config(flwr_home, address, insecure=insecure, root_certificates=root_certificates)
    cmd = [
        str(Path(sys.executable).parent / "flwr"),
        "supernode",
        "register",
        str(public_key),
        FEDERATION,
        "--name",
        name,
    ]
    r = subprocess.run(cmd, env=flower_env(flwr_home), capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise FetaError(
            f"registering node key {public_key} as {name!r} failed: {(r.stdout + r.stderr)[-1500:]}"
        )
