"""The node's own record of its ledger (``WORK/ledger-anchor.json``): which ledger it ran on, and how far it
got.

Why: the ledger's hash chain cannot see the whole file deleted or rolled back to an older copy signed by the
same key (``feta_release.ledger_chain``); either would hand the site back budget it has spent. The node keeps,
beside its other state, the ledger's id, row count and head hash (``Ledger.anchor``) at every start and every
attestation, and refuses to start (or to open the site for a message) on a ledger that does not extend it:

- the ledger file is missing although the node ran on one: refused, instead of creating a fresh, empty ledger
  silently; the fix is to restore the latest ledger. ``node start --new-ledger`` starts a new one
  deliberately: it is logged here (``history``) and the coordinator, which keeps the last attested anchor of
  every site (``feta_release.federation.anchors``), refuses the new ledger id until its admin accepts it. The
  record moves to the new ledger only after every check that needs no ledger (``edge.site.Site.open``) and
  the new ledger's creation, in one write: a start refused for its policy, config or data, or one whose
  ledger could not be created, keeps refusing an older copy of the lost ledger. The record keeps the highest
  policy version seen (``policy_floor``), so the new ledger does not take a replayed older policy;
- another ledger id, fewer rows, or a chain that does not pass through the recorded head: an older copy (or a
  copy that went on from one) was restored: refused; restore the latest ledger.

This file lives on the node's disk, so it is a guard against an ordinary restore or an accidental deletion,
not against someone who rolls back the whole disk: the coordinator's copy covers that.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from feta_release.errors import ConfigError, PrivacyError
from feta_release.files import atomic_write_bytes

ANCHOR_FILE = "ledger-anchor.json"


class LedgerRegressedError(PrivacyError):
    """The ledger is missing or older than the one this node (or its coordinator) last recorded."""


def anchor_path(work_dir: str | Path) -> Path:
    return Path(work_dir) / ANCHOR_FILE


def read(work_dir: str | Path) -> dict[str, Any]:
    """The recorded anchor document (``{}`` when the node never recorded one)."""
    p = anchor_path(work_dir)
    if not p.is_file():
        return {}
    try:
        doc = json.loads(p.read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise LedgerRegressedError(
            f"{p}: unreadable ({type(exc).__name__}); it records which ledger this node ran "
            "on: restore it from the backup of the node's work directory"
        ) from None
    return doc if isinstance(doc, dict) else {}


def _write(work_dir: str | Path, doc: dict[str, Any]) -> None:
    atomic_write_bytes(
        anchor_path(work_dir), (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode(), private=True
    )


def _fix(ledger: Path) -> str:
    return (
        f"restore the latest copy of {ledger} (with its -wal file, if any) from the backup; only if it is "
        "lost for good, move what is there aside and start once with `feta-release node start --new-ledger` "
        "(logged; the coordinator then refuses the new ledger until its admin accepts it)"
    )


def refuse_missing(ledger: str | Path, work_dir: str | Path) -> None:
    """Before a ledger is opened (and so created when missing): refuse when the node recorded one that is
    gone."""
    led, rec = Path(ledger), read(work_dir)
    if led.exists() or not rec.get("ledger_id"):
        return
    raise LedgerRegressedError(
        f"{led}: the privacy ledger is missing, but this node ran on ledger {rec['ledger_id'][:12]}… with "
        f"{rec.get('rows')} row(s) ({anchor_path(work_dir)}); a fresh ledger would re-grant the spent "
        f"budget. Fix: {_fix(led)}"
    )


def refuse_regression(ledger: Any, work_dir: str | Path) -> None:
    """After opening: refuse a ledger (``feta_release.ledger.Ledger``) that does not extend the recorded
    anchor."""
    rec = read(work_dir)
    if not rec.get("ledger_id") or ledger.extends(rec):
        return
    now = ledger.anchor()
    what = (
        f"another ledger ({now['ledger_id'][:12]}…)"
        if now["ledger_id"] != rec["ledger_id"]
        else f"an older copy of it ({now['rows']} row(s))"
        if now["rows"] < int(rec.get("rows", 0))
        else "a copy that went on from an older one (its chain does not pass through the recorded head)"
    )
    raise LedgerRegressedError(
        f"{ledger.path}: this node last ran on ledger {rec['ledger_id'][:12]}… with {rec.get('rows')} row(s) "
        f"({anchor_path(work_dir)}), but the file is {what}; it would re-grant the spent budget. "
        f"Fix: {_fix(Path(ledger.path))}"
    )


def as_given(ledger: str | Path) -> Path:
    """``ledger`` with its folder resolved (as every other path of the node) and its own name as given. Never
    resolved through a link at that name: :func:`refuse_link` looks at the name itself, and the creation
    (``ledger_chain.create_private_file``: ``O_EXCL | O_NOFOLLOW``) refuses a link put there after that look;
    a path resolved beforehand would have followed the link before either could see it. A link that reaches
    an existing file (a ledger kept on another volume, which a plain start opens) is resolved, as every other
    path of the node: a running node's later opens (the worker, each message) stay on that file, not on
    whatever the link is changed to."""
    p = Path(ledger)
    if p.is_symlink() and p.exists():
        return p.resolve()
    return p.parent.resolve() / p.name


def refuse_open_folders(ledger: str | Path, work: str | Path) -> None:
    """Refuse, in one line naming the folder, what is wrong and the fix, a ledger folder or a work folder
    that another account can change (or, where it is still to be made, the nearest existing folder it would
    be made in), or one below a folder another account can change. Whoever can write the folder can swap the
    ledger's files between the node's checks and SQLite's open, plant its ``-wal``/``-shm`` journal as links
    before SQLite makes them, or replace the work folder's anchor, cache and round checkpoints, whatever the
    files' own modes; the sticky bit (``/tmp``) does not stop a planted journal. Whoever can write a folder
    ABOVE it (not sticky) can rename the whole folder away and put their own in its place, and a folder's
    owner can do either whatever its mode says: so every folder up to ``/``, the path as given and its
    resolved one, belongs to this account or root and none that group or others can write lacks the sticky
    bit (which lets only an entry's owner rename it). The folders the node makes are 0700
    (``ledger_chain.make_private_dirs``)."""
    for what, target in (("privacy ledger's folder", Path(ledger).parent), ("work folder", Path(work))):
        folder = target
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        where = f"the node's {what}" if folder == target else f"where the node would make its {what} {target}"
        _refuse_changeable(folder, where, sticky_ok=False)
        above = {*folder.absolute().parents, *folder.resolve().parents}
        for parent in sorted(above, key=lambda p: len(p.parts), reverse=True):
            _refuse_changeable(parent, f"a folder above the node's {what} {target}", sticky_ok=True)


def _refuse_changeable(folder: Path, where: str, *, sticky_ok: bool) -> None:
    """Refuse ``folder`` where an account other than this one (or root) owns it (a link there: the link or
    what it reaches; its owner can point it elsewhere), or group or others can write it (above the node's own
    folders: unless it is sticky, as ``/tmp``)."""
    st = folder.stat()
    mode = stat.S_IMODE(st.st_mode)
    other = next((u for u in (folder.lstat().st_uid, st.st_uid) if u not in (os.geteuid(), 0)), None)
    if other is not None:
        raise ConfigError(
            f"{folder}: {where} belongs to another account (uid {other}), which can swap the ledger's "
            "files or the folder itself; fix: choose a folder this account owns, in folders only it or root "
            "owns"
        )
    if mode & 0o022 and not (sticky_ok and mode & stat.S_ISVTX):
        # a sticky shared folder (/tmp) is meant to stay writable by all: the fix is a private folder in it
        fix = (
            f"keep the node's files in a folder of their own, e.g. mkdir -m 700 {folder / 'feta-node'}"
            if mode & stat.S_ISVTX
            else f"chmod go-w {folder} (or choose a folder only this account can write)"
        )
        raise ConfigError(
            f"{folder}: {where} is mode {mode:04o}: group or others can write it, and so swap the ledger's "
            f"files, plant its journal as links or put another folder in place of the node's; fix: {fix}"
        )


def refuse_link(ledger: str | Path, *, new_ledger: bool) -> None:
    """The ledger path AS GIVEN (``node start --ledger``, node.toml ``ledger``: :func:`as_given`, the node
    config too) where it is a symbolic link through which the node would create the ledger: refused in one
    line, before anything is written; so is a folder on its way that is a link pointing nowhere.

    The rule: the node never CREATES its ledger through a link, and may OPEN an existing one through a link.
    Created through a link, the ledger (and any missing folders) would land wherever the link points, a place
    whoever can change the link chooses (``ledger_chain.create_private_file`` refuses a link only at the path
    it is handed, so no path on the way there resolves the ledger's own name). So ``--new-ledger``,
    which always creates, refuses any link, dangling or not; a plain start refuses a link that points nowhere
    (it would create the ledger at the target on a first start, or report the target missing). A link to an
    existing ledger is opened on a plain start, as before (a ledger kept on another volume): what it reaches
    is checked like any ledger file, its chain and head signature by the site key and its id, rows and head
    against this anchor, so a link moved to another ledger or an older copy is refused as a restored copy
    is."""
    led = Path(ledger)
    # a folder on the way that is a link to nothing (a volume not mounted, renamed): the node would make the
    # folders and a fresh ledger where it points, and the anchor in the default work folder beside the ledger
    # would be missing with it, so nothing would refuse the spent budget coming back
    for folder in led.absolute().parents:
        if folder.is_symlink() and not folder.exists():
            raise ConfigError(
                f"{led}: its folder {folder} is a symbolic link to {os.readlink(folder)}, which does not "
                "exist (a volume not mounted?); the node never creates its privacy ledger or its folders "
                "through a link. Fix: mount or restore what the link points to, or give --ledger (node.toml "
                "ledger) a path whose folders exist"
            )
    if not led.is_symlink():
        return
    target = os.readlink(led)
    if new_ledger:
        raise ConfigError(
            f"{led}: --new-ledger creates the privacy ledger only at a real file path, and this is a "
            f"symbolic link (to {target}). Fix: give --ledger (node.toml ledger) the path of a real file, "
            "not a link"
        )
    if not led.exists():
        raise ConfigError(
            f"{led}: the ledger path is a symbolic link to {target}, which does not exist; the node never "
            "creates its privacy ledger through a link. Fix: give --ledger (node.toml ledger) the real path "
            "of the ledger file, not a link (restore the ledger there if it is lost)"
        )


def refuse_new_over_existing(ledger: str | Path) -> None:
    """``--new-ledger`` where a ledger file is there: refused (move it aside first: nothing is deleted here,
    and an older copy put back never replaces the recorded ledger this way). A link is refused even when it
    points nowhere: the ledger is never created through one (:func:`refuse_link`)."""
    led = Path(ledger)
    refuse_link(led, new_ledger=True)
    if os.path.lexists(led):
        raise LedgerRegressedError(
            f"{led}: --new-ledger starts a NEW ledger, but one is there; move it aside first "
            "(or start without --new-ledger to keep using it)"
        )


def start_new(ledger: str | Path, work_dir: str | Path, create: Callable[[], Any]) -> Any:
    """``node start --new-ledger``: create the new ledger (``create()``, refused while a ledger file is
    there: :func:`refuse_new_over_existing`), then record it in place of the lost one (kept in ``history``)
    in one write. Returns the new ledger.

    One write, after the creation: at no point does the record name no ledger, which would let the next
    start take any ledger file (an older copy of the lost one) as the node's. A creation that fails leaves
    the record of the lost ledger; a start killed between the two leaves a new ledger the record does not
    name, refused until it is moved aside (fail closed). The site (``edge.site.Site.open``) calls it only
    once every check that needs no ledger has passed."""
    refuse_new_over_existing(ledger)
    led, rec = Path(ledger), read(work_dir)
    new = create()
    try:
        now = new.anchor()
        if now["rows"] or (rec.get("ledger_id") and now["ledger_id"] == rec["ledger_id"]):
            # a file put at the path between the check above and the creation was opened instead
            raise LedgerRegressedError(
                f"{led}: --new-ledger opened a ledger that is not new ({now['rows']} row(s)); a file was put "
                "there while the node started: move it aside and start again"
            )
        line = (
            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} --new-ledger: a new privacy ledger "
            f"{now['ledger_id']} is created at {led}"
            + (
                f", replacing ledger {rec['ledger_id']} ({rec.get('rows')} row(s))"
                if rec.get("ledger_id")
                else ""
            )
            + "; the coordinator refuses it until its admin accepts it"
        )
        # the lost ledger's policy-version floor stays (``policy_floor``)
        floor = {"policy_version": rec["policy_version"]} if "policy_version" in rec else {}
        _write(
            work_dir, {**now, **floor, "history": [*rec.get("history", []), line], "recorded": time.time()}
        )
    except BaseException:
        new.close()
        raise
    print(f"WARNING: {line}", file=sys.stderr, flush=True)
    return new


def policy_floor(work_dir: str | Path) -> int | None:
    """The highest policy version the node's ledgers have seen (``record``), kept across ``--new-ledger``: a
    new ledger has seen none, and would otherwise take a replayed older signed policy (looser caps)."""
    v = read(work_dir).get("policy_version")
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def raise_floor(work_dir: str | Path, version: int) -> None:
    """Raise the recorded policy-version floor (:func:`policy_floor`) to ``version``, a policy the site was
    just opened under, where the node recorded an anchor (``node start``) and its floor is lower; nothing
    else of the record moves. Why now and not at the next :func:`record` (an attestation): each message's
    app-bundle gate (``edge.trust``), which never opens the ledger, refuses a policy older than this floor,
    so a replayed older policy file cannot re-allow a bundle the re-signed one removed."""
    rec = read(work_dir)
    floor = policy_floor(work_dir)
    if rec and (floor is None or floor < int(version)):
        _write(work_dir, {**rec, "policy_version": int(version)})


def record(ledger: Any, work_dir: str | Path) -> dict[str, Any]:
    """Record the ledger's anchor now (node start, each attestation), with the highest policy version seen
    (:func:`policy_floor`); only ever forward (``refuse_regression`` runs first). Returns the anchor."""
    now = ledger.anchor()
    rec = read(work_dir)
    seen = [v for v in (ledger.highest_policy_version(), policy_floor(work_dir)) if v is not None]
    floor = {"policy_version": max(seen)} if seen else {}
    if {k: rec.get(k) for k in [*now, *floor]} != {**now, **floor}:
        _write(work_dir, {**now, **floor, "history": rec.get("history", []), "recorded": time.time()})
    return now
