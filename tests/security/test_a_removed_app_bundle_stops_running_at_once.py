"""The node's app-bundle allow-list (what code a message may run at the site, with its data and ledger in
reach) was fixed at ``node start``, from the policy verified then, and handed to every per-message process in
its environment. A site's administrator who re-signed the policy to remove a bundle (a version found unsafe)
saw the warm worker reopen the site under the new policy, while the bundle kept being installed and run until
the node was restarted. Every message now narrows the start's list to the ``app_bundles`` of the signed policy
the site runs then; a bundle the file adds is refused until a restart verifies the policy in full."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from flwr.cli.build import build_fab_from_disk

import edge.launch
from coordinator.setup import APP_DIR, prepare_federation
from edge import trust
from edge.site import Site, forget_sites
from feta_release.policy.document import sign_policy
from feta_release.signing import generate_keypair, load_private_key
from tests.support.federation import node_settings, tiny_sites

OTHER = "ab" * 32  # a bundle some other reviewed app would have


class _Started(Exception):
    """Stops ``start_node`` where it would start the SuperNode, with the environment it would have."""


def _node_environment(monkeypatch: pytest.MonkeyPatch, s: Any) -> dict[str, str]:
    """The environment ``node start`` gives the SuperNode (and so every per-message process) of site ``s``."""
    seen: dict[str, str] = {}

    def started(name: str, cmd: list[str], env: dict[str, str], *args: Any, **kwargs: Any) -> Any:
        seen.update(env)
        raise _Started

    monkeypatch.setattr(edge.launch, "ManagedProcess", started)
    with pytest.raises(_Started):
        edge.launch.start_node(node_settings(s, insecure=True, worker=False))
    forget_sites()
    return seen


def _resign(s: Any, bundles: list[str], *, key: Any = None) -> None:
    """Site ``s``'s policy re-signed (version + 1) with ``bundles`` as its app_bundles."""
    doc = json.loads(s.policy.read_bytes())["policy"]
    key = key if key is not None else load_private_key(s.policy_pub.with_suffix(".key"))
    doc = {**doc, "version": int(doc["version"]) + 1, "app_bundles": bundles}
    s.policy.write_text(json.dumps(sign_policy(doc, key)), "utf-8")


def _started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bundles: list[str] | None = None) -> Any:
    """A started node's environment in this process (as each per-message process has it), its site and the
    project's app bundle (its policy's own app_bundles, or ``bundles`` signed in before the start)."""
    fed = prepare_federation(tmp_path / "fed", tiny_sites(2))
    s = fed.site("site-a")
    fab = build_fab_from_disk(APP_DIR)
    assert trust.fab_hash(fab) in json.loads(s.policy.read_bytes())["policy"]["app_bundles"]
    if bundles is not None:
        _resign(s, bundles)
    for k, v in _node_environment(monkeypatch, s).items():
        if k.startswith("FETA_"):
            monkeypatch.setenv(k, v)
    monkeypatch.setattr(trust, "_current", {})
    return s, fab


def test_a_bundle_removed_from_the_policy_is_refused_at_the_next_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s, fab = _started(tmp_path, monkeypatch)
    h = trust.check_fab(fab)  # allowed while the policy lists it
    _resign(s, [OTHER])  # the site's administrator removes it
    with pytest.raises(trust.UntrustedAppError, match="no longer lists it"):
        trust.check_fab(fab)
    assert h not in trust.allowed_hashes()


def test_a_bundle_the_policy_adds_runs_only_after_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s, fab = _started(tmp_path, monkeypatch, [OTHER])
    _resign(s, [trust.fab_hash(fab), OTHER])  # added by re-signing while the node runs
    with pytest.raises(trust.UntrustedAppError, match="restart the node"):
        trust.check_fab(fab)


def test_a_policy_that_does_not_verify_now_runs_no_bundle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s, fab = _started(tmp_path, monkeypatch)
    other_key, _ = generate_keypair(tmp_path / "other", "other")
    _resign(s, [trust.fab_hash(fab)], key=load_private_key(other_key))  # not the trusted administrator
    with pytest.raises(trust.UntrustedAppError, match="does not verify now"):
        trust.check_fab(fab)


def test_an_older_policy_put_back_does_not_run_the_bundle_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gate refused a policy older than the floor the node recorded at its start, not than the version
    the site has since run under: the older file put back (both validly signed) re-allowed the bundle the
    re-signed policy removed, until the next attestation moved the floor."""
    s, fab = _started(tmp_path, monkeypatch)
    older = s.policy.read_bytes()
    _resign(s, [OTHER])  # the site's administrator removes the bundle
    Site.open(s.node_config()).ledger.close()  # the worker reopens the site under the new policy
    forget_sites()
    s.policy.write_bytes(older)  # the policy the node started under, put back
    with pytest.raises(trust.UntrustedAppError, match="does not verify now") as err:
        trust.check_fab(fab)
    assert str(tmp_path) not in str(err.value)  # the coordinator gets no local path
