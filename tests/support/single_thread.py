"""Tiny-model tests run faster on one intra-op thread: with two threads on a busy machine, OpenMP
synchronisation dominated (measured 12x slower per step). Restored afterwards for other tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
