"""Crash-safe coordinator checkpoints: the training package's atomic torch writer and its reader, reused.

The coordinator's state directory is its own, but a checkpoint is read weights-only anyway: resuming needs
tensors and plain values, nothing a file could run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..training.checkpoint import load_torch, save_torch

ROUND_FILE = "rounds.pt"
WARMUP_FILE = "warmup.pt"


def _load(path: Path) -> Any:
    return load_torch(path, weights_only=True) if path.exists() else None


def save_round(state_dir: Path, obj: dict[str, Any]) -> None:
    save_torch(state_dir / ROUND_FILE, obj)


def load_round(state_dir: Path) -> dict[str, Any] | None:
    return _load(state_dir / ROUND_FILE)


def save_warmup(state_dir: Path, obj: dict[str, Any]) -> None:
    save_torch(state_dir / WARMUP_FILE, obj)


def load_warmup(state_dir: Path) -> dict[str, Any] | None:
    return _load(state_dir / WARMUP_FILE)
