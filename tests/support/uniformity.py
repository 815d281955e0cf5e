"""The coordinator's view of a site under secure aggregation: its masked vector, uniform mod 2^64 whatever the
data. The masks come from fresh OS keys every run (no seed fixes them), so each check is a statistical test
that a correct mask fails by chance; the checks of one test are held to one family-wise error rate."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import stats

# A correct mask fails a whole family of checks with probability at most this (Bonferroni): about once in a
# million test runs. A mask that leaves any structure (a stuck bit, the data in the high bits, a tenth of the
# coordinates unmasked) has a KS distance far above the critical one at the vectors' sizes (>= ~0.07 at a
# thousand entries) and fails with p ~ 0.
FAMILY_ALPHA = 1e-6


def uniform_p_values(vectors: Sequence[np.ndarray]) -> list[float]:
    """Kolmogorov-Smirnov p-value of each vector's residues as fractions of 2^64 against U[0, 1)."""
    return [float(stats.kstest(v.astype(np.float64) / 2.0**64, "uniform").pvalue) for v in vectors]


def assert_uniform_mod_2_64(vectors: Sequence[np.ndarray], family_alpha: float = FAMILY_ALPHA) -> None:
    """Every vector uniform mod 2^64: each KS test at ``family_alpha / len(vectors)``, so that the family's
    chance of a false failure is at most ``family_alpha`` however many vectors a test checks."""
    assert vectors, "no masked vector to check"
    assert all(v.dtype == np.uint64 for v in vectors)
    level = family_alpha / len(vectors)
    p = uniform_p_values(vectors)
    assert min(p) > level, (
        f"a masked vector is not uniform mod 2^64: KS p-values {p}, each must be > {level:.2g}"
    )
