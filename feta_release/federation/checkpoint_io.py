"""Crash-safe coordinator checkpoints (the training package's atomic writes, reused)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

ROUND_FILE = "rounds.pt"
WARMUP_FILE = "warmup.pt"


def atomic_write(path: Path, data: bytes) -> Path:
    from ..training.checkpoint import atomic_write_bytes

    return atomic_write_bytes(path, data)


def _save(path: Path, obj: Any) -> None:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write(path, buf.getvalue())


def _load(path: Path) -> Any:
    import torch

    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def save_round(state_dir: Path, obj: dict[str, Any]) -> None:
    _save(state_dir / ROUND_FILE, obj)


def load_round(state_dir: Path) -> dict[str, Any] | None:
    return _load(state_dir / ROUND_FILE)


def save_warmup(state_dir: Path, obj: dict[str, Any]) -> None:
    _save(state_dir / WARMUP_FILE, obj)


def load_warmup(state_dir: Path) -> dict[str, Any] | None:
    return _load(state_dir / WARMUP_FILE)
