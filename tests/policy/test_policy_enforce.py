"""Enforcement rules: every refusal of check_request names its rule; budgets compose with the site's
accountant."""

from __future__ import annotations

import pytest

from feta_release.accounting import PrivacyEvent, epsilon
from feta_release.errors import BudgetExceededError
from feta_release.policy import (
    JobDoesNotFit,
    MechanismRequest,
    PolicyBudgetExceeded,
    PolicyViolation,
    check_app_bundle,
    check_budget,
    check_job_fits,
    check_request,
    open_signed_policy,
    sign_policy,
    verify_job,
    verify_job_with_keys,
)
from tests.support.policy import keys, policy_doc, signed_job

K = keys()


def _policy(**over):
    return open_signed_policy(sign_policy(policy_doc(K, **over), K["site"]), [K["site"].public_key()])


POL = _policy()
JOB = verify_job(signed_job(K), POL)
FOREIGN_JOB = verify_job_with_keys(signed_job(K, key="other"), [K["other"].public_key()])
OTHER_SITES_JOB = verify_job_with_keys(signed_job(K, sites=("site-b",)), [K["coord"].public_key()])
BUNDLE = "cd" * 32

# Requests that pass: one per mechanism (N = 1000 in the helper policy).
OK = {
    "central": dict(mechanism="central", sigma=4.0, q=0.5, steps=5, job=JOB),
    "frequency": dict(mechanism="frequency", sigma=10.0, q=1.0, steps=1, features=1000, job=JOB),
    "dpsgd": dict(mechanism="dpsgd", sigma=1.0, q=0.256, steps=200, clip=1.0, job=JOB, app_bundle=BUNDLE),
}


@pytest.mark.parametrize("mech", sorted(OK))
def test_allowed_requests_pass(mech: str) -> None:
    req = check_request(POL, OK[mech])
    assert isinstance(req, MechanismRequest) and req.event().stage == mech


REFUSALS = [
    ("unknown", dict(OK["dpsgd"], mechanism="pate"), "mechanisms"),
    ("sigma", dict(OK["dpsgd"], sigma=0.8), "mechanisms.dpsgd.min_sigma"),
    ("sigma-central", dict(OK["central"], sigma=3.99), "mechanisms.central.min_sigma"),
    ("sigma-freq", dict(OK["frequency"], sigma=9.0), "mechanisms.frequency.min_sigma"),
    ("sigma-nan", dict(OK["dpsgd"], sigma=float("nan")), "mechanisms.dpsgd.min_sigma"),
    ("rounds", dict(OK["central"], steps=6), "mechanisms.central.max_rounds"),
    ("central-batch", dict(OK["central"], q=0.601), "mechanisms.central.max_batch"),
    ("dpsgd-batch", dict(OK["dpsgd"], batch=257), "mechanisms.dpsgd.max_batch"),
    ("dpsgd-batch-from-q", dict(OK["dpsgd"], q=0.3), "mechanisms.dpsgd.max_batch"),
    ("steps", dict(OK["dpsgd"], steps=201), "mechanisms.dpsgd.max_steps"),
    ("clip", dict(OK["dpsgd"], clip=1.5), "mechanisms.dpsgd.max_clip"),
    ("clip-missing", dict(OK["dpsgd"], clip=None), "mechanisms.dpsgd.max_clip"),
    ("features", dict(OK["frequency"], features=1001), "mechanisms.frequency.max_features"),
    ("features-missing", dict(OK["frequency"], features=None), "mechanisms.frequency.max_features"),
    ("no-job", dict(OK["dpsgd"], job=None), "coordinators"),
    ("foreign-coordinator", dict(OK["dpsgd"], job=FOREIGN_JOB), "coordinators"),
    ("job-not-for-site", dict(OK["dpsgd"], job=OTHER_SITES_JOB), "job.sites"),
    ("bundle", dict(OK["dpsgd"], app_bundle="ee" * 32), "app_bundles"),
    ("bad-q", dict(OK["dpsgd"], q=1.5), "mechanisms.dpsgd"),
]


@pytest.mark.parametrize("name,request_,rule", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_every_refusal_names_its_rule(name: str, request_: dict, rule: str) -> None:
    with pytest.raises(PolicyViolation) as exc:
        check_request(POL, request_)
    assert exc.value.rule == rule
    assert f"policy rule {rule}:" in str(exc.value) and "site site-a" in str(exc.value)


def test_sigma_message_states_requested_and_minimum() -> None:
    with pytest.raises(PolicyViolation, match=r"mechanisms.dpsgd.min_sigma: requested σ=0.8 < minimum 1"):
        check_request(POL, dict(OK["dpsgd"], sigma=0.8))


@pytest.mark.parametrize("mech", ["central", "frequency", "dpsgd"])
def test_disallowed_mechanism(mech: str) -> None:
    pol = _policy(mechanisms={mech: {"allowed": False}})
    with pytest.raises(PolicyViolation) as exc:
        check_request(pol, OK[mech])
    assert exc.value.rule == f"mechanisms.{mech}.allowed"


def test_step_caps_count_the_whole_job() -> None:
    done = [PrivacyEvent("dpsgd", 1.0, 0.256, 150)]
    check_request(POL, dict(OK["dpsgd"], steps=50), job_events=done)
    with pytest.raises(PolicyViolation, match=r"201 \(150 done \+ 51 requested\) > cap 200"):
        check_request(POL, dict(OK["dpsgd"], steps=51), job_events=done)


def test_requests_refused_outside_the_validity_window() -> None:
    pol = _policy(not_before="2026-01-01T00:00:00Z", valid_days=30)
    check_request(pol, OK["dpsgd"], now="2026-01-15T00:00:00Z")
    for now, rule in (("2026-02-01T00:00:00Z", "expires"), ("2025-12-01T00:00:00Z", "not_before")):
        with pytest.raises(PolicyViolation) as exc:
            check_request(pol, OK["dpsgd"], now=now)
        assert exc.value.rule == rule
    with pytest.raises(JobDoesNotFit) as exc:
        check_job_fits({"site-a": pol}, {"site-a": [CENTRAL]}, now="2026-02-01T00:00:00Z")
    assert exc.value.rule == "expires"


def test_app_bundle_allow_list() -> None:
    check_app_bundle(POL, BUNDLE)
    with pytest.raises(PolicyViolation) as exc:
        check_app_bundle(POL, "00" * 32)
    assert exc.value.rule == "app_bundles"


# -- budgets ---------------------------------------------------------------------------------------

CENTRAL = PrivacyEvent("central", 8.0, 0.5, 5)
DPSGD = PrivacyEvent("dpsgd", 4.0, 0.05, 100)


def test_budget_matches_accountant() -> None:
    job_after, life_after = check_budget(POL, [CENTRAL], [CENTRAL], [DPSGD])
    assert job_after == pytest.approx(epsilon([CENTRAL, DPSGD], 1e-5, "rdp"))
    assert life_after == pytest.approx(job_after)
    assert job_after < 1.5


def test_per_job_budget_exceeded() -> None:
    big = PrivacyEvent("dpsgd", 1.0, 0.2, 200)
    with pytest.raises(BudgetExceededError) as exc:
        check_budget(POL, [CENTRAL], [CENTRAL], [big])
    err = exc.value
    assert isinstance(err, PolicyBudgetExceeded) and err.rule == "budget.per_job.epsilon"
    assert err.cap == 1.5 and err.after > 1.5
    assert err.spent == pytest.approx(epsilon([CENTRAL], 1e-5))
    assert "budget.per_job.epsilon" in str(err) and "nothing was released" in str(err)


def test_lifetime_budget_exceeded() -> None:
    # Earlier jobs spent most of the lifetime budget: this job alone fits its own cap, the site does not.
    earlier = [PrivacyEvent("dpsgd", 2.8, 0.1, 300)]
    assert 1.5 < epsilon(earlier, 1e-5) < 3.0 and epsilon([CENTRAL, DPSGD], 1e-5) < 1.5
    with pytest.raises(PolicyBudgetExceeded) as exc:
        check_budget(POL, [], earlier, [DPSGD, CENTRAL])
    assert exc.value.rule == "budget.lifetime.epsilon" and exc.value.cap == 3.0
    assert "lifetime" in str(exc.value)


def test_prv_accountant_is_used_when_the_policy_says_so() -> None:
    pol = _policy(accountant="prv")
    job_after, _ = check_budget(pol, [], [], [DPSGD])
    assert job_after == pytest.approx(epsilon([DPSGD], 1e-5, "prv"), rel=1e-6)
    assert job_after != pytest.approx(epsilon([DPSGD], 1e-5, "rdp"), rel=1e-3)


# -- coordinator planning --------------------------------------------------------------------------


def test_job_fits_every_site() -> None:
    pol_b = _policy()
    pol_b = type(pol_b)(**{**pol_b.__dict__, "site_id": "site-b"})
    plan = [MechanismRequest("central", 8.0, 0.5, 5), MechanismRequest("dpsgd", 4.0, 0.05, 100, clip=1.0)]
    out = check_job_fits({"site-a": POL, "site-b": pol_b}, {"site-a": plan, "site-b": plan}, job=JOB)
    assert set(out) == {"site-a", "site-b"}
    assert out["site-a"] == pytest.approx(epsilon([CENTRAL, DPSGD], 1e-5))


def test_job_refused_names_site_and_rule() -> None:
    strict = _policy(mechanisms={"dpsgd": {"min_sigma": 5.0}})
    strict = type(strict)(**{**strict.__dict__, "site_id": "site-b"})
    plan = [CENTRAL, DPSGD]
    with pytest.raises(JobDoesNotFit) as exc:
        check_job_fits({"site-a": POL, "site-b": strict}, {"site-a": plan, "site-b": plan})
    assert exc.value.problems[0][:2] == ("site-b", "mechanisms.dpsgd.min_sigma")
    assert (
        exc.value.site == "site-b" and "site site-b" in str(exc.value) and "before anything" in str(exc.value)
    )


def test_job_refused_over_budget_and_missing_policy() -> None:
    plan = [CENTRAL, PrivacyEvent("dpsgd", 1.0, 0.2, 200)]
    with pytest.raises(JobDoesNotFit) as exc:
        check_job_fits({"site-a": POL}, {"site-a": plan}, job=JOB)
    rules = {(s, r) for s, r, _ in exc.value.problems}
    assert rules == {("site-a", "budget.per_job.epsilon"), ("site-b", "policy")}


def test_job_refused_by_lifetime_spend_reported_by_site() -> None:
    earlier = [PrivacyEvent("dpsgd", 2.8, 0.1, 300)]
    with pytest.raises(JobDoesNotFit) as exc:
        check_job_fits({"site-a": POL}, {"site-a": [CENTRAL, DPSGD]}, lifetime_events={"site-a": earlier})
    assert exc.value.rule == "budget.lifetime.epsilon"


def test_planning_takes_clip_and_features_from_the_job() -> None:
    pol = _policy(mechanisms={"dpsgd": {"max_clip": 0.5}})
    # clip unknown without a job: node checks later
    check_job_fits({"site-a": pol}, {"site-a": [CENTRAL, DPSGD]})
    with pytest.raises(JobDoesNotFit) as exc:
        check_job_fits({"site-a": pol, "site-b": pol}, {"site-a": [CENTRAL, DPSGD]}, job=JOB)  # job clip 1.0
    assert ("site-a", "mechanisms.dpsgd.max_clip") in {(s, r) for s, r, _ in exc.value.problems}
