"""Ed25519 keys, canonical JSON and detached signatures (``cryptography`` does the cryptography).

Canonical serialization (what every signature in feta-release covers):
  JSON, UTF-8, keys sorted at every level, separators "," and ":" with no whitespace,
  non-ASCII characters kept as UTF-8 (ensure_ascii=False), floats written by Python's repr
  (shortest round-trip form), NaN/Infinity refused. Integers stay integers.
That is the same bytes on every machine for the same document, so a signature made on one
machine verifies on another.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import ConfigError, FetaError, PolicyError

SIGNATURE_ALG = "ed25519"


def canonical_json(obj: Any) -> bytes:
    """The canonical byte form of a JSON document (see module docstring)."""
    _reject_non_finite(obj)
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode(
        "utf-8"
    )


class DuplicateKeyError(ValueError):
    """A JSON object names the same key twice: two parsers could read two different documents."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKeyError(f"duplicate key {k!r} in a JSON object")
        out[k] = v
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not JSON")


# Deeper than any document of the project (a manifest nests about a dozen levels): JSON nested past it is
# refused before any recursive walk (canonical_json, signature checks) could overflow the stack.
MAX_JSON_DEPTH = 64


def loads_strict(text: str | bytes) -> Any:
    """Parse a signed (or to-be-verified) JSON document: duplicate keys, NaN/Infinity and nesting deeper than
    ``MAX_JSON_DEPTH`` are refused.

    Why: with ``{"epsilon": 9, "epsilon": 0.5}`` Python keeps the last value while another reader may keep
    the first; a signature would then cover a document that readers disagree about. Raises ``ValueError``
    (``json.JSONDecodeError`` or :class:`DuplicateKeyError`).
    """
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except RecursionError:
        raise ValueError("JSON nested too deep to parse") from None
    _check_depth(doc)
    return doc


def _check_depth(doc: Any) -> None:
    """Without recursion: a list of (value, depth) still to look at."""
    todo = [(doc, 1)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
            todo.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))


def _reject_non_finite(obj: Any) -> None:
    if isinstance(obj, float) and not math.isfinite(obj):
        raise ValueError(f"non-finite number {obj!r} cannot be signed")
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise ValueError(f"JSON keys must be strings, got {k!r}")
            _reject_non_finite(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _reject_non_finite(v)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


# -- keys ------------------------------------------------------------------------------------------


def public_key_bytes(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def full_fingerprint(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    """sha256 over the raw 32-byte public key, all 64 hex digits (the short form is for display only)."""
    if isinstance(key, Ed25519PrivateKey):
        key = key.public_key()
    return hashlib.sha256(public_key_bytes(key)).hexdigest()


def fingerprint(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    """Short hex fingerprint: first 16 hex digits of sha256 over the raw 32-byte public key."""
    if isinstance(key, Ed25519PrivateKey):
        key = key.public_key()
    return hashlib.sha256(public_key_bytes(key)).hexdigest()[:16]


def generate_keypair(
    out_dir: str | Path, name: str = "signing", passphrase: bytes | None = None
) -> tuple[Path, Path]:
    """Write ``NAME.key`` (PKCS#8 PEM, mode 0600, optionally encrypted) and ``NAME.pub`` (PEM)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    priv_path, pub_path = out / f"{name}.key", out / f"{name}.pub"
    for p in (priv_path, pub_path):
        if p.exists():
            raise PolicyError(f"{p}: already exists; refusing to overwrite a key")
    key = Ed25519PrivateKey.generate()
    enc = serialization.BestAvailableEncryption(passphrase) if passphrase else serialization.NoEncryption()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc)
    # Create with 0600 from the start, so the key is never readable by others even briefly.
    fd = os.open(priv_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    pub_path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return priv_path, pub_path


def write_new_key(path: Path, data: bytes) -> None:
    """Mode 0600 from the first byte; O_EXCL: never overwrite a key, nor write through a planted link."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except FileExistsError:
        raise ConfigError(
            f"{path}: already exists; refusing to overwrite a private key (choose another --out)"
        ) from None
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def make_node_auth_key(out_dir: str | Path, name: str) -> tuple[Path, Path]:
    """A node's key to authenticate to the SuperLink: EC SECP384R1 in OpenSSH format, as Flower expects
    (``flwr supernode register NAME.pub``; node: ``--auth-key NAME``). Made by ``site init`` and by the
    coordinator's test and pilot kits."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    priv, pub = out / name, out / f"{name}.pub"
    write_new_key(
        priv,
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ),
    )
    pub.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        + b"\n"
    )
    return priv, pub


def refuse_shared_secret_file(
    path: str | Path, what: str, st: os.stat_result | None = None, error: type[FetaError] = PolicyError
) -> None:
    """Refuse a secret file (a private key, the data secret) that its group or other accounts may read or
    change: any of them could then sign, authenticate or recompute the data commitment as the site. The one
    check of every secret the project loads; ``st``: the file's stat when the caller already has it. POSIX
    only (Windows keeps file access in ACLs, which mode bits do not show)."""
    if os.name != "posix":
        return
    p = Path(path)
    mode = (p.stat() if st is None else st).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        how = "readable by other users" if mode & (stat.S_IRGRP | stat.S_IROTH) else "writable by other users"
        raise error(f"{p}: the {what} is {how} (mode {stat.S_IMODE(mode):o}); run `chmod 600 {p}`")


def load_private_key(path: str | Path, passphrase: bytes | None = None) -> Ed25519PrivateKey:
    p = Path(path)
    try:
        data = p.read_bytes()
        refuse_shared_secret_file(p, "private key")
    except OSError as exc:
        raise PolicyError(f"{p}: cannot read private key: {exc.strerror}") from None
    try:
        key = serialization.load_pem_private_key(data, password=passphrase)
    except TypeError:
        # cryptography raises TypeError both for a missing passphrase and for an unneeded one.
        if passphrase is None:
            raise PolicyError(f"{p}: private key is encrypted; give its passphrase") from None
        raise PolicyError(f"{p}: private key is not encrypted; do not give a passphrase") from None
    except ValueError as exc:
        if passphrase is not None and b"ENCRYPTED" in data:
            raise PolicyError(f"{p}: wrong passphrase for this private key") from None
        raise PolicyError(f"{p}: not a readable private key (wrong passphrase or format): {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise PolicyError(f"{p}: not an Ed25519 private key")
    return key


def load_public_key(path_or_pem: str | Path | bytes) -> Ed25519PublicKey:
    if isinstance(path_or_pem, bytes):
        data, where = path_or_pem, "<public key>"
    else:
        p = Path(path_or_pem)
        where = str(p)
        try:
            data = p.read_bytes()
        except OSError as exc:
            raise PolicyError(f"{p}: cannot read public key: {exc.strerror}") from None
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError as exc:
        raise PolicyError(f"{where}: not a readable PEM public key: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise PolicyError(f"{where}: not an Ed25519 public key")
    return key


def public_key_pem(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    if isinstance(key, Ed25519PrivateKey):
        key = key.public_key()
    return key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


# -- signatures ------------------------------------------------------------------------------------


def sign_document(doc: Any, key: Ed25519PrivateKey) -> dict[str, str]:
    """Detached signature over ``canonical_json(doc)``."""
    return {
        "alg": SIGNATURE_ALG,
        "signer": fingerprint(key),
        "public_key": public_key_pem(key),
        "signature": base64.b64encode(key.sign(canonical_json(doc))).decode("ascii"),
    }


def verify_document(
    doc: Any, signature: object, trusted: list[Ed25519PublicKey], what: str = "document"
) -> str:
    """Check ``signature`` over ``doc`` against the trusted keys; return the signer's fingerprint.

    The key embedded in the signature is only a hint: trust comes from ``trusted``.
    """
    if not isinstance(signature, dict) or signature.get("alg") != SIGNATURE_ALG:
        raise PolicyError(f"{what}: signature missing or not {SIGNATURE_ALG}")
    try:
        raw = base64.b64decode(signature["signature"], validate=True)
    except (KeyError, ValueError, TypeError):
        raise PolicyError(f"{what}: signature value is not valid base64") from None
    by_fp = {fingerprint(k): k for k in trusted}
    signer = signature.get("signer")
    if signer not in by_fp:
        raise PolicyError(
            f"{what}: signed by unknown key {signer!r}; trusted: {', '.join(sorted(by_fp)) or 'none given'}"
        )
    try:
        by_fp[signer].verify(raw, canonical_json(doc))
    except InvalidSignature:
        raise PolicyError(
            f"{what}: bad signature (content changed after signing, or wrong key {signer})"
        ) from None
    return signer
