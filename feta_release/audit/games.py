"""The audit games: the project's REAL mechanisms run on canary data only (never a site's images), so the
audit's own output is not a release.

One-shot mechanisms (central mean, central mode, frequency statistics): a worst-case neighbouring pair
D = {blank image} and D' = D + {canary}, where the canary has the largest contribution the mechanism's
sensitivity allows (an all-white image: its clipped vector has norm exactly C, it moves every mode pixel, and
every feature vector has norm 1 anyway). The mechanism runs ``trials`` times on each; a one-dimensional score
(the output projected on the canary's direction) feeds a threshold test, whose threshold is chosen on the
first half of the runs and evaluated on the second half with Clopper-Pearson bounds. Runs use q = 1 (no
sampling): the claimed ε is that of ONE unsampled release at the preset's σ, which is what the runs measure.

Central MODE: the release is an argmax per pixel, so the pair above (16 pixel values, a blank against a white
image, score = white pixels) can never reach the claim: with 2 bins the argmax sees only the DIFFERENCE of two
noisy counts (noise std sigma·sqrt(2 d) on it, against a shift of 1 per pixel), and binarising d such pixels
loses another factor 2/pi in the squared signal-to-noise ratio, so the best test on that pair is a Gaussian
test of mu = 0.56/sigma (ε 1.06 at sigma 2, delta 1e-5, against the claimed 2.17: a ratio < 1/2 with
infinitely many runs). The worst case for the released output is ONE pixel value (no downsampling, 2 bins) and
a tail threshold: D = m black one-pixel images, D' = D + one white one; the output is white iff Z1 - Z0 > m -
[canary], a threshold test on a Gaussian of mu = 1/(sigma·sqrt 2) at the point m (Neyman-Pearson: the best
test on that output). m is chosen BEFORE the evaluation runs (``mode_blanks``): from the noise scale measured
on a small pilot of separate runs (so that a mechanism with too little noise moves the threshold to where it
shows), and the number of runs; every evaluation run then evaluates (no half spent on fitting a threshold).
``mode_design="count"`` keeps the 16-pixel count test: weaker, but the one that exercises the sqrt(#pixels)
sensitivity of the mode's noise. The mode's true ε is therefore that of a Gaussian with sigma·sqrt 2 (1.36 at
sigma 2 against the claimed 2.17): its accounting as a Gaussian of sigma is an upper bound that no audit of
the released argmax can reach, and the 2x goal is met from ~2 million runs per neighbour (measured: 1M 0.47,
4M 0.53, 16M 0.59; bench/bench_audit.py, docs/audit.md). Those runs are cheap: one call of the mechanism
releases 1,000 classes, i.e. 1,000 independent one-class releases (``_mode_runs``).

DP-SGD: the one-run audit of Steinke, Nasr & Jagielski (2023) through the project's own ``DPSGDTrainer``
(Poisson sampling, per-example clipping, Gaussian noise): m white-box Dirac canaries (example i's gradient is
C·e_i, so canaries do not interfere), each included with probability 1/2, trained for the preset's steps at
its σ and q; the auditor sees every noisy gradient (the DP-SGD threat model allows that) and scores canary i
by the sum of coordinate i over the steps.

``noise_factor`` and ``record_copies`` exist to BREAK a mechanism on purpose (noise scaled down; one record
contributing several examples, i.e. a sensitivity that ignores how much one person adds): the tests use them
to show that an audit has the power to catch such a bug. A real audit leaves both at 1.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from ..accounting import Accountant, PrivacyEvent, epsilon
from .stats import best_threshold, one_run_bound, threshold_bound

SHAPE = (1, 8, 8)  # canary images: small, so thousands of runs take seconds
METHOD_CP = "threshold test on a worst-case pair, Clopper-Pearson (threshold fitted on half of the runs)"
METHOD_ONE_RUN = "one-run audit (Steinke, Nasr & Jagielski 2023), white-box Dirac gradient canaries"


@dataclass
class AuditResult:
    mechanism: str
    claimed_epsilon: float
    lower_bound: float
    delta: float
    confidence: float
    trials: int
    method: str
    event: dict[str, Any]
    seconds: float
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pair(record_copies: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """(D, D'): a blank image, and the blank image plus the canary (``record_copies`` times: a broken
    unit)."""
    blank, canary = np.zeros((1, *SHAPE), np.float32), np.ones((record_copies, *SHAPE), np.float32)
    d0 = (blank, np.zeros(1, np.int64))
    d1 = (np.concatenate([blank, canary]), np.zeros(1 + record_copies, np.int64))
    return d0, d1


def _central_scores(
    kind: Literal["mean", "mode"],
    sigma: float,
    trials: int,
    seed: int,
    record_copies: int,
    classes: int = 200,
) -> tuple[np.ndarray, ...]:
    """Scores of ``trials`` releases per neighbour; one call releases ``classes`` disjoint classes, each
    holding its own copy of the pair (independent noise per class: independent one-class releases, as in
    _mode_runs)."""
    from ..mechanisms.central import central_images

    k = min(classes, trials)
    rounds = -(-trials // k)
    out = []
    for i, (x, _y) in enumerate(_pair(record_copies)):
        n_public = k * (1 + record_copies)  # public and the same for both neighbours; batch = n_public: q = 1
        xs = np.tile(x, (k, 1, 1, 1))
        ys = np.repeat(np.arange(k, dtype=np.int64), len(x))
        rel, _ = central_images(
            xs,
            ys,
            k,
            kind=kind,
            rounds=rounds,
            batch=n_public,
            sigma=sigma,
            n_public=n_public,
            rng=np.random.default_rng([seed, i]),
            bins=2 if kind == "mode" else None,
        )
        flat = rel.values.reshape(rounds * k, -1)[:trials]
        # mean: the canary direction is all-ones; mode: how many pixels came out white.
        out.append(flat.sum(axis=1) if kind == "mean" else (flat > 0.5).sum(axis=1).astype(np.float64))
    return out[0], out[1]


MODE_SHAPE = (1, 1, 1)  # one pixel value: the mode's worst case (see the module docstring)


def mode_blanks(
    spread: float, trials: int, delta: float, confidence: float = 0.95, max_blanks: int = 2000
) -> int:
    """The number m >= 1 of black images in the mode audit's pair: the m that maximises the bound ``trials``
    runs would give if every count were at its expectation, for a noise std ``spread`` on the difference of
    the two bins (sigma·sqrt 2 for a correct mechanism): a threshold test on a Gaussian shift of 1/spread at
    m."""
    from .stats import expected_threshold_bound

    return max(
        range(1, max_blanks + 1),
        key=lambda m: expected_threshold_bound(
            _norm_sf(m / spread), _norm_sf((m - 1) / spread), trials, delta, confidence
        ),
    )


def _mode_pilot_spread(sigma: float, run_sigma: float, trials: int, seed: int) -> tuple[float, int]:
    """The std of the bins' difference, measured on pilot runs of D alone with k = 1 and k ~ the claimed
    spread black images: P[white] = Phi(-k / spread); the k whose rate is nearer Phi(-1) ~ 0.16 (where the
    rate pins the spread down best) gives the estimate. Separate runs: the evaluation's threshold never sees
    its own runs."""
    from statistics import NormalDist

    n = max(1000, trials // 40)
    best: tuple[float, float] | None = None  # (distance of the rate from 0.16, spread)
    for i, k in enumerate(sorted({1, max(1, round(sigma * math.sqrt(2.0)))})):
        rate = min(max(float(_mode_runs(k, 0, run_sigma, n, [seed, 7, i]).mean()), 0.5 / n), 0.5 - 0.5 / n)
        cand = (abs(rate - 0.16), k / -NormalDist().inv_cdf(rate))
        best = cand if best is None or cand[0] < best[0] else best
    assert best is not None
    return best[1], 2 * n


MODE_CLASSES = 1000  # one-class releases per call of the mechanism (see _mode_runs)


def _mode_runs(blanks: int, copies: int, sigma: float, trials: int, seed: list[int]) -> np.ndarray:
    """White (1) or black (0) per release of the real mode mechanism on ``blanks`` black one-pixel images plus
    ``copies`` white ones (q = 1: batch = the public size, the same for both neighbours).

    Each call releases K classes, each holding that same data: the classes are disjoint and get independent
    noise of the same std (the mechanism's parallel composition: one image touches one class), so the K class
    outputs are K independent releases of the one-class mechanism, at a thousandth of the cost of K calls."""
    from ..mechanisms.central import central_images

    k = min(MODE_CLASSES, trials)
    rounds = -(-trials // k)
    one = np.concatenate(
        [np.zeros((blanks, *MODE_SHAPE), np.float32), np.ones((copies, *MODE_SHAPE), np.float32)]
    )
    x = np.tile(one, (k, 1, 1, 1))
    y = np.repeat(np.arange(k, dtype=np.int64), len(one))
    rel, _ = central_images(
        x,
        y,
        k,
        kind="mode",
        rounds=rounds,
        batch=len(x),
        sigma=sigma,
        n_public=len(x),
        downsample=1.0,
        bins=2,
        rng=np.random.default_rng(seed),
    )
    return (rel.values.reshape(rounds * k)[:trials] > 0.5).astype(np.float64)


def _norm_sf(x: float) -> float:
    return 0.5 * math.erfc(x / math.sqrt(2.0))


def _frequency_scores(
    sigma: float, trials: int, seed: int, record_copies: int, features: int = 64, classes: int = 100
) -> tuple[np.ndarray, ...]:
    """Scores of ``trials`` releases per neighbour. One call releases ``classes`` class columns, each computed
    from its own copy of the pair with independent noise of std sigma/N (one image touches one column): the
    columns are independent one-class releases, so a call yields that many runs."""
    import torch

    from ..mechanisms.frequency import frequency_statistics, rff_features, rff_frequencies

    direction = rff_features(
        np.ones((1, int(np.prod(SHAPE))), np.float32), rff_frequencies(int(np.prod(SHAPE)), features)
    ).numpy()[0]
    k = min(classes, trials)
    calls = -(-trials // k)
    out = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny products: thread start-up would cost 10x the arithmetic
    try:
        for i, (x, _y) in enumerate(_pair(record_copies)):
            gen = np.random.default_rng([seed, i])
            xs = np.tile(x, (k, 1, 1, 1))
            ys = np.repeat(np.arange(k, dtype=np.int64), len(x))
            s = np.empty((calls, k))
            for t in range(calls):
                rel, _ = frequency_statistics(xs, ys, k, features=features, sigma=sigma, n_public=2, rng=gen)
                s[t] = direction @ rel.embedding
            out.append(s.reshape(-1)[:trials])
    finally:
        torch.set_num_threads(threads)
    return out[0], out[1]


def audit_one_shot(
    mechanism: str,
    sigma: float,
    *,
    trials: int,
    delta: float,
    accountant: Accountant = "rdp",
    seed: int = 0,
    confidence: float = 0.95,
    noise_factor: float = 1.0,
    record_copies: int = 1,
    mode_design: str = "tail",
) -> AuditResult:
    """Audit one unsampled release of ``mechanism`` ("central mean" | "central mode" | "frequency") at σ.
    ``mode_design``: "tail" (the one-pixel tail test, tight) or "count" (the 16-pixel count test)."""
    t0 = time.perf_counter()
    run_sigma = sigma * noise_factor
    scorers: dict[str, Callable[[], tuple[np.ndarray, ...]]] = {
        "central mean": lambda: _central_scores("mean", run_sigma, trials, seed, record_copies),
        "central mode": lambda: _central_scores("mode", run_sigma, trials, seed, record_copies),
        "frequency": lambda: _frequency_scores(run_sigma, trials, seed, record_copies),
    }
    detail: dict[str, Any]  # threshold_bound's figures, plus the tail test's pair and pilot
    if mechanism == "central mode" and mode_design == "tail":  # the test is fixed before the evaluation runs
        spread, pilot = _mode_pilot_spread(sigma, run_sigma, trials, seed)
        blanks = mode_blanks(spread, trials, delta, confidence)
        null = _mode_runs(blanks, 0, run_sigma, trials, [seed, 0])
        alt = _mode_runs(blanks, record_copies, run_sigma, trials, [seed, 1])
        bound, detail = threshold_bound(null, alt, 0.5, delta, confidence)
        detail = {
            **detail,
            "pair": f"{blanks} black one-pixel images, and the same + {record_copies} white",
            "pilot_runs": pilot,
            "pilot_spread": spread,
        }
    else:
        null, alt = scorers[mechanism]()
        h = trials // 2
        threshold = best_threshold(null[:h], alt[:h], delta, confidence=confidence)
        bound, detail = threshold_bound(null[h:], alt[h:], threshold, delta, confidence)
    stage = "frequency" if mechanism == "frequency" else "central"
    event = PrivacyEvent(stage, sigma, 1.0, 1)
    return AuditResult(
        mechanism,
        epsilon([event], delta, accountant),
        bound,
        delta,
        confidence,
        trials,
        METHOD_CP,
        event.to_dict(),
        time.perf_counter() - t0,
        detail,
    )


def _canary_trainer(m: int, sigma: float, q: float, clip: float, seed: int) -> Any:
    """The project's DPSGDTrainer on a model whose only parameter is w in R^m, with a per-example loss
    <w, x>: example x's gradient is x itself, so a canary x = C·e_i has a gradient of norm exactly C."""
    import torch

    from ..config import JobConfig
    from ..training.dpsgd import DPSGDTrainer

    class Weights(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(m))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w

    class DotLoss:  # the PerExampleLoss protocol of training.dpsgd
        def draw(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
            return {"unused": torch.zeros(n)}

        def __call__(
            self, model: Any, x: torch.Tensor, y: torch.Tensor, rand: dict[str, torch.Tensor]
        ) -> torch.Tensor:
            return (model(x) * x).sum()

    base = JobConfig()
    cfg = dataclasses.replace(
        base, dpsgd=dataclasses.replace(base.dpsgd, clip=float(clip), physical_batch=256)
    )
    gen = torch.Generator().manual_seed(seed)
    return DPSGDTrainer(Weights(), cfg, sigma, q, gen, loss=DotLoss())


def audit_dpsgd_one_run(
    sigma: float,
    q: float,
    steps: int,
    *,
    canaries: int = 1000,
    delta: float,
    accountant: Accountant = "rdp",
    seed: int = 0,
    confidence: float = 0.95,
    clip: float = 1.0,
    noise_factor: float = 1.0,
    record_copies: int = 1,
) -> AuditResult:
    """One training run with ``canaries`` Dirac canaries at the preset's σ, q and steps (see module
    docstring)."""
    import torch

    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    included = rng.random(canaries) < 0.5
    ids = np.repeat(np.flatnonzero(included), record_copies)  # a broken unit: one record, several examples
    x = torch.zeros((len(ids), canaries))
    x[torch.arange(len(ids)), torch.from_numpy(ids)] = clip
    y = torch.zeros(len(ids), dtype=torch.int64)
    trainer = _canary_trainer(canaries, sigma * noise_factor, q, clip, seed)
    scores = torch.zeros(canaries, dtype=torch.float64)
    for _ in range(steps):
        grads, _stats = trainer.noisy_gradient(x, y)
        scores += grads["w"].double()  # white box: the auditor sees every privatised gradient
    bound, detail = one_run_bound(scores.numpy(), included, delta, confidence)
    event = PrivacyEvent("dpsgd", sigma, q, steps)
    return AuditResult(
        "DP-SGD",
        epsilon([event], delta, accountant),
        bound,
        delta,
        confidence,
        1,
        METHOD_ONE_RUN,
        event.to_dict(),
        time.perf_counter() - t0,
        {**detail, "canaries": canaries, "included": int(included.sum())},
    )
