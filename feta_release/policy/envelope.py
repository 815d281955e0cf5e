"""Enveloped signatures: ``{"<kind>": {...}, "signature": {...}}``.

The signature (``signing.sign_document``) covers ``signing.canonical_json`` of the body only. Opening an
envelope is stricter than ``signing.verify_document``: the envelope may hold nothing else, and the
signature's own fields must be exactly what signing would produce (canonical base64, the embedded public
key equal to the trusted one), so that altering ANY byte of a signed file is refused, not just the body.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .. import signing
from ..errors import PolicyError
from .errors import PolicyViolation

SIGNATURE_FIELDS = {"alg", "signer", "public_key", "signature"}

KeyLike = Ed25519PublicKey | Ed25519PrivateKey | str | Path | bytes


def as_public_key(item: KeyLike) -> Ed25519PublicKey:
    """A public key from a key object, PEM text/bytes, or a path to a PEM file (.pub or unencrypted .key)."""
    if isinstance(item, Ed25519PublicKey):
        return item
    if isinstance(item, Ed25519PrivateKey):
        return item.public_key()
    if isinstance(item, bytes):
        return signing.load_public_key(item)
    if isinstance(item, str) and item.lstrip().startswith("-----BEGIN"):
        return signing.load_public_key(item.encode())
    p = Path(item)
    try:
        head = p.read_bytes()[:64]
    except OSError as exc:
        raise PolicyError(f"{p}: cannot read key: {exc.strerror}") from None
    if b"PRIVATE KEY" in head:
        return signing.load_private_key(p).public_key()
    return signing.load_public_key(p)


def as_public_keys(items: Iterable[KeyLike]) -> list[Ed25519PublicKey]:
    if isinstance(items, (str, Path, bytes, Ed25519PublicKey, Ed25519PrivateKey)):
        items = [items]
    return [as_public_key(i) for i in items]


def seal(kind: str, body: dict[str, Any], key: Ed25519PrivateKey) -> dict[str, Any]:
    return {kind: body, "signature": signing.sign_document(body, key)}


def signer_of(envelope: dict[str, Any]) -> str | None:
    sig = envelope.get("signature") if isinstance(envelope, dict) else None
    return sig.get("signer") if isinstance(sig, dict) else None


def open_envelope(
    envelope: Any,
    kind: str,
    trusted: Iterable[Ed25519PublicKey],
    source: str,
    *,
    signer_rule: str = "signature.signer",
) -> tuple[dict[str, Any], str]:
    """Check the envelope against ``trusted`` keys; return (body, signer fingerprint). Nothing is parsed
    from the body before its signature verifies."""
    if not isinstance(envelope, dict) or "signature" not in envelope:
        raise PolicyViolation(
            "signature.required",
            f"{source}: unsigned {kind} (no signature envelope); sign it with `feta-release {kind} sign`",
        )
    if set(envelope) != {kind, "signature"}:
        raise PolicyViolation(
            "signature.envelope",
            f"{source}: a signed {kind} holds exactly {kind!r} and "
            f"'signature'; found {', '.join(sorted(map(str, envelope)))}",
        )
    body, sig = envelope[kind], envelope["signature"]
    if not isinstance(body, dict):
        raise PolicyViolation("signature.envelope", f"{source}: {kind!r} must be an object")
    if not isinstance(sig, dict) or set(sig) != SIGNATURE_FIELDS:
        raise PolicyViolation(
            "signature.envelope",
            f"{source}: signature must have exactly the fields {', '.join(sorted(SIGNATURE_FIELDS))}",
        )
    by_fp = {signing.fingerprint(k): k for k in trusted}
    signer = sig.get("signer")
    if signer not in by_fp:
        raise PolicyViolation(
            signer_rule,
            f"{source}: signed by unknown key {signer!r}; trusted: "
            f"{', '.join(sorted(by_fp)) or 'none given'}",
        )
    key = by_fp[signer]
    if sig.get("public_key") != signing.public_key_pem(key):
        raise PolicyViolation(
            "signature.valid", f"{source}: the signature's public_key is not the trusted key {signer}"
        )
    raw = sig.get("signature")
    try:
        canonical_b64 = (
            isinstance(raw, str) and base64.b64encode(base64.b64decode(raw, validate=True)).decode() == raw
        )
    except ValueError:
        canonical_b64 = False
    if not canonical_b64:
        raise PolicyViolation("signature.valid", f"{source}: signature value is not canonical base64")
    try:
        signing.verify_document(body, sig, [key], what=source)
    except (PolicyError, ValueError) as exc:
        raise PolicyViolation("signature.valid", f"{source}: bad signature ({exc})") from None
    return body, signer


def read_text(path: str | Path, what: str) -> str:
    """A policy or signed document's text, or one ``PolicyError`` line naming the file and what is wrong."""
    p = Path(path)
    try:
        return p.read_text("utf-8")
    except FileNotFoundError:
        raise PolicyError(f"{p}: {what} file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(f"{p}: cannot read {what}: {exc}") from None


def read_json(path: str | Path, what: str) -> Any:
    p = Path(path)
    text = read_text(p, what)
    try:
        return signing.loads_strict(text)
    except signing.DuplicateKeyError as exc:
        raise PolicyError(f"{p}: {what} refused: {exc}; a signed document names each key once") from None
    except ValueError as exc:
        raise PolicyError(f"{p}: {what} is not JSON ({exc}); signed documents are JSON") from None


def write_json(path: str | Path, doc: Any) -> Path:
    """Readable JSON (indentation does not matter: signatures cover the canonical form of the body)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    return p
