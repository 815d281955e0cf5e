"""A run directory's torch checkpoints and released arrays, written crash-safe.

Every file a resume depends on is written to a temporary file in the same directory, flushed, fsynced, then
moved over the old one with ``os.replace`` and the directory fsynced, so a kill at any instant leaves either
the old or the new version, never a torn one. This matters most for ``privacy.json``: it is the record of what
has been spent, and it is written (and on disk) BEFORE the step it pays for runs.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Names the local driver (training/pipeline.py) and the run account (stages/account.py) import from here;
# their homes are the torch-free layers below, where the release side reads them too.
from ..config import config_hash  # noqa: F401
from ..files import atomic_write_bytes, atomic_write_json  # noqa: F401
from ..files import read_run_json as read_json  # noqa: F401
from ..models.model_file import MODEL_FILE  # noqa: F401


def npz_bytes(**arrays: Any) -> bytes:
    """The bytes of an ``.npz`` of ``arrays`` (compressed, never pickled): a released file of a run, a
    coordinator's cached release; the one writer of both drivers."""
    buf = io.BytesIO()
    np.savez_compressed(buf, allow_pickle=False, **arrays)
    return buf.getvalue()


def torch_bytes(obj: Any) -> bytes:
    """The bytes ``save_torch`` writes for ``obj`` (a run hashes them into its ledger before writing them)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def save_torch(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_bytes(path, torch_bytes(obj))


def load_torch(path: str | os.PathLike, *, weights_only: bool = False) -> Any:
    """``weights_only=False`` only for a run's own checkpoints (generator states and plain dicts written by
    this process's pipeline); anything another party could have written is read with ``weights_only=True``."""
    return torch.load(Path(path), map_location="cpu", weights_only=weights_only)


def load_torch_bytes(data: bytes, *, weights_only: bool = False) -> Any:
    """:func:`load_torch` of bytes already read (and checked: a run's checkpoint against its ledger's
    hash)."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
