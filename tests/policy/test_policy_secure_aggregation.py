"""The secure-aggregation trust assumption in the signed policy: the field, its schema errors, and the two
epsilons (under the assumption / every other site colluding) a site computes and caps."""

from __future__ import annotations

import dataclasses

import pytest

from feta_release.accountants.skellam import skellam_epsilon
from feta_release.mechanisms.skellam import SkellamParams
from feta_release.policy import open_signed_policy
from feta_release.policy.document import SitePolicy, validate_policy
from feta_release.policy.errors import PolicySchemaError, PolicyViolation
from feta_release.policy.secure_aggregation import check_secure_aggregation, policy_site_epsilons
from tests.support.policy import keys, policy_doc, signed_policy

PARAMS = SkellamParams(dim=100, clip=1.0, scale=256.0, noise_multiplier=3.0, n_sites=4)


def _pins() -> dict[str, str]:
    """Pinned keys of three other sites (a policy pins its peers, else no other share counts)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from feta_release.signing import public_key_pem

    return {f"peer-{i}": public_key_pem(Ed25519PrivateKey.generate().public_key()) for i in range(3)}


def _policy_for_pins() -> SitePolicy:
    return SitePolicy.from_document(policy_doc(keys()), None)


def test_default_is_no_colluder_and_no_worst_case_cap() -> None:
    pol = SitePolicy.from_document(policy_doc(keys()), None)
    assert pol.max_colluders == 0 and pol.max_worst_case_epsilon is None


def test_signed_policy_carries_the_trust_assumption() -> None:
    k = keys()
    signed = signed_policy(k, secure_aggregation={"max_colluders": 2, "max_worst_case_epsilon": 4.0})
    pol = open_signed_policy(signed, [k["site"].public_key()])
    assert pol.max_colluders == 2 and pol.max_worst_case_epsilon == 4.0
    signed["policy"]["secure_aggregation"]["max_colluders"] = 0  # a coordinator cannot relax it
    with pytest.raises(PolicyViolation, match="signature"):
        open_signed_policy(signed, [k["site"].public_key()])


@pytest.mark.parametrize(
    "value,field",
    [
        ({"max_colluders": -1}, "secure_aggregation.max_colluders"),
        ({"max_colluders": 1.5}, "secure_aggregation.max_colluders"),
        ({"max_worst_case_epsilon": 0}, "secure_aggregation.max_worst_case_epsilon"),
        ({"max_colluderz": 1}, "secure_aggregation.max_colluderz"),
        ({"peers": {"site-b": "not a key"}}, "secure_aggregation.peers.site-b"),
    ],
)
def test_schema_errors_name_the_field(value: dict[str, object], field: str) -> None:
    doc = policy_doc(keys())
    doc["secure_aggregation"] = value
    with pytest.raises(PolicySchemaError) as exc:
        validate_policy(doc, "p.json")
    assert field in exc.value.fields


def test_assumed_epsilon_counts_the_honest_shares_and_worst_case_the_own_share() -> None:
    k = keys()
    pins = _pins()
    honest = SitePolicy.from_document(policy_doc(k, secure_aggregation={"peers": pins}), None)
    wary = SitePolicy.from_document(
        policy_doc(k, secure_aggregation={"max_colluders": 1, "peers": pins}), None
    )
    paranoid = SitePolicy.from_document(
        policy_doc(k, secure_aggregation={"max_colluders": 99, "peers": pins}), None
    )
    e0 = policy_site_epsilons(honest, PARAMS, 1.0, 10, threshold=3)
    e1 = policy_site_epsilons(wary, PARAMS, 1.0, 10, threshold=3)
    e_all = policy_site_epsilons(paranoid, PARAMS, 1.0, 10, threshold=3)
    assert (e0.honest_shares, e1.honest_shares, e_all.honest_shares) == (3, 2, 1)
    assert e0.assumed == pytest.approx(skellam_epsilon(PARAMS, 1.0, 10, honest.job_delta, noise_shares=3))
    assert e0.assumed < e1.assumed < e_all.assumed == e_all.worst_case == e0.worst_case
    assert e0.worst_case == skellam_epsilon(PARAMS, 1.0, 10, honest.job_delta, noise_shares=1)


def test_caps_refuse_with_the_rule_named() -> None:
    k = keys()
    pol = SitePolicy.from_document(
        policy_doc(
            k, per_job=(1.5, 1e-5), secure_aggregation={"max_worst_case_epsilon": 2.0, "peers": _pins()}
        ),
        None,
    )
    params = SkellamParams(dim=100, clip=1.0, scale=256.0, noise_multiplier=8.0, n_sites=4)
    fits = policy_site_epsilons(pol, params, 1.0, 2, threshold=4)
    assert fits.assumed <= 1.5 and fits.worst_case <= 2.0
    check_secure_aggregation(pol, fits)
    too_many = policy_site_epsilons(pol, params, 1.0, 40, threshold=4)
    with pytest.raises(PolicyViolation) as exc:
        check_secure_aggregation(pol, too_many)
    assert exc.value.rule == "budget.per_job.epsilon" and "site site-a" in str(exc.value)
    worst_only = policy_site_epsilons(pol, params, 1.0, 4, threshold=4)
    assert worst_only.assumed <= 1.5 < 2.0 < worst_only.worst_case
    with pytest.raises(PolicyViolation) as exc:
        check_secure_aggregation(pol, worst_only)
    assert exc.value.rule == "secure_aggregation.max_worst_case_epsilon"


def test_default_worst_case_cap_is_three_times_the_per_job_cap() -> None:
    """No max_worst_case_epsilon: the node still caps the worst case, at DEFAULT_WORST_CASE_FACTOR x
    per-job."""
    from feta_release.policy.document import DEFAULT_WORST_CASE_FACTOR

    k = keys()
    pol = SitePolicy.from_document(
        policy_doc(k, per_job=(1.5, 1e-5), secure_aggregation={"peers": _pins()}), None
    )
    assert pol.max_worst_case_epsilon is None and pol.worst_case_cap == DEFAULT_WORST_CASE_FACTOR * 1.5 == 4.5
    params = SkellamParams(dim=100, clip=1.0, scale=256.0, noise_multiplier=8.0, n_sites=4)
    # small-noise setting where the own share alone passes 4.5 while the assumed epsilon fits 1.5
    for steps in range(1, 60):
        eps = policy_site_epsilons(pol, dataclasses.replace(params, n_sites=9), 1.0, steps, threshold=9)
        if eps.assumed <= 1.5 < 4.5 < eps.worst_case:
            break
    else:
        pytest.fail(
            "no job found with the assumed epsilon in budget and the worst case above the default cap"
        )
    with pytest.raises(PolicyViolation) as exc:
        check_secure_aggregation(pol, eps)
    assert exc.value.rule == "secure_aggregation.max_worst_case_epsilon" and "the default" in str(exc.value)


def test_pinned_peers_refuse_unpinned_sites_and_substituted_keys() -> None:
    """The coordinator supplied the keys that authenticate key adverts, so it could put its own
    keys under invented (sybil) site ids or under a real site's id. Now the site's admin-signed policy pins
    them."""
    import dataclasses

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from feta_release.errors import PolicyError
    from feta_release.policy.secure_aggregation import check_pinned_peers
    from feta_release.signing import public_key_pem

    pol = _policy_for_pins()
    b, c, evil = (public_key_pem(Ed25519PrivateKey.generate().public_key()) for _ in range(3))
    pinned = dataclasses.replace(pol, peers={"site-b": b, "site-c": c})
    assert check_pinned_peers(pinned, [pol.site_id, "site-b", "site-c"], {"site-b": b}) == {
        "site-b": b,
        "site-c": c,
    }
    with pytest.raises(PolicyError, match=r"secure_aggregation\.peers.*sybil-1"):
        check_pinned_peers(pinned, [pol.site_id, "site-b", "sybil-1"])
    with pytest.raises(PolicyError, match=r"secure_aggregation\.peers.*differ"):
        check_pinned_peers(pinned, [pol.site_id, "site-b", "site-c"], {"site-b": evil})
    unpinned = policy_site_epsilons(pol, PARAMS, 1.0, 10, threshold=4)
    assert unpinned.honest_shares == 1 and unpinned.assumed == unpinned.worst_case
    # without pins: the relay is taken, but no other site's share is counted (assumed epsilon = worst case)
    assert pol.counted_colluders(5) == 4 and pinned.counted_colluders(5) == min(pol.max_colluders, 4)


def test_verify_cross_checks_the_attested_colluders_and_shares_with_policy_and_job() -> None:
    """Verify did not compare the attestation's max_colluders with the policy, nor mu/mu_worst
    with the shares the threshold and colluders allow."""
    from feta_release.accounting import SkellamEvent
    from feta_release.release.verify import secure_assumption_violations

    sites = ["a", "b", "c", "d", "e"]
    cfg = {"federation": {"secagg_threshold": 3}}
    pinned = {
        "site_id": "a",
        "secure_aggregation": {"max_colluders": 0, "peers": {s: "pem" for s in sites[1:]}},
    }

    def ev(shares: float) -> SkellamEvent:
        return SkellamEvent("central", 1.0, 1, 10.0, 100.0, mu=shares * 50.0, mu_worst=50.0)

    ok = {"secure_aggregation": {"max_colluders": 0}}
    assert secure_assumption_violations(pinned, ok, [ev(2)], sites, cfg) == []  # honest_shares(5, 3, 0) = 2
    assert "allows 2" in " ".join(secure_assumption_violations(pinned, ok, [ev(3)], sites, cfg))
    lax = {"secure_aggregation": {"max_colluders": 1}}
    assert "policy 0" in " ".join(secure_assumption_violations(pinned, lax, [ev(2)], sites, cfg))
    unpinned = {"site_id": "a", "secure_aggregation": {"max_colluders": 0}}
    assert "policy 4" in " ".join(secure_assumption_violations(unpinned, ok, [ev(1)], sites, cfg))
    assert (
        secure_assumption_violations(
            unpinned, {"secure_aggregation": {"max_colluders": 4}}, [ev(1)], sites, cfg
        )
        == []
    )


def test_min_sigma_bounds_the_own_noise_share_of_a_secure_release() -> None:
    """Min_sigma was checked against the pooled sigma of the sum; a site whose policy asks
    sigma >= 3 accepted a 3-site secure release at pooled sigma 4 (own share ~ 4 / sqrt 3 = 2.3)."""
    from feta_release.accountants.skellam import skellam_event
    from feta_release.policy.enforce import skellam_own_sigma
    from feta_release.release.verify import policy_violations

    params = SkellamParams(dim=100, clip=1.0, scale=256.0, noise_multiplier=4.0, n_sites=3)
    ev = skellam_event(params, "central", 0.01, 5, noise_shares=3)
    assert (
        skellam_own_sigma(ev) == pytest.approx(4.0 / 3**0.5, rel=0.05)
        and skellam_own_sigma(ev) <= 4.0 / 3**0.5
    )
    doc = policy_doc(keys())
    doc["mechanisms"]["central"]["min_sigma"] = 3.0
    st = {
        "site_id": doc["site_id"],
        "epsilon": 0.1,
        "delta": 1e-6,
        "accountant": doc.get("accountant", "rdp"),
    }
    assert any("own noise share" in p for p in policy_violations(doc, st, [ev]))
    doc["mechanisms"]["central"]["min_sigma"] = 2.0
    assert not any("min" in p for p in policy_violations(doc, st, [ev]))
