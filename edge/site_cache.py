"""The site's opened data, cached in a private file so that a per-message open does no work that counts N.

Why: without a warm worker (``node start --no-worker``, or the per-message fallback of
``edge.forward`` when the worker is down or busy) every message runs in a fresh process that opens the site,
and opening decodes every image file and hashes every pixel: O(exact N) work (~30 µs per 28x28 PNG, ms per
DICOM slice) before the reply, none of it padded to the public size. ``hello`` is uncharged, so the
coordinator could time as many as it likes and average the jitter away.

So the site is decoded once, when the node starts (``node start``'s preflight opens it) or when its files
change, and what the open produced (the dataset after the policy's unit was applied, the patient ids, the
keyed commitment) is written to ``site-data.cache`` in the node's owner-only work directory. A later open with
the same files reads that file instead of decoding. Its work is a function of public values only:

  * the check that the files are unchanged is ``site_stamp`` with the policy's public size: ``public_rows``
    entries stat-ed and hashed whatever the real file count;
  * the file holds the images and labels padded with blank rows to ``public_rows(N, n_public)``, so reading
    it, its MAC and parsing it cost the public bucket, never N;
  * the dataset's validation and the patient grouping run on the real rows and again on the padding rows (into
    dropped values), so those too cost the bucket (see ``_padded_checks`` for the sub-µs residue left).

The file is as private as the images it holds: 0600, written through a random-named ``mkstemp`` file, in the
0700 work directory. It is MACed with a key derived from the site's data secret over the stamp and the
contents, so a file that was not written by this node for exactly these files (stale, truncated, edited) is a
miss and the site is decoded and verified afresh. A miss (node start, the first message after the site's files
changed) does the full O(N) open once: the residual timing this leaves is at the site's own moments, not at
the coordinator's.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import hmac
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from feta_release.data import dataset as _dataset
from feta_release.data import declared as _declared
from feta_release.data import loading as _loading
from feta_release.data.commitment import public_rows
from feta_release.data.dataset import ImageDataset
from feta_release.privacy_unit import group_patient_rows

log = logging.getLogger("feta.node")

CACHE_NAME = "site-data.cache"
# HKDF info of the cache's MAC key (never the commitment's key)
_DOMAIN = b"feta-release site data cache v3\0"
_TAG = 32
# float32 bytes converted or written at a time: what a cache read or write adds to the site
_CHUNK_BYTES = 16 << 20
_READ_BYTES = 1 << 20
# node-config keys (edge.site's CFG_*; spelled out here because edge.site imports this module)
_FILES_BY_HASH = ("policy-file", "trusted-policy-key", "site-key", "data-secret")
_DATA, _LEDGER = "data-path", "ledger-path"


def _file_id(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _stamp_entry(h: Any, f: Path) -> None:
    try:
        h.update(str(f).encode() + json.dumps(_file_id(f)).encode())
    except OSError:
        h.update(str(f).encode() + b"-")


def site_stamp(node_config: dict[str, Any], n_public: int | None = None) -> str:
    """A digest that changes when anything the site was opened from changes.

    Small files (policy, keys, secret) by content; the data (a folder's files, a CSV and the files it lists,
    or one file) and the ledger by identity, size and times: a file replaced or rewritten gets a new inode or
    mtime/ctime.

    This runs before every request (the warm worker's check, this cache's lookup), and for a folder it costs
    about 0.1 ms per file: the reply's latency would time the site's exact file count. With ``n_public`` (the
    signed policy's nominal size) the per-file work is padded to ``public_rows`` entries: the same path, sort,
    stat and hashing work on the real entries again, into a digest that is dropped (a CSV's parse is not
    padded: about 1 µs per row, against the ~30 µs per image its decoding cost)."""
    h = hashlib.sha256()
    for key in _FILES_BY_HASH:
        p = Path(str(node_config.get(key, "")))
        h.update(key.encode() + b"\0" + (hashlib.sha256(p.read_bytes()).digest() if p.is_file() else b"-"))
    data = Path(str(node_config.get(_DATA, "")))
    files = _data_files(data)
    for f in [data, *files]:
        _stamp_entry(h, f)
    if n_public is not None and files and files != [data]:
        pad, extra = hashlib.sha256(), public_rows(len(files), n_public) - len(files)
        # the real entries again, as fresh paths, sorted and stat-ed: about the cost of as many more files
        for f in sorted(Path(str(files[i % len(files)])) for i in range(extra)):
            _stamp_entry(pad, f)
    ledger = Path(str(node_config.get(_LEDGER, "")))
    h.update(json.dumps(_file_id(ledger)[:2] if ledger.exists() else None).encode())
    return h.hexdigest()


def _data_files(data: Path) -> list[Path]:
    """The files the data are read from: a folder's entries; a CSV's listed image files (without them an image
    replaced or deleted behind an unchanged CSV would go unseen: the warm worker would keep serving it, and
    this cache would keep the deleted images); else the one file (.npz, a DICOM file)."""
    if data.is_dir():
        return sorted(data.rglob("*"))
    if data.suffix.lower() != ".csv" or not data.is_file():
        return [data]
    try:
        with open(data, newline="", encoding="utf-8-sig") as fh:
            listed = [row[0].strip() for row in list(csv.reader(fh))[1:] if row and row[0].strip()]
    except (OSError, UnicodeDecodeError, csv.Error):
        return [data]  # the loader refuses it with its own line; the CSV's own identity is still stamped
    return [data, *(data.parent / name for name in listed)]


@functools.lru_cache(maxsize=1)
def _loader_code() -> bytes:
    """The sha256 of the code that decodes and maps the data: an upgrade that changes how images are read
    makes every cache a miss instead of serving data the old code decoded."""
    h = hashlib.sha256()
    for mod in (_loading, _declared, _dataset):
        h.update(Path(str(mod.__file__)).read_bytes())
    return h.hexdigest().encode()


def cache_key(node_config: dict[str, Any], n_public: int, policy_digest: str) -> str:
    """What a cached open is valid for: every node-config value (paths, load options), the loader's code, the
    stamp of the files, checked with public work (``site_stamp`` padded to the public size), and the digest of
    the verified policy the data are shaped under (its unit and patient cap decide which images are kept).
    The stamp covers the policy FILE as it is now: replaced since the site verified it, the cache would
    otherwise hand data shaped under one policy to the opens under the other, whose commitment, if unchanged,
    passes them."""
    config = json.dumps(sorted((str(k), str(v)) for k, v in node_config.items())).encode()
    stamp = site_stamp(node_config, n_public).encode()
    return hashlib.sha256(
        config + b"\0" + _loader_code() + b"\0" + stamp + b"\0" + policy_digest.encode()
    ).hexdigest()


def _mac(secret: bytes, key: str) -> Any:
    """The running HMAC of a cache for ``key``: its body is fed in chunks (the file is never one bytes
    object). A key of its own, derived from the data secret with HKDF (the commitment keys HMAC with the
    secret itself)."""
    mac_key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_DOMAIN).derive(secret)
    return hmac.new(mac_key, key.encode() + b"\0", hashlib.sha256)


def _eight_bit(images: np.ndarray) -> bool:
    """Whether every pixel is k/255 exactly as the loader computes it from an 8-bit source (``float32(k) /
    float32(255)``): then one byte per pixel holds it and ``_to_unit`` gives back the very same float32
    bits."""
    step = _chunk(images.shape)
    for start in range(0, images.shape[0], step):
        part = images[start : start + step]
        if not np.array_equal(_to_unit(np.rint(part * 255.0).astype(np.uint8)), part):
            return False
    return True


def _chunk(shape: Any) -> int:
    """Rows per chunk for images of ``shape`` (N, C, H, W)."""
    return max(1, _CHUNK_BYTES // (4 * int(np.prod(shape[1:]))))


def _to_unit(stored: np.ndarray) -> np.ndarray:
    """Stored pixels as the dataset's float32 in [0, 1] (8-bit: the loader's own arithmetic)."""
    if stored.dtype == np.uint8:
        return stored.astype(np.float32) / np.float32(255)  # type: ignore[no-any-return]
    return np.array(stored, dtype=np.float32)


def _layout(data: ImageDataset, rows: int, pixels: str, patients: bool, commitment: str) -> dict[str, Any]:
    """The cache's header: its public facts and where each padded array lies after it (sizes rounded up to
    64)."""
    arrays: dict[str, Any] = {"images": [pixels, [rows, *data.images.shape[1:]]], "labels": ["<i8", [rows]]}
    if patients:
        arrays["patients"] = ["<i8", [rows]]
    head: dict[str, Any] = {
        "n": data.n,
        "commitment": commitment,
        "class_names": list(data.class_names),
        "source": data.source,
        "arrays": {},
    }
    offset = 0
    for name, (dtype, shape) in arrays.items():
        head["arrays"][name] = {"dtype": dtype, "shape": shape, "offset": offset}
        offset += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // 64) * 64
    return head


def save(
    work: Path, key: str, secret: bytes, data: ImageDataset, patient_ids: Any, commitment: str, n_public: int
) -> None:
    """Write the opened site for ``key``: images and labels padded with blank rows to ``public_rows``; pixels
    as one byte each where the source was 8-bit (bit-exact, ``_eight_bit``), else float32. Streamed in chunks
    into a 0600 ``mkstemp`` file renamed into place, the MAC computed as it is written: no copy of the whole
    site."""
    rows = public_rows(data.n, n_public)
    pixels = "|u1" if _eight_bit(data.images) else "<f4"
    head = _layout(data, rows, pixels, patient_ids is not None, commitment)
    header = json.dumps(head, sort_keys=True).encode()
    prefix = len(header).to_bytes(8, "little") + header
    mac = _mac(secret, key)
    fd, tmp = tempfile.mkstemp(dir=work, prefix=f".{CACHE_NAME}.", suffix=".tmp")  # 0600, random name
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(b"\0" * _TAG)
            _write(fh, mac, prefix)
            base = _TAG + len(prefix)
            sources = {"images": data.images, "labels": data.labels, "patients": patient_ids}
            for name, spec in head["arrays"].items():
                _write(fh, mac, b"\0" * (base + spec["offset"] - fh.tell()))
                _write_rows(fh, mac, np.asarray(sources[name]), np.dtype(spec["dtype"]), spec["shape"])
            fh.seek(0)
            fh.write(mac.digest())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, work / CACHE_NAME)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write(fh: Any, mac: Any, chunk: bytes | memoryview) -> None:
    mac.update(chunk)
    fh.write(chunk)


def _write_rows(fh: Any, mac: Any, real: np.ndarray, dtype: np.dtype, shape: list[int]) -> None:
    """``real``'s rows in ``dtype``, then blank rows up to ``shape[0]`` (the public bucket), chunk by
    chunk."""
    step = _chunk(shape) if len(shape) > 1 else 1 << 20
    for start in range(0, shape[0], step):
        stop = min(start + step, shape[0])
        part = np.zeros((stop - start, *shape[1:]), dtype=dtype)
        have = real[start : min(stop, real.shape[0])]
        if have.shape[0]:
            part[: have.shape[0]] = np.rint(have * 255.0) if dtype == np.uint8 else have
        _write(fh, mac, part.data.cast("B"))


def load(work: Path, key: str, secret: bytes) -> dict[str, Any] | None:
    """The cached open for ``key`` (padded arrays, the real count, the commitment), or None: no file, or one
    not MACed by this node for exactly these files (a miss: the caller decodes and verifies the data afresh).

    The MAC is checked by reading the file in chunks; the arrays are then memory-mapped from the SAME open
    file (a file renamed over it later is not seen), so nothing holds the whole body as bytes. Only a writer
    of this 0600 file in place (the site's own account) could change mapped bytes after the check."""
    try:
        fh = open(work / CACHE_NAME, "rb")
    except OSError:
        return None
    with fh:
        tag, mac = fh.read(_TAG), _mac(secret, key)
        while chunk := fh.read(_READ_BYTES):
            mac.update(chunk)
        if not hmac.compare_digest(tag, mac.digest()):
            return None
        return _parse(fh)


def _parse(fh: Any) -> dict[str, Any]:
    """The MACed body's header and its arrays as read-only memory maps (the MAC vouches for this node's
    layout)."""
    fh.seek(_TAG)
    size = int.from_bytes(fh.read(8), "little")
    head = json.loads(fh.read(size))
    base = _TAG + 8 + size
    out: dict[str, Any] = {
        "n": head["n"],
        "commitment": head["commitment"],
        "source": head["source"],
        "class_names": head["class_names"],
    }
    for name, spec in head["arrays"].items():
        out[name] = np.memmap(
            fh,
            dtype=np.dtype(spec["dtype"]),
            mode="r",
            offset=base + spec["offset"],
            shape=tuple(spec["shape"]),
        )
    return out


def cached_site(cached: dict[str, Any]) -> tuple[ImageDataset, Any, str]:
    """(dataset of the real rows, their patient ids or None, the keyed commitment) from ``load``'s arrays,
    checked with work padded to the cached (public) row count. The pixels are converted to float32 chunk by
    chunk into the dataset's one array: the memory of the site is its float32 images once, plus a chunk."""
    n = int(cached["n"])
    stored = cached["images"]
    images = np.empty((n, *stored.shape[1:]), dtype=np.float32)
    step = _chunk(stored.shape)
    for start in range(0, n, step):
        images[start : start + step] = _to_unit(stored[start : min(start + step, n)])
    data = ImageDataset(
        images=images,
        labels=np.array(cached["labels"][:n]),
        class_names=tuple(str(c) for c in cached["class_names"]),
        source=str(cached["source"]),
    )
    ids = np.array(cached["patients"][:n]) if "patients" in cached else None
    _padded_checks(cached, n, data.class_names)
    return data, ids, str(cached["commitment"])


def _padded_checks(cached: dict[str, Any], n: int, class_names: tuple[str, ...]) -> None:
    """The dataset's validation (its min/max over labels and pixels) again on the padding rows, dropped, so
    that the two together cost the public row count; for a patient site the grouping is padded by the patient
    index (``padded_grouping``). Left unpadded: Python-level constants and a numpy slice (no per-row work)."""
    stored, labels = cached["images"], cached["labels"]
    step = _chunk(stored.shape)
    for start in range(n, stored.shape[0], step):  # the same conversion, chunk by chunk, then validation
        stop = min(start + step, stored.shape[0])
        ImageDataset(
            images=_to_unit(stored[start:stop]), labels=np.array(labels[start:stop]), class_names=class_names
        )


def padded_grouping(n_patients: int, rows: int) -> None:
    """Group ``rows - n_patients`` one-image dummy patients, dropped: with the real grouping (one tensor per
    patient, ~µs each, and a sort of the ids) the tensors made are ``rows`` (public) whatever the patient
    count. The sort is over N + rows - n_patients ids: a residue of ns per image (docs/federation.md, padded
    work)."""
    group_patient_rows(np.arange(max(rows - n_patients, 0), dtype=np.int64))
