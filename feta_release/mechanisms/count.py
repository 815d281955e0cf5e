"""The public dataset size of a single-site run without a declared one: a Gaussian mechanism on the count.

Every rate, denominator and size that leaves a site is public; with a signed policy (or ``--public-size``) it
is the declaration. Without one, ``train`` used to round the EXACT count to 2 significant digits: a
deterministic, un-noised function of N, so neighbouring datasets at a rounding boundary (3949 vs 3950 images)
gave different releases (epsilon infinite for that bit). Here the count gets Gaussian noise first (sensitivity
1: adding or removing one image changes N by 1), the event ``size`` is charged in the run's ledger before
anything else is released, and the rounding is post-processing of that release. A patient-level run without a
declared patient count draws that count the same way (event ``patients``, sensitivity 1 patient).

``SIZE_SIGMA`` = 50 (noise std 50 images): its RDP cost alpha / (2 sigma^2) adds 0.0034 to cpu-eps1's epsilon
at the same DP-SGD sigma (0.0007 to cpu-eps10-nodpsgd; 0.115 alone at delta 1e-5), while the noise is within
the 2 significant digits' rounding step (100) for any dataset of 10,000 images or more, and 1.25 % of 4,000
images.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..accounting import PrivacyEvent
from ..errors import PrivacyError
from ._checks import require_generator

SIZE_STAGE = "size"
PATIENTS_STAGE = "patients"  # the public patient count of a patient-level run without a declared one
SIZE_SIGMA = 50.0  # the noise multiplier (= noise std in images, sensitivity 1); fixed and public
MIN_PUBLIC_SIZE = 10  # the smallest public size a draw gives (a noisy count can be tiny or negative)


def size_event(unit: str = "image") -> PrivacyEvent:
    """The privacy event of one noisy count (no sampling, one composition)."""
    return PrivacyEvent(SIZE_STAGE, SIZE_SIGMA, 1.0, 1, unit=unit)


def patients_event() -> PrivacyEvent:
    """The event of the noisy PATIENT count (sensitivity 1 patient: one patient added or removed)."""
    return PrivacyEvent(PATIENTS_STAGE, SIZE_SIGMA, 1.0, 1, unit="patient")


def noisy_count(n: int, rng: np.random.Generator, sigma: float = SIZE_SIGMA) -> float:
    """``n`` + N(0, sigma^2): the Gaussian mechanism on a count of L2 sensitivity 1. ``rng``: the run's secret
    generator (an integer seed is refused: a known seed makes the noise subtractable)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise PrivacyError(f"noisy count: the count must be an integer >= 0, got {n!r}")
    if not (math.isfinite(sigma) and sigma > 0):
        raise PrivacyError(f"noisy count: sigma must be a finite number > 0, got {sigma!r}")
    gen = require_generator(rng, "noisy count")
    return float(n) + float(sigma) * float(gen.standard_normal())


def public_size_from(noisy: float) -> int:
    """Post-processing of the noisy count: 2 significant digits, at least ``MIN_PUBLIC_SIZE``."""
    if not math.isfinite(noisy):
        raise PrivacyError(f"noisy count: not a finite number ({noisy!r})")
    v = max(MIN_PUBLIC_SIZE, int(round(noisy)))
    if v < 100:
        return max(MIN_PUBLIC_SIZE, int(round(v, -1)))
    return int(round(v, -(len(str(v)) - 2)))


def draw_public_size(n: int, rng: np.random.Generator, sigma: float = SIZE_SIGMA) -> int:
    """The public size released for a dataset of ``n`` images: rounded noisy count (charge ``size_event``
    first)."""
    return public_size_from(noisy_count(n, rng, sigma))


def counted_events(events: Iterable[Any]) -> list[PrivacyEvent]:
    """The noisy counts among a job's charged ``events`` (stages ``size`` / ``patients``): a site that drew
    its public size for a job (``feta-release train`` without a declared size) charged them first, under the
    job's id; the planner counts them first in that job's history (``planning.stage_events(size=...)``)."""
    return [e for e in events if isinstance(e, PrivacyEvent) and e.stage in (SIZE_STAGE, PATIENTS_STAGE)]
