"""THE model file: the one format of a released denoiser, written by `train` and by the coordinator, read by
`export`, the coordinator's release step and the benches.

It lives beside the models (not with the training engines) because the release side reads it too: the release
layer never imports the training layer.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import ReleaseError
from ..files import atomic_write_bytes

MODEL_FILE = "model.pt"
# The denoiser's spec, its (EMA) weights and the class names, in that order of need.
MODEL_KEYS = ("spec", "state_dict", "class_names")


def write_model_file(
    path: str | os.PathLike,
    *,
    spec: Mapping[str, Any],
    state_dict: Mapping[str, torch.Tensor],
    class_names: list[str],
    **extra: Any,
) -> Path:
    """Write THE model file atomically: ``spec`` (``models.denoiser_spec``), ``state_dict`` (the weights to
    release, on CPU), ``class_names``, plus plain ``extra`` values (job hash, sampler settings)."""
    doc = {
        "spec": dict(spec),
        "state_dict": {k: v.detach().cpu() for k, v in state_dict.items()},
        "class_names": [str(c) for c in class_names],
        **extra,
    }
    buf = io.BytesIO()
    torch.save(doc, buf)
    return atomic_write_bytes(path, buf.getvalue())


def read_model_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read THE model file as tensors and plain values only (``torch.load(weights_only=True)``).

    Why: a full unpickle runs whatever code the file names; a run directory may come from anyone who could
    write to it, and ``export`` then signs with the site key. Anything beyond weights is refused."""
    p = Path(path)
    try:
        doc = torch.load(p, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, AttributeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ReleaseError(
            f"{p}: not a weights-only checkpoint ({first[:200]}); refusing to unpickle it, "
            "re-create it with `feta-release train`"
        ) from None
    if not isinstance(doc, dict):
        raise ReleaseError(f"{p}: expected a checkpoint dictionary")
    missing = [k for k in MODEL_KEYS if doc.get(k) is None]
    if missing:
        raise ReleaseError(
            f"{p}: not a feta-release model file (no {', '.join(missing)}); re-create it with "
            "`feta-release train` or the coordinator"
        )
    return doc
