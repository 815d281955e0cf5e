"""`node start --new-ledger` reset the ledger's anchor (``WORK/ledger-anchor.json``: which ledger the node ran
on, how many rows, its head) before the site was opened, so a start then refused for its policy, node config
or data had already forgotten the lost ledger: an older copy of it restored next was taken as the node's
ledger and handed the site back the budget spent after that copy (a rollback the anchor exists to refuse).
Every refusal that the policy, the config or the data decide now comes before the anchor is touched; the
reordering keeps every rollback refused: an older copy put back is refused after a refused start, after a
successful one, and without --new-ledger before any image is read."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from coordinator.setup import prepare_federation
from edge import ledger_anchor
from edge.launch import NodeSettings, preflight
from edge.site import Site, forget_sites
from feta_release.data.loading import LoadOptions
from feta_release.errors import FetaError
from feta_release.ledger import Ledger
from feta_release.policy.document import sign_policy, write_signed_policy
from feta_release.signing import load_private_key
from tests.support.federation import node_settings, tiny_sites
from tests.support.lost_ledger import lose_ledger, lost_ledger, node_work

Refusal = Callable[[Any, NodeSettings], NodeSettings]

REFUSALS: dict[str, tuple[dict[str, Any], Refusal, str]] = {
    # a node.toml patient cap its image-level policy does not declare
    "patient cap": ({}, lambda fed, n: dataclasses.replace(n, load=LoadOptions(patient_cap=2)), "patient"),
    # another site's images: the keyed commitment differs
    "data changed": ({}, lambda fed, n: dataclasses.replace(n, data=fed.site("site-b").data), "commitment"),
    # a policy signed by a key this node does not trust
    "untrusted policy": (
        {},
        lambda fed, n: dataclasses.replace(n, trusted_policy_key=fed.site("site-b").policy_pub),
        "signature",
    ),
    # the policy names another site key
    "site key": ({}, lambda fed, n: dataclasses.replace(n, site_key=fed.site("site-b").site_key), "site_key"),
    # a policy that allows no app bundle: nothing could run
    "no app bundle": ({"app_bundles": []}, lambda fed, n: n, "app_bundles"),
    # a node config no node runs with
    "round checkpoint": ({}, lambda fed, n: dataclasses.replace(n, round_checkpoint_every=-1), "steps"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refused_new_ledger_start_leaves_the_anchor_and_an_older_copy_stays_refused(
    tmp_path: Path, case: str
) -> None:
    policy, broken, words = REFUSALS[case]
    fed, s, old = lost_ledger(tmp_path, **policy)
    before = ledger_anchor.read(node_work(s))
    assert before["rows"] == 2
    with pytest.raises(FetaError, match=words):
        preflight(broken(fed, node_settings(s, insecure=True, new_ledger=True))).ledger.close()
    assert ledger_anchor.read(node_work(s)) == before  # not reset, no --new-ledger line logged
    assert not s.ledger.exists()  # no new ledger made either
    shutil.copy2(old, s.ledger)  # the older backup put back: it would re-grant one row's spend
    with pytest.raises(ledger_anchor.LedgerRegressedError, match=r"an older copy of it \(1 row"):
        Site.open(s.node_config())


def test_a_new_ledger_start_that_passes_anchors_the_new_ledger_and_refuses_the_old_copy(
    tmp_path: Path,
) -> None:
    fed, s, old = lost_ledger(tmp_path)
    before = ledger_anchor.read(node_work(s))
    shutil.copy2(old, s.ledger)
    # --new-ledger never replaces a ledger that is there (here the older copy): move it aside first
    with pytest.raises(ledger_anchor.LedgerRegressedError, match="one is there; move it aside"):
        preflight(node_settings(s, insecure=True, new_ledger=True))
    assert ledger_anchor.read(node_work(s)) == before
    s.ledger.unlink()
    preflight(node_settings(s, insecure=True, new_ledger=True)).ledger.close()
    rec = ledger_anchor.read(node_work(s))
    with Ledger(s.ledger) as led:
        assert rec["ledger_id"] == led.anchor()["ledger_id"] != before["ledger_id"] and rec["rows"] == 0
    assert any("--new-ledger" in line and before["ledger_id"] in line for line in rec["history"])
    forget_sites()
    lose_ledger(s.ledger)
    shutil.copy2(old, s.ledger)  # the lost ledger's older copy instead of the new one
    with pytest.raises(ledger_anchor.LedgerRegressedError, match="another ledger"):
        Site.open(s.node_config())


def test_without_new_ledger_an_older_copy_is_refused_before_any_image_is_read(tmp_path: Path) -> None:
    fed, s, old = lost_ledger(tmp_path)
    shutil.copy2(old, s.ledger)
    gone = dataclasses.replace(node_settings(s, insecure=True), data=tmp_path / "no-such-data")
    with pytest.raises(ledger_anchor.LedgerRegressedError, match=r"an older copy of it \(1 row"):
        preflight(gone)


def test_the_site_still_refuses_a_policy_older_than_its_ledger_has_seen(tmp_path: Path) -> None:
    """The policy's version is checked against the ledger once it is open, after the checks that need no
    ledger: a replayed older policy (a rollback of the site's caps) is refused as before."""
    fed = prepare_federation(tmp_path / "fed", tiny_sites(2))
    s = fed.site("site-a")
    v1 = s.policy.read_bytes()
    doc = json.loads(v1)["policy"]
    key = load_private_key(s.policy_pub.with_suffix(".key"))
    write_signed_policy(s.policy, sign_policy({**doc, "version": int(doc["version"]) + 1}, key))
    Site.open(s.node_config()).ledger.close()  # the ledger has seen the newer version
    forget_sites()
    s.policy.write_bytes(v1)
    with pytest.raises(FetaError, match="older than version"):
        Site.open(s.node_config())
