"""The per-site DP-SGD round's remaining work that depended on the site's exact count N.

Attack: the coordinator times the per-site round's reply (another local user reads the worker's CPU time).
After the step padding, three pieces still varied with N: the Poisson draw (``torch.rand(N)``, ~20 µs per
1,333 rows), the padded float conversion (skipped at N = n_public·2^k, one call fewer) and the padding calls
themselves (a padding call skipped the adds, loss copy and clip count of a real one, so a step's time grew
with its realised sample, whose mean is q·N). Now the draw is made over the PUBLIC bucket ``public_rows(N,
n_public)`` and the rows >= N dropped (the law over the real rows is still independent Bernoulli(q): checked
exactly and statistically), the conversion always runs, and a padding call does a real call's bookkeeping into
dropped values."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

import feta_release.training.dpsgd as dp
from feta_release.accounting import PrivacyEvent
from feta_release.mechanisms.poisson import inclusion_threshold
from feta_release.training.padding import public_rows, step_bound
from tests.support.dpsgd import random_site
from tests.support.federation import tiny_job


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 60), extra=st.integers(0, 60), q=st.floats(0.01, 1.0), seed=st.integers(0, 2**31 - 1))
def test_the_draw_over_a_public_bucket_is_the_poisson_sample_of_the_real_rows(n, extra, q, seed):
    """Exactly: real row i joins iff its own float64 uniform is below floor(q·2^53)/2^53 (independent
    Bernoulli, rate <= q: finding F2); rows >= n never do."""
    rows = n + extra
    idx = dp.poisson_sample(n, q, torch.Generator().manual_seed(seed), rows)
    u = torch.rand(rows, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    assert idx.tolist() == [i for i in range(n) if u[i] < inclusion_threshold(q)]


def test_the_sampled_sets_have_the_poisson_law_chi_square():
    """The joint law of the sampled subset of 3 real rows (drawn over a bucket of 8): every one of the 2^3
    patterns with probability q^k (1-q)^(3-k). Chi-square over 20,000 draws (fixed seed)."""
    n, rows, q, draws = 3, 8, 0.3, 20_000
    gen = torch.Generator().manual_seed(7)
    patterns = list(itertools.product((0, 1), repeat=n))
    counts = dict.fromkeys(patterns, 0)
    for _ in range(draws):
        idx = set(dp.poisson_sample(n, q, gen, rows).tolist())
        assert idx <= set(range(n))
        counts[tuple(int(i in idx) for i in range(n))] += 1
    expected = [draws * q ** sum(p) * (1 - q) ** (n - sum(p)) for p in patterns]
    assert chisquare([counts[p] for p in patterns], expected).pvalue > 1e-3


_WORK: dict[tuple[int, int], dict[str, Any]] = {}


def _round_work(n: int, seed: int, n_public: int = 20) -> dict[str, Any]:
    """Run ``edge.releases.dpsgd_round`` on ``n`` images (public size ``n_public``) and count its N-timing
    work: the Poisson draws' sizes, the image conversions (calls and rows), and how each clipped sum is used
    (cached: the rounds take seconds)."""
    if (n, seed) not in _WORK:
        with pytest.MonkeyPatch.context() as mp:
            _WORK[(n, seed)] = _counted_round(mp, n, seed, n_public)
    return _WORK[(n, seed)]


def _counted_round(monkeypatch: pytest.MonkeyPatch, n: int, seed: int, n_public: int) -> dict[str, Any]:
    from edge.releases import dpsgd_round

    work: dict[str, Any] = {"draws": [], "convert_calls": 0, "convert_rows": 0, "sum_reads": []}
    rand, from_numpy, clip_and_sum = torch.rand, torch.from_numpy, dp.clip_and_sum

    def counted_rand(*a: Any, **k: Any) -> torch.Tensor:
        # the Poisson draw: one int size (the loss draws pass a shape tuple; the engine's build-time
        # cross-check draws its 2 public dummy images as rand(2, C, H, W))
        if len(a) == 1 and isinstance(a[0], int):
            work["draws"].append(a[0])
        return rand(*a, **k)

    def counted_from_numpy(a: np.ndarray) -> torch.Tensor:
        if a.shape[1:] == (1, 16, 16):  # image arrays (not weights or labels)
            work["convert_calls"] += 1
            work["convert_rows"] += int(a.shape[0])
        return from_numpy(a)

    class Reads(dict):
        reads: int

        def __getitem__(self, key: str) -> torch.Tensor:
            self.reads += 1
            return super().__getitem__(key)

    def counted_clip_and_sum(grads: Any, clip: float, **kw: Any) -> Any:
        summed, norms = clip_and_sum(grads, clip, **kw)
        r = Reads(summed)
        r.reads = 0
        work["sum_reads"].append(r)
        return r, norms

    monkeypatch.setattr(torch, "rand", counted_rand)
    monkeypatch.setattr(torch, "from_numpy", counted_from_numpy)
    monkeypatch.setattr(dp, "clip_and_sum", counted_clip_and_sum)
    cfg = tiny_job(dpsgd={"batch": 4, "physical_batch": 4})
    ds, weights = random_site(n, seed, cfg)
    dpsgd_round(
        ds,
        cfg,
        copy.deepcopy(weights),
        PrivacyEvent("dpsgd", 1.5, 4 / n_public, 2),
        torch.Generator().manual_seed(seed),
        n_public,
    )
    work["sum_reads"] = sorted({r.reads for r in work["sum_reads"]})
    return work


def test_the_rounds_draw_and_conversion_do_not_depend_on_n_within_a_bucket():
    """N = 11, 16 and 20 (= the public size) against public size 20: the same draw size (the bucket, 20) every
    step and the same conversion calls and rows: the rows the two steps index (each step's public bound, in
    chunks of the physical batch), converted as they are indexed, never a pass over the exact N."""
    seen = []
    for n, seed in ((11, 0), (16, 1), (20, 2)):
        w = _round_work(n, seed)
        seen.append((tuple(w["draws"]), w["convert_calls"], w["convert_rows"]))
    assert len(set(seen)) == 1 and seen[0][0] == (public_rows(11, 20),) * 2, seen
    assert seen[0][2] == 2 * step_bound(20, 4 / 20, 4), seen


def test_a_site_above_its_public_size_draws_over_its_bucket():
    w = _round_work(27, 3)
    bound = step_bound(40, 4 / 20, 4)  # the bucket's step bound, not the public size's
    assert w["draws"] == [40, 40] and w["convert_rows"] == 2 * bound


def test_a_padding_call_does_the_bookkeeping_of_a_real_call():
    """Every clipped sum of a step, real or padding, is read for every parameter (added into a total), so that
    a step's time does not grow with how many of its calls are real (its realised sample)."""
    from feta_release.models import build_denoiser

    n_params = sum(p.requires_grad for p in build_denoiser(tiny_job().model, (1, 16, 16), 10).parameters())
    for n, seed in ((11, 0), (20, 2), (27, 3)):
        assert _round_work(n, seed)["sum_reads"] == [n_params]
