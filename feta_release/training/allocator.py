"""Keep freed heap pages mapped between DP-SGD chunks (glibc malloc settings), for the DP-SGD engine.

Why: every physical chunk of a DP-SGD step allocates its per-example gradients afresh (chunk x parameters
floats: 20 MB for 32 examples of the 160k-parameter UNet) and frees them after the clip. glibc serves blocks
of that size by ``mmap`` or trims them off the top of the heap when they are freed, so the pages go back to
the kernel and the next chunk faults them in again, zero-filled: 36,000 minor faults a step at the cpu-eps1
preset's B = 250, K = 1, physical batch 32, against 10,700 for the non-private step of the same batch, and
~0.05 s of system time a step (``bench/bench_dpsgd.py``; docs/evaluation.md, "DP-SGD step cost"). With the
mmap threshold at glibc's maximum and trimming off, a freed block stays on the heap and the next chunk reuses
pages that are already mapped.

Cost: the process keeps its peak heap (RSS no longer shrinks after a step); the peak itself does not grow. The
setting is process-wide and made once; only glibc has it (elsewhere, e.g. musl or macOS, this is a no-op and
the allocator keeps its own policy). It changes no value anywhere: only where freed memory goes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

__all__ = ["keep_freed_pages"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
# glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit): blocks above it still use mmap,
# and no per-example gradient tensor of the presets comes near it (the largest: 32 x 9,216 floats, 1.2 MB)
_MMAP_THRESHOLD = 32 * 1024 * 1024
_TRIM_THRESHOLD = 1 << 30  # give memory back only beyond 1 GiB free at the heap top

_state: dict[str, bool] = {}


def keep_freed_pages() -> bool:
    """Set glibc's malloc to keep freed pages mapped (once per process). True if the setting is in force."""
    if "set" not in _state:
        _state["set"] = _set_glibc_options()
    return _state["set"]


def _set_glibc_options() -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; both or the setting is only half there (reported as not in force)
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) & bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )
