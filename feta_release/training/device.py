"""``--device auto|cpu|cuda``: where training, DP-SGD and sampling run.

Randomness is drawn from CPU generators on every device (the same streams on any machine), and every
array written to a run directory is moved back to the CPU first; only the arithmetic moves.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str) -> torch.device:
    """``auto``: the first CUDA device when one is visible, else the CPU. ``cuda`` without one is an error."""
    if name not in DEVICES:
        raise ConfigError(f"--device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "--device cuda: no CUDA device is visible to torch (torch.cuda.is_available() is False); "
            "use --device cpu or --device auto"
        )
    return torch.device(name)
