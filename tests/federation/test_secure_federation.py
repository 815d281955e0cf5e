"""Secure aggregation wired through the node's release protocol and the JobDriver, over the in-process Grid:
the coordinator sees the sum only, sites charge their SkellamEvents once, dropouts, malformed vectors,
split-view aware accounting, replays."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.setup import sign_job_file
from feta_release.accountants.skellam import honest_shares
from feta_release.accounting import SkellamEvent, epsilon, events_from_list, worst_case_epsilon
from feta_release.errors import PolicyError
from feta_release.federation import messages as fm
from feta_release.signing import load_private_key
from tests.support.federation import full_job, harness, make_federation
from tests.support.federation import ledger_requests as _requests
from tests.support.federation import run_harness_job as _run
from tests.support.uniformity import assert_uniform_mod_2_64


def secure_job(**fed: Any) -> Any:
    return full_job(federation={"secure_aggregation": True, "rounds": 1, **fed})


def _stage(msg: Any) -> str | None:
    doc, _ = fm.read_payload(msg.content)
    return doc.get("stage")


class Recorder:
    """Keeps every reply the coordinator receives (its whole view of the job)."""

    def __init__(self, grid: Any) -> None:
        self.replies: list[tuple[int, dict[str, Any], dict[str, np.ndarray]]] = []
        deliver = grid._deliver

        def spy(msg: Any) -> Any:
            rep = deliver(msg)
            if rep is not None and not rep.has_error():
                doc, arrays = fm.read_payload(rep.content)
                self.replies.append((msg.metadata.dst_node_id, doc, arrays))
            return rep

        grid._deliver = spy

    def masked(self, phase: str) -> list[np.ndarray]:
        return [a["masked"] for _, d, a in self.replies if d.get("phase") == phase and "masked" in a]


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_federation(tmp_path_factory.mktemp("secfed") / "fed")


def test_secure_job_charges_skellam_events_and_the_coordinator_sees_only_masked_vectors(
    fed: Any, tmp_path: Path
) -> None:
    signed, _ = sign_job_file(fed, secure_job(), "job-sec")
    secagg_dirs = [Path(fed.site(s.site_id).ledger).parent / "work" / "secagg" for s in fed.sites]
    for d in secagg_dirs:  # An existing, too open directory
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o755)
    grid = harness(fed)
    rec = Recorder(grid)
    res = _run(fed, grid, signed, tmp_path / "out")
    assert res.rounds_done == 1
    for d in secagg_dirs:  # after the unmask stage no state (ECDH secrets sk1, sk2) is left; the dir is 0700
        assert (d.stat().st_mode & 0o777) == 0o700 and not list(d.glob("job-sec.*"))
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    types = [m.metadata.message_type for m in grid.sent]
    assert fm.CENTRAL not in types and fm.FREQUENCY not in types and types.count(fm.SECAGG) == 2 * 4 * 3
    for s in fed.sites:
        reqs = _requests(fed, s.site_id, "job-sec")
        assert [r["mechanism"] for r in reqs] == ["central", "frequency", "dpsgd"]  # each charged once
        events = events_from_list([e for r in reqs for e in r["events"]])
        assert [type(e).__name__ for e in events] == ["SkellamEvent", "SkellamEvent", "PrivacyEvent"]
        sk = [e for e in events if isinstance(e, SkellamEvent)]
        # default policy (0 colluders), threshold = all 3 sites: 3 honest shares counted, own share for the
        # worst case
        assert all(e.mu == pytest.approx(3 * e.mu_worst) for e in sk)
        eps = epsilon(events, 1e-5)
        assert eps <= 1.0 + 1e-9 < worst_case_epsilon(events, 1e-5)
        assert res.attestations[s.site_id]["statement"]["epsilon"] == pytest.approx(eps)
        # the coordinator planned what is charged
        assert plan[s.site_id]["planned_epsilon"] == pytest.approx(eps)
    # The coordinator's view of one site: a masked vector, uniform mod 2^64 whatever the data (the six KS
    # tests held to one family-wise error rate: the masks come from fresh OS keys every run)
    vectors = {phase: rec.masked(phase) for phase in ("central", "frequency")}
    assert all(len(v) == 3 for v in vectors.values())
    assert_uniform_mod_2_64(vectors["central"] + vectors["frequency"])
    # ... while the decoded sum carries exactly the POOLED noise: std sigma c / denominator (all 3 shares),
    # here 5 x 14 / (3 sites x batch 10 / 10 classes) = 23.3, the signal (< 1 per pixel) negligible beside it
    with np.load(tmp_path / "out" / "state" / "central_secure.npz") as z:
        values, denom = z["values"], float(z["denominator"])
    assert denom == 3.0 and values.shape == (10, 1, 14, 14)
    assert float(np.std(values)) == pytest.approx(5.0 * 14.0 / 3.0, rel=0.1)
    docs = [d for _, d, _ in rec.replies if d.get("phase")]
    assert not any("n" in d or "count" in d or "dataset_size" in d for d in docs)  # no exact counts leave
    check_attested_words(fed, res.attestations)


def check_attested_words(fed: Any, attestations: dict[str, Any]) -> None:
    """Each site attests both epsilons; verify recomputes the worst case and says both in plain words."""
    from feta_release.release.manifest import site_record
    from feta_release.release.verify import (
        VerificationResult,
        _check_epsilon,
        describe_site,
        policy_violations,
    )

    for s in fed.sites:
        st = attestations[s.site_id]["statement"]
        events = events_from_list(st["events"])
        worst = worst_case_epsilon(events, st["delta"])
        assert st["secure_aggregation"]["worst_case_epsilon"] == pytest.approx(worst)
        assert st["secure_aggregation"]["max_colluders"] == 0
        words = describe_site(site_record(attestations[s.site_id]))
        assert f"ε = {st['epsilon']:.3g}" in words and f"ε would be {worst:.3g}" in words
        assert "no other site colludes" in words and "own noise share only" in words
        res = VerificationResult("x")
        _check_epsilon(res, s.site_id, st, events)
        assert res.ok and any("if every other site colluded" in c.detail for c in res.checks)
        forged = {**st, "secure_aggregation": {**st["secure_aggregation"], "worst_case_epsilon": worst / 2}}
        res = VerificationResult("x")
        _check_epsilon(res, s.site_id, forged, events)
        assert not res.ok
        policy = json.loads(fed.site(s.site_id).policy.read_text())["policy"]
        assert policy_violations(policy, st, events) == []
        policy["secure_aggregation"] = {"max_worst_case_epsilon": worst * 0.9}
        assert any("max_worst_case_epsilon" in p for p in policy_violations(policy, st, events))


def test_a_site_dropped_after_masking_is_covered_by_the_threshold(fed: Any, tmp_path: Path) -> None:
    signed, _ = sign_job_file(fed, secure_job(secagg_threshold=2), "job-drop")
    # site-c dies when asked to unmask the central sum: its masked vector is in, its shares never come
    grid = harness(
        fed, fail_on={"site-c": lambda m: m.metadata.message_type == fm.SECAGG and _stage(m) == "unmask"}
    )
    # the frequency sum needs every site in its key setup (a site masks against all of them): site-c is gone,
    # so the job fails cleanly after the redone setups, with no frequency charge anywhere
    with pytest.raises(PolicyError, match="did not complete with every site"):
        _run(fed, grid, signed, tmp_path / "out")
    meta = json.loads((tmp_path / "out" / "state" / "central_secure.json").read_text())
    assert meta["sites"] == ["site-a", "site-b", "site-c"]  # its data and noise share are in the sum
    assert not (tmp_path / "out" / "state" / "frequency_secure.json").exists()
    for sid in ("site-a", "site-b", "site-c"):
        assert [r["mechanism"] for r in _requests(fed, sid, "job-drop")] == ["central"]
    # threshold 2 of 3, 0 colluders: 2 honest shares counted (2 * 2 > 3: no split view isolates a vector)
    ev = events_from_list(_requests(fed, "site-a", "job-drop")[0]["events"])[0]
    assert isinstance(ev, SkellamEvent) and ev.mu == pytest.approx(2 * ev.mu_worst)


def test_an_out_of_modulus_vector_is_refused_and_its_site_left_out(
    fed: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from feta_release.mechanisms import secure_sums

    monkeypatch.setattr(secure_sums, "DEFAULT_MODULUS_BITS", 32)
    signed, _ = sign_job_file(fed, secure_job(secagg_threshold=2), "job-bad")
    grid = harness(fed)
    deliver = grid._deliver
    node_b = next(
        n for n, node in grid.nodes.items() if node.node_config and "site-b" in str(node.node_config)
    )

    def tamper(msg: Any) -> Any:
        rep = deliver(msg)
        if msg.metadata.dst_node_id == node_b and _stage(msg) == "collect_masked_vectors":
            doc, arrays = fm.read_payload(rep.content)
            arrays["masked"] = arrays["masked"].copy()
            arrays["masked"][0] = np.uint64(1 << 40)  # outside [0, 2^32)
            rep.content = fm.make_payload(doc, arrays)
        return rep

    grid._deliver = tamper
    _run(fed, grid, signed, tmp_path / "out")
    log = (tmp_path / "out" / "progress.jsonl").read_text()
    assert "outside the modulus" in log
    for phase in ("central", "frequency"):
        assert json.loads((tmp_path / "out" / "state" / f"{phase}_secure.json").read_text())["sites"] == [
            "site-a",
            "site-c",
        ]


def test_split_view_aware_charge_counts_only_the_own_share_when_a_vector_can_be_isolated(
    tmp_path: Path,
) -> None:
    """max_colluders 1, threshold 2 of 3: 2 (t - k) = 2 <= n - k = 2, a lying coordinator with one colluder
    can unmask one vector alone (test_secagg runs that attack): the site charges its own share only."""
    fed = make_federation(
        tmp_path / "fed",
        policy_overrides={
            s: {"secure_aggregation": {"max_colluders": 1}} for s in ("site-a", "site-b", "site-c")
        },
    )
    assert honest_shares(3, 2, 1) == 1
    signed, _ = sign_job_file(fed, secure_job(secagg_threshold=2), "job-split")
    _run(fed, harness(fed), signed, tmp_path / "out")
    for s in fed.sites:
        sk = [e for e in events_from_list(_requests(fed, s.site_id, "job-split")[0]["events"])]
        assert isinstance(sk[0], SkellamEvent) and sk[0].mu == sk[0].mu_worst


def test_a_repeated_masked_request_replays_and_a_new_key_setup_is_refused_without_a_charge(
    fed: Any, tmp_path: Path
) -> None:
    from flwr.app import Message

    from feta_release.federation.driver import JobDriver
    from feta_release.federation.secagg import ALREADY_RELEASED, AlreadyReleased
    from feta_release.federation.secure_collect import secure_sum

    signed, _ = sign_job_file(fed, secure_job(), "job-replay")
    grid = harness(fed)
    rec = Recorder(grid)
    d = JobDriver(
        grid,
        signed,
        tmp_path / "out",
        coordinator_key=load_private_key(fed.coordinator_key),
        wait_timeout=2,
        poll_interval=0.05,
    )
    d.wait_for_sites()
    d.collect_central()
    before = _requests(fed, "site-a", "job-replay")
    assert [r["mechanism"] for r in before] == ["central"]
    node_a = d.sites["site-a"].node_id
    collect = next(
        m
        for m in grid.sent
        if m.metadata.dst_node_id == node_a
        and m.metadata.message_type == fm.SECAGG
        and _stage(m) == "collect_masked_vectors"
    )
    first = next(a["masked"] for n, doc, a in rec.replies if n == node_a and "masked" in a)
    doc, _ = fm.read_payload(collect.content)
    grid.push_messages(
        [Message(fm.make_payload(doc), dst_node_id=node_a, message_type=fm.SECAGG, group_id="x")]
    )
    _, again_doc, again = rec.replies[-1]
    assert np.array_equal(again["masked"], first)  # the recorded answer, not a fresh draw
    assert _requests(fed, "site-a", "job-replay") == before  # not charged twice
    # a redo on a new key setup: the sites refuse its key setup (their central contribution is already
    # released)
    with pytest.raises(AlreadyReleased, match="already released their masked contribution"):
        secure_sum(d, "central", attempt=1)
    log = (tmp_path / "out" / "progress.jsonl").read_text()
    assert ALREADY_RELEASED in log
    for s in fed.sites:
        assert len(_requests(fed, s.site_id, "job-replay")) == 1


def test_per_site_release_is_refused_for_a_secure_job_before_any_charge(fed: Any, tmp_path: Path) -> None:
    signed, _ = sign_job_file(fed, secure_job(), "job-mode")
    grid = harness(fed)
    node_a = next(n for n, node in grid.nodes.items() if "site-a" in str(node.node_config))
    from flwr.app import Message

    msg = Message(fm.make_payload({"job": signed}), dst_node_id=node_a, message_type=fm.CENTRAL, group_id="x")
    grid.push_messages([msg])
    rep = grid._replies.popitem()[1]
    assert rep.has_error() and "per-site" in rep.error.reason
    assert _requests(fed, "site-a", "job-mode") == []


def test_the_coordinator_refuses_a_secure_job_past_a_worst_case_cap_before_any_release(
    tmp_path: Path,
) -> None:
    from feta_release.policy.errors import JobDoesNotFit

    fed = make_federation(
        tmp_path / "fed",
        policy_overrides={"site-b": {"secure_aggregation": {"max_worst_case_epsilon": 0.05}}},
    )
    signed, _ = sign_job_file(fed, secure_job(), "job-cap")
    grid = harness(fed)
    with pytest.raises(JobDoesNotFit, match="secure_aggregation.max_worst_case_epsilon"):
        _run(fed, grid, signed, tmp_path / "out")
    assert fm.SECAGG not in [m.metadata.message_type for m in grid.sent]
    for s in fed.sites:
        assert _requests(fed, s.site_id, "job-cap") == []


def test_a_split_view_through_the_nodes_gets_too_few_key_shares_when_the_epsilon_counts_two_shares(
    fed: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Threshold 2 of 3, no colluders (2 (t - k) = 4 > 3: the site counts 2 honest shares). A lying
    coordinator tells site-a and site-c that site-c is alive (their seed shares of c) and site-b that it
    dropped (b's share of c's mask key): it gets ONE key share of site-c, below the threshold, so c's pairwise
    masks stay unknown and its vector is never alone; asking site-a again for c's key share is refused (one
    unmask per sum)."""
    from feta_release.federation.secagg import SecAggCoordinator

    signed, _ = sign_job_file(fed, secure_job(secagg_threshold=2), "job-split-view")
    grid = harness(fed)
    rec = Recorder(grid)
    nodes = {s.site_id: 100 + i for i, s in enumerate(fed.sites)}
    a, b, c = nodes["site-a"], nodes["site-b"], nodes["site-c"]
    honest = SecAggCoordinator.collect_masked

    def split(self: SecAggCoordinator, vectors: Any) -> Any:
        req = honest(self, vectors)
        req[b] = ([a, b], [c])  # site-b is told that c dropped
        return req

    monkeypatch.setattr(SecAggCoordinator, "collect_masked", split)
    with pytest.raises(Exception):  # noqa: B017 - the lie leaves the coordinator nothing it can decode
        _run(fed, grid, signed, tmp_path / "out")
    unmasks = [
        (n, d) for n, d, _ in rec.replies if d.get("stage") == "unmask" and d.get("phase") == "central"
    ]
    key_shares_of_c = [n for n, d in unmasks if n == b and str(c) in d["shares"]]
    seed_shares_of_c = [n for n, d in unmasks if n in (a, c) and str(c) in d["shares"]]
    assert key_shares_of_c == [b] and sorted(seed_shares_of_c) == sorted([a, c])  # 1 key share < threshold 2
    collect = next(m for m in grid.sent if m.metadata.dst_node_id == a and _stage(m) == "unmask")
    doc, _ = fm.read_payload(collect.content)
    from flwr.app import Message

    again = {**doc, "active": [a, b], "dead": [c]}
    grid.push_messages([Message(fm.make_payload(again), dst_node_id=a, message_type=fm.SECAGG, group_id="x")])
    rep = grid._replies.popitem()[1]
    # refused: the sum's state (and its ECDH secrets) is gone after the unmask stage
    assert rep.has_error() and "no key setup" in rep.error.reason
    ev = events_from_list(_requests(fed, "site-c", "job-split-view")[0]["events"])[0]
    # what site_epsilons counts
    assert isinstance(ev, SkellamEvent) and ev.mu == pytest.approx(2 * ev.mu_worst)
