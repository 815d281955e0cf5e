"""A charged request the ledger calls interrupted (its process killed: never recorded, never failed) may be
finished once without a second charge; one that failed after its charge never again (``Ledger.interrupted`` /
``mark_failed``, used by the node's release protocol for DP-SGD rounds)."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.accounting import PrivacyEvent
from feta_release.errors import PolicyError, PrivacyError
from feta_release.ledger import Budget, Ledger

BUDGET = Budget(job_epsilon=10.0, lifetime_epsilon=20.0, delta=1e-5)
KEY = Ed25519PrivateKey.generate()
ROUND = [PrivacyEvent("dpsgd", 1.2, 0.1, 5)]


def test_a_charged_request_is_interrupted_until_it_is_recorded_or_failed(tmp_path):
    led = Ledger(tmp_path / "l.db", key=KEY)
    assert not led.interrupted("job", "job:train:0", "dpsgd", ROUND)  # never charged
    led.charge("job", "job:train:0", "dpsgd", ROUND, BUDGET)
    assert led.interrupted("job", "job:train:0", "dpsgd", ROUND)
    led.record_response("job:train:0", b"answer")
    assert not led.interrupted("job", "job:train:0", "dpsgd", ROUND)  # done: a replay gets the record
    assert led.check("job", "job:train:0", "dpsgd", ROUND, BUDGET).response == b"answer"
    led.charge("job", "job:train:1", "dpsgd", ROUND, BUDGET)
    led.mark_failed("job:train:1")
    assert not led.interrupted("job", "job:train:1", "dpsgd", ROUND)
    with pytest.raises(PolicyError, match="failed after its charge"):
        led.check("job", "job:train:1", "dpsgd", ROUND, BUDGET)
    with pytest.raises(PrivacyError, match="not a pending charge"):
        led.record_response("job:train:1", b"late")  # a failed request records no answer
    led.close()


@settings(max_examples=25, deadline=None)
@given(
    job=st.sampled_from(["job", "other"]),
    mechanism=st.sampled_from(["dpsgd", "central"]),
    sigma=st.sampled_from([1.2, 1.3]),
    steps=st.sampled_from([5, 6]),
)
def test_only_the_very_request_that_was_charged_is_interrupted(
    tmp_path_factory, job, mechanism, sigma, steps
):
    """Another job, mechanism or event under the same request id is not that request: it cannot be finished
    without a charge of its own."""
    led = Ledger(tmp_path_factory.mktemp("l") / "l.db", key=KEY)
    led.charge("job", "job:train:0", "dpsgd", ROUND, BUDGET)
    same = (job, mechanism, sigma, steps) == ("job", "dpsgd", 1.2, 5)
    ev = [PrivacyEvent(mechanism, sigma, 0.1, steps)]
    assert led.interrupted(job, "job:train:0", mechanism, ev) is same
    led.close()
