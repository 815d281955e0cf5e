"""The semantic selection as a secure sum (``mechanisms.secure_sums``): a site's integer input is exactly its
scaled votes (the conditionally rounded one-hot records) plus its Skellam noise share, one image moves one
count by 2^10, the decoded sum carries the pooled noise sigma per group, and the planner's selection event in
a secure job is the Skellam event the distributed-noise accountant prices."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.accountants.skellam import honest_shares, skellam_epsilon, skellam_event
from feta_release.accounting import (
    SkellamEvent,
    epsilon,
    group_epsilon,
    patient_epsilon,
    worst_case_epsilon,
)
from feta_release.config import JobConfig, load_preset
from feta_release.data.procedural import generate_dataset
from feta_release.errors import PrivacyError
from feta_release.mechanisms import secure_sums as ss
from feta_release.mechanisms import selection as sel
from feta_release.mechanisms import skellam as sk
from feta_release.planning import secure_stage_events, stage_event
from feta_release.stages.pretrain import PublicInputs, with_public

S = 2**ss.SCALE_BITS
SHAPE = (1, 4, 4)

images = st.integers(1, 10).flatmap(
    lambda n: st.lists(st.lists(st.floats(0, 1, width=32), min_size=16, max_size=16), min_size=n, max_size=n)
)


def _centroids(k: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 2, size=(k, sel.feature_dim(SHAPE)))


class _NoNoise(np.random.Generator):
    """A generator whose Poisson draws are all 0: the contribution's noiseless part, to compare exactly."""

    def poisson(self, lam, size=None):  # type: ignore[override]
        return np.zeros(size, dtype=np.int64)


@settings(max_examples=60, deadline=None)
@given(images, st.integers(2, 8), st.integers(0, 2**31 - 1), st.data())
def test_a_sites_input_is_its_rounded_one_hot_records_and_one_image_moves_one_count_by_the_scale(
    rows, k, seed, data
):
    """Exact sensitivity Delta2 = Delta1 = s after scaling, whatever the centroids; the charged bounds are
    at least that."""
    x = np.asarray(rows, dtype=np.float32).reshape(-1, *SHAPE)
    c = _centroids(k, seed)
    params = ss.selection_params(k, 20.0, 3)
    noiseless = ss.selection_contribution(x, c, sigma=20.0, n_sites=3, rng=_NoNoise(np.random.PCG64(seed)))
    # the generic quantization of the one-hot records (clip 1, scale s, conditional rounding) gives the same
    one_hot = np.eye(k)[sel.nearest_group(sel.features(x), c)]
    assert np.array_equal(noiseless, sk.quantize_records(one_hot, params, np.random.default_rng(seed)))
    assert np.array_equal(noiseless, S * sel.vote_counts(x, c))
    drop = data.draw(st.integers(0, len(x) - 1))
    rest = np.delete(x, drop, axis=0)
    less = (
        ss.selection_contribution(rest, c, sigma=20.0, n_sites=3, rng=_NoNoise(np.random.PCG64(seed)))
        if len(rest)
        else np.zeros(k, dtype=np.int64)
    )
    diff = noiseless - less
    assert sorted(diff.tolist()) == [0] * (k - 1) + [S]  # L2 = L1 = s exactly
    event = skellam_event(params, "selection", 1.0, 1, 3)
    assert event.l2 >= S and event.l1 >= S and event.l2 < S * 1.001


@settings(max_examples=6, deadline=None)
@given(st.integers(2, 4), st.floats(2.0, 30.0), st.integers(0, 2**31 - 1))
def test_the_decoded_sum_carries_the_pooled_noise_sigma_per_group_and_each_share_its_nth(
    n_sites, sigma, seed
):
    """n sites, each adding its share Sk((sigma s)^2 / n) to 2^10 x its votes: the decoded sum minus the
    exact total votes has mean 0 and std sigma in every group; one site's share alone std sigma / sqrt(n).
    3,000 sums of 4 groups; bounds at about 6 standard errors."""
    rng = np.random.default_rng(seed)
    k, draws = 4, 3000
    c = _centroids(k, seed)
    sites = [rng.uniform(0, 1, size=(5 + i, *SHAPE)).astype(np.float32) for i in range(n_sites)]
    exact = sum(sel.vote_counts(x, c) for x in sites)
    noise, shares = np.empty((draws, k)), np.empty((draws, k))
    for t in range(draws):
        inputs = [ss.selection_contribution(x, c, sigma=sigma, n_sites=n_sites, rng=rng) for x in sites]
        residues = sk.modular_sum([sk.to_modular(v, 64) for v in inputs], 64)
        noise[t] = ss.decode_selection(residues, k, sigma, n_sites) - exact
        shares[t] = (inputs[0] - S * sel.vote_counts(sites[0], c)) / S
    se = sigma / np.sqrt(draws)
    assert np.abs(noise.mean(0)).max() < 6 * se
    assert np.abs(noise.std(0) / sigma - 1).max() < 6 / np.sqrt(2 * draws)
    assert np.abs(shares.std(0) / (sigma / np.sqrt(n_sites)) - 1).max() < 6 / np.sqrt(2 * draws)


def _cfg(**over) -> JobConfig:
    strokes = generate_dataset("strokes", 64, size=28, seed=4)
    base = with_public(
        load_preset("tiny").replace(public={"pretrain_iterations": 4, "pretrain_batch": 16}),
        PublicInputs(strokes),
        (1, 28, 28),
    )
    return base.replace(
        public={"selection": True, "selection_groups": 4, "selection_sigma": 6.0},
        federation={"sites": ["a", "b", "c"], "secure_aggregation": True, "rounds": 2, "local_steps": 2},
        **over,
    )


@pytest.mark.parametrize("colluders", [0, 1])
def test_a_secure_jobs_selection_event_is_the_skellam_sum_of_the_sites_shares(colluders):
    cfg = _cfg()
    warm = ss.secagg_warmup_events(cfg, 240, (1, 28, 28), 10, 3, colluders)
    ev = warm[0]
    params = ss.selection_params(4, 6.0, 3)
    h = honest_shares(3, 3, colluders)
    assert isinstance(ev, SkellamEvent) and ev == skellam_event(params, "selection", 1.0, 1, h)
    assert params.mu == pytest.approx((6.0 * S) ** 2) and ev.mu_worst == pytest.approx(params.mu / 3)
    # the distributed-noise accountant: the same figure accountants.skellam computes from the parameters
    assert epsilon([ev], 1e-5) == pytest.approx(skellam_epsilon(params, 1.0, 1, 1e-5, h), rel=1e-9)
    assert worst_case_epsilon([ev], 1e-5) == pytest.approx(skellam_epsilon(params, 1.0, 1, 1e-5, 1), rel=1e-9)
    # an image-level release: a patient-level site counts it by group privacy over its patient cap
    per_patient = patient_epsilon([ev], 1e-5, 4)
    assert per_patient == pytest.approx(group_epsilon([ev], 1e-5, 4)) and per_patient > epsilon([ev], 1e-5)
    events = secure_stage_events(cfg, 240, warm)
    assert events[0] == ev and stage_event(events, "dpsgd") is not None
    # DP-SGD is calibrated over the history the ledger holds, the Skellam selection included
    assert epsilon(events, 1e-5) == pytest.approx(cfg.privacy.epsilon, rel=0.02)
    assert epsilon(events, 1e-5) <= cfg.privacy.epsilon + 1e-9


def test_a_secure_history_without_the_selection_is_refused():
    cfg = _cfg()
    warm = ss.secagg_warmup_events(cfg, 240, (1, 28, 28), 10, 3, 0)
    with pytest.raises(PrivacyError, match="holds no selection event"):
        secure_stage_events(cfg, 240, warm[1:])


def test_the_decoded_sum_refuses_a_vector_of_the_wrong_length():
    with pytest.raises(PrivacyError, match="4 uint64 residues"):
        ss.decode_selection(np.zeros(5, np.uint64), 4, 6.0, 3)
