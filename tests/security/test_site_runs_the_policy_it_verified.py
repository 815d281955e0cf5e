"""A site node read its signed policy file more than once while it opened: ``node start`` to check that the
policy allows an app bundle, ``Site.open`` to check the node config's patient cap against it, then again,
after the ledger and the data were opened, to check the data's keyed commitment and to run under it. A file
replaced between the reads (both versions validly signed) was the policy the site ran under, though the other
one had been checked: one policy checked, another run. The node now reads and verifies the file once, checks
the cap, the app bundle and the data's commitment on that object and runs under it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import edge.site
import feta_release.policy.document as document
from coordinator.setup import prepare_federation
from edge.launch import preflight
from edge.site import CFG_DATA, CFG_LEDGER, CFG_SITE_KEY, CFG_WORK, Site, forget_sites
from feta_release.errors import PolicyError
from feta_release.policy.document import sign_policy
from feta_release.signing import load_private_key
from tests.support.federation import node_settings, tiny_sites


def _federation(tmp_path: Path) -> tuple[Any, Any, bytes]:
    """A federation whose site-a policy file may be replaced by ``bigger``: the same data and commitment,
    signed by the same administrator, version + 1, but a lifetime budget ten times larger."""
    fed = prepare_federation(tmp_path / "fed", tiny_sites(2))
    s = fed.site("site-a")
    doc = json.loads(s.policy.read_bytes())["policy"]
    budget = {**doc["budget"], "lifetime": {**doc["budget"]["lifetime"]}}
    budget["lifetime"]["epsilon"] = 10 * float(budget["lifetime"]["epsilon"])
    key = load_private_key(s.policy_pub.with_suffix(".key"))
    bigger = sign_policy({**doc, "version": int(doc["version"]) + 1, "budget": budget}, key)
    return fed, s, json.dumps(bigger).encode()


def _reads(monkeypatch: pytest.MonkeyPatch, policy: Path) -> list[Path]:
    """Every read of ``policy`` as a signed policy (the one function that reads it for verification)."""
    seen: list[Path] = []
    real = document.read_json

    def counted(path: Any, what: str) -> Any:
        if Path(path).resolve() == policy.resolve():
            seen.append(Path(path))
        return real(path, what)

    monkeypatch.setattr(document, "read_json", counted)
    return seen


def _replaced_while_the_data_load(monkeypatch: pytest.MonkeyPatch, policy: Path, replacement: bytes) -> None:
    """The policy file is replaced after the site read it and before its data are checked against it."""
    real = edge.site._opened_data

    def swapped(*args: Any) -> Any:
        policy.write_bytes(replacement)
        return real(*args)

    monkeypatch.setattr(edge.site, "_opened_data", swapped)


def test_a_policy_file_replaced_while_the_site_opens_is_not_the_one_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fed, s, bigger = _federation(tmp_path)
    verified = document.load_site_policy(s.policy, [s.policy_pub])
    reads = _reads(monkeypatch, s.policy)
    _replaced_while_the_data_load(monkeypatch, s.policy, bigger)
    site = Site.open(s.node_config())
    try:
        assert json.loads(s.policy.read_bytes()) == json.loads(bigger)  # the file did change
        # the site runs under the policy whose cap it checked, not the one put there while it opened
        assert site.policy.digest == verified.digest
        assert site.policy.lifetime_epsilon == verified.lifetime_epsilon
        assert site.ledger.highest_policy_version() == verified.version
        assert len(reads) == 1, reads
    finally:
        site.ledger.close()
        forget_sites()


def test_node_start_reads_and_verifies_the_policy_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fed, s, _ = _federation(tmp_path)
    reads = _reads(monkeypatch, s.policy)
    site = preflight(node_settings(s, insecure=True))
    try:
        assert len(reads) == 1, reads
    finally:
        site.ledger.close()
        forget_sites()


def test_a_site_held_in_memory_still_checks_its_policy_against_its_data_and_key(tmp_path: Path) -> None:
    """``train``'s site (images in memory): the one read of the policy still refuses other images (the keyed
    commitment) and another site key, as an opened site does."""
    fed = prepare_federation(tmp_path / "fed", tiny_sites(2))
    a, b = fed.site("site-a"), fed.site("site-b")
    opened = Site.open(b.node_config())
    other = opened.data
    opened.ledger.close()
    forget_sites()
    config = {k: v for k, v in a.node_config().items() if k != CFG_DATA}
    with pytest.raises(PolicyError, match="commitment"):
        Site.in_memory(config, other)
    mine = Site.open(a.node_config())
    data = mine.data
    mine.ledger.close()
    forget_sites()
    # a ledger of its own: the site's ledger would refuse the other key first (its head's signature)
    elsewhere = {CFG_LEDGER: str(tmp_path / "b.db"), CFG_WORK: str(tmp_path / "b-work")}
    with pytest.raises(PolicyError, match="site_key"):
        Site.in_memory({**config, **elsewhere, CFG_SITE_KEY: str(b.site_key)}, data)
    held = Site.in_memory(config, data)
    held.ledger.close()


def test_hello_states_the_policy_the_site_runs_not_the_file_as_it_is_now(tmp_path: Path) -> None:
    """``hello`` sent the policy file as it was at the time of the reply, read again, while the site (opened
    once, kept open) ran under the policy it had verified: the coordinator then planned for, checked the
    attestations against and recorded another policy (here ten times the lifetime budget) than the one the
    site enforces."""
    from coordinator.setup import sign_job_file
    from feta_release.federation import messages as fm
    from tests.support.federation import full_job, harness

    fed, s, bigger = _federation(tmp_path)
    ran = json.loads(s.policy.read_bytes())
    signed, _ = sign_job_file(fed, full_job(), "job-hello-policy")
    grid = harness(fed)

    def hello_policy() -> Any:
        replies = grid.send_and_receive(
            [grid.create_message(fm.make_payload({"job": signed}), fm.HELLO, 100 + i, "t") for i in (0, 1)]
        )
        docs = [fm.read_payload(r.content)[0] for r in replies if not r.has_error()]
        return next(d["policy"] for d in docs if d["site_id"] == "site-a")

    try:
        assert hello_policy() == ran
        s.policy.write_bytes(bigger)  # the site stays open under the policy it verified
        assert (
            edge.site.site_for(s.node_config()).policy.lifetime_epsilon
            == ran["policy"]["budget"]["lifetime"]["epsilon"]
        )
        assert hello_policy() == ran
    finally:
        forget_sites()


def test_data_shaped_under_one_policy_are_not_cached_for_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The private cache of the site's decoded images was keyed on the policy FILE as it was when the data
    were read, while they were shaped (unit, patient cap) under the policy the site had verified before: a
    file replaced in between had the cache hand images shaped under the old policy to every later open
    under the new one, whose commitment, if unchanged, passed them. The cache is now keyed on the verified
    policy (``edge.site_cache.cache_key``)."""
    fed, s, bigger = _federation(tmp_path)
    _replaced_while_the_data_load(monkeypatch, s.policy, bigger)
    Site.open(s.node_config()).ledger.close()
    forget_sites()
    monkeypatch.undo()
    decoded: list[Any] = []
    real = edge.site.load_site_data_report

    def counted(*args: Any) -> Any:
        decoded.append(args)
        return real(*args)

    monkeypatch.setattr(edge.site, "load_site_data_report", counted)
    site = Site.open(s.node_config())  # under the policy now in the file
    try:
        assert site.policy.version == json.loads(bigger)["policy"]["version"]
        assert len(decoded) == 1  # decoded and shaped under this policy, not served from the other's cache
        site.ledger.close()
        forget_sites()
        Site.open(s.node_config()).ledger.close()  # the cache written under this policy serves it
        assert len(decoded) == 1
    finally:
        site.ledger.close()
        forget_sites()
