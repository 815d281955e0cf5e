"""A PUBLIC image set for pretraining (``train --public PATH``, ``[public]`` in the job).

It goes through the same loader and checks as a site's private data (``load_dataset``: layouts,
decompression-bomb guard, windowing, resize), labels optional: an unlabelled set is one class folder (or
classes that name none of the private ones) and is learnt without labels. The job names it by the sha256 of
its canonical form (``ImageDataset.fingerprint``: class names, shape, float32 pixels, int64 labels; the
loader's path is not hashed), its count, image shape, classes and a description, so anyone holding the same
files can check what the model saw before any private image (``verify --public PATH``). Unlike a site's data,
whose fingerprint is never published (``data.commitment``), a public set's hash is published on purpose: it is
public.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import DataError
from .dataset import ImageDataset
from .loading import LoadOptions, load_dataset

MAX_DESCRIPTION = 500


def read_public(path: str | os.PathLike, opts: LoadOptions, image_size: int | None = None) -> ImageDataset:
    """The public set at ``path`` through the private data's loader and checks (``opts``: resize, size,
    window; ``image_size``: the size to resize to when ``opts`` resize)."""
    kw = opts.kwargs()
    kw["patient_cap"] = None  # public images have no privacy unit
    if kw["resize"] != "refuse" and image_size is not None:
        kw["image_size"] = int(image_size)  # resized to the private data's size, as asked
    ds, _ = load_dataset(path, **kw)
    return ds


def load_public(
    path: str | os.PathLike, opts: LoadOptions, image_shape: tuple[int, int, int]
) -> ImageDataset:
    """The public set at ``path``, read with the private data's options at its image shape; refused (one line,
    with the fix) when it does not come out at ``image_shape``."""
    ds = read_public(path, opts, int(image_shape[-1]))
    if tuple(ds.image_shape) != tuple(image_shape):
        raise DataError(
            f"{path}: public images are {list(ds.image_shape)} (C, H, W) but the private data's are "
            f"{list(image_shape)}; give the same channels and --resize resize (or crop) to fit the size"
        )
    return ds


def public_record(ds: ImageDataset, description: str = "") -> dict[str, Any]:
    """The job's ``[public]`` naming of ``ds``: sha256 of its canonical form, count, shape, classes,
    description."""
    if len(description) > MAX_DESCRIPTION:
        raise DataError(
            f"--public-description is {len(description)} characters; keep it to {MAX_DESCRIPTION}"
        )
    return {
        "sha256": ds.fingerprint(),
        "count": int(ds.n),
        "shape": [int(v) for v in ds.image_shape],
        "class_names": list(ds.class_names),
        "description": description,
    }


def public_problem(named: dict[str, Any], ds: ImageDataset) -> str | None:
    """Why ``ds`` is not the public set ``named`` (a job's ``[public]``), or None when it is (the hash
    decides; count and shape are compared first for a clearer message)."""
    rec = public_record(ds)
    for key in ("count", "shape", "sha256"):
        want = named.get(key)
        want = list(want) if isinstance(want, (list, tuple)) else want
        if want != rec[key]:
            return f"its {key} is {rec[key]} but the job names {want}: not the public set this job names"
    return None
