"""Tamper evidence for the site ledger: a hash chain over its rows and a head signed by the site key.

Why: the ledger is the site's only memory of what it has released. A local user who deletes a
row, lowers a recorded spend, reorders rows or swaps in another file would otherwise hand the
site a fresh budget. Each row stores ``prev_hash`` and ``row_hash`` = sha256(prev_hash ‖
canonical_json(row)); the first ``prev_hash`` is derived from the ledger's random id, so rows
cannot be moved between ledgers. The head (ledger id, number of rows, last hash, the ``meta``
table) is signed with the site's Ed25519 key (``feta_release.signing``). Without that key
nobody can write a head that verifies, so an edit, a deletion (also of the last rows), a
reordering or a replaced file is detected when the ledger is opened.

What it cannot see: the whole file (and its signed head) rolled back to an older copy made by
the same key, or deleted. That needs a monotonic anchor outside the node's disk; the node keeps
its files 0600 and refuses a group/other-writable ledger.

The response blobs are bound through ``response_sha256`` (in the chain); their bytes are checked
in a deep verification (node start, ``node status``) and whenever a replay returns one.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import sqlite3
import stat
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from feta_release.errors import PolicyError, PrivacyError
from feta_release.signing import canonical_json, public_key_bytes, sign_document, verify_document

FORMAT = "feta-ledger/2"

# Columns of ``requests`` covered by the chain, in this order.
ROW_FIELDS = (
    "seq",
    "request_id",
    "job_id",
    "mechanism",
    "events",
    "status",
    "response_sha256",
    "job_epsilon",
    "lifetime_epsilon",
    "created_at",
    "completed_at",
)

CHAIN_SCHEMA = """
CREATE TABLE IF NOT EXISTS chain_head (
    id        INTEGER PRIMARY KEY CHECK (id = 1),
    document  TEXT NOT NULL,   -- canonical JSON: format, ledger_id, site_key, rows, head, meta
    signature TEXT NOT NULL    -- JSON: feta_release.signing detached signature by the site key
);
"""


class LedgerTamperedError(PrivacyError):
    """The ledger's chain or signed head does not match its rows: edited, truncated or replaced."""


class LedgerNotChainedError(PrivacyError):
    """A ledger written before tamper evidence existed (no chain): it must be migrated explicitly."""


def key_id(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    """Full sha256 of the raw public key (the whole key, not a short fingerprint)."""
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return hashlib.sha256(public_key_bytes(pub)).hexdigest()


def genesis(ledger_id: str) -> str:
    return hashlib.sha256(canonical_json({"format": FORMAT, "ledger_id": ledger_id})).hexdigest()


def row_document(row: dict[str, Any]) -> dict[str, Any]:
    doc = {k: row[k] for k in ROW_FIELDS}
    doc["events"] = json.loads(doc["events"])
    return doc


def row_hash(prev: str, row: dict[str, Any]) -> str:
    return hashlib.sha256(prev.encode("ascii") + canonical_json(row_document(row))).hexdigest()


def make_private_dirs(path: str | os.PathLike[str]) -> Path:
    """``path`` as a directory, each folder of it that is missing made for this account only (0700, whatever
    the umask lets the group do). ``mkdir(parents=True)`` gives the folders on the way the umask's mode: under
    umask 002 a group could write the folder a ledger is then created in. Existing folders are left as they
    are (a node refuses a ledger or work folder others can write: ``edge.ledger_anchor``)."""
    p = Path(path)
    missing: list[Path] = []
    while not p.exists() and not p.is_symlink() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(mode=0o700, exist_ok=True)
    return Path(path)


def create_private_file(path: Path) -> None:
    """Create ``path`` empty, mode 0600, failing if anything (a file, a link) is already there."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except FileExistsError:
        raise PrivacyError(
            f"{path}: something (a dangling link?) is already there; refusing to create the ledger "
            "through it. Remove it or choose another --ledger path"
        ) from None
    os.close(fd)


def check_file_mode(path: Path) -> None:
    mode = path.stat().st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PolicyError(
            f"{path}: the ledger is writable by group/others (mode {stat.S_IMODE(mode):o}); "
            f"fix with `chmod 600 {path}`"
        )


def _rows(db: sqlite3.Connection, with_response: bool = False) -> list[dict[str, Any]]:
    # The answers can be megabytes each (model weights): read them only for a deep check.
    cols = (*ROW_FIELDS, "prev_hash", "row_hash", *(("response",) if with_response else ()))
    cur = db.execute(f"SELECT {', '.join(cols)} FROM requests ORDER BY seq")
    return [dict(zip(cols, r)) for r in cur]


def _meta(db: sqlite3.Connection) -> dict[str, str]:
    return {k: v for k, v in db.execute("SELECT key, value FROM meta ORDER BY key")}


def has_requests_table(db: sqlite3.Connection) -> bool:
    return (
        db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='requests'").fetchone()
        is not None
    )


def is_chained(db: sqlite3.Connection) -> bool:
    cols = {r[1] for r in db.execute("PRAGMA table_info(requests)")}
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    return "row_hash" in cols and "chain_head" in tables


def verify(
    db: sqlite3.Connection, path: Path, public_key: Ed25519PublicKey | None, deep: bool = False
) -> dict:
    """Check every link, the head and (with ``public_key``) its signature; return the head document.

    Raises ``LedgerTamperedError`` naming the first inconsistency.
    """
    bad = f"{path}: privacy ledger tampered with"
    fix = "; the node refuses to run on it. Restore the ledger from a backup (never edit it by hand)"
    head_row = db.execute("SELECT document, signature FROM chain_head WHERE id=1").fetchone()
    if head_row is None:
        raise LedgerTamperedError(f"{bad}: it has no signed head{fix}")
    _refuse_code_in_schema(db, bad, fix)
    head, signature = json.loads(head_row[0]), json.loads(head_row[1])
    meta = _meta(db)
    if head.get("format") != FORMAT or head.get("ledger_id") != meta.get("ledger_id"):
        raise LedgerTamperedError(f"{bad}: its head belongs to another ledger or format{fix}")
    prev = genesis(head["ledger_id"])
    rows = _rows(db, with_response=deep)
    for i, row in enumerate(rows, 1):
        where = f"row {row['seq']} (request {row['request_id']!r})"
        if row["seq"] != i:
            raise LedgerTamperedError(f"{bad}: row {i} is missing (rows deleted or renumbered){fix}")
        if row["prev_hash"] != prev:
            raise LedgerTamperedError(
                f"{bad}: the chain breaks before {where} (a row was deleted or moved){fix}"
            )
        prev = row_hash(prev, row)
        if row["row_hash"] != prev:
            raise LedgerTamperedError(f"{bad}: {where} was changed after it was recorded{fix}")
        if (
            deep
            and row["response"] is not None
            and hashlib.sha256(bytes(row["response"])).hexdigest() != row["response_sha256"]
        ):
            raise LedgerTamperedError(f"{bad}: the stored answer of {where} was changed{fix}")
    if head.get("rows") != len(rows) or head.get("head") != prev:
        raise LedgerTamperedError(
            f"{bad}: the signed head covers {head.get('rows')} row(s) but the file has "
            f"{len(rows)} or different ones (rows added or removed outside the node){fix}"
        )
    if head.get("meta") != meta:
        raise LedgerTamperedError(
            f"{bad}: its meta table (policy version seen, ...) differs from the signed head{fix}"
        )
    if public_key is not None:
        if head.get("site_key") != key_id(public_key):
            raise LedgerTamperedError(
                f"{bad}: it was signed by another key than this site's (file replaced?){fix}"
            )
        try:
            verify_document(head, signature, [public_key], f"{path}: head")
        except PolicyError:
            raise LedgerTamperedError(f"{bad}: the signature over its head does not verify{fix}") from None
    return head


def _refuse_code_in_schema(db: sqlite3.Connection, bad: str, fix: str) -> None:
    """The ledger never creates a trigger or a view; one in the file is an edit the chain cannot see.

    Why: the chain covers the rows, not the schema, and every write re-links and signs the rows as they are
    after its INSERT; a planted trigger that rewrites or drops each new charge would have the node sign a
    ledger that never held the spend."""
    found = db.execute(
        "SELECT type, name FROM sqlite_master WHERE type IN ('trigger', 'view') ORDER BY name"
    ).fetchall()
    if found:
        raise LedgerTamperedError(
            f"{bad}: it holds {', '.join(f'{t} {n!r}' for t, n in found)}, which the node never "
            f"creates (a trigger could rewrite or drop each new charge before it is signed){fix}"
        )


def seal_chain(db: sqlite3.Connection, key: Ed25519PrivateKey) -> None:
    """Re-link every row and sign a new head. Call inside the write transaction, after ``verify``."""
    ledger_id = _meta(db)["ledger_id"]
    prev = genesis(ledger_id)
    for row in _rows(db):
        h = row_hash(prev, row)
        if (row["prev_hash"], row["row_hash"]) != (prev, h):
            db.execute("UPDATE requests SET prev_hash=?, row_hash=? WHERE seq=?", (prev, h, row["seq"]))
        prev = h
    n = db.execute("SELECT COUNT(*) FROM requests").fetchone()[0]
    head = {
        "format": FORMAT,
        "ledger_id": ledger_id,
        "site_key": key_id(key),
        "rows": n,
        "head": prev,
        "meta": _meta(db),
    }
    db.execute(
        "INSERT INTO chain_head(id, document, signature) VALUES (1, ?, ?) "
        "ON CONFLICT(id) DO UPDATE SET document=excluded.document, signature=excluded.signature",
        (canonical_json(head).decode("utf-8"), json.dumps(sign_document(head, key))),
    )


def anchor(head: dict[str, Any]) -> dict[str, Any]:
    """The ledger's position from its (verified) head: ``{ledger_id, rows, head}``.

    Why: a rollback or deletion of the whole file is invisible to the chain itself (module docstring); a party
    outside the node's disk that keeps this triple (the coordinator, from each attestation) sees it as fewer
    rows, a head the ledger no longer holds, or another ledger id."""
    return {"ledger_id": str(head["ledger_id"]), "rows": int(head["rows"]), "head": str(head["head"])}


def hash_at(db: sqlite3.Connection, ledger_id: str, rows: int) -> str | None:
    """The chain hash after the first ``rows`` rows (the genesis hash for 0), None when the ledger holds
    fewer. Call on a verified ledger: the stored ``row_hash`` of row ``rows`` is then the chain's own."""
    if rows == 0:
        return genesis(ledger_id)
    got = db.execute("SELECT row_hash FROM requests WHERE seq=?", (int(rows),)).fetchone()
    return None if got is None else str(got[0])


def init(db: sqlite3.Connection, key: Ed25519PrivateKey) -> None:
    """A new ledger's id and first signed head (inside the creating transaction)."""
    db.execute("INSERT INTO meta(key, value) VALUES ('ledger_id', ?)", (secrets.token_hex(16),))
    seal_chain(db, key)


def migrate(db: sqlite3.Connection, key: Ed25519PrivateKey) -> int:
    """Chain an old ledger's rows in their recorded order and sign its head. Returns the row count."""
    cols = {r[1] for r in db.execute("PRAGMA table_info(requests)")}
    for col, decl in (("seq", "INTEGER"), ("prev_hash", "TEXT"), ("row_hash", "TEXT")):
        if col not in cols:
            db.execute(f"ALTER TABLE requests ADD COLUMN {col} {decl}")
    db.execute(CHAIN_SCHEMA)
    ids = [r[0] for r in db.execute("SELECT rowid FROM requests ORDER BY rowid")]
    for i, rid in enumerate(ids, 1):
        db.execute("UPDATE requests SET seq=? WHERE rowid=?", (i, rid))
    db.execute("CREATE UNIQUE INDEX IF NOT EXISTS requests_seq ON requests(seq)")
    if "ledger_id" not in _meta(db):
        db.execute("INSERT INTO meta(key, value) VALUES ('ledger_id', ?)", (secrets.token_hex(16),))
    seal_chain(db, key)
    return len(ids)
