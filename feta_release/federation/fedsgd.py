"""The coordinator's side of FedSGD over secure aggregation (``[federation] fedsgd``;
docs/secure-aggregation.md).

Each round is ONE pooled DP-SGD step: the global weights go to every site with the masking stage of the
round's secure sum (phase ``dpsgd``, round id ``JOB:dpsgd:ROUND:ATTEMPT``); each site returns its
clipped-gradient sum plus its Skellam noise share, masked (edge/fedsgd.py). The coordinator learns the SUM
only, decodes it (centre mod m, divide by the scale), divides by the PUBLIC expected batch sum_s q_s N_s over
the sites in the sum (N_s the public sizes, q_s = batch / N_s the planned rates), and takes the optimizer step
and the EMA update itself: the same step ``DPSGDTrainer.step`` takes on one site, with the pooled noise sigma
c (all n shares) instead of a per-site one. Its output is post-processing of the noisy sum.

A round whose key setup a site left before masking is redone under a new round id (nothing was charged); a
round decoded is checkpointed with the optimizer's state, and a restarted coordinator resumes after it. A
round the sites masked before the coordinator stopped (and so lost that setup's state) is refused a new setup
by the sites and skipped: no step, its budget spent, the job goes on.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch import nn

from ..mechanisms import secure_sums as ss
from ..planning import stage_sampling_rate
from ..training.ema import EMA
from . import checkpoint_io
from .secagg import AlreadyReleased
from .secure_collect import phase_layout, sum_with_redo

PHASE = "dpsgd"


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters in the order a FedSGD gradient vector lists them (the sites use the same)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def optimizer_for(model: nn.Module, cfg: Any) -> torch.optim.Optimizer:
    """The optimizer ``DPSGDTrainer`` uses (Adam at ``[dpsgd] lr``), over the trainable parameters."""
    return torch.optim.Adam([p for _, p in trainable(model)], lr=cfg.dpsgd.lr)


def coordinator_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, noisy_sum: np.ndarray, divisor: float
) -> None:
    """One DP-SGD step from a decoded noisy gradient SUM (flat, ``trainable`` order) and the PUBLIC
    divisor."""
    if not (np.isfinite(divisor) and divisor > 0):
        raise ValueError(f"FedSGD step: the public divisor must be > 0, got {divisor!r}")
    flat = torch.from_numpy(np.asarray(noisy_sum, dtype=np.float64))
    at = 0
    for _, p in trainable(model):
        k = p.numel()
        p.grad = (flat[at : at + k].reshape(p.shape) / divisor).to(dtype=p.dtype, device=p.device)
        at += k
    if at != flat.numel():
        raise ValueError(f"FedSGD step: a gradient of {flat.numel()} values for a model of {at}")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def expected_batch(d: Any, contributors: list[str]) -> float:
    """sum over the sites in the sum of q_s x N_s: public sizes and planned rates only, never a realised
    count."""
    b = d.cfg.dpsgd.batch
    return float(
        sum(stage_sampling_rate(b, d.sites[s].size, "dpsgd") * d.sites[s].size for s in contributors)
    )


def decode_gradient(d: Any, residues: np.ndarray) -> np.ndarray:
    """The modular sum -> the noisy clipped-gradient sum in real units (flat float64)."""
    lay = phase_layout(d, PHASE)
    # sigma: unused to decode
    params = ss.fedsgd_params(lay.block_dim, d.cfg.dpsgd.clip, 1.0, len(d.job.sites))
    return ss.decode(residues, lay, params).reshape(-1)


def run_rounds(d: Any, model: nn.Module, ema: EMA) -> int:
    """``[federation] rounds`` FedSGD rounds into ``model`` (``ema`` folded after each, a round being one
    step); returns the rounds done."""
    optimizer = optimizer_for(model, d.cfg)
    ck = checkpoint_io.load_round(d.state)
    start = 0
    if ck is not None:
        d.skipped = {int(k): list(v) for k, v in (ck.get("skipped") or {}).items()}
        model.load_state_dict(ck["model"])
        ema.load_state_dict(ck["ema"])
        optimizer.load_state_dict(ck["optimizer"])
        start = int(ck["round"])
        d.emit(PHASE, f"resuming after FedSGD round {start}")
    rounds = d.cfg.federated_rounds
    t0 = time.monotonic()
    for r in range(start, rounds):
        tr = time.monotonic()
        weights = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
        try:
            residues, contributors = sum_with_redo(d, PHASE, round_no=r, weights=weights)
        # released before a restart, undecodable now: no step, the budget is spent
        except AlreadyReleased as exc:
            d.skipped[r] = sorted(d.sites)
            d.emit(
                PHASE,
                f"FedSGD round {r + 1}/{rounds} skipped: {exc}",
                round=r + 1,
                rounds=rounds,
                error=str(exc),
            )
        else:
            coordinator_step(model, optimizer, decode_gradient(d, residues), expected_batch(d, contributors))
            ema.update(model)
            d.emit(
                PHASE,
                f"FedSGD round {r + 1}/{rounds}: secure sum of {len(contributors)} site(s)",
                round=r + 1,
                rounds=rounds,
                seconds=time.monotonic() - tr,
                sites=contributors,
            )
        checkpoint_io.save_round(
            d.state,
            {
                "model": model.state_dict(),
                "ema": ema.state_dict(),
                "optimizer": optimizer.state_dict(),
                "round": r + 1,
                "skipped": {str(k): v for k, v in d.skipped.items()},
            },
        )
    d.timings[PHASE] = time.monotonic() - t0
    return rounds
