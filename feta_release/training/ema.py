"""Exponential moving average of a model's parameters (the weights every stage carries forward)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class EMA:
    """Shadow copy of ``model``'s floating-point parameters and buffers.

    ``update()`` after each optimiser step applies ``shadow = d * shadow + (1 - d) * param`` with
    ``d = min(decay, (1 + t) / (10 + t))`` when ``warmup`` is on (t = updates so far). The warm-up
    matters at CPU scale: with decay 0.999 and only a few hundred steps, a plain EMA would still be
    mostly the random initialisation (0.999^300 = 0.74), so the carried-forward weights would be junk.
    """

    def __init__(self, model: nn.Module, decay: float, *, warmup: bool = True) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay = float(decay)
        self.warmup = warmup
        self.num_updates = 0
        self.model = model
        self.shadow: dict[str, torch.Tensor] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def current_decay(self) -> float:
        if not self.warmup:
            return self.decay
        t = self.num_updates
        return min(self.decay, (1.0 + t) / (10.0 + t))

    def update(self, model: nn.Module | None = None) -> None:
        """Fold the current weights of ``model`` (default: the model given at construction) in."""
        model = self.model if model is None else model
        d = self.current_decay()
        # no_grad blocks, not torch's decorator (it made both methods Any to mypy, their callers unchecked);
        # not inference mode: the shadow is loaded into a model that goes on training (copy_to)
        with torch.no_grad():
            for k, v in model.state_dict().items():
                s = self.shadow[k]
                if s.dtype.is_floating_point:
                    s.mul_(d).add_(v.detach(), alpha=1.0 - d)
                else:  # integer buffers (e.g. BatchNorm counters) are copied, not averaged
                    s.copy_(v)
        self.num_updates += 1

    def copy_to(self, model: nn.Module | None = None) -> None:
        model = self.model if model is None else model
        with torch.no_grad():
            model.load_state_dict(self.shadow)

    def state_dict(self) -> dict[str, Any]:
        return {
            "decay": self.decay,
            "warmup": self.warmup,
            "num_updates": self.num_updates,
            "shadow": {k: v.clone() for k, v in self.shadow.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decay = float(state["decay"])
        self.warmup = bool(state["warmup"])
        self.num_updates = int(state["num_updates"])
        missing = set(self.shadow) ^ set(state["shadow"])
        if missing:
            raise ValueError(f"EMA state does not match the model (keys differ: {sorted(missing)[:5]})")
        for k, v in state["shadow"].items():
            self.shadow[k].copy_(v)
