"""The coordinator's record of every site's ledger: a monotonic anchor outside the site's disk.

Why: a site's ledger detects any edit of its rows (``feta_release.ledger_chain``) but not the whole file
deleted or restored from an older copy signed by the same key; either hands the site back the lifetime budget
it has spent (and resets the policy-version floor the ledger keeps). Every final attestation carries the
ledger's ``{ledger_id, rows, head}`` under the site's signature (``edge.attest``); the coordinator keeps the
last one per site here and, at the next job's hello, refuses a site whose ledger does not extend it, before
anything is planned or released:

- the same ledger id with fewer rows (an older copy restored), or as many rows ending at another head (a copy
  that went on from an older one);
- another ledger id (deleted and started afresh), unless the coordinator's admin accepted that id
  (``feta-release coordinator accept-ledger``, logged here). The old ledger's attested lifetime events are
  then carried into every later plan of the site, so the new ledger does not re-grant the old spend at the
  coordinator.

One file per coordinator key (``ledger-anchors.json`` beside it): the ServerApp is given that key's path, and
every job the coordinator signs is checked against the same record. Writes are atomic and serialized by a lock
file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ..errors import PrivacyError
from ..files import atomic_write_bytes

ANCHORS_FILE = "ledger-anchors.json"
FORMAT = "feta-ledger-anchors/1"


class LedgerRegressed(PrivacyError):
    """A site's ledger does not extend the one its last attestation recorded (deleted or restored)."""


def anchors_path(coordinator_key: str | Path) -> Path:
    """Where the coordinator holding ``coordinator_key`` keeps its sites' ledger anchors."""
    return Path(coordinator_key).resolve().parent / ANCHORS_FILE


def _position(doc: Any) -> dict[str, Any] | None:
    """``{ledger_id, rows, head}`` out of a hello's or a statement's ``ledger`` field, None when it holds
    none."""
    if not isinstance(doc, Mapping):
        return None
    try:
        return {"ledger_id": str(doc["ledger_id"]), "rows": int(doc["rows"]), "head": str(doc["head"])}
    except (KeyError, TypeError, ValueError):
        return None


def _fix(site: str, ledger_id: str | None) -> str:
    accept = (
        f"; only if the site lost its ledger for good and started a new one (`node start --new-ledger`), "
        f"accept it: `feta-release coordinator accept-ledger --site {site} --ledger-id {ledger_id} --key "
        "COORDINATOR.key`"
        if ledger_id
        else ""
    )
    return f"fix: site {site} restores its latest ledger (and starts its node again){accept}"


def regression(
    site: str, last: Mapping[str, Any], seen: Mapping[str, Any] | None, accepted: str | None
) -> str | None:
    """Why ``seen`` (a site's ledger position now) does not extend ``last`` (its last attested one), None when
    it does (or when it is another ledger id the admin ``accepted``)."""
    was = (
        f"its last attestation (job {last.get('job_id')}) recorded ledger {str(last['ledger_id'])[:12]}… "
        f"with {last['rows']} row(s)"
    )
    if seen is None:
        return f"site {site} sent no ledger position, but {was}; {_fix(site, None)}"
    if seen["ledger_id"] != last["ledger_id"]:
        if accepted == seen["ledger_id"]:
            return None
        return (
            f"site {site}'s ledger was deleted or replaced: {was}, it now runs on ledger "
            f"{seen['ledger_id'][:12]}… ({seen['rows']} row(s)), which would re-grant its spent budget; "
            + _fix(site, seen["ledger_id"])
        )
    if seen["rows"] < last["rows"] or (seen["rows"] == last["rows"] and seen["head"] != last["head"]):
        return (
            f"site {site}'s ledger was restored from an older copy: {was} (head {str(last['head'])[:12]}…), "
            f"it now holds {seen['rows']} (head {seen['head'][:12]}…), which would re-grant its spent "
            "budget; " + _fix(site, None)
        )
    return None


class AnchorStore:
    """``ledger-anchors.json``: ``{format, sites: {site: last position + job_id + lifetime_events +
    carried_events}, accepted: {site: ledger id}, log: [lines]}``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        """The document under an exclusive lock, written back (atomically) when the body changed it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released by the kernel if this process dies
            doc = self._read()
            before = json.dumps(doc, sort_keys=True)
            yield doc
            if json.dumps(doc, sort_keys=True) != before:
                atomic_write_bytes(self.path, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())

    def _read(self) -> dict[str, Any]:
        if not self.path.is_file():
            return {"format": FORMAT, "sites": {}, "accepted": {}, "log": []}
        try:
            doc = json.loads(self.path.read_text("utf-8"))
            if doc.get("format") != FORMAT:
                raise ValueError(f"format {doc.get('format')!r}")
        except (OSError, ValueError, AttributeError) as exc:
            raise PrivacyError(
                f"{self.path}: not the coordinator's ledger anchors ({exc}); restore it from a "
                "backup (it is what refuses a site's deleted or rolled-back ledger)"
            ) from None
        return doc

    def last(self, site: str) -> dict[str, Any] | None:
        with self._locked() as doc:
            return doc["sites"].get(site)

    def check(self, site: str, seen: Any) -> list[dict[str, Any]]:
        """Refuse (``LedgerRegressed``) a site whose ledger position ``seen`` (its hello's) does not extend
        the last attested one. Returns the lifetime events of the site's earlier, accepted-as-replaced
        ledgers, which its plan must count on top of what the ledger it runs on now reports."""
        with self._locked() as doc:
            last, accepted = doc["sites"].get(site), doc["accepted"].get(site)
        if last is None:
            return []
        why = regression(site, last, _position(seen), accepted)
        if why is not None:
            raise LedgerRegressed(why)
        pos = _position(seen)
        carried = list(last.get("carried_events", []))
        return (
            carried + list(last.get("lifetime_events", []))
            if pos and pos["ledger_id"] != last["ledger_id"]
            else carried
        )

    def record(self, site: str, job_id: str, statement: Mapping[str, Any]) -> None:
        """Keep the ledger position of a site's verified final attestation (a statement without one:
        nothing)."""
        pos = _position(statement.get("ledger"))
        if pos is None:
            return
        life = list((statement.get("lifetime") or {}).get("events", []))
        with self._locked() as doc:
            last = doc["sites"].get(site)
            carried: list[Any] = []
            if last is not None:
                why = regression(site, last, pos, doc["accepted"].get(site))
                if why is not None:
                    raise LedgerRegressed(why)
                carried = list(last.get("carried_events", []))
                # the accepted new ledger: the old one's spend stays
                if pos["ledger_id"] != last["ledger_id"]:
                    carried += list(last.get("lifetime_events", []))
                    doc["accepted"].pop(site, None)
                    doc["log"].append(
                        f"{_now()} site {site}: ledger {last['ledger_id']} replaced by the accepted "
                        f"{pos['ledger_id']} (job {job_id}); {len(carried)} earlier event(s) carried"
                    )
            doc["sites"][site] = {**pos, "job_id": job_id, "lifetime_events": life, "carried_events": carried}

    def accept(self, site: str, ledger_id: str) -> str:
        """The admin's explicit acceptance of a site's new ledger id (logged). Returns the logged line."""
        with self._locked() as doc:
            last = doc["sites"].get(site)
            if last is None:
                raise PrivacyError(
                    f"{self.path}: no ledger of site {site} was recorded here; nothing to accept"
                )
            if last["ledger_id"] == ledger_id:
                raise PrivacyError(f"site {site} already runs on ledger {ledger_id}; nothing to accept")
            line = (
                f"{_now()} site {site}: new ledger {ledger_id} accepted in place of {last['ledger_id']} "
                f"({last['rows']} row(s), job {last.get('job_id')}); its attested lifetime spend stays "
                "counted"
            )
            doc["accepted"][site] = ledger_id
            doc["log"].append(line)
        return line


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
