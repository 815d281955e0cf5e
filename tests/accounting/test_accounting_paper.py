"""Reproducing DP-FETA's published DP-SGD noise multipliers (paper Table 5, MNIST, epsilon = 1).

Published setting: N = 55,000 training images, delta = 1e-5, DP-SGD batch 4096 (q = 4096/55000), central batch
6000 with sigma_c = 5, one central image per class per round (10 classes: rounds = images / 10).  Table 5:

    central images   0     50    500   750   1000  1250
    sigma_f          12.8  13.2  16.1  19.1  24.4  40.0

Findings (RDP, opacus orders, Balle et al. 2020 conversion; the paper states it uses RDP):

* The step count is not the 2.2K of Table 8: with q = 4096/55000, 2,200 steps need sigma = 14.2 and 150 epochs
  (2,014 steps, DPDM's setting) need 13.6.  sigma = 12.8 is reproduced by ~1,775-1,800 steps (~133 epochs);
  we document T = 1,790.
* With that T the smallest warm-up (50 images) gives 13.09 against the published 13.2 (about one rounding
  unit); larger warm-ups diverge when the central sampling rate is 6000/55000 (500 images: 16.9 vs 16.1; 1,250
  images alone spend eps 1.03 > 1, while the paper reports 40.0).
* The published large-warm-up figures are consistent with a central sampling rate of 6000/60000 (the batch
  taken over MNIST's full 60,000 training images): then every row is within 6 % of the paper.
An opacus-style coarse search (``get_noise_multiplier``: doubling from 10, bisection until eps is within 0.01
of the target) on that rate lands exactly on 40.0 for 1,250 images, but gives 13.1 / 15.9 for 50 / 500.
No standard setting we tried (N in {55k, 60k} for either stage, Mironov or Balle conversion, integer or
fractional orders, PRV) reproduces all six rows to the paper's rounding.
"""

from __future__ import annotations

import pytest

from feta_release.accounting import PrivacyEvent, calibrate_noise_multiplier, epsilon
from feta_release.errors import PrivacyError

N = 55_000
DELTA = 1e-5
Q_SGD = 4096 / N
SIGMA_C = 5.0
STEPS = 1790  # reproduces the no-warm-up 12.8 (see module docstring)
PAPER = {0: 12.8, 50: 13.2, 500: 16.1, 750: 19.1, 1000: 24.4, 1250: 40.0}


def sigma_for(images: int, q_central: float, steps: int = STEPS) -> float:
    prior = [PrivacyEvent("central", SIGMA_C, q_central, images // 10)] if images else []
    # tol 0.001 so that the comparison at the paper's one-decimal rounding is not decided by the tolerance
    return calibrate_noise_multiplier(prior, Q_SGD, steps, 1.0, DELTA, tol=0.001)


def test_no_warmup_sigma_is_reproduced() -> None:
    assert round(sigma_for(0, 6000 / N), 1) == PAPER[0]


def test_table8_step_counts_do_not_give_12_8() -> None:
    assert round(sigma_for(0, 6000 / N, steps=2200), 1) == 14.2  # Table 8's "2.2K iterations"
    assert round(sigma_for(0, 6000 / N, steps=2014), 1) == 13.6  # 150 epochs of 55,000 at batch 4096


def test_small_warmup_matches_within_rounding() -> None:
    s50 = sigma_for(50, 6000 / N)
    assert abs(s50 - PAPER[50]) <= 0.15  # 13.09: within about one unit of the paper's last digit
    assert s50 > sigma_for(0, 6000 / N)  # the warm-up's cost moves DP-SGD noise up


def test_large_warmups_with_q_6000_of_55000_diverge_from_the_paper() -> None:
    assert round(sigma_for(500, 6000 / N), 1) == 16.9  # paper: 16.1
    spent = epsilon([PrivacyEvent("central", SIGMA_C, 6000 / N, 125)], DELTA)
    assert spent > 1.0  # 1,250 central images alone exceed epsilon = 1 at this rate
    with pytest.raises(PrivacyError, match="warm-up"):
        sigma_for(1250, 6000 / N)


def test_all_rows_close_with_central_rate_over_60000() -> None:
    for images, published in PAPER.items():
        ours = sigma_for(images, 6000 / 60_000)
        assert abs(ours - published) / published < 0.06, (images, ours, published)
