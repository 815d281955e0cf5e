"""Another local account cannot take over the node's Flower tasks: the SuperNode's Runtime API (acquire-task
hands out the pending task and its token) is a Unix socket in a 0700 directory, nothing of the node listens on
TCP, and the task token never appears on a command line (edge/runtime_api.py)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from tests.support.federation import make_federation, node_settings

OTHER_UID = 65534  # nobody


def acquire_task(targets: list[tuple[str, str]]) -> dict[str, str]:
    """What a local account would run: Flower's own SuperExec request (acquire-task, with Flower's version
    headers) against every address of the node's Runtime API it can find (the TCP ports and the sockets of the
    work dir)."""
    import httpx
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor
    from flwr.supercore.runtime import RuntimeHttpClient

    out = {}
    for kind, where in targets:
        client = RuntimeHttpClient.from_server_address(
            where if kind == "tcp" else "127.0.0.1:1",
            insecure=True,
            root_certificates=None,
            interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperExec")],
        )
        if kind == "unix":
            client._client = httpx.Client(transport=httpx.HTTPTransport(uds=where), timeout=10)
        try:
            res = client.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
            out[where] = "answered: a task could be acquired" + (" (one was pending)" if res.token else "")
        except httpx.HTTPStatusError as exc:
            out[where] = f"answered HTTP {exc.response.status_code}"
        except (httpx.TransportError, OSError) as exc:
            out[where] = f"refused: {type(exc).__name__}: {exc}"
    return out


def run_attack(targets: list[tuple[str, str]], uid: int | None) -> dict[str, str]:
    """``acquire_task`` as ``uid`` (None: this account), in a forked child that drops to that uid (no exec:
    the interpreter need not be reachable by it). The child must report on every address: one that could not
    even run would otherwise pass for a refusal."""
    acquire_task([])  # the imports, before the fork
    if uid is None:
        return acquire_task(targets)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.write(w, json.dumps({"uid": os.getuid(), "got": acquire_task(targets)}).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        raw = fh.read()
    os.waitpid(pid, 0)
    assert raw, "the attacker's process did not report"
    doc = json.loads(raw)
    assert doc["uid"] == uid and set(doc["got"]) == {where for _, where in targets}
    return dict(doc["got"])


def tcp_listeners(pid: int) -> list[str]:
    """host:port of every TCP socket that a process of the node's tree listens on."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    pids = {p.pid for p in procs}
    return sorted(
        {
            f"{c.laddr.ip}:{c.laddr.port}"
            for c in psutil.net_connections(kind="tcp")
            if c.pid in pids and c.status == psutil.CONN_LISTEN
        }
    )


def unix_sockets(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("*") if not p.is_symlink() and stat.S_ISSOCK(p.lstat().st_mode))


@pytest.fixture()
def open_node(tmp_path):
    """A started node (no worker: the Runtime API is the SuperNode's) whose work dir every account may
    traverse, as a shared /srv or /opt tree would be: only the node's own directory modes stand between it and
    other accounts."""
    from edge.launch import start_node
    from feta_release.federation.procs import free_port

    fed = make_federation(tmp_path / "fed")
    s = fed.site("site-a")
    shared = Path(tempfile.mkdtemp(prefix="feta-node-"))
    shared.chmod(0o755)
    port = free_port()
    node = start_node(
        node_settings(
            s,
            insecure=True,
            worker=False,
            superlink=f"127.0.0.1:{free_port()}",
            port=port,
            work_dir=shared / "work",
        )
    )
    try:
        deadline = time.monotonic() + 120
        while not (tcp_listeners(node.pid) or unix_sockets(shared)):
            assert node.alive() and time.monotonic() < deadline, node.tail()
            time.sleep(0.2)
        time.sleep(1.0)  # every listener of the tree up, not just the first
        yield node, shared
    finally:
        node.stop()
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="switching to another uid needs root"
)
def test_another_local_account_cannot_acquire_the_nodes_flower_task(open_node):
    node, shared = open_node
    targets = [("tcp", a) for a in tcp_listeners(node.pid)] + [("unix", p) for p in unix_sockets(shared)]
    assert targets, "the node's Runtime API was not found"
    # the site's own account reaches it (the attack below is a request the node answers) ...
    assert any(v.startswith("answered: a task could be acquired") for v in run_attack(targets, None).values())
    # ... another account reaches none of it
    got = run_attack(targets, OTHER_UID)
    assert all(v.startswith("refused") for v in got.values()), got


def test_nothing_of_the_node_listens_on_tcp(open_node):
    node, shared = open_node
    assert tcp_listeners(node.pid) == []
    (sock,) = unix_sockets(shared)
    assert stat.S_IMODE(Path(sock).parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(Path(sock).stat().st_mode) == 0o600


def test_the_task_token_goes_to_the_clientapp_in_its_environment_not_its_command_line(tmp_path, monkeypatch):
    """/proc/PID/cmdline is readable by every local account; /proc/PID/environ by the process's own only."""
    from flwr.supercore.constant import TaskType
    from flwr.supercore.superexec.executor.types import ExecutionSpec, LaunchResultStatus

    from edge.runtime_api import ENV_TOKEN, launch_with_token_in_env

    seen = tmp_path / "seen"
    fake = tmp_path / "bin" / "flwr-clientapp"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$*" > {seen}.args\necho "${ENV_TOKEN}" > {seen}.env\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    token = "ab" * 32
    spec = ExecutionSpec(
        task_type=TaskType.CLIENT_APP,
        runtime_api_address="127.0.0.1:9094",
        token=token,
        insecure=True,
        root_certificates_path=None,
        runtime_dependency_install=False,
        parent_pid=None,
        suppress_output=True,
        task_id=7,
    )
    assert launch_with_token_in_env(None, spec).status == LaunchResultStatus.ACCEPTED
    deadline = time.monotonic() + 30
    while not Path(f"{seen}.env").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    args = Path(f"{seen}.args").read_text()
    assert token not in args and "--token" not in args and "--runtime-api-address 127.0.0.1:9094" in args
    assert Path(f"{seen}.env").read_text().strip() == token


def test_a_site_node_launches_clientapp_tasks_only():
    from flwr.supercore.constant import TaskType
    from flwr.supercore.superexec.executor.types import ExecutionSpec, LaunchResultStatus

    from edge.runtime_api import launch_with_token_in_env

    spec = ExecutionSpec(
        task_type=TaskType.SERVER_APP,
        runtime_api_address="127.0.0.1:9094",
        token="ab" * 32,
        insecure=True,
        root_certificates_path=None,
        runtime_dependency_install=False,
        parent_pid=None,
        suppress_output=True,
        task_id=7,
    )
    assert launch_with_token_in_env(None, spec).status == LaunchResultStatus.FAILED


def test_the_clientapp_takes_the_token_from_its_environment_and_drops_it(monkeypatch):
    from edge.runtime_api import ENV_TOKEN, take_token_from_env

    monkeypatch.setattr(
        sys, "argv", ["flwr-clientapp", "--runtime-api-address", "127.0.0.1:9094", "--insecure"]
    )
    monkeypatch.setenv(ENV_TOKEN, "cd" * 32)
    take_token_from_env()
    assert sys.argv[-2:] == ["--token", "cd" * 32] and ENV_TOKEN not in os.environ


def test_without_the_private_socket_the_node_refuses_rather_than_fall_back_to_tcp(monkeypatch, tmp_path):
    from edge.runtime_api import ENV_SOCKET, RuntimeApiError, check_private_parent, socket_from_env

    monkeypatch.delenv(ENV_SOCKET, raising=False)
    with pytest.raises(RuntimeApiError, match=ENV_SOCKET):
        socket_from_env()
    open_dir = tmp_path / "runtime"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    with pytest.raises(RuntimeApiError, match="0700"):
        check_private_parent(open_dir / "runtime.sock")
    open_dir.chmod(0o700)
    check_private_parent(open_dir / "runtime.sock")


def test_the_socket_refuses_a_connection_from_another_account(tmp_path):
    """The kernel's own check, which the node relies on: a 0700 directory keeps another uid from connect()."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("switching to another uid needs root")
    d = Path(tempfile.mkdtemp(prefix="feta-node-"))
    try:
        (d / "runtime").mkdir(mode=0o700)
        path = d / "runtime" / "s.sock"
        d.chmod(0o755)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
            srv.bind(str(path))
            os.chmod(path, 0o666)
            srv.listen(1)
            got = run_attack([("unix", str(path))], OTHER_UID)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    assert got[str(path)].startswith("refused") and "Permission" in got[str(path)]
