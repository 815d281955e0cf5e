"""Crash-safe files for a run directory: atomic writes, torch checkpoints, the job hash.

Every file a resume depends on is written to a temporary file in the same directory, flushed, fsynced, then
moved over the old one with ``os.replace`` and the directory fsynced, so a kill at any instant leaves either the
old or the new version, never a torn one. This matters most for ``privacy.json``: it is the record of what has
been spent, and it is written (and on disk) BEFORE the step it pays for runs.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

from ..errors import FetaError


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


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically and durably (tmp + fsync + os.replace + directory fsync)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, p)
    _fsync_dir(p.parent)
    return p


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def read_json(path: str | os.PathLike) -> Any:
    p = Path(path)
    try:
        return json.loads(p.read_text("utf-8"))
    except json.JSONDecodeError as exc:
        raise FetaError(f"{p}: corrupt JSON ({exc}); the run directory was modified outside feta-release") from None


def save_torch(path: str | os.PathLike, obj: Any) -> Path:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return atomic_write_bytes(path, buf.getvalue())


def load_torch(path: str | os.PathLike) -> Any:
    import torch

    # weights_only=False: checkpoints hold generator states and plain dicts that we wrote ourselves.
    return torch.load(Path(path), map_location="cpu", weights_only=False)


def config_hash(cfg_dict: dict[str, Any]) -> str:
    """sha256 of the job configuration in canonical JSON (key order and whitespace do not matter)."""
    blob = json.dumps(cfg_dict, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()
