"""A ledger keeps the highest policy version its site has seen, and a node refuses a policy older than it (a
replayed signed policy: the site's older, looser caps). `node start --new-ledger` began a ledger that had seen
none, so a lost ledger took its floor with it: the older policy, restored from the same backup as the lost
ledger's older copy, was taken. The node's anchor now keeps the floor across a new ledger, and the older
policy is refused before the new ledger is created."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.setup import prepare_federation
from edge import ledger_anchor
from edge.launch import preflight
from edge.site import forget_sites
from feta_release.errors import FetaError
from feta_release.ledger import Ledger
from feta_release.policy.document import sign_policy, write_signed_policy
from feta_release.signing import load_private_key
from tests.support.federation import node_settings, tiny_sites
from tests.support.lost_ledger import lose_ledger, node_work


def test_a_new_ledger_start_refuses_a_policy_older_than_the_lost_ledger_had_seen(tmp_path: Path) -> None:
    fed = prepare_federation(tmp_path / "fed", tiny_sites(2))
    s = fed.site("site-a")
    v1 = s.policy.read_bytes()
    doc = json.loads(v1)["policy"]
    newer = int(doc["version"]) + 1
    v2 = sign_policy({**doc, "version": newer}, load_private_key(s.policy_pub.with_suffix(".key")))
    # the node runs on the newer policy: its ledger and its anchor see it
    write_signed_policy(s.policy, v2)
    preflight(node_settings(s, insecure=True)).ledger.close()
    forget_sites()
    before = ledger_anchor.read(node_work(s))
    lose_ledger(s.ledger)  # the ledger is lost
    s.policy.write_bytes(v1)  # the older policy back, from the backup the ledger was not in
    with pytest.raises(FetaError, match="older than version"):
        preflight(node_settings(s, insecure=True, new_ledger=True)).ledger.close()
    assert ledger_anchor.read(node_work(s)) == before and not s.ledger.exists()
    # with the current policy the new ledger starts, and has seen the floor
    write_signed_policy(s.policy, v2)
    preflight(node_settings(s, insecure=True, new_ledger=True)).ledger.close()
    forget_sites()
    with Ledger(s.ledger) as new:
        assert new.highest_policy_version() == newer
    assert ledger_anchor.read(node_work(s))["policy_version"] == newer
