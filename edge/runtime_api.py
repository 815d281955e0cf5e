"""The SuperNode's local Runtime API on a Unix socket that only the site's account can reach.

Threat: flwr 1.42's SuperNode serves its Runtime API (the ClientAppIo of earlier versions: ``acquire-task``,
``pull-task-input``, ``push-task-output``, ...) as HTTP on a TCP port. In subprocess isolation
``acquire-task`` takes no credential (Flower ignores the SuperExec auth secret there), and the task token it
hands out reaches ``flwr-clientapp`` on its command line, which every local account reads in
``/proc/PID/cmdline``. Any local account could so acquire the pending task, read the coordinator's message and
answer it in the site's name.

What flwr 1.42 offers, and why this module takes the last one:
  * ``--isolation process`` with ``--superexec-auth-secret-file``: an HMAC on ``acquire-task`` only (marked
    experimental); the API stays on TCP for every account, and the token still travels on a command line;
  * ``--ssl-certfile``: server TLS; it authenticates the SuperNode to its clients, no client to the SuperNode;
  * a private network namespace (``unshare --net``): the SuperNode must reach the SuperLink over the network;
  * the API on a Unix socket in a 0700 directory: the kernel refuses every other account at ``connect`` (root
    excepted), whatever Flower checks or forgets to check behind it. Taken, with nothing left on TCP, and the
    task token handed to the ClientApp in its environment (``/proc/PID/environ`` is readable by its own
    account only).
Remaining assumption: root and the site's own account are trusted (they can read the site key and the ledger
anyway).

How: Flower's three programs, each with one change, behind the flwr pin (``edge.trust.PINNED_FLWR``):
  * the SuperNode (``python -m edge.runtime_api supernode``, started by ``edge.launch``): its Runtime API
    server binds the socket (uvicorn ``uds``) instead of ``--host``/``--port``;
  * the SuperExec (``flower-superexec``, which the SuperNode starts from PATH, where ``edge.launch`` puts this
    module's shim first): its Runtime API client dials the socket, and it starts ``flwr-clientapp`` with the
    task token in the environment instead of ``--token`` (only ClientApp tasks: nothing else runs on a site
    node);
  * the ClientApp (``edge.trust.main``): its client dials the socket and takes the token from the environment.
A real ``flower-superexec`` found instead of the shim dials the TCP address, where nothing listens: it fails
closed.
"""

from __future__ import annotations

import importlib
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from flwr.supercore.constant import TASK_TYPE_TO_APPIO_API_ADDRESS_ARG, TASK_TYPE_TO_COMMAND, TaskType
from flwr.supercore.runtime import runtime_http_client as rhc
from flwr.supercore.superexec.executor.types import LaunchResult

from feta_release.errors import FetaError

# set by `feta-release node start`; the coordinator cannot change a node's env
ENV_SOCKET = "FETA_RUNTIME_SOCKET"
ENV_TOKEN = "FETA_TASK_TOKEN"
SOCKET_NAME = "runtime.sock"
SERVER_START_TIMEOUT = 60.0


class RuntimeApiError(FetaError):
    """The node's local Runtime API cannot be set up as this module requires; nothing was started."""


def socket_from_env() -> Path:
    """The socket ``edge.launch`` named for this node; refuse (never fall back to TCP) when there is none."""
    raw = os.environ.get(ENV_SOCKET)
    if not raw:
        raise RuntimeApiError(
            f"{ENV_SOCKET} is not set: the node's Runtime API must be a private Unix socket; "
            "start the node with `feta-release node start`"
        )
    return Path(raw)


def check_private_parent(sock: Path) -> None:
    """The socket's directory is this account's and closed to everyone else (0700): the access control."""
    st = sock.parent.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise RuntimeApiError(
            f"{sock.parent}: the Runtime API's directory must be this account's with mode 0700 "
            f"(it is {stat.S_IMODE(st.st_mode):o}); restart the node"
        )


def _supernode_module() -> Any:
    """The module ``flwr.supernode.cli.flower_supernode`` (its package exports a function of the same name,
    which ``from flwr.supernode.cli import flower_supernode`` would give instead)."""
    return importlib.import_module("flwr.supernode.cli.flower_supernode")


def serve_on_socket() -> None:
    """Replace the SuperNode's Runtime API server (TCP ``--host:--port``) by the same app on the private
    socket."""
    fs = _supernode_module()
    sock = socket_from_env()
    check_private_parent(sock)

    def start_on_socket(config: Any, state_factory: Any) -> tuple[Any, threading.Thread]:
        import uvicorn
        from flwr.supernode.main import create_app

        sock.unlink(missing_ok=True)  # a stale socket of an earlier start
        server = uvicorn.Server(
            uvicorn.Config(
                app=create_app(
                    state_factory=state_factory, superexec_auth_secret=config.superexec_auth_secret
                ),
                uds=str(sock),
                reload=False,
                access_log=False,
                workers=1,
            )
        )
        thread = threading.Thread(target=server.run, name="supernode-runtime-http-api")
        thread.start()
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while thread.is_alive() and not server.started and time.monotonic() < deadline:
            time.sleep(0.1)
        if not server.started:
            raise RuntimeApiError(f"{sock}: the SuperNode's Runtime API did not start")
        os.chmod(sock, 0o600)  # uvicorn makes it 0666; the directory already keeps others out, this too
        return server, thread

    fs._start_supernode_http_api = start_on_socket


def dial_socket() -> None:
    """Every Runtime API client of this process (SuperExec, ClientApp) talks to the private socket."""
    cls = rhc.RuntimeHttpClient
    if getattr(cls.__init__, "__feta_socket__", False):
        return
    sock = str(socket_from_env())
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        tcp = self._client
        self._client = httpx.Client(
            transport=httpx.HTTPTransport(uds=sock), timeout=tcp.timeout, follow_redirects=True
        )
        tcp.close()

    __init__.__feta_socket__ = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[method-assign]


def clientapp_command(spec: Any) -> list[str]:
    """``flwr-clientapp``'s arguments for a task, as Flower's SubprocessExecutor builds them, less
    ``--token``."""
    args = [
        TASK_TYPE_TO_COMMAND[spec.task_type],
        TASK_TYPE_TO_APPIO_API_ADDRESS_ARG[spec.task_type],
        spec.runtime_api_address,
    ]
    if spec.insecure:
        args.append("--insecure")
    elif spec.root_certificates_path is not None:
        args.extend(["--root-certificates", spec.root_certificates_path])
    if spec.parent_pid is not None:
        args.extend(["--parent-pid", str(spec.parent_pid)])
    if spec.runtime_dependency_install:
        args.append("--allow-runtime-dependency-installation")
    return args


def launch_with_token_in_env(self: Any, spec: Any) -> Any:
    """SubprocessExecutor.launch with the task token in the child's environment, never on its command line."""
    if spec.task_type != TaskType.CLIENT_APP:
        return LaunchResult.failed(f"a site node runs ClientApp tasks only, not {spec.task_type}")
    out = subprocess.DEVNULL if spec.suppress_output else None
    subprocess.Popen(
        clientapp_command(spec),
        env={**os.environ, ENV_TOKEN: spec.token},  # noqa: S603
        stdout=out,
        stderr=out,
    )
    return LaunchResult.accepted()


def take_token_from_env() -> None:
    """The ClientApp side: the token from the environment into this process's own argument list (in memory:
    the command line others can read stays without it), and out of the environment its children would
    inherit."""
    token = os.environ.pop(ENV_TOKEN, None)
    if token is not None and "--token" not in sys.argv and "--token-file" not in sys.argv:
        sys.argv += ["--token", token]


def client_side() -> None:
    """What ``edge.trust.main`` installs before Flower's ``flwr-clientapp`` runs."""
    dial_socket()
    take_token_from_env()


def check_runtime_api_internals() -> None:
    """The Flower names this module replaces exist (the flwr pin is checked by ``edge.trust``)."""
    from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor

    for owner, name in (
        (_supernode_module(), "_start_supernode_http_api"),
        (SubprocessExecutor, "launch"),
        (rhc, "RuntimeHttpClient"),
    ):
        if not callable(getattr(owner, name, None)):
            raise RuntimeApiError(f"flwr internals changed: {name} not found; refusing to start the node")


def write_superexec_shim(bin_dir: Path) -> Path:
    """The ``flower-superexec`` that ``edge.launch`` puts first on the SuperNode's PATH."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    shim = bin_dir / "flower-superexec"
    shim.write_text(
        f"#!{sys.executable}\nfrom edge.runtime_api import main\nmain(['superexec'])\n", encoding="utf-8"
    )
    shim.chmod(0o755)
    return shim


def main(argv: list[str] | None = None) -> None:
    """``python -m edge.runtime_api supernode|superexec ARGS`` (or the shim: ``main(["superexec"])``, Flower's
    arguments being the shim's own): Flower's program with the changes above."""
    if argv is None:
        role, rest = (sys.argv[1] if len(sys.argv) > 1 else ""), sys.argv[2:]
    else:
        role, rest = argv[0], sys.argv[1:]
    sys.argv = [f"flower-{role}", *rest]  # Flower parses sys.argv and names itself after it
    if role == "supernode":
        from flwr.supernode.cli.flower_supernode import flower_supernode

        serve_on_socket()
        flower_supernode()
    elif role == "superexec":
        from flwr.supercore.cli.flower_superexec import flower_superexec
        from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor

        dial_socket()
        SubprocessExecutor.launch = launch_with_token_in_env  # type: ignore[method-assign]
        flower_superexec()
    else:
        raise SystemExit("usage: python -m edge.runtime_api supernode|superexec [Flower's arguments]")


if __name__ == "__main__":
    main()
