"""A site's keyed commitment to its data: HMAC-SHA256 under a secret that never leaves the site.

Why not a plain hash: the policy (and with it every release) used to carry ``sha256(all pixels and labels)``.
Anyone who knows all images but one can hash each candidate for the last one and test membership offline.
An HMAC under a 256-bit secret drawn from the OS (``secrets.token_bytes``) binds the signed policy to the data
just as firmly (the node recomputes it at start and refuses other data), but without the secret the value is
indistinguishable from random (HMAC-SHA256 is a PRF), so it reveals nothing about the images.

The secret lives in one file on the site, created with ``O_CREAT | O_EXCL`` and mode 0600, loaded only by the
node and by ``feta-release policy data-commitment``; it is never sent, logged or written into a release.
"""

from __future__ import annotations

import hmac
import os
import secrets
import struct
from collections.abc import Iterable
from hashlib import sha256
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..signing import refuse_shared_secret_file

__all__ = [
    "SECRET_BYTES",
    "COMMITMENT_DOMAIN",
    "create_secret",
    "load_secret",
    "ensure_secret",
    "dataset_commitment",
    "same_commitment",
    "suggest_public_size",
]

SECRET_BYTES = 32  # 256 bits
COMMITMENT_DOMAIN = b"feta-dataset-commitment-v1\n"  # keeps this HMAC apart from any other use of a key
PATIENTS_DOMAIN = b"\nfeta-patient-grouping-v1\n"  # precedes a patient-level policy's grouping


def create_secret(path: str | Path) -> Path:
    """Write a fresh 256-bit secret (hex) to a NEW file readable by its owner only; refuse to overwrite
    one."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(
            f"{p}: a data secret already exists; keep it (the policy's commitment depends on it) "
            "or move it away yourself"
        ) from None
    with os.fdopen(fd, "w", encoding="ascii") as fh:
        fh.write(secrets.token_bytes(SECRET_BYTES).hex() + "\n")
    return p


def load_secret(path: str | Path) -> bytes:
    """The secret bytes, or a ``ConfigError`` naming the file and the fix (missing, readable by others,
    short)."""
    p = Path(path)
    try:
        st = p.stat()
        text = p.read_text("ascii").strip()
    except FileNotFoundError:
        raise ConfigError(
            f"{p}: data secret not found; create it with `feta-release policy data-commitment DATA "
            f"--secret {p}` and put the printed commitment into the policy"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: cannot read the data secret: {exc}") from None
    refuse_shared_secret_file(p, "data secret", st, error=ConfigError)
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(
            f"{p}: the data secret is not hex text; recreate it with `feta-release policy data-commitment`"
        ) from None
    if len(key) < SECRET_BYTES:
        raise ConfigError(
            f"{p}: the data secret has {len(key) * 8} bits, fewer than {SECRET_BYTES * 8}; "
            "recreate it with `feta-release policy data-commitment`"
        )
    return key


def ensure_secret(path: str | Path) -> tuple[bytes, bool]:
    """(secret, created): load the site's secret, creating it first if there is none."""
    created = not Path(path).exists()
    if created:
        create_secret(path)
    return load_secret(path), created


def dataset_commitment(ds: Any, secret: bytes, patients: Iterable[Any] | None = None) -> str:
    """HMAC-SHA256 (hex) of the dataset's canonical bytes (``ImageDataset.canonical_parts``) under ``secret``.

    ``patients``: per image, its patient's index (a patient-level policy's grouping,
    ``loading.patient_grouping``). It is bound too: without it a local user could regroup the patient ids
    after the admin signed (same images, same labels, same commitment) and make each image a 'patient' of its
    own under the cap. Only the grouping enters (renumbered by first appearance), never the ids; an
    image-level commitment (``None``) is unchanged."""
    if len(secret) < SECRET_BYTES:
        raise ConfigError(
            f"data secret too short ({len(secret) * 8} bits); at least {SECRET_BYTES * 8} are needed"
        )
    mac = hmac.new(secret, COMMITMENT_DOMAIN, sha256)
    for part in ds.canonical_parts():
        mac.update(part)
    if patients is not None:
        mac.update(PATIENTS_DOMAIN + _grouping_bytes(patients, ds.n))
    return mac.hexdigest()


def _grouping_bytes(patients: Iterable[Any], n: int) -> bytes:
    """The grouping as little-endian int64 indices, renumbered 0, 1, ... by first appearance."""
    ids = [int(p) for p in patients]
    if len(ids) != n:
        raise ConfigError(
            f"patient grouping has {len(ids)} entries for {n} images; load the data and its patient "
            "ids together (feta_release.data.load_dataset)"
        )
    index: dict[int, int] = {}
    return struct.pack(f"<{len(ids)}q", *(index.setdefault(p, len(index)) for p in ids))


def same_commitment(a: str, b: str) -> bool:
    """Constant-time comparison (the node compares its own value with the policy's)."""
    return hmac.compare_digest(a.encode("ascii", "replace"), b.encode("ascii", "replace"))


def suggest_public_size(n: int) -> int:
    """A round figure near ``n`` (2 significant digits) for the policy's public nominal size. The site's
    administrator decides: the value is declared public, and no mechanism's guarantee depends on how close it
    is to the true count (rates and denominators use it; sensitivities are computed with it)."""
    if n < 1:
        raise ConfigError(f"dataset has {n} images; nothing to declare")
    if n < 100:
        return max(10, int(round(n, -1)))
    digits = len(str(int(n))) - 2
    return int(round(n, -digits))


def public_rows(n: int, n_public: int) -> int:
    """Rows a pass over the whole dataset processes for ``n`` real ones: ``n_public``, doubled until it covers
    ``n`` (a site holding more than its public size reveals only that bucket)."""
    rows = max(1, int(n_public))
    while rows < n:
        rows *= 2
    return rows
