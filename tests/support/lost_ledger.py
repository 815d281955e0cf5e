"""A node whose ledger is lost, with an older copy of it (a backup): what `node start --new-ledger` and the
ledger's anchor (``edge.ledger_anchor``) are tested against."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from coordinator.setup import prepare_federation
from edge import ledger_anchor
from edge.site import CFG_WORK, Site, forget_sites
from feta_release.accounting import PrivacyEvent
from feta_release.ledger import Budget, Ledger
from tests.support.federation import node_settings, tiny_sites


def charge(ledger: Ledger, n: int) -> None:
    """``n`` rows of spend on ``ledger``."""
    budget = Budget(job_epsilon=50.0, lifetime_epsilon=50.0, delta=1e-5)
    for _ in range(n):
        rows = ledger.anchor()["rows"]
        ledger.charge(
            "job", f"r{rows}", "central", [PrivacyEvent("central", 5.0, 0.1, 1)], budget, response=b"x"
        )


def lose_ledger(ledger: Path) -> None:
    """The node's ledger is gone with the journal files beside it (a lost volume, a deleted file)."""
    for p in ledger.parent.glob(ledger.name + "*"):
        p.unlink()


def lost_ledger(tmp_path: Path, **policy: Any) -> tuple[Any, Path, Path]:
    """A node that ran on a ledger of 2 rows (anchored), whose ledger is then lost; with the copy of it taken
    after its first row (an older backup). Returns (federation, site-a's files, the older copy)."""
    fed = prepare_federation(tmp_path / "fed", tiny_sites(2), policy_overrides={"site-a": policy})
    s = fed.site("site-a")
    site = Site.open(s.node_config())
    charge(site.ledger, 1)
    old = tmp_path / "old-ledger.db"
    site.ledger.close()
    shutil.copy2(s.ledger, old)
    site = Site.open(s.node_config())
    charge(site.ledger, 1)
    ledger_anchor.record(site.ledger, site.work_dir)
    site.ledger.close()
    forget_sites()
    lose_ledger(s.ledger)
    return fed, s, old


def node_work(s: Any) -> Path:
    """The node's work directory, where its anchor lives."""
    return Path(node_settings(s).node_config()[CFG_WORK])
