"""Finding F2: a site's Poisson subsample included a record with probability ABOVE the charged q.

Attack (on the accounting): every site-side draw was ``uniform < q`` on a float grid. torch.rand's float32 is
k / 2^24, so P(join) = ceil(q·2^24) / 2^24, up to 6e-8 above q (1.3 % above at q = 1e-6); numpy's random() is
k / 2^53, so P(join) = ceil(q·2^53) / 2^53 > q off the grid. The accountant charges q, which then
under-counts. Now every draw goes through ``mechanisms.poisson.poisson_mask``: float64 uniforms on the 2^-53
grid (checked here for numpy and torch), joined iff u < floor(q·2^53) / 2^53, so P(join) = floor(q·2^53) /
2^53 <= q exactly.

The exact tests feed grid points (stubbed uniforms of the dtype each draw asks for) either side of q: a draw
that includes the grid point k makes P(join) >= (k + 1) / 2^bits, which must not exceed q."""

from __future__ import annotations

import ast
import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import binomtest

import feta_release.mechanisms.central as central
import feta_release.mechanisms.skellam as sk
from feta_release.errors import PrivacyError
from feta_release.mechanisms.poisson import inclusion_threshold, poisson_mask
from feta_release.mechanisms.secure_sums import central_contribution
from feta_release.training.dpsgd import patient_batch, poisson_sample

ROOT = Path(__file__).resolve().parents[2]
OFF_GRID = [0.1, 1 / 3, 1e-6, 0.3, 2**-40 * 1.5 + 2**-60]  # off both grids: the old draws joined above q
ON_GRID = [0.5, 0.75, 1.0, 2**-53, 3 * 2**-20]


def _bits(dtype: torch.dtype | None) -> int:
    # mantissa bits, implicit 1 in
    return {torch.float32: 24, torch.float64: 53}[dtype or torch.get_default_dtype()]


def _last_below(q: float, bits: int) -> int:
    """The largest grid point k / 2^bits strictly below q (a draw of u < q includes it)."""
    return math.ceil(Fraction(q) * 2**bits) - 1


class GridGenerator(np.random.Generator):
    """A numpy Generator whose random() returns fixed points of the 2^-53 grid (normal() returns zeros, so an
    included record shows in the sums); everything else is the real generator."""

    def __init__(self, ks: list[int]) -> None:
        super().__init__(np.random.PCG64(0))
        self.ks = ks

    def random(self, size: Any = None, dtype: Any = np.float64, out: Any = None) -> Any:
        n = int(np.prod(size))
        return np.array([self.ks[i % len(self.ks)] / 2.0**53 for i in range(n)], dtype=np.float64).reshape(
            size
        )

    def normal(self, loc: Any = 0.0, scale: Any = 1.0, size: Any = None) -> Any:
        return np.zeros(size)


def _torch_grid_rand(q: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.rand returns, for the dtype asked, the last grid point below q (k / 2^24 for float32, k / 2^53
    for float64): the old float32 draw then joined with probability ceil(q·2^24) / 2^24."""

    def rand(*size: Any, generator: Any = None, dtype: torch.dtype | None = None, **_: Any) -> torch.Tensor:
        bits = _bits(dtype)
        return torch.full(size, _last_below(q, bits) / 2.0**bits, dtype=dtype or torch.get_default_dtype())

    monkeypatch.setattr(torch, "rand", rand)


def _implied_rate_ok(included: bool, q: float, bits: int) -> bool:
    """A draw that includes the grid point k = last below q joins with probability >= (k + 1) / 2^bits."""
    return not included or Fraction(_last_below(q, bits) + 1, 2**bits) <= Fraction(q)


# -- the uniforms really are on the 2^-53 grid, using all 53 bits
# ----------------------------------------------


@pytest.mark.parametrize("source", ["numpy", "torch"])
def test_float64_uniforms_are_k_over_2_to_the_53(source):
    if source == "numpy":
        u = np.random.default_rng(5).random(400_000)
    else:
        u = torch.rand(400_000, generator=torch.Generator().manual_seed(5), dtype=torch.float64).numpy()
    k = u * 2.0**53
    assert (k == np.floor(k)).all() and (u >= 0).all() and (u < 1).all()
    odd = (k.astype(np.uint64) & np.uint64(1)).mean()  # the lowest bit is used: not a coarser grid
    assert 0.49 < odd < 0.51 and u.max() > 1 - 1e-4


# -- the exact threshold
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("q", OFF_GRID + ON_GRID)
def test_numpy_draw_joins_exactly_the_grid_points_below_floor_q(q):
    m = math.floor(Fraction(q) * 2**53)
    assert Fraction(m, 2**53) <= Fraction(q) and inclusion_threshold(q) == m / 2.0**53
    assert poisson_mask(2, q, GridGenerator([m - 1, m])).tolist() == [True, False]


@pytest.mark.parametrize("q", OFF_GRID + ON_GRID)
def test_torch_draw_is_float64_and_joins_exactly_below_floor_q(q, monkeypatch):
    m = math.floor(Fraction(q) * 2**53)
    seen = []

    def rand(*size: Any, generator: Any = None, dtype: Any = None, **_: Any) -> torch.Tensor:
        seen.append(dtype)
        return torch.tensor([(m - 1) / 2.0**53, m / 2.0**53], dtype=torch.float64)

    monkeypatch.setattr(torch, "rand", rand)
    assert poisson_mask(2, q, torch.Generator()).tolist() == [True, False] and seen == [torch.float64]


@pytest.mark.parametrize("q", OFF_GRID)
def test_dpsgd_poisson_sample_joins_at_most_q(q, monkeypatch):
    """Fails on the old float32 draw: it includes ceil(q·2^24)/2^24 - 2^-24 < q, so P(join) > q."""
    _torch_grid_rand(q, monkeypatch)
    for rows in (None, 16):
        idx = poisson_sample(8, q, torch.Generator(), rows)
        assert _implied_rate_ok(idx.numel() > 0, q, 53), f"q = {q!r}: joined with probability above q"


@pytest.mark.parametrize("q", OFF_GRID)
def test_patient_batch_joins_each_patient_at_most_q(q, monkeypatch):
    _torch_grid_rand(q, monkeypatch)
    rows_of = [torch.tensor([0, 1]), torch.tensor([2])]
    img, _ = patient_batch(rows_of, q, 2, torch.Generator(), 4)
    assert _implied_rate_ok(img.numel() > 0, q, 53)


@pytest.mark.parametrize("kind", ["mean", "mode"])
@pytest.mark.parametrize("n_public", [3, 10])
def test_central_images_join_at_most_q(kind, n_public, monkeypatch):
    """q = 1 / n_public (1/3, 1/10: off the grid); each uniform is the last grid point below q. Fails on the
    old ``gen.random(n) < q``, which included it (P(join) = ceil(q·2^53) / 2^53 > q)."""
    q = 1 / n_public
    seen: list[int] = []
    for name in ("_class_sums", "_class_histograms"):
        real = getattr(central, name)
        monkeypatch.setattr(central, name, lambda v, *a, _r=real: (seen.append(len(v)), _r(v, *a))[1])
    x, y = np.ones((4, 1, 4, 4), np.float32), np.zeros(4, np.int64)
    central.central_images(
        x,
        y,
        1,
        kind=kind,
        rounds=1,
        batch=1,
        sigma=1.0,
        n_public=n_public,
        rng=GridGenerator([_last_below(q, 53)]),
    )
    assert seen and _implied_rate_ok(sum(seen) > 0, q, 53)


def test_secure_central_contribution_joins_at_most_q(monkeypatch):
    q, seen = 1 / 3, []
    real = sk.quantize_records
    monkeypatch.setattr(sk, "quantize_records", lambda recs, *a: (seen.append(len(recs)), real(recs, *a))[1])
    x, y = np.ones((4, 1, 4, 4), np.float32), np.zeros(4, np.int64)
    central_contribution(
        x,
        y,
        1,
        rounds=1,
        batch=1,
        sigma=1.0,
        clip=None,
        downsample=0.5,
        n_public=3,
        n_sites=2,
        modulus_bits=32,
        rng=GridGenerator([_last_below(q, 53)]),
    )
    assert _implied_rate_ok(sum(seen) > 0, q, 53)


# -- every site-side draw goes through poisson_mask ----------------------------------------------------------

# Uniform comparisons that are not a charged subsample: conditional rounding (its bias is covered by the
# rounded norm bound), an audit game's canary coin, the label dropout of the loss.
# Uniform draws that are not a subsample of private data: rounding, canaries, the loss's noise levels, the
# rule itself, and the generator of public procedural images (it draws shapes, never private records).
NOT_SUBSAMPLES = {
    "feta_release/mechanisms/skellam.py",
    "feta_release/audit/games.py",
    "feta_release/models/edm.py",
    "feta_release/mechanisms/poisson.py",
    "feta_release/data/procedural.py",
}


def _uniform_comparisons(path: Path) -> list[int]:
    out = []
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                f = side.func if isinstance(side, ast.Call) else None
                if isinstance(f, ast.Attribute) and f.attr in ("rand", "random", "rand_like"):
                    out.append(node.lineno)
    return out


def test_no_other_module_compares_a_uniform_draw_with_a_rate():
    files = [p for d in ("feta_release", "edge", "coordinator") for p in (ROOT / d).rglob("*.py")]
    found = {
        f"{p.relative_to(ROOT)}:{line}"
        for p in files
        if str(p.relative_to(ROOT)) not in NOT_SUBSAMPLES
        for line in _uniform_comparisons(p)
    }
    assert not found, f"Poisson draws outside mechanisms.poisson.poisson_mask: {sorted(found)}"


# -- the law
# -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["numpy", "torch"])
def test_the_rate_is_q_binomial_test(source):
    """2,000,000 draws at q = 0.3 (fixed seed): the count is Binomial(n, q) (two-sided exact test)."""
    q, n = 0.3, 2_000_000
    gen: Any = np.random.default_rng(11) if source == "numpy" else torch.Generator().manual_seed(11)
    count = int(poisson_mask(n, q, gen).sum())
    assert binomtest(count, n, q).pvalue > 1e-4


@settings(max_examples=300, deadline=None)
@given(
    q=st.one_of(
        st.floats(0.0, 1.0),
        st.integers(0, 2**53).map(lambda k: k / 2.0**53),
        st.integers(1, 10**6).flatmap(lambda n: st.integers(1, n).map(lambda b: b / n)),
    )
)
def test_threshold_is_the_largest_grid_point_at_most_q(q):
    t = inclusion_threshold(q)
    m = t * 2.0**53
    assert m == math.floor(m) and Fraction(t) <= Fraction(q) < Fraction(t) + Fraction(1, 2**53)
    if Fraction(q) * 2**53 == math.floor(Fraction(q) * 2**53):
        assert t == q  # on the grid: the rate is q itself
    ks = [k for k in (int(m) - 1, int(m)) if 0 <= k < 2**53]
    assert poisson_mask(len(ks), q, GridGenerator(ks)).tolist() == [k < m for k in ks]


@pytest.mark.parametrize("q", [-0.1, 1.5, float("nan"), True, "0.1"])
def test_a_rate_outside_0_1_is_refused(q):
    with pytest.raises(PrivacyError, match="Poisson sampling rate"):
        inclusion_threshold(q)


def test_a_cuda_or_foreign_generator_is_refused():
    with pytest.raises(PrivacyError, match="numpy Generator or a CPU torch.Generator"):
        poisson_mask(3, 0.5, np.random.RandomState(0))  # type: ignore[call-overload]
