"""``Site.in_memory(verified=...)`` ran under the policy object its caller handed over (``train``: the one its
job was sized from) and checked its commitment, validity, schema, site key and version, but not that the
site's trusted key signed it: an object read without trusting its signer (``read_signed_policy_unverified``,
which checks a signature against the key the file itself embeds) or built in code opened the site and was
charged under. The site now verifies the object's own signed envelope against its trusted key (no second read
of the file, which may have been replaced) and runs only where that is the object handed over."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.setup import prepare_federation
from edge.site import CFG_DATA, CFG_POLICY, CFG_TRUSTED, Site, forget_sites, verify_policy_file
from feta_release.errors import PolicyError
from feta_release.policy import sign_policy, write_signed_policy
from feta_release.policy.document import read_signed_policy_unverified
from feta_release.signing import generate_keypair, load_private_key
from tests.support.federation import tiny_sites


@pytest.fixture()
def held(tmp_path: Path) -> Iterator[tuple[dict[str, Any], Any]]:
    """(a site's config without its data path, its images), as ``train`` holds a site."""
    site = prepare_federation(tmp_path / "fed", tiny_sites(2)).site("site-a")
    opened = Site.open(site.node_config())
    data = opened.data
    opened.ledger.close()
    forget_sites()
    yield {k: v for k, v in site.node_config().items() if k != CFG_DATA}, data
    forget_sites()


def test_a_policy_another_key_signed_is_refused_when_handed_over(
    held: tuple[dict[str, Any], Any], tmp_path: Path
) -> None:
    config, data = held
    body = json.loads(Path(config[CFG_POLICY]).read_text("utf-8"))["policy"]
    rogue, _ = generate_keypair(tmp_path / "rogue", "rogue")
    forged = write_signed_policy(tmp_path / "forged.json", sign_policy(body, load_private_key(rogue)))
    unverified, envelope = read_signed_policy_unverified(forged)  # checked against the key it embeds
    for handed in (unverified, dataclasses.replace(unverified, signed=envelope)):
        with pytest.raises(PolicyError, match="signer|not the signed policy"):
            Site.in_memory(config, data, verified=handed)


def test_a_policy_object_that_is_not_its_signed_envelope_is_refused(held: tuple[dict[str, Any], Any]) -> None:
    config, data = held
    verified = verify_policy_file(config[CFG_POLICY], config[CFG_TRUSTED])
    looser = dataclasses.replace(verified, job_epsilon=1e6, lifetime_epsilon=1e6)  # the envelope kept
    with pytest.raises(PolicyError, match="not the signed policy"):
        Site.in_memory(config, data, verified=looser)
    with pytest.raises(PolicyError, match="not the signed policy"):
        Site.in_memory(config, data, verified=dataclasses.replace(verified, signed=None))


def test_the_policy_the_caller_verified_opens_the_site(held: tuple[dict[str, Any], Any]) -> None:
    config, data = held
    verified = verify_policy_file(config[CFG_POLICY], config[CFG_TRUSTED])
    site = Site.in_memory(config, data, verified=verified)
    try:
        assert site.policy is verified
    finally:
        site.ledger.close()
