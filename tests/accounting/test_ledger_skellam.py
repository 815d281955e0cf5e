"""The ledger stores, replays and composes secure-aggregation (Skellam) events next to Gaussian ones; the
per-job, lifetime and worst-case caps are checked over the mixed history by one function
(accounting.epsilon)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.accountants.skellam import skellam_epsilon, skellam_event
from feta_release.accounting import (
    PrivacyEvent,
    SkellamEvent,
    epsilon,
    event_from_dict,
    events_from_list,
    events_to_list,
    gaussian_only,
    worst_case_epsilon,
)
from feta_release.errors import PolicyBudgetExceeded, PolicyError, PrivacyError
from feta_release.ledger import Budget, Ledger
from feta_release.mechanisms.skellam import SkellamParams

KEY = Ed25519PrivateKey.generate()
PARAMS = SkellamParams(dim=196, clip=3.0, scale=1024 / 3.0, noise_multiplier=8.0, n_sites=3)
CENTRAL = skellam_event(PARAMS, "central", 0.5, 2, noise_shares=2)
FREQ = PrivacyEvent("frequency", 20.0, 1.0, 1)

positive = st.floats(min_value=1e-6, max_value=1e9, allow_nan=False, allow_infinity=False)


@st.composite
def skellam_events(draw: st.DrawFn) -> SkellamEvent:
    mu = draw(positive)
    return SkellamEvent(
        draw(st.sampled_from(["central", "frequency", "dpsgd"])),
        draw(st.floats(min_value=1e-6, max_value=1.0)),
        draw(st.integers(0, 10**6)),
        draw(positive),
        draw(positive),
        mu,
        draw(st.floats(min_value=1e-9, max_value=1.0)) * mu,
    )


gaussian = st.builds(
    PrivacyEvent,
    st.sampled_from(["central", "frequency", "dpsgd"]),
    positive,
    st.floats(min_value=1e-6, max_value=1.0),
    st.integers(0, 10**6),
)


@settings(max_examples=200, deadline=None)
@given(history=st.lists(st.one_of(gaussian, skellam_events()), max_size=8))
def test_event_format_round_trips_through_json(history: list[PrivacyEvent | SkellamEvent]) -> None:
    stored = json.loads(json.dumps(events_to_list(history)))
    assert events_from_list(stored) == history
    # a Gaussian event keeps its four keys (old ledgers and releases read unchanged)
    for d, e in zip(stored, history, strict=True):
        assert set(d) == (
            {"stage", "sigma", "q", "steps"}
            if isinstance(e, PrivacyEvent)
            else {"kind", "stage", "q", "steps", "l2", "l1", "mu", "mu_worst"}
        )


@settings(max_examples=60, deadline=None)
@given(
    ev=skellam_events(),
    key=st.sampled_from(["mu", "l2", "q", "steps", "kind"]),
    bad=st.sampled_from([None, -1.0, 0.0, float("nan"), "x", True]),
)
def test_a_malformed_skellam_event_is_refused(ev: SkellamEvent, key: str, bad: object) -> None:
    d = {**ev.to_dict(), key: bad}
    with pytest.raises(PrivacyError):
        event_from_dict(d)


def test_the_own_share_cannot_exceed_the_counted_shares() -> None:
    with pytest.raises(PrivacyError, match="mu_worst"):
        SkellamEvent("central", 0.5, 1, 10.0, 10.0, mu=100.0, mu_worst=200.0)


def test_mixed_history_epsilon_is_one_function_and_matches_the_skellam_accountant() -> None:
    assert epsilon([CENTRAL], 1e-5) == pytest.approx(skellam_epsilon(PARAMS, 0.5, 2, 1e-5, 2), rel=1e-9)
    assert worst_case_epsilon([CENTRAL], 1e-5) == pytest.approx(
        skellam_epsilon(PARAMS, 0.5, 2, 1e-5, 1), rel=1e-9
    )
    both = epsilon([FREQ, CENTRAL], 1e-5)
    assert (
        max(epsilon([FREQ], 1e-5), epsilon([CENTRAL], 1e-5))
        < both
        < epsilon([FREQ], 1e-5) + epsilon([CENTRAL], 1e-5)
    )
    assert epsilon([FREQ, CENTRAL], 1e-5, "prv") == both  # no Skellam PLD: RDP composition, stated in the doc
    assert both < worst_case_epsilon([FREQ, CENTRAL], 1e-5)
    with pytest.raises(PrivacyError, match="secure-aggregation"):
        gaussian_only([FREQ, CENTRAL], "local run")


def test_ledger_charges_replays_and_sums_skellam_events(tmp_path: Path) -> None:
    budget = Budget(job_epsilon=5.0, lifetime_epsilon=8.0, delta=1e-5, worst_case_epsilon=15.0)
    led = Ledger(tmp_path / "l.db", key=KEY)
    led.charge("job1", "job1:frequency:0", "frequency", [FREQ], budget, response=b"f")
    r = led.charge("job1", "job1:central:0", "central", [CENTRAL], budget)
    led.record_response("job1:central:0", b"masked")
    assert r.job_epsilon == pytest.approx(epsilon([FREQ, CENTRAL], 1e-5))
    again = led.charge("job1", "job1:central:0", "central", [CENTRAL], budget)
    assert again.replay and again.response == b"masked"
    assert led.summary(budget)["jobs"]["job1"]["epsilon_spent"] == pytest.approx(r.job_epsilon)
    assert events_from_list(led.job_events("job1")) == [FREQ, CENTRAL]
    reopened = Ledger(tmp_path / "l.db", key=KEY)  # the chain verifies with the new row kind
    assert events_from_list(reopened.job_events("job1")) == [FREQ, CENTRAL]
    other = SkellamEvent(
        CENTRAL.stage, CENTRAL.q, CENTRAL.steps, CENTRAL.l2, CENTRAL.l1, CENTRAL.mu * 2, CENTRAL.mu_worst
    )
    with pytest.raises(PolicyError, match="other parameters"):
        led.charge("job1", "job1:central:0", "central", [other], budget)


def test_ledger_refuses_past_the_worst_case_cap_naming_the_rule(tmp_path: Path) -> None:
    assumed, worst = epsilon([CENTRAL], 1e-5), worst_case_epsilon([CENTRAL], 1e-5)
    led = Ledger(tmp_path / "l.db", key=KEY)
    tight = Budget(
        job_epsilon=assumed + 0.01, lifetime_epsilon=10.0, delta=1e-5, worst_case_epsilon=worst - 0.01
    )
    with pytest.raises(PolicyBudgetExceeded) as exc:
        led.charge("job1", "r1", "central", [CENTRAL], tight)
    assert exc.value.rule == "secure_aggregation.max_worst_case_epsilon"
    assert led.requests() == []  # nothing charged
    with pytest.raises(PolicyBudgetExceeded) as exc:
        led.charge(
            "job1", "r1", "central", [CENTRAL], Budget(assumed - 0.01, 10.0, 1e-5, worst_case_epsilon=99.0)
        )
    assert exc.value.rule == "budget.per_job.epsilon"
    ok = led.charge(
        "job1", "r1", "central", [CENTRAL], Budget(assumed + 0.01, 10.0, 1e-5, worst_case_epsilon=worst)
    )
    assert not ok.replay


def test_budget_from_a_policy_brings_the_default_worst_case_cap() -> None:
    from tests.support.policy import keys, policy_doc

    doc = policy_doc(keys(), per_job=(1.5, 1e-5))
    assert Budget.from_policy(doc).worst_case_epsilon == 4.5
    doc["secure_aggregation"] = {"max_worst_case_epsilon": 2.0}
    assert Budget.from_policy(doc).worst_case_epsilon == 2.0


def test_a_later_gaussian_charge_cannot_push_the_worst_case_past_its_cap() -> None:
    """The worst-case cap was checked only when the NEW events held a
    Skellam event, so DP-SGD charged after a secure warm-up took the job's worst case from 5.63 to 6.48 (cap
    6)."""
    from feta_release.accounting import epsilon, worst_case_epsilon
    from feta_release.ledger import check_spend

    b = Budget(job_epsilon=8.0, lifetime_epsilon=100.0, delta=1e-5, worst_case_epsilon=6.0)
    best = None
    for s in (20, 10, 6, 4, 3, 2.5, 2, 1.6, 1.3, 1.0):  # the least noise whose worst case fits the cap
        sk = SkellamEvent(
            "central", 1.0, 1, 1100.0, 1100.0 * 32, mu=(s * 1024) ** 2, mu_worst=(s * 1024) ** 2 / 3
        )
        if worst_case_epsilon([sk], 1e-5) < 6.0:
            best = sk
    assert best is not None
    check_spend(b, [], [], [best])
    g = PrivacyEvent("dpsgd", 1.0, 0.01, 2000)
    assert epsilon([best, g], 1e-5) < 8.0  # within the per-job cap: only the worst-case cap can refuse it
    assert worst_case_epsilon([best, g], 1e-5) > 6.0
    with pytest.raises(PolicyBudgetExceeded, match="max_worst_case_epsilon"):
        check_spend(b, [best], [best], [g])
