"""A site node's ``hello`` read its signed policy file again when it answered, and sent the file as it was at
that moment rather than the signed policy the site verified at open and enforces (and charges) under. A file
replaced in between (the site's administrator re-signing, or whoever can write the node's config folder), both
versions validly signed, was what the coordinator planned with and what the release recorded, beside the
site's attestation of the other one. The node now sends the signed envelope it verified at open, in the same
wire format; a warm worker that opens the site again after the file changed shows and enforces the new one
together."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from coordinator.setup import prepare_federation, sign_job_file
from edge import clientapp
from edge.site import forget_sites, site_for
from feta_release.federation import messages as fm
from feta_release.federation.driver import hello_problem
from feta_release.policy.document import open_signed_policy, sign_policy
from feta_release.signing import load_private_key
from tests.support.federation import tiny_job, tiny_sites
from tests.support.flower import flower_message, node_context


def _bigger(s: Any) -> dict[str, Any]:
    """Site ``s``'s policy re-signed by its own administrator: version + 1, a lifetime budget ten times
    larger, everything else (data commitment, site key, app bundles) unchanged: a node would open under it."""
    doc = json.loads(s.policy.read_bytes())["policy"]
    budget = {**doc["budget"], "lifetime": {**doc["budget"]["lifetime"]}}
    budget["lifetime"]["epsilon"] = 10 * float(budget["lifetime"]["epsilon"])
    key = load_private_key(s.policy_pub.with_suffix(".key"))
    return sign_policy({**doc, "version": int(doc["version"]) + 1, "budget": budget}, key)


@pytest.fixture()
def federation(tmp_path: Path) -> Any:
    fed = prepare_federation(tmp_path / "fed", tiny_sites(2))
    signed_job, _ = sign_job_file(fed, tiny_job(), "job-hello")
    forget_sites()
    yield fed, fed.site("site-a"), signed_job
    forget_sites()  # closes the ledgers of the sites opened here


def _hello(s: Any, signed_job: dict[str, Any]) -> dict[str, Any]:
    """The site's hello reply, as the ClientApp answers it (the per-message process or the warm worker)."""
    reply = clientapp.app(flower_message({"job": signed_job}), node_context(s.node_config()))
    doc, _ = fm.read_payload(reply.content)
    return dict(doc)


def test_hello_sends_the_policy_verified_at_open_not_the_file_replaced_since(federation: Any) -> None:
    fed, s, signed_job = federation
    verified = json.loads(s.policy.read_bytes())
    site = site_for(s.node_config())  # opened and verified: the policy it enforces and charges under
    bigger = _bigger(s)
    s.policy.write_text(json.dumps(bigger), "utf-8")  # validly signed, a newer version, ten times the budget
    sent = _hello(s, signed_job)["policy"]
    assert site_for(s.node_config()) is site  # the same open site answered
    assert sent["policy"]["version"] == site.policy.version, "hello showed the replaced file"
    assert sent == verified and sent != bigger
    # the coordinator reads it as before (the wire format is unchanged) and sees the enforced policy
    assert hello_problem({"site_id": s.site_id, "policy": sent}) is None
    shown = open_signed_policy(sent, [sent["signature"]["public_key"]], "hello")
    assert shown.digest == site.policy.digest and shown.version == site.policy.version
    assert shown.lifetime_epsilon == site.policy.lifetime_epsilon


def test_a_warm_worker_shows_and_enforces_one_policy_across_a_replaced_file(
    federation: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm worker checks the site's files before each message and opens the site again when the policy
    changed. A file replaced after that check (while the message is in hand) is neither shown nor enforced by
    this message's answer; the next message opens the site under it, and its hello shows that one."""
    from edge.worker import Worker

    fed, s, signed_job = federation
    worker = Worker(s.node_config())
    site = worker.fresh_site()
    before = site.policy.signed
    bigger = _bigger(s)
    # the file replaced between the worker's check of the site's files and the handler's answer
    s.policy.write_text(json.dumps(bigger), "utf-8")
    sent = _hello(s, signed_job)["policy"]
    assert sent["policy"]["version"] == site.policy.version, "hello showed the replaced file"
    assert sent == before
    assert site_for(s.node_config()) is site
    # the next message: the change is seen, the site opened and verified again; shown and enforced together
    reopened = worker.fresh_site()
    assert reopened is not site and reopened.policy.version == site.policy.version + 1
    sent = _hello(s, signed_job)["policy"]
    assert sent == bigger == reopened.policy.signed
    shown = open_signed_policy(sent, [sent["signature"]["public_key"]], "hello")
    assert shown.digest == reopened.policy.digest
