"""`policy check` lists every failing rule of a job in ONE pass, each once, with the fix that applies.

A batch larger than the site's public size used to be printed once per release under three rule names, the
budget refusal behind it appeared only after the batch was fixed, and the planner advised "raise [privacy]
epsilon" where the site's own per-job cap was the limit.
"""

from __future__ import annotations

from typing import Any

from edge.admission import admit
from feta_release.config import load_preset
from feta_release.policy import make_policy, open_signed_policy, sign_job, sign_policy
from tests.support.policy import keys

K = keys()


def _admit(policy_epsilon: float, **job: Any) -> list[tuple[str, str]]:
    doc = make_policy(
        "site-a",
        "ab" * 32,
        100,
        [K["coord"].public_key()],
        per_job=(policy_epsilon, 1e-5),
        app_bundles=["cd" * 32],
    )
    pol = open_signed_policy(sign_policy(doc, K["site"]), [K["site"].public_key()])
    cfg = load_preset("tiny").replace(privacy={"epsilon": 1.0}, **job)
    return admit(pol, sign_job(cfg, K["coord"], "j", ["site-a"])).failures


def test_batch_and_budget_refusals_show_together_each_once() -> None:
    failures = _admit(0.5, central={"batch": 200})
    text = "\n".join(m for _, m in failures)
    assert text.count("batch 200 exceeds the dataset size 100") == 1, failures
    assert "warm-up alone spends" in text, failures  # the budget, judged in the same pass
    assert len({r for r, _ in failures}) == len(failures) or all(r == "job" for r, _ in failures)


def test_site_cap_as_the_limit_says_raise_the_policy_cap_not_the_jobs_epsilon() -> None:
    failures = _admit(0.5, central={"batch": 50})
    text = "\n".join(m for _, m in failures)
    assert "raise [privacy] epsilon" not in text and "raise the POLICY's cap" in text, failures
    assert "budget.per_job.epsilon = 0.5" in text


def test_job_epsilon_as_the_limit_says_so() -> None:
    failures = _admit(2.0, central={"batch": 50, "sigma": 1.0})
    text = "\n".join(m for _, m in failures)
    assert failures and "the limit is the JOB" in text and "raise the POLICY's cap" not in text, failures
