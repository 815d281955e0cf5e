"""Crash-safe files for a run directory: atomic writes, torch checkpoints, the model file, the job hash.

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
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import FetaError, ReleaseError
from ..files import atomic_write_bytes

MODEL_FILE = "model.pt"
# The one model file format, written by `train` and by the coordinator, read by `export`, the coordinator's
# release step and the benches: the denoiser's spec, its (EMA) weights and the class names, in that order of need.
MODEL_KEYS = ("spec", "state_dict", "class_names")


def npz_bytes(**arrays: Any) -> bytes:
    """The bytes of an ``.npz`` of ``arrays`` (compressed, never pickled): a released file of a run, a coordinator's
    cached release; the one writer of both drivers."""
    buf = io.BytesIO()
    np.savez_compressed(buf, allow_pickle=False, **arrays)
    return buf.getvalue()


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def read_json(path: str | os.PathLike) -> Any:
    p = Path(path)
    try:
        return json.loads(p.read_text("utf-8"))
    except json.JSONDecodeError as exc:
        raise FetaError(f"{p}: corrupt JSON ({exc}); the run directory was modified outside feta-release") from None


def torch_bytes(obj: Any) -> bytes:
    """The bytes ``save_torch`` writes for ``obj`` (a run hashes them into its ledger before writing them)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def save_torch(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_bytes(path, torch_bytes(obj))


def load_torch(path: str | os.PathLike, *, weights_only: bool = False) -> Any:
    """``weights_only=False`` only for a run's own checkpoints (generator states and plain dicts written by this
    process's pipeline); anything another party could have written is read with ``weights_only=True``."""
    return torch.load(Path(path), map_location="cpu", weights_only=weights_only)


def load_torch_bytes(data: bytes, *, weights_only: bool = False) -> Any:
    """:func:`load_torch` of bytes already read (and checked: a run's checkpoint against its ledger's hash)."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)


def write_model_file(path: str | os.PathLike, *, spec: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor],
               class_names: list[str], **extra: Any) -> Path:
    """Write THE model file atomically: ``spec`` (``models.denoiser_spec``), ``state_dict`` (the weights to
    release, on CPU), ``class_names``, plus plain ``extra`` values (job hash, sampler settings)."""
    doc = {"spec": dict(spec), "state_dict": {k: v.detach().cpu() for k, v in state_dict.items()},
           "class_names": [str(c) for c in class_names], **extra}
    return save_torch(path, doc)


def read_model_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read THE model file as tensors and plain values only (``torch.load(weights_only=True)``).

    Why: a full unpickle runs whatever code the file names; a run directory may come from anyone who could
    write to it, and ``export`` then signs with the site key. Anything beyond weights is refused."""
    p = Path(path)
    try:
        doc = torch.load(p, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, AttributeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ReleaseError(f"{p}: not a weights-only checkpoint ({first[:200]}); refusing to unpickle it, "
                           "re-create it with `feta-release train`") from None
    if not isinstance(doc, dict):
        raise ReleaseError(f"{p}: expected a checkpoint dictionary")
    missing = [k for k in MODEL_KEYS if doc.get(k) is None]
    if missing:
        raise ReleaseError(f"{p}: not a feta-release model file (no {', '.join(missing)}); re-create it with "
                           "`feta-release train` or the coordinator")
    return doc


def config_hash(cfg_dict: dict[str, Any]) -> str:
    """sha256 of the job configuration in canonical JSON (key order and whitespace do not matter)."""
    blob = json.dumps(cfg_dict, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()
