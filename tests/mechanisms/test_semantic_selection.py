"""Semantic selection of the public set (``[public] selection``, mechanisms/selection.py): the noisy
histogram's sensitivity and noise, the rule that keeps public groups, the planner's event, the ledger's and
the policy's refusals, and what a site accepts (centroids, never a public image)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.config import JobConfig, load_preset
from feta_release.data.procedural import generate_dataset
from feta_release.errors import ConfigError, PolicyError, PrivacyError
from feta_release.ledger import Budget, Ledger
from feta_release.mechanisms import selection as sel
from feta_release.mechanisms.secure_sums import secagg_warmup_events
from feta_release.planning import plan, secure_stage_events, stage_events
from feta_release.stages.pretrain import PublicInputs, selected, selection_groups, with_public


@pytest.fixture(scope="module")
def strokes():
    return generate_dataset("strokes", 64, size=28, seed=4)


def _cfg(public, **over) -> JobConfig:
    base = with_public(
        load_preset("tiny").replace(public={"pretrain_iterations": 4, "pretrain_batch": 16}),
        PublicInputs(public),
        (1, 28, 28),
    )
    return base.replace(public={"selection": True, "selection_groups": 4, **over})


images = st.integers(1, 12).flatmap(
    lambda n: st.lists(st.lists(st.floats(0, 1, width=32), min_size=16, max_size=16), min_size=n, max_size=n)
)


@settings(max_examples=60, deadline=None)
@given(images, st.integers(1, 6), st.integers(0, 2**31 - 1), st.data())
def test_one_image_added_or_removed_moves_exactly_one_count_by_one(rows, k, seed, data):
    """Sensitivity 1 (L1 and L2) under add/remove of one image, for ANY centroids (a coordinator's too)."""
    x = np.asarray(rows, dtype=np.float32).reshape(-1, 1, 4, 4)
    centroids = np.random.default_rng(seed).uniform(-1, 2, size=(k, sel.feature_dim((1, 4, 4))))
    full = sel.vote_counts(x, centroids)
    assert full.sum() == len(x) and (full >= 0).all()
    drop = data.draw(st.integers(0, len(x) - 1))
    rest = np.delete(x, drop, axis=0)
    diff = full - (sel.vote_counts(rest, centroids) if len(rest) else np.zeros(k, dtype=np.int64))
    assert sorted(diff.tolist()) == [0] * (k - 1) + [1]


def test_the_histogram_noise_is_gaussian_with_std_sigma_per_group(strokes):
    """The released counts minus the exact counts: mean 0, std sigma in every group (4,000 draws, bounds at
    about 5 standard errors)."""
    centroids, _ = sel.public_groups(strokes.images, 4, 0)
    x = generate_dataset("strokes", 30, size=28, seed=8).images
    exact = sel.vote_counts(x, centroids)
    rng = np.random.default_rng(123)
    draws = np.stack([sel.selection_histogram(x, centroids, 7.0, rng)[0] - exact for _ in range(4000)])
    assert np.abs(draws.mean(0)).max() < 5 * 7.0 / np.sqrt(4000)
    assert np.abs(draws.std(0) / 7.0 - 1).max() < 0.06
    assert sel.selection_histogram(x, centroids, 7.0, rng)[1] == sel.selection_event(7.0)
    with pytest.raises(PrivacyError, match="integer seeds are refused"):
        sel.selection_histogram(x, centroids, 7.0, 5)  # type: ignore[arg-type]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(-50, 500), min_size=2, max_size=8), st.floats(0.01, 1.0), st.integers(0, 1000))
def test_the_kept_groups_are_the_highest_noisy_counts_and_cover_the_fraction(hist, keep, seed):
    k = len(hist)
    group = np.random.default_rng(seed).integers(0, k, size=50)
    kept = sel.select_groups(np.array(hist), group, keep)
    assert len(kept) >= keep * len(group) - 1e-9 or len(kept) == len(group)
    chosen = set(group[kept].tolist())
    others = [hist[g] for g in range(k) if g not in chosen and (group == g).any()]
    assert all(hist[g] >= max(others) for g in chosen) if others else True
    assert np.array_equal(kept, np.flatnonzero(np.isin(group, list(chosen))))  # whole groups only


def test_the_public_groups_are_a_deterministic_function_of_the_public_set_and_seed(strokes):
    c1, g1 = sel.public_groups(strokes.images, 5, 3)
    c2, g2 = sel.public_groups(strokes.images, 5, 3)
    assert np.array_equal(c1, c2) and np.array_equal(g1, g2)
    assert (np.bincount(g1, minlength=5) > 0).all()
    assert c1.shape == (5, sel.feature_dim((1, 28, 28)))
    with pytest.raises(Exception, match="selection_groups"):
        sel.public_groups(strokes.images[:3], 5, 3)


def test_the_selection_reads_nothing_private_beyond_the_noisy_histogram(strokes):
    """What pretraining gets is a function of the public set, the job and the released histogram: two private
    sets with the same released histogram select the same public images; a different histogram may not."""
    cfg = _cfg(strokes)
    pub = PublicInputs(strokes)
    centroids, groups = selection_groups(pub, cfg)
    released = np.array([40.0, -3.0, 12.0, 7.5])
    a = selected(pub, cfg, released, groups).data
    b = selected(pub, cfg, released.copy(), groups).data
    assert a is not None and b is not None
    assert a.fingerprint() == b.fingerprint() and a.n < strokes.n
    other = selected(pub, cfg, released[::-1].copy(), groups).data
    assert other is not None and other.fingerprint() != a.fingerprint()


def test_the_config_is_off_by_default_validated_and_hashes_as_before_when_off(strokes):
    cfg = with_public(load_preset("tiny"), PublicInputs(strokes), (1, 28, 28))
    assert not cfg.public.selection and "selection" not in cfg.to_dict()["public"]
    assert _cfg(strokes).to_dict()["public"]["selection_groups"] == 4
    with pytest.raises(ConfigError, match=r"give the public set \(--public PATH\)"):
        with_public(load_preset("tiny").replace(public={"selection": True}), None, (1, 28, 28))
    with pytest.raises(ConfigError, match="pretrain_iterations > 0 or selection = false"):
        _cfg(strokes, pretrain_iterations=0)
    with pytest.raises(ConfigError, match=r"selection_groups must be >= 2 and at most .* count \(64\)"):
        _cfg(strokes, selection_groups=65)
    with pytest.raises(ConfigError, match="selection_keep"):
        _cfg(strokes, selection_keep=0.0)
    with pytest.raises(ConfigError, match="selection_sigma"):
        _cfg(strokes, selection_sigma=-1.0)


def test_the_planner_charges_the_selection_first_and_it_composes_into_the_one_epsilon(strokes):
    cfg = _cfg(strokes, selection_sigma=3.0)
    plain = cfg.replace(public={"selection": False})
    events = stage_events(cfg, 240)
    assert events[0] == sel.selection_event(3.0) and events[1:] == stage_events(plain, 240)[:1] + events[2:]
    assert [e.stage for e in events] == ["selection"] + [e.stage for e in stage_events(plain, 240)]
    p = plan(cfg.replace(dpsgd={"noise_multiplier": 2.0}), 240)
    assert p.stage("selection").epsilon > 0 and p.stage("selection").sigma == 3.0
    assert p.epsilon > plan(plain.replace(dpsgd={"noise_multiplier": 2.0}), 240).epsilon
    assert "4 public groups" in p.stage("selection").note
    # a secure-aggregation job charges the selection as its Skellam secure sum, first as well
    secure = cfg.replace(federation={"sites": ["a", "b"], "secure_aggregation": True})
    warm = secagg_warmup_events(secure, 240, (1, 28, 28), 10, 2, 0)
    assert secure_stage_events(secure, 240, warm)[0] == warm[0] != sel.selection_event(3.0)
    assert warm[0].stage == "selection"


def test_the_ledger_refuses_a_selection_over_the_budget_naming_the_rule(tmp_path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from feta_release.errors import BudgetExceededError

    budget = Budget(job_epsilon=0.5, lifetime_epsilon=10.0, delta=1e-5, accountant="rdp")
    with Ledger(tmp_path / "l.sqlite", key=Ed25519PrivateKey.generate()) as led:
        with pytest.raises(BudgetExceededError, match="budget.per_job.epsilon"):
            led.charge("j", "j:selection:0", "selection", [sel.selection_event(0.5)], budget)
        assert led.requests("j") == []
        led.charge("j", "j:selection:0", "selection", [sel.selection_event(50.0)], budget)  # fits: charged
        assert [r["mechanism"] for r in led.requests("j")] == ["selection"]


def test_a_policy_without_a_selection_rule_refuses_it_naming_the_fix():
    from feta_release.policy import check_request
    from feta_release.policy.document import SitePolicy
    from tests.support.policy import keys, policy_doc

    k = keys()
    mech = policy_doc(k)["mechanisms"]

    def pol(selection=None):
        m = {**mech, **({"selection": selection} if selection else {})}
        doc = policy_doc(k, mechanisms=m)
        if selection is None:
            del doc["mechanisms"]["selection"]  # a policy from before the mechanism existed: allows none
        return SitePolicy.from_document(doc, None)

    assert not pol().mechanisms["selection"].allowed
    with pytest.raises(PolicyError, match=r"mechanisms.selection.allowed.*\[public\] selection = false"):
        check_request(pol(), sel.selection_event(20.0), require_job=False)
    with pytest.raises(PolicyError, match="mechanisms.selection.min_sigma"):
        check_request(pol({"allowed": True, "min_sigma": 30.0}), sel.selection_event(20.0), require_job=False)
    check_request(pol({"allowed": True, "min_sigma": 10.0}), sel.selection_event(20.0), require_job=False)


def test_a_site_refuses_centroids_that_are_not_the_jobs_or_carry_images():
    with pytest.raises(PrivacyError, match="centroids"):
        sel.check_centroids(np.zeros((4, 10)), 4, (1, 28, 28))
    with pytest.raises(PrivacyError, match="NaN"):
        sel.check_centroids(np.full((4, 64), np.nan), 4, (1, 28, 28))
    assert sel.check_centroids(np.zeros((4, 64), np.float32), 4, (1, 28, 28)).shape == (4, 64)
