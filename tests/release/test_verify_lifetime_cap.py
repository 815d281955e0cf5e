"""``verify`` holds each site's signed LIFETIME spend to its signed policy's lifetime cap, as the node's
ledger does.

A site's ledger refuses any charge that would take its lifetime ε (every job on the same data) past
``budget.lifetime.epsilon``; a release whose site statement says otherwise was not made under that policy, and
the verifier's "within policy" must not be printed for it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from feta_release.accounting import PrivacyEvent, SkellamEvent, epsilon, worst_case_epsilon  # noqa: E402
from feta_release.release.manifest import build_attestation  # noqa: E402
from feta_release.release.verify import (  # noqa: E402
    VerificationResult,
    _check_epsilon,
    lifetime_violations,
    verify_release,
)
from feta_release.signing import canonical_json, sha256_hex, sign_document  # noqa: E402
from tests.support.release import assemble, new_keys, signed_job  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # fixtures: tests/conftest.py

# One job's spend: about ε = 0.73 at δ = 1e-5, within a per-job cap of 1.0.
JOB = [
    PrivacyEvent("central", 20.0, 0.1, 5),
    PrivacyEvent("frequency", 60.0, 1.0, 1),
    PrivacyEvent("dpsgd", 3.0, 0.05, 100),
]
EARLIER = JOB * 2  # two earlier jobs on the same data: the lifetime is about ε = 1.5


def _policy(keys, lifetime: float) -> dict:
    from feta_release.policy import make_policy, sign_policy

    doc = make_policy(
        "a",
        "0" * 64,
        5000,
        [keys.coordinator.public_key()],
        per_job=(1.0, 1e-5),
        lifetime=(lifetime, 1e-5),
        site_key=keys.site.public_key(),
    )
    return sign_policy(doc, keys.policy)


def _release(out, den_onnx, keys, lifetime_cap: float):
    from feta_release.policy.document import SitePolicy

    policy = _policy(keys, lifetime_cap)
    job = signed_job(keys.coordinator, "job-1", ["a"])
    att = build_attestation(
        "a",
        "job-1",
        JOB,
        1e-5,
        "rdp",
        SitePolicy.from_document(policy["policy"], None).digest,
        keys.site,
        job_sha256=sha256_hex(canonical_json(job["job"])),
        lifetime_events=EARLIER + JOB,
        lifetime_delta=1e-5,
    )
    return assemble(out, den_onnx, keys.coordinator, job, [att], {"a": policy})


def test_verify_refuses_lifetime_epsilon_over_the_signed_cap(tmp_path, den_onnx):
    keys = new_keys()
    assert epsilon(JOB, 1e-5) < 1.0 < epsilon(EARLIER + JOB, 1e-5)
    res = verify_release(_release(tmp_path / "over", den_onnx, keys, lifetime_cap=1.0), keys.trust())
    assert not res.ok
    assert {c.name for c in res.failures} == {"site a policy"}
    assert "exceeds the lifetime cap budget.lifetime.epsilon 1.0" in res.reason()
    # The same release under a lifetime cap it fits passes: the check is the cap, not the history.
    res = verify_release(_release(tmp_path / "within", den_onnx, keys, lifetime_cap=2.0), keys.trust())
    assert res.ok, res.reason()


def test_lifetime_cap_is_checked_at_the_caps_delta_not_the_stated_one():
    """A statement at a larger lifetime δ has a smaller ε: the cap is held at the policy's own δ."""
    life = EARLIER + JOB
    policy = {"budget": {"lifetime": {"epsilon": 1.2, "delta": 1e-5}}, "accountant": "rdp"}
    loose = {
        "lifetime": {"events": [e.to_dict() for e in life], "delta": 1e-2, "epsilon": epsilon(life, 1e-2)}
    }
    assert epsilon(life, 1e-2) < 1.2 < epsilon(life, 1e-5)
    problems = lifetime_violations(policy, loose)
    assert any("budget.lifetime.epsilon 1.2" in p for p in problems)
    assert any("budget.lifetime.delta" in p for p in problems)


def test_verify_refuses_a_lifetime_worst_case_figure_its_history_does_not_compose_to():
    """Under secure aggregation the statement carries the lifetime ε if every other site colluded: it must be
    what the lifetime history composes to (a site-signed figure understated by half is refused)."""
    keys = new_keys()
    sk = SkellamEvent("central", 1.0, 2, l2=40.0, l1=1600.0, mu=4e5, mu_worst=1e5)
    life = [sk, *JOB]
    att = build_attestation("a", "job-1", [sk], 1e-5, "rdp", None, keys.site, lifetime_events=life)
    st = att["statement"]
    truth = worst_case_epsilon(life, 1e-5)
    assert st["secure_aggregation"]["lifetime_worst_case_epsilon"] == pytest.approx(truth)
    res = VerificationResult("x")
    _check_epsilon(res, "a", st, [sk])
    assert res.ok, res.reason()
    forged = {
        **st,
        "secure_aggregation": {**st["secure_aggregation"], "lifetime_worst_case_epsilon": truth / 2},
    }
    sign_document(forged, keys.site)  # the site itself signs it: only the recomputation can catch it
    res = VerificationResult("x")
    _check_epsilon(res, "a", forged, [sk])
    assert {c.name for c in res.failures} == {"site a lifetime secure aggregation"}
    missing = {
        **st,
        "secure_aggregation": {
            k: v for k, v in st["secure_aggregation"].items() if k != "lifetime_worst_case_epsilon"
        },
    }
    res = VerificationResult("x")
    _check_epsilon(res, "a", missing, [sk])
    assert "no lifetime worst-case epsilon" in res.reason()
