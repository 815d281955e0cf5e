"""Crash-safe, optionally owner-only files: the one atomic writer of the library, the drivers and the node.

Torch-free (the node's per-message process, the site kit and ``verify`` import it): a run's checkpoints and noise
secret (``training.checkpoint``), the node's secure-aggregation state (``edge.secure``) and its site cache
(``edge.site_cache``) all go through :func:`atomic_write_bytes`.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the file itself is already fsynced
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _process_umask() -> int:
    # Read once at import (os.umask can only be read by setting it; doing that per write would race other threads).
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _process_umask()


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, private: bool = False) -> Path:
    """Write ``data`` to ``path`` atomically and durably (tmp + fsync + os.replace + directory fsync).

    The temporary file comes from ``tempfile.mkstemp`` in the target's directory: a random name created with
    O_EXCL at mode 0600, so a local user can neither predict it nor plant a link there that would receive the bytes
    (a checkpoint holds the DP-SGD noise stream's state; the noise secret is a file too). ``private``: the file
    stays 0600 (whoever reads it can subtract the noise); otherwise it gets the ordinary 0666 & ~umask."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            if not private:
                os.fchmod(fh.fileno(), 0o666 & ~_UMASK)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(p.parent)
    return p


def private_dir(path: str | os.PathLike) -> Path:
    """``path`` as a directory only its owner can list or enter (0700), tightened if it already exists looser: it
    holds a run's checkpoints (the noise stream's state) and its noise secret."""
    p = Path(path)
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    if stat.S_IMODE(p.stat().st_mode) & 0o077:
        os.chmod(p, 0o700)
    return p
