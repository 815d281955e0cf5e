"""The one Poisson draw every site-side subsample uses: each record joins with probability AT MOST the charged
q.

Every Poisson subsample a site makes (central images and their secure sums, DP-SGD per image and per patient,
FedSGD) includes each record independently iff a uniform u lies below a threshold, and the accountant charges
the rate q. A float uniform is not a real one, so ``u < q`` is not Bernoulli(q):

  - torch.rand's default float32 is k / 2^24, k uniform on [0, 2^24) (ATen ``uniform_real``: 24 bits of one
    random()), so P(u < q) = ceil(q·2^24) / 2^24, up to 2^-24 ~ 6e-8 ABOVE q: 1.3 % above q at q = 1e-6;
  - numpy's ``Generator.random()`` is k / 2^53 ((next_uint64 >> 11)·2^-53), so P(u < q) = ceil(q·2^53) / 2^53,
    above q whenever q is off that grid (q = 0.1, say).

Here u is a float64 uniform on the 2^-53 grid, numpy (as above) or torch CPU ``torch.rand(dtype=float64)``
(ATen ``uniform_real<double>``: (random64() & (2^53 - 1))·2^-53; tests/security/test_poisson_inclusion.py
checks both grids), and a record joins iff u < t with t = floor(q·2^53) / 2^53 (exact in float64: a
power-of-two scaling, a floor, and the scaling back). Then P(join) = #{k in [0, 2^53) : k < floor(q·2^53)} /
2^53 = floor(q·2^53) / 2^53 <= q, equal to q whenever q is on the grid (every float64 q >= 1/2, every batch /
n_public with n_public a power of two <= 2^53).

Charging q for a true rate q' <= q is an upper bound. With record x, the output law at rate q' is the mixture
(1 - q'/q)·Q + (q'/q)·P_q of the law Q without x and the law P_q with x at rate q; by joint convexity of the
f-divergences (exp((α-1)·D_α), the hockey-stick), each direction's divergence at q' is at most its value at q.
So the subsampled Gaussian's (and Skellam's) RDP and (ε, δ) are nondecreasing in q, and the accountant's
charge at q covers the draw made here.

The draw's shape is the caller's, unchanged: ``rows`` uniforms (a public bucket where the caller pads),
one comparison each; the threshold depends on q alone."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, overload

import numpy as np

from ..errors import PrivacyError

if TYPE_CHECKING:
    import torch

GRID_BITS = 53  # float64 uniforms from numpy and from torch's CPU generator are k / 2^53
GRID = float(2**GRID_BITS)


def inclusion_threshold(q: float) -> float:
    """t = floor(q·2^53) / 2^53: ``u < t`` for u uniform on the 2^-53 grid has probability t <= q
    (exactly)."""
    if isinstance(q, bool) or not isinstance(q, (int, float, np.floating)) or not 0.0 <= float(q) <= 1.0:
        raise PrivacyError(
            f"Poisson sampling rate q must be a number in [0, 1], got {q!r}; check the batch and "
            "the public dataset size"
        )
    return math.floor(float(q) * GRID) / GRID


@overload
def poisson_mask(rows: int, q: float, gen: np.random.Generator) -> np.ndarray: ...
@overload
def poisson_mask(rows: int, q: float, gen: torch.Generator) -> torch.Tensor: ...


def poisson_mask(
    rows: int, q: float, gen: np.random.Generator | torch.Generator
) -> np.ndarray | torch.Tensor:
    """A boolean mask of ``rows`` independent Bernoulli draws, each True with probability floor(q·2^53)/2^53
    <= q (module docstring). ``gen``: a numpy Generator (numpy mask) or a CPU torch.Generator (torch mask)."""
    t = inclusion_threshold(q)
    if isinstance(gen, np.random.Generator):
        return gen.random(int(rows), dtype=np.float64) < t
    import torch  # lazy: the numpy mechanisms (and the light install) never load torch

    if not isinstance(gen, torch.Generator) or gen.device.type != "cpu":
        raise PrivacyError(
            f"Poisson sampling needs a numpy Generator or a CPU torch.Generator, got {gen!r}: "
            "only their float64 uniforms are known to be on the 2^-53 grid"
        )
    return torch.rand(int(rows), generator=gen, dtype=torch.float64) < t
