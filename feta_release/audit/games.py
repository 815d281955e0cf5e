"""The audit games: the project's REAL mechanisms run on canary data only (never a site's images), so the
audit's own output is not a release.

One-shot mechanisms (central mean, central mode, frequency statistics): a worst-case neighbouring pair
D = {blank image} and D' = D + {canary}, where the canary has the largest contribution the mechanism's
sensitivity allows (an all-white image: its clipped vector has norm exactly C, it moves every mode pixel, and
every feature vector has norm 1 anyway). The mechanism runs ``trials`` times on each; a one-dimensional score
(the output projected on the canary's direction) feeds a threshold test, whose threshold is chosen on the first
half of the runs and evaluated on the second half with Clopper-Pearson bounds. Runs use q = 1 (no sampling):
the claimed ε is that of ONE unsampled release at the preset's σ, which is what the runs measure.

DP-SGD: the one-run audit of Steinke, Nasr & Jagielski (2023) through the project's own ``DPSGDTrainer``
(Poisson sampling, per-example clipping, Gaussian noise): m white-box Dirac canaries (example i's gradient is
C·e_i, so canaries do not interfere), each included with probability 1/2, trained for the preset's steps at its
σ and q; the auditor sees every noisy gradient (the DP-SGD threat model allows that) and scores canary i by the
sum of coordinate i over the steps.

``noise_factor`` and ``record_copies`` exist to BREAK a mechanism on purpose (noise scaled down; one record
contributing several examples, i.e. a sensitivity that ignores how much one person adds): the tests use them to
show that an audit has the power to catch such a bug. A real audit leaves both at 1.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from collections.abc import Callable

import numpy as np

from ..accounting import PrivacyEvent, epsilon
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
    """(D, D'): a blank image, and the blank image plus the canary (``record_copies`` times: a broken unit)."""
    blank, canary = np.zeros((1, *SHAPE), np.float32), np.ones((record_copies, *SHAPE), np.float32)
    d0 = (blank, np.zeros(1, np.int64))
    d1 = (np.concatenate([blank, canary]), np.zeros(1 + record_copies, np.int64))
    return d0, d1


def _central_scores(kind: str, sigma: float, trials: int, seed: int, record_copies: int) -> tuple[np.ndarray, ...]:
    from ..mechanisms.central import central_images

    out = []
    for i, (x, y) in enumerate(_pair(record_copies)):
        n_public = 1 + record_copies  # public and the same for both neighbours; batch = n_public: q = 1
        rel, _ = central_images(x, y, 1, kind=kind, rounds=trials, batch=n_public, sigma=sigma,
                                n_public=n_public, rng=np.random.default_rng([seed, i]), bins=2 if kind == "mode" else None)
        flat = rel.values.reshape(trials, -1)
        # mean: the canary direction is all-ones; mode: how many pixels came out white.
        out.append(flat.sum(axis=1) if kind == "mean" else (flat > 0.5).sum(axis=1).astype(np.float64))
    return out[0], out[1]


def _frequency_scores(sigma: float, trials: int, seed: int, record_copies: int, features: int = 64
                      ) -> tuple[np.ndarray, ...]:
    import torch

    from ..mechanisms.frequency import frequency_statistics, rff_features, rff_frequencies

    direction = rff_features(np.ones((1, int(np.prod(SHAPE))), np.float32),
                             rff_frequencies(int(np.prod(SHAPE)), features)).numpy()[0]
    out = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny products: thread start-up would cost 10x the arithmetic
    try:
        for i, (x, y) in enumerate(_pair(record_copies)):
            gen = np.random.default_rng([seed, i])
            s = np.empty(trials)
            for t in range(trials):
                rel, _ = frequency_statistics(x, y, 1, features=features, sigma=sigma, n_public=2, rng=gen)
                s[t] = float(rel.embedding[:, 0] @ direction)
            out.append(s)
    finally:
        torch.set_num_threads(threads)
    return out[0], out[1]


def audit_one_shot(mechanism: str, sigma: float, *, trials: int, delta: float, accountant: str = "rdp",
                   seed: int = 0, confidence: float = 0.95, noise_factor: float = 1.0, record_copies: int = 1
                   ) -> AuditResult:
    """Audit one unsampled release of ``mechanism`` ("central mean" | "central mode" | "frequency") at σ."""
    t0 = time.perf_counter()
    run_sigma = sigma * noise_factor
    scorers: dict[str, Callable[[], tuple[np.ndarray, ...]]] = {
        "central mean": lambda: _central_scores("mean", run_sigma, trials, seed, record_copies),
        "central mode": lambda: _central_scores("mode", run_sigma, trials, seed, record_copies),
        "frequency": lambda: _frequency_scores(run_sigma, trials, seed, record_copies),
    }
    null, alt = scorers[mechanism]()
    h = trials // 2
    threshold = best_threshold(null[:h], alt[:h], delta)
    bound, detail = threshold_bound(null[h:], alt[h:], threshold, delta, confidence)
    stage = "frequency" if mechanism == "frequency" else "central"
    event = PrivacyEvent(stage, sigma, 1.0, 1)
    return AuditResult(mechanism, epsilon([event], delta, accountant), bound, delta, confidence, trials, METHOD_CP,
                       event.to_dict(), time.perf_counter() - t0, detail)


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

        def __call__(self, model: Any, x: torch.Tensor, y: torch.Tensor, rand: dict[str, torch.Tensor]) -> torch.Tensor:
            return (model(x) * x).sum()

    base = JobConfig()
    cfg = dataclasses.replace(base, dpsgd=dataclasses.replace(base.dpsgd, clip=float(clip), physical_batch=256))
    gen = torch.Generator().manual_seed(seed)
    return DPSGDTrainer(Weights(), cfg, sigma, q, gen, loss=DotLoss())


def audit_dpsgd_one_run(sigma: float, q: float, steps: int, *, canaries: int = 1000, delta: float,
                        accountant: str = "rdp", seed: int = 0, confidence: float = 0.95, clip: float = 1.0,
                        noise_factor: float = 1.0, record_copies: int = 1) -> AuditResult:
    """One training run with ``canaries`` Dirac canaries at the preset's σ, q and steps (see module docstring)."""
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
    return AuditResult("DP-SGD", epsilon([event], delta, accountant), bound, delta, confidence, 1, METHOD_ONE_RUN,
                       event.to_dict(), time.perf_counter() - t0,
                       {**detail, "canaries": canaries, "included": int(included.sum())})
