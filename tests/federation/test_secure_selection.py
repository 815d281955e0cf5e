"""The semantic selection query of a secure-aggregation job, over the in-process Grid: each site's histogram
goes out as a masked Skellam contribution (its own noise share only), the coordinator decodes the noisy SUM
and nothing else, each site charges the planner's SkellamEvent before it counts a vote, and a site's policy
judges its own noise share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy import stats

from coordinator.setup import sign_job_file
from feta_release.accountants.skellam import honest_shares, skellam_epsilon
from feta_release.accounting import SkellamEvent, epsilon, events_from_list, worst_case_epsilon
from feta_release.data.procedural import generate_dataset
from feta_release.federation import messages as fm
from feta_release.ledger import Ledger
from feta_release.mechanisms import secure_sums as ss
from feta_release.mechanisms import selection as sel
from feta_release.mechanisms import skellam as sk
from feta_release.release.verify import policy_violations
from feta_release.stages import PublicInputs
from feta_release.stages.pretrain import with_public
from tests.support.federation import harness, ledger_requests, make_federation, run_harness_job, tiny_job

pytestmark = pytest.mark.slow  # tiny federations over the in-process Grid

GROUPS, SIGMA = 3, 20.0


def _public() -> PublicInputs:
    return PublicInputs(generate_dataset("strokes", 48, size=28, seed=9), "pen strokes")


def _job(pub: PublicInputs, secure: bool = True, **public: Any) -> Any:
    return with_public(
        tiny_job(
            federation={"secure_aggregation": secure, "rounds": 1},
            public={
                "pretrain_iterations": 2,
                "pretrain_batch": 8,
                "selection": True,
                "selection_groups": GROUPS,
                "selection_sigma": SIGMA,
                **public,
            },
        ),
        pub,
        (1, 28, 28),
    )


class Seen:
    """What the coordinator receives (every reply) and what each site computed before masking (its noisy
    integer selection input), plus the order of the sites' charges and vote counts."""

    def __init__(self, grid: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.replies: list[tuple[dict[str, Any], dict[str, np.ndarray]]] = []
        self.contributions: list[np.ndarray] = []
        self.order: list[str] = []
        deliver = grid._deliver

        def spy(msg: Any) -> Any:
            rep = deliver(msg)
            if rep is not None and not rep.has_error():
                self.replies.append(fm.read_payload(rep.content))
            return rep

        grid._deliver = spy
        contribution, charge, votes = ss.selection_contribution, Ledger.charge, sel.vote_counts

        def contributed(images: np.ndarray, centroids: np.ndarray, **kw: Any) -> np.ndarray:
            out = contribution(images, centroids, **kw)
            if np.asarray(images).any():  # the padding's blank rows are dropped, never sent
                self.contributions.append(out.copy())
            return out

        def charged(led: Any, job_id: str, rid: str, mechanism: str, events: Any, limits: Any) -> Any:
            out = charge(led, job_id, rid, mechanism, events, limits)
            self.order.append(f"charge:{mechanism}")
            return out

        def counted(images: np.ndarray, centroids: np.ndarray) -> np.ndarray:
            if np.asarray(images).any():
                self.order.append("votes")
            return votes(images, centroids)

        monkeypatch.setattr(ss, "selection_contribution", contributed)
        monkeypatch.setattr(Ledger, "charge", charged)
        monkeypatch.setattr(sel, "vote_counts", counted)


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_federation(tmp_path_factory.mktemp("secsel") / "fed")


@pytest.fixture(scope="module")
def secure_run(fed: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One secure job with the selection, run end to end over 3 sites."""
    mp = pytest.MonkeyPatch()
    pub = _public()
    signed, _ = sign_job_file(fed, _job(pub), "job-secsel")
    grid = harness(fed)
    seen = Seen(grid, mp)
    out = tmp_path_factory.mktemp("secsel-out")
    try:
        res = run_harness_job(fed, grid, signed, out, public=pub)
    finally:
        mp.undo()
    return res, grid, seen, out


def test_the_coordinator_sees_masked_vectors_only_never_a_sites_histogram(secure_run: Any) -> None:
    res, grid, seen, _ = secure_run
    assert res.rounds_done == 1
    types = [m.metadata.message_type for m in grid.sent]
    assert fm.SELECTION not in types  # no per-site histogram is asked for
    masked = [a["masked"] for d, a in seen.replies if d.get("phase") == "selection" and "masked" in a]
    assert len(masked) == 3 and len(seen.contributions) == 3
    for d, a in seen.replies:
        assert "histogram" not in a  # no reply carries a histogram
        if d.get("phase") == "selection":
            assert set(a) <= {"masked"}
    own = [sk.to_modular(c, 64) for c in seen.contributions]
    for v in masked:  # each vector is masked: no coordinate equals any site's own input
        assert v.dtype == np.uint64 and v.shape == (GROUPS,)
        assert all((v != o).all() for o in own)
    # uniform mod 2^64 whatever the data (KS test over the 3 x 3 coordinates on [0, 1))
    pooled = np.concatenate(masked).astype(np.float64) / 2.0**64
    assert stats.kstest(pooled, "uniform").pvalue > 1e-4


def test_the_unmasked_sum_is_the_sum_of_the_sites_noisy_contributions(secure_run: Any) -> None:
    _, _, seen, out = secure_run
    released = np.array(json.loads((out / "selection.json").read_text())["histogram"])
    total = np.sum(seen.contributions, axis=0)  # integers: s x the votes + the 3 noise shares
    assert np.array_equal(released * 2**ss.SCALE_BITS, total.astype(np.float64))
    decoded = ss.decode_selection(
        sk.modular_sum([sk.to_modular(c, 64) for c in seen.contributions], 64), GROUPS, SIGMA, 3
    )
    assert np.array_equal(decoded, released)
    with np.load(out / "state" / "selection_secure.npz") as z:
        assert np.array_equal(z["histogram"], released)
    doc = json.loads((out / "selection.json").read_text())
    assert 0.5 * 48 <= doc["kept"] <= 48


def test_each_site_charges_the_planned_skellam_event_before_it_counts_a_vote(
    fed: Any, secure_run: Any
) -> None:
    res, _, seen, out = secure_run
    for i in range(3):  # the harness asks the sites in turn: each charges, then counts
        assert seen.order[2 * i : 2 * i + 2] == ["charge:selection", "votes"]
    h = honest_shares(3, 3, 0)  # default policies: peers pinned, no colluder, threshold all 3
    params = ss.selection_params(GROUPS, SIGMA, 3)
    plan = json.loads((out / "plan.json").read_text())
    for s in fed.sites:
        rows = ledger_requests(fed, s.site_id, "job-secsel")
        assert [r["mechanism"] for r in rows] == ["selection", "dpsgd"]
        ev = events_from_list(rows[0]["events"])[0]
        assert isinstance(ev, SkellamEvent) and ev.stage == "selection" and (ev.q, ev.steps) == (1.0, 1)
        # the total noise is the sum of the sites' shares; the site counts the h honest ones
        assert ev.mu == pytest.approx(h * params.site_mu) and ev.mu_worst == pytest.approx(params.site_mu)
        assert params.site_mu * 3 == pytest.approx((SIGMA * 2**ss.SCALE_BITS) ** 2)
        # the plan's events are the ledger's, its epsilon the distributed-noise accountant's
        planned = events_from_list(plan[s.site_id]["events"])
        charged = events_from_list([e for r in rows for e in r["events"]])
        assert planned == charged
        assert plan[s.site_id]["planned_epsilon"] == pytest.approx(epsilon(charged, 1e-5))
        # cross-check: the selection alone is accountants.skellam's epsilon of its parameters
        assert epsilon([ev], 1e-5) == pytest.approx(skellam_epsilon(params, 1.0, 1, 1e-5, h), rel=1e-9)
        assert worst_case_epsilon([ev], 1e-5) == pytest.approx(
            skellam_epsilon(params, 1.0, 1, 1e-5, 1), rel=1e-9
        )
        st = res.attestations[s.site_id]["statement"]
        assert st["events"][0] == ev.to_dict()
        assert st["secure_aggregation"]["worst_case_epsilon"] == pytest.approx(
            worst_case_epsilon(charged, st["delta"])
        )
        # verify judges the attested selection against the policy's min_sigma with its OWN share (20/sqrt 3)
        policy = json.loads(fed.site(s.site_id).policy.read_text())["policy"]
        assert policy_violations(policy, st, charged) == []
        policy["mechanisms"]["selection"]["min_sigma"] = 15.0
        assert any(
            v.startswith("selection:") and "own noise share" in v
            for v in policy_violations(policy, st, charged)
        )


def test_a_per_site_selection_request_is_refused_in_a_secure_job_before_any_charge(
    fed: Any, tmp_path: Path
) -> None:
    from flwr.app import Message

    pub = _public()
    signed, _ = sign_job_file(fed, _job(pub), "job-secsel-mode")
    grid = harness(fed)
    node_a = next(n for n, node in grid.nodes.items() if "site-a" in str(node.node_config))
    centroids = np.zeros((GROUPS, sel.feature_dim((1, 28, 28))), np.float32)
    msg = Message(
        fm.make_payload({"job": signed}, {"centroids": centroids}),
        dst_node_id=node_a,
        message_type=fm.SELECTION,
        group_id="x",
    )
    grid.push_messages([msg])
    rep = grid._replies.popitem()[1]
    assert rep.has_error() and "per-site" in rep.error.reason
    assert ledger_requests(fed, "site-a", "job-secsel-mode") == []


def test_min_sigma_judges_the_sites_own_noise_share_in_a_secure_job(tmp_path: Path) -> None:
    """The research policies' mechanisms.selection.min_sigma is 5. sigma 8 over 3 sites: each site's own
    share is 8 / sqrt(3) = 4.6 < 5, so the coordinator refuses the secure job before any release and a node
    refuses the request before its charge (a coordinator cannot make one site's share small by summing over
    many sites), while the per-site job (full noise 8 at each site) passes the rule."""
    from edge.admission import admit
    from edge.protocol import planned
    from feta_release.policy.enforce import check_request
    from feta_release.policy.errors import JobDoesNotFit, PolicyViolation
    from tests.support.federation import site_and_job

    fed = make_federation(tmp_path / "fed")
    pub = _public()
    cfg = _job(pub, selection_sigma=8.0)
    signed, _ = sign_job_file(fed, cfg, "job-secsel-small")
    grid = harness(fed)
    with pytest.raises(JobDoesNotFit, match="mechanisms.selection.min_sigma"):
        run_harness_job(fed, grid, signed, tmp_path / "out", public=pub)
    assert fm.SECAGG not in [m.metadata.message_type for m in grid.sent]
    for s in fed.sites:
        assert ledger_requests(fed, s.site_id, "job-secsel-small") == []
    site, job, _ = site_and_job(fed, "job-secsel-node", cfg)
    event, request = planned(site, job, "selection")
    assert isinstance(event, SkellamEvent) and request.sigma == pytest.approx(8.0 / np.sqrt(3), rel=1e-3)
    with pytest.raises(PolicyViolation, match="mechanisms.selection.min_sigma"):
        check_request(site.policy, request)
    per_site, _ = sign_job_file(fed, _job(pub, secure=False, selection_sigma=8.0), "job-sel-per-site")
    judged = admit(site.policy, per_site, data_shape=((1, 28, 28), 10))
    assert not any(rule == "mechanisms.selection.min_sigma" for rule, _ in judged.failures)
