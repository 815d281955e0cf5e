"""Torch checkpoints and released arrays, written crash-safe.

Every file a resume depends on is written to a temporary file in the same directory, flushed, fsynced, then
moved over the old one with ``os.replace`` and the directory fsynced, so a kill at any instant leaves either
the old or the new version, never a torn one (a round checkpoint the site's ledger binds, a coordinator's
state).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

# the one atomic writer (torch-free, in files.py); the drivers' state writers import it from here too
from ..files import atomic_write_bytes


def npz_bytes(**arrays: Any) -> bytes:
    """The bytes of an ``.npz`` of ``arrays`` (compressed, never pickled): a released file of a run, a
    coordinator's cached release; the one writer of every job directory."""
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
