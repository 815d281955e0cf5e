"""A PUBLIC image set for pretraining (``train --public PATH``, ``[public]`` in the job).

It goes through the same loader and checks as a site's private data (``load_dataset``: layouts,
decompression-bomb guard, windowing, resize), labels optional: an unlabelled set is one class folder (or
classes that name none of the private ones) and is learnt without labels. The job names it by the sha256 of
its canonical form (``ImageDataset.fingerprint``: class names, shape, float32 pixels, int64 labels; the
loader's path is not hashed), its count, image shape, classes and a description, so anyone holding the same
files can check what the model saw before any private image (``verify --public PATH``). Unlike a site's data,
whose fingerprint is never published (``data.commitment``), a public set's hash is published on purpose: it is
public.

A public set must not hold the private images themselves: pretraining on it costs no epsilon, so a copy of a
private image in it reaches the model, and so the release, with no noise at all. Where one process holds both
(``train``, the demo) :func:`refuse_private_copies` refuses such a set before anything is charged or trained.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import DataError, PrivateImagesInPublicSet
from .dataset import ImageDataset, _to_uint8
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


# -- copies of private images in a public set ------------------------------------------------------------

_DIGEST_BYTES = 16  # blake2b-128: a chance collision among millions of images is ~1e-26, never a false count
_CHUNK = 1024  # images quantised at once: bounded memory for large sets


def _quantised(images: np.ndarray) -> Iterator[np.ndarray]:
    """``images`` (N, ...) in their canonical comparison form, in chunks: uint8 as they are, floats in [0, 1]
    rounded to the nearest of 256 levels, so an image stored as uint8 and the same image round-tripped
    through float32 (k / 255, as the loaders return it) come out equal."""
    for start in range(0, len(images), _CHUNK):
        part = np.asarray(images[start : start + _CHUNK])
        if part.dtype != np.uint8:
            # the conversion ``save_npz(dtype="uint8")`` stores a set with: its stored copy matches exactly
            part = _to_uint8(np.clip(part.astype(np.float32), 0, 1))
        yield np.ascontiguousarray(part)


def image_digests(images: np.ndarray, skip_constant: bool = False) -> list[bytes]:
    """One blake2b digest per image of its quantised pixels and shape (:func:`_quantised`): equal images,
    equal digests, compared in O(N + M) instead of pixel by pixel. ``skip_constant``: none for the solid
    images (:func:`_solid`)."""
    shape = np.asarray(images.shape[1:], dtype="<i8").tobytes()
    out = []
    for part in _quantised(images):
        constant = _solid(part) if skip_constant else np.zeros(len(part), bool)
        for row, blank in zip(part, constant, strict=True):
            if not blank:
                out.append(hashlib.blake2b(shape + row.tobytes(), digest_size=_DIGEST_BYTES).digest())
    return out


def _solid(part: np.ndarray) -> np.ndarray:
    """Per image of ``part`` ((N, C, H, W), or (N, H, W): one channel), whether it holds no spatial
    information: in EVERY channel, every quantised pixel equals that channel's value at every other position
    (a blank slice, or a solid colour whose channels differ, as a solid red frame)."""
    channels = part.shape[1] if part.ndim == 4 else 1
    per_channel = part.reshape(len(part), channels, -1)
    return np.asarray((per_channel == per_channel[:, :, :1]).all(axis=(1, 2)))


def private_copies(public: np.ndarray, private: np.ndarray) -> int:
    """How many of the ``public`` images are exact copies (after quantising to uint8) of some ``private``
    image; a public image repeated k times counts k times, whatever the order of either set.

    Solid images are left out of the count: those whose every quantised pixel, in every channel, equals that
    channel's value at every other spatial position (a blank or saturated slice, or a solid colour such as a
    red frame, each channel constant though the channels differ; :func:`_solid`). One carries nothing about
    anyone (every scanner writes the same blank slice), so a solid frame in both sets discloses no one's
    image, and counting it refused ordinary public sets as holding private ones."""
    if not len(public) or not len(private) or public.shape[1:] != private.shape[1:]:
        return 0
    seen = set(image_digests(private, skip_constant=True))
    return sum(d in seen for d in image_digests(public, skip_constant=True))


def refuse_private_copies(
    public: ImageDataset, private: ImageDataset, path: str | os.PathLike, private_name: str
) -> None:
    """Refuse (one line: the public file, how many of its images are copies, the fix) a public set that holds
    images of the private data, BEFORE anything is charged or trained.

    Only where the process that reads the public set holds the private data anyway: ``train`` (``--data``
    and ``--public`` are both read there) and ``demo`` (its sites' data are the embedded digits it split).
    Never at a federation site or against site data: a node that refused a job because its public set holds
    one of the node's images would tell the coordinator, who chose the public set, that this image is in the
    site's data - membership disclosed with no noise, the very thing the release is protecting. In a
    federation the signed job names the public set by its sha256, and that it holds no site's data is the
    coordinator operator's declaration, as is everything else the job says is public."""
    n = private_copies(public.images, private.images)
    if n:
        raise PrivateImagesInPublicSet(
            f"{path}: {n} of its {public.n} images are exact copies of images in {private_name}, and a "
            "public set must hold none of the private images (it costs no epsilon: pretraining on them "
            "would release them unprotected); use a public set from another source"
        )
