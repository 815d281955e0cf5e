"""``ImageDataset``: the one canonical in-memory form of a labelled image set.

Every loader, mechanism, trainer and evaluator exchanges this object, so its invariants are checked
once, here, when it is built: float32 pixels in [0, 1], channels-first, int64 labels in
``[0, n_classes)``. This module imports only numpy (the torch-free release path may use it).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DataError

FINGERPRINT_VERSION = "feta-imagedataset-v1"
# the most memory a site's float32 images may take; default half the machine's
MEMORY_ENV = "FETA_MAX_DATASET_MB"


def dataset_memory_limit() -> int:
    """Bytes the canonical float32 images of one set may take: ``FETA_MAX_DATASET_MB``, else half of this
    machine's physical memory (the mechanisms and the cache conversion need room beside the set itself)."""
    value = os.environ.get(MEMORY_ENV, "").strip()
    if value:
        try:
            return int(float(value) * 2**20)
        except ValueError:
            raise DataError(
                f"{MEMORY_ENV}={value!r} is not a number of MiB; set it like {MEMORY_ENV}=3000"
            ) from None
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def check_dataset_memory(n: int, values_per_image: int, where: str) -> None:
    """Refuse, before any pixel is read, a set whose float32 images (N x C x H x W x 4 bytes) exceed the
    limit: every stage holds them once (``ImageDataset``), so such a set would exhaust the machine part-way
    instead."""
    need, limit = int(n) * int(values_per_image) * 4, dataset_memory_limit()
    if need > limit:
        raise DataError(
            f"{where}: {n:,} images of {values_per_image:,} values need {need / 2**30:,.2f} GiB as "
            f"float32 (N*C*H*W*4 bytes) > the limit {limit / 2**30:,.2f} GiB; use smaller images "
            f"(--image-size), split the site, or raise {MEMORY_ENV} on a machine with the memory"
        )


# What a site's computing process holds beside its float32 images: Python, numpy and torch, the job's model,
# one chunk of the cache conversion and the releases' temporaries. bench/site_scale.py at 100,000 x 64x64
# (1.53 GiB of images): peak RSS 2.0 to 2.4 GiB per stage, at most 0.9 GiB above the images; rounded up.
SITE_WORKING_MB = 1024


def site_memory_bytes(n: int, values_per_image: int) -> int:
    """Bytes a site's computing process needs for ``n`` images of ``values_per_image`` values: the float32
    set it holds whole (``ImageDataset``) plus :data:`SITE_WORKING_MB`."""
    return int(n) * int(values_per_image) * 4 + SITE_WORKING_MB * 2**20


def check_site_memory(n: int, shape: tuple[int, ...], limit_mb: float, where: str, limit_name: str) -> None:
    """Refuse, before any pixel is read, a site whose images need more memory than ``limit_mb`` (the policy's
    ``resources.max_worker_memory_mb``: the computing processes' RLIMIT_DATA, ``edge/resources.py``), one line
    naming the bytes needed, the limit and the fixes. Without it the open or the first release would fail
    part-way under the limit, after the node had started."""
    values = 1
    for v in shape:
        values *= int(v)
    need = site_memory_bytes(n, values)
    if need > limit_mb * 2**20:
        side = "x".join(str(int(v)) for v in shape)
        raise DataError(
            f"{where}: {int(n):,} images of {side} need {need / 2**30:,.2f} GiB (float32 images "
            f"N*C*H*W*4 bytes + {SITE_WORKING_MB} MiB working memory) > {limit_name} "
            f"{limit_mb:,.0f} MiB; use smaller images (--image-size), split the site, or raise "
            f"{limit_name} on a machine with the memory"
        )


@dataclass
class ImageDataset:
    """Labelled images in canonical form.

    images: float32 (N, C, H, W), finite, values in [0, 1]
    labels: int64 (N,), values in [0, n_classes)
    class_names: one name per class; ``n_classes = len(class_names)``
    source: human-readable provenance (a path, ``embedded:mnist_5k``, ``... [heldout]``)
    """

    images: np.ndarray
    labels: np.ndarray
    class_names: tuple[str, ...]
    source: str = ""

    def __post_init__(self) -> None:
        self.class_names = tuple(str(c) for c in self.class_names)
        where = self.source or "<dataset>"
        if (
            not isinstance(self.images, np.ndarray)
            or self.images.dtype != np.float32
            or self.images.ndim != 4
        ):
            raise DataError(
                f"{where}: images must be a float32 array (N, C, H, W); got "
                f"{getattr(self.images, 'dtype', type(self.images).__name__)} "
                f"{getattr(self.images, 'shape', '')}"
            )
        if not isinstance(self.labels, np.ndarray) or self.labels.dtype != np.int64 or self.labels.ndim != 1:
            raise DataError(
                f"{where}: labels must be an int64 array (N,); got "
                f"{getattr(self.labels, 'dtype', type(self.labels).__name__)} "
                f"{getattr(self.labels, 'shape', '')}"
            )
        if len(self.labels) != len(self.images):
            raise DataError(f"{where}: {len(self.images)} images but {len(self.labels)} labels")
        if not self.class_names:
            raise DataError(f"{where}: no class names")
        if len(set(self.class_names)) != len(self.class_names):
            raise DataError(f"{where}: duplicate class names {list(self.class_names)}")
        if len(self.labels) and (self.labels.min() < 0 or self.labels.max() >= len(self.class_names)):
            raise DataError(
                f"{where}: labels must lie in [0, {len(self.class_names)}); "
                f"found {int(self.labels.min())}..{int(self.labels.max())}"
            )
        if self.images.size:
            lo, hi = float(self.images.min()), float(self.images.max())
            # min/max are NaN if any pixel is NaN, so one comparison covers NaN, inf and range.
            if not (0.0 <= lo and hi <= 1.0):
                raise DataError(
                    f"{where}: pixel values must be finite and in [0, 1]; found min {lo}, max {hi}"
                )

    # -- shape ----------------------------------------------------------------------------------
    @property
    def n(self) -> int:
        return int(self.images.shape[0])

    def __len__(self) -> int:
        return self.n

    @property
    def n_classes(self) -> int:
        return len(self.class_names)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W)."""
        c, h, w = self.images.shape[1:]
        return int(c), int(h), int(w)

    def class_counts(self) -> np.ndarray:
        """int64 array (n_classes,): number of images of each class (zeros included)."""
        return np.bincount(self.labels, minlength=self.n_classes).astype(np.int64)

    # -- derived datasets -----------------------------------------------------------------------
    def subset(self, idx: np.ndarray | list[int], source: str | None = None) -> ImageDataset:
        """Rows ``idx`` (integer indices or a boolean mask), same class names; arrays are copies."""
        idx = np.asarray(idx)
        return ImageDataset(
            images=np.ascontiguousarray(self.images[idx]),
            labels=np.ascontiguousarray(self.labels[idx]),
            class_names=self.class_names,
            source=self.source if source is None else source,
        )

    # -- identity -------------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """SHA-256 (hex) of a canonical serialization; equal data give equal fingerprints on any machine.

        The hashed byte string is, in order:
        1. ``b"feta-imagedataset-v1\\n"``;
        2. the UTF-8 of ``json.dumps({"class_names": [...], "shape": [N, C, H, W]}, sort_keys=True,
           separators=(",", ":"), ensure_ascii=False)`` followed by ``b"\\n"``;
        3. the images as little-endian float32, C order (exact bytes, no quantization);
        4. the labels as little-endian int64.
        ``source`` is NOT hashed: the same pixels loaded from a folder or an ``.npz`` match.
        """
        h = hashlib.sha256()
        h.update(FINGERPRINT_VERSION.encode() + b"\n")
        for part in self.canonical_parts():
            h.update(part)
        return h.hexdigest()

    def canonical_parts(self) -> list[bytes | memoryview]:
        """Items 2-4 of ``fingerprint``'s byte string (header, pixels, labels): what a site's keyed commitment
        (``feta_release.data.commitment``) binds. Never published as a plain hash: see that module. The pixels
        are a view of the array's own buffer (a copy only when it is not little-endian C-order float32): a
        large site is hashed without a second copy of its images."""
        header = {"class_names": list(self.class_names), "shape": [int(s) for s in self.images.shape]}
        head = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        return [
            head + b"\n",
            np.ascontiguousarray(self.images, dtype="<f4").data.cast("B"),
            np.ascontiguousarray(self.labels, dtype="<i8").tobytes(),
        ]

    def summary(self) -> dict:
        """JSON-ready description (no pixels)."""
        counts = self.class_counts()
        return {
            "source": self.source,
            "n": self.n,
            "n_classes": self.n_classes,
            "class_names": list(self.class_names),
            "class_counts": {name: int(c) for name, c in zip(self.class_names, counts)},
            "image_shape": list(self.image_shape),
            "fingerprint": self.fingerprint(),
        }


def _to_uint8(images: np.ndarray, rows: int = 4096) -> np.ndarray:
    """``rint(images * 255)`` as uint8, chunk by chunk: the whole-array expression holds two float32
    temporaries the size of the set (3.2 GB more at 100,000 images of 64x64)."""
    out = np.empty(images.shape, dtype=np.uint8)
    for i in range(0, len(images), rows):
        out[i : i + rows] = np.rint(images[i : i + rows] * 255.0)
    return out


def save_npz(ds: ImageDataset, path: str | os.PathLike, *, dtype: str = "float32") -> Path:
    """Write ``ds`` as a compressed ``.npz`` that ``load_dataset`` reads back.

    ``dtype="float32"`` (default) round-trips exactly (same fingerprint); ``"uint8"`` quantizes to
    0..255 and is 4x smaller. The file appears atomically (temporary file + rename), so a reader
    never sees a half-written dataset.
    """
    if dtype not in ("float32", "uint8"):
        raise DataError(f"save_npz: dtype must be 'float32' or 'uint8', not {dtype!r}")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    images = ds.images if dtype == "float32" else _to_uint8(ds.images)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as fh:  # a file object: np.savez would append ".npz" to a name
            np.savez_compressed(
                fh,
                images=images,
                labels=ds.labels.astype(np.int64),
                class_names=np.array(ds.class_names, dtype=str),
                source=np.array(ds.source, dtype=str),
            )
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
