"""The coordinator folds its global model into training/ema.py's EMA once per round (no second EMA of its own)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from feta_release.federation.driver import round_ema

from tests.support.federation import tiny_job


def test_round_ema_is_the_per_step_ema_over_a_rounds_local_steps():
    """One fold per round with decay d**L equals the hand-rolled EMA the driver carried before (d**L, no warm-up),
    and integer buffers are copied, not averaged."""
    cfg = tiny_job(dpsgd={"ema": 0.9}, federation={"local_steps": 3})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    ema, old = round_ema(model, cfg), copy.deepcopy(model)
    decay = 0.9 ** 3
    for _ in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
            model[1].num_batches_tracked += 5
        ema.update(model)
        with torch.no_grad():
            for pe, pm in zip(old.state_dict().values(), model.state_dict().values()):
                if pe.dtype.is_floating_point:
                    pe.mul_(decay).add_(pm, alpha=1 - decay)
                else:
                    pe.copy_(pm)
    for k, v in old.state_dict().items():
        assert torch.allclose(ema.shadow[k], v), k
    assert int(ema.shadow["1.num_batches_tracked"]) == 20
