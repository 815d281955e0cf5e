"""Final attestations and one signed job per job id, at the node.

Attacks: a coordinator that asks for more after a site signed its spend statement (the statement would no
longer be what the job spent), and one that sends a second job document under an existing job id (the site
would answer it from the first job's records). Each test fails on 473f707 and passes after.
"""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from coordinator.setup import sign_job_file
from feta_release.accounting import PrivacyEvent
from feta_release.errors import PolicyError
from feta_release.federation import messages as fm
from feta_release.federation.job import run_job
from feta_release.ledger import Budget, Ledger
from feta_release.signing import load_private_key
from tests.support.federation import harness, make_federation, tiny_job
from tests.support.federation import ledger_requests as _requests


@pytest.fixture()
def fed(tmp_path):
    return make_federation(tmp_path / "fed")


def _weights(cfg):
    from feta_release.models import build_denoiser

    return {k: v.numpy() for k, v in build_denoiser(cfg.model, (1, 28, 28), 10).state_dict().items()}


def _send(grid, kind, doc, arrays=None, node=100):
    msg = grid.create_message(fm.make_payload(doc, arrays or {}), kind, node, "g")
    (rep,) = grid.send_and_receive([msg])
    return rep


def test_attesting_closes_the_job_at_the_node(fed, tmp_path):
    """Fails on 473f707: after the attestation the site still answered (and could charge) the job."""
    cfg = tiny_job()
    signed, _ = sign_job_file(fed, cfg, "job-close")
    res = run_job(
        harness(fed),
        signed,
        tmp_path / "out",
        coordinator_key=load_private_key(fed.coordinator_key),
        wait_timeout=2,
        poll_interval=0.05,
    )
    st = res.attestations["site-a"]["statement"]
    assert st["final"] is True
    before = _requests(fed, "site-a", "job-close")
    grid = harness(fed)
    for kind, doc in ((fm.TRAIN, {"job": signed, "round": 0}), (fm.TRAIN, {"job": signed, "round": 1})):
        rep = _send(grid, kind, doc, _weights(cfg))
        assert rep.has_error() and "is closed at site site-a" in rep.error.reason
    assert _requests(fed, "site-a", "job-close") == before  # nothing charged, nothing recorded
    # A repeated attest (a coordinator retry) is answered: the same closed history, signed again.
    rep = _send(grid, "query.attest", {"job": signed})
    assert not rep.has_error(), rep.error.reason if rep.has_error() else ""
    again = fm.read_payload(rep.content)[0]["attestation"]["statement"]
    assert again["events"] == st["events"] and again["final"] is True


def test_charge_racing_the_close_is_refused_by_the_ledger(tmp_path):
    """A charge that reaches the ledger after the close (it passed the handler's checks before) is refused
    under the write lock. Fails on 473f707 (no close at all)."""
    led = Ledger(tmp_path / "l.sqlite", key=Ed25519PrivateKey.generate())
    b = Budget(10.0, 20.0, 1e-5)
    ev = [PrivacyEvent("dpsgd", 1.0, 0.01, 10)]
    led.charge("j", "j:train:0", "dpsgd", ev, b, response=b"r0")
    led.close_job("j", "d" * 64)
    assert led.is_closed("j") and not led.is_closed("other")
    with pytest.raises(PolicyError, match="closed at this site"):
        led.charge("j", "j:train:1", "dpsgd", ev, b, response=b"r1")
    assert [r["request_id"] for r in led.requests("j")] == ["j:train:0"]
    led.charge("other", "other:train:0", "dpsgd", ev, b, response=b"x")  # other jobs go on


def test_same_job_id_with_another_signed_job_is_refused(fed, tmp_path):
    """A second job document under an existing id (here: other sampler settings, so the same privacy events)
    was answered from the first job's record on 473f707. Now refused: one job id names one signed job."""
    cfg = tiny_job()
    first, _ = sign_job_file(fed, cfg, "job-dup")
    grid = harness(fed)
    assert not _send(grid, fm.TRAIN, {"job": first, "round": 0}, _weights(cfg)).has_error()
    second, _ = sign_job_file(
        fed, cfg.replace(sampler={"steps": cfg.sampler.steps + 1}), "job-dup", out=tmp_path / "second.json"
    )
    assert second["job"] != first["job"]
    rep = _send(grid, fm.TRAIN, {"job": second, "round": 0}, _weights(cfg))
    assert rep.has_error() and "already bound at this site to another signed job" in rep.error.reason
    assert len(_requests(fed, "site-a", "job-dup")) == 1


def test_bind_job_refuses_another_signer(tmp_path):
    led = Ledger(tmp_path / "l.sqlite", key=Ed25519PrivateKey.generate())
    led.bind_job("j", "a" * 64, "1" * 64)
    led.bind_job("j", "a" * 64, "1" * 64)  # the same job again: fine
    with pytest.raises(PolicyError, match="already bound"):
        led.bind_job("j", "a" * 64, "2" * 64)
    with pytest.raises(PolicyError, match="already bound"):
        led.bind_job("j", "b" * 64, "1" * 64)


def test_node_refuses_a_site_key_its_policy_does_not_name(fed, tmp_path):
    """Every attestation this node signed with another key would be refused by `verify`; refuse at start."""
    from edge.site import CFG_SITE_KEY, Site
    from feta_release.signing import generate_keypair

    other, _ = generate_keypair(tmp_path / "k", "other")
    cfg = {**fed.site("site-a").node_config(), CFG_SITE_KEY: str(other)}
    with pytest.raises(PolicyError, match="not the site key that"):
        Site.open(cfg)


def test_binding_and_closing_a_job_keep_the_signed_head_valid(tmp_path):
    """Merge regression (security's job records x node's signed head): bind_job/close_job wrote the ``meta``
    table outside the signing write, so the next open of the ledger (every node message) saw a head that no
    longer covered ``meta`` and refused the ledger as tampered; the e2e demo then got no release from any
    site."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    path = tmp_path / "l.db"
    with Ledger(path, key=key) as led:
        led.bind_job("job-1", "a" * 64, "b" * 64)
    with Ledger(path, key=key, deep=True) as led:  # raised LedgerTamperedError before the fix
        led.bind_job("job-1", "a" * 64, "b" * 64)  # the same job again: nothing new
        led.close_job("job-1", "a" * 64)
    with Ledger(path, verify_key=key.public_key(), deep=True) as led:  # a reader checks the head too
        assert led.is_closed("job-1")
    with Ledger(path, key=key) as led:
        with pytest.raises(PolicyError, match="already bound"):
            led.bind_job("job-1", "c" * 64, "b" * 64)
