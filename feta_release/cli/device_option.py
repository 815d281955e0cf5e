"""One form of ``--device auto|cpu|cuda`` wherever the computation can move (``train``, ``coordinator run``,
``node start``): the same choices, default and help shape; resolved by ``training.device.resolve_device``
where each command computes. The choices are ``training.device.DEVICES`` spelled out, not imported: that
module loads torch (the stage layer imports at module top), and a CPU node's supervising process must start
without it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

CHOICES = ("auto", "cpu", "cuda")  # = training.device.DEVICES (tests/cli/test_cli_consistency.py checks both)


def device_option(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add ``--device`` (the function gets ``device: str``, default ``cpu``); ``what`` says what runs
    there."""
    return click.option(
        "--device",
        type=click.Choice(list(CHOICES)),
        default="cpu",
        show_default=True,
        help=f"Where {what} run (auto: CUDA when visible).",
    )
