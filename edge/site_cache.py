"""The site's opened data, cached in a private file so that a per-message open does no work that counts N.

Why: without a warm worker (``node start --no-worker``, or the per-message fallback of
``edge.forward`` when the worker is down or busy) every message runs in a fresh process that opens the site, and
opening decodes every image file and hashes every pixel: O(exact N) work (~30 µs per 28x28 PNG, ms per DICOM
slice) before the reply, none of it padded to the public size. ``hello`` is uncharged, so the coordinator could
time as many as it likes and average the jitter away.

So the site is decoded once, when the node starts (``node start``'s preflight opens it) or when its files change,
and what the open produced (the dataset after the policy's unit was applied, the patient ids, the keyed
commitment) is written to ``site-data.cache`` in the node's owner-only work directory. A later open with the same
files reads that file instead of decoding. Its work is a function of public values only:

  * the check that the files are unchanged is ``site_stamp`` with the policy's public size: ``public_rows``
    entries stat-ed and hashed whatever the real file count;
  * the file holds the images and labels padded with blank rows to ``public_rows(N, n_public)``, so reading it,
    its MAC and parsing it cost the public bucket, never N;
  * the dataset's validation and the patient grouping run on the real rows and again on the padding rows (into
    dropped values), so those too cost the bucket (see ``_padded_checks`` for the sub-µs residue left).

The file is as private as the images it holds: 0600, written through a random-named ``mkstemp`` file, in the 0700
work directory. It is MACed with a key derived from the site's data secret over the stamp and the contents, so
a file that was not written by this node for exactly these files (stale, truncated, edited) is a miss and the
site is decoded and verified afresh. A miss (node start, the first message after the site's files changed) does
the full O(N) open once: the residual timing this leaves is at the site's own moments, not at the coordinator's.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import hmac
import io
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from feta_release.data import dataset as _dataset
from feta_release.data import declared as _declared
from feta_release.data import loading as _loading
from feta_release.data.commitment import public_rows
from feta_release.files import atomic_write_bytes
from feta_release.data.dataset import ImageDataset
from feta_release.privacy_unit import group_patient_rows

log = logging.getLogger("feta.node")

CACHE_NAME = "site-data.cache"
_DOMAIN = b"feta-release site data cache v2\0"  # HKDF info of the cache's MAC key (never the commitment's key)
_TAG = 32
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

    Small files (policy, keys, secret) by content; the data (a folder's files, a CSV and the files it lists, or
    one file) and the ledger by identity, size and times: a file replaced or rewritten gets a new inode or
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
    replaced or deleted behind an unchanged CSV would go unseen: the warm worker would keep serving it, and this
    cache would keep the deleted images); else the one file (.npz, a DICOM file)."""
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
    """The sha256 of the code that decodes and maps the data: an upgrade that changes how images are read makes
    every cache a miss instead of serving data the old code decoded."""
    h = hashlib.sha256()
    for mod in (_loading, _declared, _dataset):
        h.update(Path(str(mod.__file__)).read_bytes())
    return h.hexdigest().encode()


def cache_key(node_config: dict[str, Any], n_public: int) -> str:
    """What a cached open is valid for: every node-config value (paths, load options), the loader's code and the
    stamp of the files, checked with public work (``site_stamp`` padded to the public size)."""
    config = json.dumps(sorted((str(k), str(v)) for k, v in node_config.items())).encode()
    stamp = site_stamp(node_config, n_public).encode()
    return hashlib.sha256(config + b"\0" + _loader_code() + b"\0" + stamp).hexdigest()


def _mac(secret: bytes, key: str, body: bytes) -> bytes:
    # a key of its own, derived from the data secret with HKDF (the commitment keys HMAC with the secret itself)
    mac_key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_DOMAIN).derive(secret)
    return hmac.new(mac_key, key.encode() + b"\0" + body, hashlib.sha256).digest()


def save(work: Path, key: str, secret: bytes, data: ImageDataset, patient_ids: Any, commitment: str,
         n_public: int) -> None:
    """Write the opened site for ``key``: images and labels padded with blank rows to ``public_rows``."""
    n, rows = data.n, public_rows(data.n, n_public)
    images = np.zeros((rows, *data.images.shape[1:]), dtype=np.float32)
    images[:n] = data.images
    labels = np.zeros(rows, dtype=np.int64)
    labels[:n] = data.labels
    arrays: dict[str, Any] = {"images": images, "labels": labels, "n": np.int64(n), "commitment": np.str_(commitment),
                              "class_names": np.array(list(data.class_names), dtype=np.str_), "source": np.str_(data.source)}
    if patient_ids is not None:
        ids = np.zeros(rows, dtype=np.int64)
        ids[:n] = np.asarray(patient_ids, dtype=np.int64)
        arrays["patients"] = ids
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    body = buf.getvalue()
    atomic_write_bytes(work / CACHE_NAME, _mac(secret, key, body) + body, private=True)  # 0600, random tmp name


def load(work: Path, key: str, secret: bytes) -> dict[str, Any] | None:
    """The cached open for ``key`` (padded arrays, the real count, the commitment), or None: no file, or one not
    MACed by this node for exactly these files (a miss: the caller decodes and verifies the data afresh)."""
    try:
        raw = (work / CACHE_NAME).read_bytes()
    except OSError:
        return None
    tag, body = raw[:_TAG], raw[_TAG:]
    if not hmac.compare_digest(tag, _mac(secret, key, body)):
        return None
    with np.load(io.BytesIO(body), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def cached_site(cached: dict[str, Any]) -> tuple[ImageDataset, Any, str]:
    """(dataset of the real rows, their patient ids or None, the keyed commitment) from ``load``'s arrays,
    checked with work padded to the cached (public) row count."""
    n = int(cached["n"])
    data = ImageDataset(images=cached["images"][:n], labels=cached["labels"][:n],
                        class_names=tuple(str(c) for c in cached["class_names"]), source=str(cached["source"]))
    ids = cached["patients"][:n] if "patients" in cached else None
    _padded_checks(cached, n, data.class_names)
    return data, ids, str(cached["commitment"])


def _padded_checks(cached: dict[str, Any], n: int, class_names: tuple[str, ...]) -> None:
    """The dataset's validation (its min/max over labels and pixels) again on the padding rows, dropped, so that
    the two together cost the public row count; for a patient site the grouping is padded by the patient
    index (``padded_grouping``). Left unpadded: Python-level constants and a numpy slice (no per-row work)."""
    ImageDataset(images=cached["images"][n:], labels=cached["labels"][n:], class_names=class_names)


def padded_grouping(n_patients: int, rows: int) -> None:
    """Group ``rows - n_patients`` one-image dummy patients, dropped: with the real grouping (one tensor per
    patient, ~µs each, and a sort of the ids) the tensors made are ``rows`` (public) whatever the patient count.
    The sort is over N + rows - n_patients ids: a residue of ns per image (docs/federation.md, padded work)."""
    group_patient_rows(np.arange(max(rows - n_patients, 0), dtype=np.int64))
