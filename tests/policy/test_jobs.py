"""Coordinator-signed jobs: tamper over every field, allowed coordinators only, the job must name the site."""

from __future__ import annotations

import copy

import pytest

from feta_release import signing
from feta_release.errors import FetaError, PolicyError
from feta_release.policy import (
    PolicyViolation,
    open_signed_policy,
    sign_job,
    verify_job,
    verify_job_with_keys,
)
from tests.support.policy import job_config, keys, policy_doc, sign_policy, signed_job, tamper_cases

K = keys()
POLICY = open_signed_policy(sign_policy(policy_doc(K), K["site"]), [K["site"].public_key()])
SIGNED = signed_job(K)
CASES = tamper_cases(SIGNED)


def test_valid_job_accepted() -> None:
    job = verify_job(copy.deepcopy(SIGNED), POLICY)
    assert job.job_id == "job-1" and job.sites == ("site-a", "site-b")
    assert job.signer == job.coordinator == signing.fingerprint(K["coord"])
    # the signed job states the mode (secure: 2 sites)
    assert job.config == job_config().with_secure_default(2)
    assert job.config.federation.secure_aggregation is True
    assert job.created.isoformat() == "2026-05-01T12:00:00+00:00"


def test_tamper_cases_cover_config_and_signature() -> None:
    described = " ".join(d for d, _ in CASES)
    for field in (
        "job.job_id",
        "job.coordinator",
        "job.sites.0",
        "job.created",
        "job.config.dpsgd.steps",
        "job.config.privacy.epsilon",
        "job.config.central.sigma",
        "signature.signature",
    ):
        assert f"alter {field} " in described, field


@pytest.mark.parametrize("desc,doc", CASES, ids=[d for d, _ in CASES])
def test_any_tampering_is_refused(desc: str, doc: dict) -> None:
    with pytest.raises(PolicyError):
        verify_job(doc, POLICY)


def test_unknown_coordinator_refused() -> None:
    with pytest.raises(PolicyViolation) as exc:
        verify_job(signed_job(K, key="other"), POLICY)
    assert exc.value.rule == "coordinators"


def test_fingerprint_only_coordinator_entry() -> None:
    """A policy may name a coordinator by the FULL sha256 of its raw key; the job's embedded key must hash to
    it."""
    doc = policy_doc(K)
    doc["coordinators"] = [signing.full_fingerprint(K["coord"])]
    pol = open_signed_policy(sign_policy(doc, K["site"]), [K["site"].public_key()])
    job = verify_job(signed_job(K), pol)
    assert job.signer == signing.fingerprint(K["coord"]) and job.signer_sha256 == signing.full_fingerprint(
        K["coord"]
    )
    with pytest.raises(PolicyViolation) as exc:
        verify_job(signed_job(K, key="other"), pol)
    assert exc.value.rule == "coordinators"


def test_short_fingerprint_coordinator_entry_refused() -> None:
    """Attack: a 16-hex (64-bit) allow-list entry lets anyone who finds a key whose short hash
    matches (~2^64 work) sign jobs. Such a policy is refused. Fails on 473f707 (it accepted the entry)."""
    from feta_release.policy.errors import PolicySchemaError

    doc = policy_doc(K)
    doc["coordinators"] = [signing.fingerprint(K["coord"])]
    with pytest.raises(PolicySchemaError, match="coordinators"):
        sign_policy(doc, K["site"])


def test_job_must_name_the_site() -> None:
    with pytest.raises(PolicyViolation) as exc:
        verify_job(signed_job(K, sites=("site-b", "site-c")), POLICY)
    assert exc.value.rule == "job.sites"


def test_unsigned_job_refused() -> None:
    with pytest.raises(PolicyViolation) as exc:
        verify_job({"job": SIGNED["job"]}, POLICY)
    assert exc.value.rule == "signature.required"


def test_sign_job_refuses_invalid_config() -> None:
    with pytest.raises(FetaError, match="batch must be >= 1"):
        sign_job({"dpsgd": {"steps": 10, "batch": 0}}, K["coord"], "j", ["site-a"])
    with pytest.raises(PolicyError, match="job_id"):
        sign_job(job_config(), K["coord"], "bad id!", ["site-a"])


def test_verify_with_explicit_keys() -> None:
    assert verify_job_with_keys(SIGNED, [K["coord"].public_key()]).job_id == "job-1"
    with pytest.raises(PolicyViolation):
        verify_job_with_keys(SIGNED, [K["site"].public_key()])
