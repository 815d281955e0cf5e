"""The authenticated local channel between a node's per-message ClientApp and its warm worker
(``edge.worker``).

Access control, in layers:
  * the socket lives in a directory only the site's account can enter (0700) and is itself 0600;
  * every connection runs the stdlib's mutual HMAC challenge-response (``multiprocessing.connection`` with an
    ``authkey``: each side proves it holds the key without sending it) under a random key made at each node
    start, kept in a 0600 file beside the socket. (Python 3.11's handshake uses HMAC-MD5, which is still a
    sound MAC; 3.12 moves it to SHA-256.)
So another local user, or a process of this account that cannot read the key file, cannot ask the worker
for a release.

What crosses it is data only: ``multiprocessing.connection`` would pickle with ``send``/``recv``, so this
module uses nothing but ``send_bytes``/``recv_bytes``. A request is three frames: a JSON header, the Flower
``Message`` exactly as Flower delivered it (Flower's protobuf encoding) and the ``Context`` (protobuf). A
reply is a JSON header and, on success, the reply's ``RecordDict``
(``feta_release.federation.messages.payload_bytes``) and the updated ``Context``. Both ends parse them as data
(JSON, protobuf), never as code.

This module imports neither torch nor the site's handlers: the per-message ClientApp (``edge.forward``) uses
it.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import stat
import struct
import tempfile
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any

from feta_release.errors import FetaError
from feta_release.files import private_dir

PROTOCOL = "feta-worker/1"
# set by `feta-release node start`; the coordinator cannot change a node's env
ENV_SOCKET = "FETA_WORKER_SOCKET"
ENV_KEY = "FETA_WORKER_KEY"
KEY_BYTES = 32
MAX_HEADER = 64 * 1024
MAX_FRAME = 1 << 31  # a frame larger than 2 GiB is not a model update this node could have been sent
# AF_UNIX socket paths are limited to 108 bytes (Linux, with the terminating NUL).
MAX_SOCKET_PATH = 100
# Deadlines.
# Worker side: a client has this long per read or write, for the challenge, its request and taking the reply.
SERVE_TIMEOUT = 60.0
# Client side: the worker serves one request at a time, so connecting (and the challenge) may wait for the
# request ahead (a DP-SGD round: minutes), and the reply for this one; past this the worker is taken as stuck.
# The ceiling: a message of a job waits its round timeout plus a margin when that is shorter (edge.forward).
CLIENT_TIMEOUT = 3600.0


class WorkerUnavailable(FetaError):
    """No worker answers on the channel (not started, stopped, or died)."""


class WorkerRequestError(FetaError):
    """A request or reply on the channel is not what the protocol says; refused."""


class WorkerTimeout(WorkerRequestError):
    """The other end took longer than the channel's deadline (a request already handed over is not re-run
    here)."""


def set_deadline(conn: Connection, seconds: float) -> None:
    """Kernel timeouts on every read and write of ``conn`` (SO_RCVTIMEO / SO_SNDTIMEO; also bounds a blocking
    AF_UNIX ``connect`` on Linux): a peer that stops answering makes the call fail with
    ``BlockingIOError``."""
    # a duplicate: options are the socket's, shared by both fds
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        _socket_deadline(sock, seconds)
    finally:
        sock.close()


def _socket_deadline(sock: socket.socket, seconds: float) -> None:
    whole = int(seconds)
    micro = int(round((seconds - whole) * 1e6))
    tv = struct.pack("ll", whole, micro if whole or micro else 1)  # all zero would mean "wait for ever"
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


class TimedListener(Listener):
    """The worker's listener: the mutual challenge runs under ``SERVE_TIMEOUT`` per read/write, and so does
    everything after it on the accepted connection (a hung client is dropped, the worker serves the next)."""

    def __init__(self, address: str, key: bytes, timeout: float = SERVE_TIMEOUT) -> None:
        super().__init__(address, family="AF_UNIX")  # no authkey here: the challenge is run by accept, timed
        self._key, self.timeout = key, float(timeout)

    def accept(self) -> Connection:
        conn = super().accept()
        try:
            set_deadline(conn, self.timeout)
            deliver_challenge(conn, self._key)
            answer_challenge(conn, self._key)
        except BlockingIOError:
            conn.close()
            raise WorkerTimeout(
                f"a client did not finish the channel's challenge within {self.timeout:g} s; dropped"
            ) from None
        except BaseException:
            conn.close()
            raise
        return conn


def socket_path(state_dir: Path, name: str = "worker.sock") -> Path:
    """The socket in the node's state dir, or (when that path is too long for AF_UNIX) in a fresh private temp
    dir."""
    p = state_dir / name
    if len(os.fsencode(str(p))) <= MAX_SOCKET_PATH:
        return p
    return Path(tempfile.mkdtemp(prefix="feta-node-")) / name  # mkdtemp makes it 0700


def write_key(path: Path) -> bytes:
    """A fresh random key in a new 0600 file (the old one, from an earlier start, is replaced)."""
    key = secrets.token_bytes(KEY_BYTES)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(key)
    return key


def read_key(path: str | Path) -> bytes:
    p = Path(path)
    try:
        st = p.stat()
        key = p.read_bytes()
    except OSError as exc:
        raise WorkerUnavailable(
            f"{p}: cannot read the worker key ({exc.strerror}); restart the node"
        ) from None
    if st.st_mode & 0o077 or st.st_uid != os.getuid():
        raise WorkerRequestError(
            f"{p}: the worker key must be this account's and mode 0600 (it is "
            f"{stat.S_IMODE(st.st_mode):o}); restart the node to make a new one"
        )
    if len(key) != KEY_BYTES:
        raise WorkerRequestError(f"{p}: the worker key must be {KEY_BYTES} bytes; restart the node")
    return key


def listen(sock: Path, key: bytes, timeout: float | None = None) -> Listener:
    """Bind the socket (0600; a stale one from a killed worker is removed first); ``timeout``: each client's
    deadline per read/write (``TimedListener``)."""
    private_dir(sock.parent, error=WorkerRequestError)
    sock.unlink(missing_ok=True)
    old = os.umask(0o177)
    try:
        listener = TimedListener(str(sock), key, SERVE_TIMEOUT if timeout is None else timeout)
    finally:
        os.umask(old)
    os.chmod(sock, 0o600)
    return listener


def _dial(sock: str | Path, timeout: float) -> Connection:
    """A connected, not yet authenticated connection whose connect, reads and writes each give up after
    ``timeout`` s (blocking socket + kernel timeouts: ``Connection`` reads the plain file descriptor)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _socket_deadline(s, timeout)
        s.connect(str(sock))
        return Connection(s.detach())
    finally:
        s.close()  # a no-op once detached


def connect(sock: str | Path, key: bytes, timeout: float | None = None) -> Connection:
    """A connection to the worker after the mutual challenge-response, or ``WorkerUnavailable`` in one line
    (also when the worker takes no connection within ``timeout`` s: stuck, or busy for longer than that)."""
    timeout = CLIENT_TIMEOUT if timeout is None else timeout
    if not Path(sock).exists():
        raise WorkerUnavailable(
            f"no worker socket at {sock}: the node's worker is not running (start the node with "
            "`feta-release node start`)"
        )
    try:
        conn = _dial(sock, timeout)
    except BlockingIOError:
        raise WorkerUnavailable(
            f"the worker at {sock} did not take the connection within {timeout:g} s (stuck, or "
            "busy with a longer request)"
        ) from None
    except (ConnectionRefusedError, FileNotFoundError, ConnectionResetError) as exc:
        raise WorkerUnavailable(
            f"the worker at {sock} does not answer ({type(exc).__name__}): it stopped or died"
        ) from None
    try:
        answer_challenge(conn, key)
        deliver_challenge(conn, key)
        return conn
    except BlockingIOError:
        conn.close()
        raise WorkerUnavailable(
            f"the worker at {sock} did not answer the channel's challenge within {timeout:g} s "
            "(stuck, or busy with a longer request)"
        ) from None
    except (EOFError, BrokenPipeError, ConnectionResetError) as exc:
        conn.close()
        raise WorkerUnavailable(
            f"the worker at {sock} does not answer ({type(exc).__name__}): it stopped or died"
        ) from None
    except Exception as exc:  # noqa: BLE001 - AuthenticationError and the stdlib's bare assert on a bad challenge
        conn.close()
        raise WorkerRequestError(
            f"the worker at {sock} refused this channel's key ({type(exc).__name__}): the node "
            "was restarted with a new key, or this is not the node's worker"
        ) from None


def encode_header(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")


def parse_header(raw: bytes, what: str) -> dict[str, Any]:
    """A frame that must be a JSON object of this protocol, or ``WorkerRequestError`` naming what is wrong."""
    if len(raw) > MAX_HEADER:
        raise WorkerRequestError(f"{what}: header of {len(raw)} bytes exceeds {MAX_HEADER}; refused")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise WorkerRequestError(f"{what}: header is not JSON; refused") from None
    if not isinstance(doc, dict) or doc.get("protocol") != PROTOCOL:
        raise WorkerRequestError(f"{what}: header is not a {PROTOCOL} object; refused")
    return doc


def send(conn: Connection, frames: list[bytes]) -> None:
    try:
        for f in frames:
            conn.send_bytes(f)
    except BlockingIOError:
        raise WorkerTimeout(
            "the other end of the worker channel took nothing for longer than the channel's deadline; dropped"
        ) from None


def receive(conn: Connection, what: str, max_frames: int = 3) -> tuple[dict[str, Any], list[bytes]]:
    """A header and the ``frames`` it announces (bytes only: never ``recv``, which unpickles)."""
    try:
        doc = parse_header(conn.recv_bytes(MAX_HEADER), what)
        n = doc.get("frames")
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= max_frames:
            raise WorkerRequestError(f"{what}: header announces {n!r} frames, not 0..{max_frames}; refused")
        return doc, [conn.recv_bytes(MAX_FRAME) for _ in range(n)]
    except EOFError:
        raise WorkerUnavailable(f"{what}: the other end closed the channel mid-message") from None
    except BlockingIOError:
        raise WorkerTimeout(f"{what}: nothing arrived within the channel's deadline; dropped") from None
    except OSError as exc:  # recv_bytes raises OSError("bad message length") past the limit
        raise WorkerRequestError(f"{what}: a frame was refused ({exc})") from None


def call(
    sock: str | Path, key: bytes, doc: dict[str, Any], frames: list[bytes], timeout: float | None = None
) -> tuple[dict[str, Any], list[bytes]]:
    """Send one request (header ``doc`` + ``frames``), return the reply's header and frames. One request per
    connection; ``timeout`` (default ``CLIENT_TIMEOUT``): seconds for the connection (and challenge), and per
    read or write after it."""
    conn = connect(sock, key, timeout)
    try:
        try:
            send(conn, [encode_header({**doc, "protocol": PROTOCOL, "frames": len(frames)}), *frames])
        except (BrokenPipeError, ConnectionResetError):
            raise WorkerUnavailable(
                f"the worker at {sock} closed the channel before the request was sent"
            ) from None
        return receive(conn, f"reply of the worker at {sock}")
    finally:
        conn.close()
