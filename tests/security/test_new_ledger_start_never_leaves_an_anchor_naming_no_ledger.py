"""`node start --new-ledger` wrote an anchor that named no ledger (``WORK/ledger-anchor.json``, its history
only) and then created the new ledger and recorded it: a start that failed or was killed between the two (the
ledger path a link that points nowhere, a full disk, the policy version's first write) left a node that took
the next ledger file it found as its own, so an older copy of the lost ledger put back was opened and handed
the site back the budget spent after that copy. The new ledger is now created first and recorded in place of
the lost one in one write: whatever fails, the anchor names the lost ledger or the new one."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from edge import ledger_anchor
from edge.launch import preflight
from edge.site import Site
from feta_release import ledger_chain
from feta_release.errors import ConfigError, FetaError, PrivacyError
from feta_release.ledger import Ledger
from tests.support.federation import node_settings
from tests.support.lost_ledger import lose_ledger, lost_ledger, node_work


def _older_copy_is_refused(s: Any, old: Path, words: str) -> None:
    """The lost ledger's older copy put where the ledger lives is refused by a start without --new-ledger."""
    lose_ledger(s.ledger)
    shutil.copy2(old, s.ledger)
    with pytest.raises(ledger_anchor.LedgerRegressedError, match=words):
        Site.open(s.node_config())


def test_a_new_ledger_start_refused_at_a_link_pointing_nowhere_keeps_the_anchor(tmp_path: Path) -> None:
    # the ledger lived on a volume that is gone: its path is a link to nothing
    fed, s, old = lost_ledger(tmp_path)
    before = ledger_anchor.read(node_work(s))
    gone = tmp_path / "lost-volume" / "ledger.db"
    s.ledger.symlink_to(gone)
    # the site opened on the link itself (`node start` refuses the link before it resolves the path:
    # test_new_ledger_refuses_a_ledger_path_that_is_a_link.py)
    with pytest.raises(ConfigError, match="only at a real file path"):
        Site.open(s.node_config(), new_ledger=True).ledger.close()
    assert ledger_anchor.read(node_work(s)) == before
    # the volume comes back from an older backup
    gone.parent.mkdir()
    shutil.copy2(old, gone)
    with pytest.raises(ledger_anchor.LedgerRegressedError, match=r"an older copy of it \(1 row"):
        Site.open(s.node_config())


def test_a_new_ledger_that_cannot_be_created_leaves_the_anchor_of_the_lost_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fed, s, old = lost_ledger(tmp_path)
    before = ledger_anchor.read(node_work(s))

    def full_disk(path: Path) -> None:
        raise PrivacyError(f"{path}: No space left on device")

    monkeypatch.setattr(ledger_chain, "create_private_file", full_disk)
    with pytest.raises(FetaError, match="No space left"):
        preflight(node_settings(s, insecure=True, new_ledger=True)).ledger.close()
    monkeypatch.undo()
    assert ledger_anchor.read(node_work(s)) == before
    _older_copy_is_refused(s, old, r"an older copy of it \(1 row")


def test_a_new_ledger_start_killed_after_the_creation_anchors_the_new_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fed, s, old = lost_ledger(tmp_path)
    before = ledger_anchor.read(node_work(s))

    def killed(self: Ledger, version: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Ledger, "observe_policy_version", killed)
    with pytest.raises(KeyboardInterrupt):
        preflight(node_settings(s, insecure=True, new_ledger=True)).ledger.close()
    monkeypatch.undo()
    rec = ledger_anchor.read(node_work(s))
    with Ledger(s.ledger) as new:
        assert rec["ledger_id"] == new.anchor()["ledger_id"] != before["ledger_id"]
    assert any(before["ledger_id"] in line for line in rec["history"])
    _older_copy_is_refused(s, old, "another ledger")


def test_a_ledger_put_at_the_path_while_a_new_one_is_created_is_not_taken_as_new(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fed, s, old = lost_ledger(tmp_path)
    before = ledger_anchor.read(node_work(s))
    check = ledger_anchor.refuse_new_over_existing
    calls = {"n": 0}

    def then_put_back(ledger: Any) -> None:
        check(ledger)
        calls["n"] += 1
        if calls["n"] == 2:  # the check right before the creation: the older copy lands after it
            shutil.copy2(old, s.ledger)

    monkeypatch.setattr(ledger_anchor, "refuse_new_over_existing", then_put_back)
    with pytest.raises(ledger_anchor.LedgerRegressedError):
        preflight(node_settings(s, insecure=True, new_ledger=True)).ledger.close()
    monkeypatch.undo()
    assert calls["n"] == 2
    assert ledger_anchor.read(node_work(s)) == before
    with pytest.raises(ledger_anchor.LedgerRegressedError, match=r"an older copy of it \(1 row"):
        Site.open(s.node_config())
