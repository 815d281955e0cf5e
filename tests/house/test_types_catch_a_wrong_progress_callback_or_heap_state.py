"""The sampler's ``progress`` callback and the allocator's per-process state are typed, so mypy catches a
callback of the wrong shape (the sampler calls it with (images done, images in all)) and a wrong value kept
as the heap setting. Untyped, both were ``Any``: mypy passed either, and the first showed only when a draw
called the callback, the second when a stage end trimmed the heap."""

from __future__ import annotations

from pathlib import Path

from tests.support.mypy_run import mypy_report

WRONG = """
from feta_release import allocator
from feta_release.models.sampler import generate


def draw(denoiser, cfg) -> None:  # type: ignore[no-untyped-def]
    generate(denoiser, 1, 0, cfg, progress=lambda done: None)  # the sampler passes two counts


def keep() -> None:
    allocator._state.setting = "kept"  # a HeapSetting or None
"""

RIGHT = """
from feta_release import allocator
from feta_release.models.sampler import generate
from feta_release.progress_events import Meter


def draw(denoiser, cfg) -> None:  # type: ignore[no-untyped-def]
    generate(denoiser, 1, 0, cfg, progress=Meter(None, "sampling", "images", 10))
    generate(denoiser, 1, 0, cfg, progress=lambda done, total: None)


def keep() -> None:
    allocator._state.setting = allocator.HeapSetting(False, "off")
"""


def test_mypy_refuses_a_wrong_progress_callback_and_a_wrong_heap_setting(tmp_path: Path) -> None:
    out = mypy_report(tmp_path, "wrong", WRONG)
    assert 'Argument "progress" to "generate"' in out, out
    assert 'Incompatible types in assignment (expression has type "str"' in out, out
    right = mypy_report(tmp_path, "right", RIGHT)
    assert right.strip().startswith("Success"), right
