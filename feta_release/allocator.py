"""Keep freed heap pages mapped for the life of the process (glibc malloc settings), set at process start.

Why: training and sampling allocate the same large tensors again at every step (activations, their gradients,
per-example gradients, optimiser temporaries: megabytes each) and free them at the step's end. glibc's malloc
gives such memory back to the kernel as soon as it is freed: a block above its mmap threshold (dynamic,
from 128 KiB up to 32 MiB) is its own ``mmap`` and is unmapped on free, and the free space at the top of the
heap is trimmed once it passes the trim threshold (twice the mmap threshold). The next step then faults
every page in again, zero-filled by the kernel: the system time of a fault per 4 KiB page, every step.
Measured on the derived job of 4,000 64x64 images on 2 CPU cores: 728 million minor faults and 1,454 s of
system time against 1,935 s of user time in a 31 min ``train``; ``bench/bench_page_faults.py`` measures it on
a short piece of the same work (docs/results.md, "Speed, memory and the test suite").

What: no block gets its own ``mmap`` (``M_MMAP_MAX`` = 0), and the heap is trimmed only beyond 1 GiB free at
its top, so a freed block stays in the heap and the next step's blocks reuse pages that are already mapped.
Raising the mmap threshold is not enough: glibc refuses one above 32 MiB, and the largest blocks of the
derived 64 px job are above it (the aux generator's activations, 100 x 32 x 64 x 64 floats = 52 MB, and the
sampler's at its batch of 256, 67 MB): with the threshold at 32 MiB the aux fit still faulted 2.6 of its 3.5
million pages (``bench/bench_page_faults.py``). The threshold is still fixed at that maximum (which also stops
its dynamic moves) for a process where another library sets ``M_MMAP_MAX`` again.

Cost: freed pages stay resident. Within a stage that is the point (its steps reuse them); across stages the
holes one stage left in the heap add to the next stage's blocks when their sizes differ (measured: the peak
RSS of a process running warm-up, aux fit and sampling rose from 2.0 to 3.1 GiB). So the end of each stage
that allocates large blocks (``train_denoiser``, an aux fit, an aux-generator draw, ``generate``) hands its
free pages back with :func:`release_freed_pages` (glibc's ``malloc_trim``), after its own large locals are
freed (a block still referenced at the trim becomes a resident hole when it is freed after it): the next stage
faults in what it uses once. With the trims that process peaked at 2.6 GiB, still above glibc's own 2.0 (a
stage's holes fragment its own heap), for 4 s of system time instead of 24 and 2.5 million faults instead of
16.1; the node's stages, each in its own process, peak within 0-5 % of glibc's own (``bench/site_scale.py``).
A transient that is large because a stage did at once what it can do in parts is cut into the parts: the cell
prototypes drew 1,024 64 px aux images in one pass (~4 GiB of activations, kept until the next stage's end:
6.1 GiB at the peak of a reduced 64 px ``train`` against 4.3 under glibc's own policy); aux draws now run in
passes of ``training.frequency.AUX_DRAW_BATCH`` images, and that ``train`` peaks at 3.0-3.2 GiB
(docs/derived-job.md, "Page faults"). The setting is process-wide, made once, and changes no value anywhere:
only where freed memory goes. The C library is loaded once, by the setting, and every trim calls it.

Under a data limit (a site's computing processes: the warm worker and a per-message ClientApp run under the
policy's ``resources.max_worker_memory_mb`` as RLIMIT_DATA, ``edge/resources.py``) large blocks keep their own
mapping: RLIMIT_DATA counts the heap's address space, not its resident pages, so a large block freed below a
live one would leave a hole that still counts (``malloc_trim`` hands back pages, not address space), and a
stage that fitted under glibc's own policy could fail part-way, after its release was charged. There only
the threshold is fixed at 32 MiB and the trim threshold raised (``under_data_limit=True``): blocks up to
32 MiB are reused from the heap, larger ones are mapped and unmapped as glibc does.

Where: the entry of every process that trains or samples calls :func:`keep_freed_pages` first: the
command line (``feta_release.cli.main``: ``train``, ``demo``, ``coordinator run``, ``node start``,
``synthesize``, ...), the node's warm worker (``edge.worker``) and per-message ClientApp (``edge.trust``), the
coordinator's ServerApp (``coordinator.serverapp``); the DP-SGD engine calls it too
(``training.dpsgd.batch_gradients``), for a library caller.

Off: ``FETA_KEEP_FREED_PAGES=0`` in the environment leaves glibc's policy as it is (child processes inherit
it). Only glibc has these settings: elsewhere (musl, macOS) this is a no-op and the allocator keeps its own
policy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from dataclasses import dataclass

__all__ = ["ENV_SWITCH", "HeapSetting", "heap_setting", "keep_freed_pages", "release_freed_pages"]

ENV_SWITCH = "FETA_KEEP_FREED_PAGES"  # "0" (or "off", "no", "false"): leave glibc's malloc policy as it is

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # glibc <malloc.h>
# glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit)
_MMAP_THRESHOLD = 32 * 1024 * 1024
_TRIM_THRESHOLD = 1 << 30  # give memory back only beyond 1 GiB free at the heap top
_LIMITED_OPTIONS = (
    ("M_MMAP_THRESHOLD", _M_MMAP_THRESHOLD, _MMAP_THRESHOLD),
    ("M_TRIM_THRESHOLD", _M_TRIM_THRESHOLD, _TRIM_THRESHOLD),
)
# no block mapped on its own: every one comes from the heap (not under a data limit: the module's docstring)
_OPTIONS = (*_LIMITED_OPTIONS, ("M_MMAP_MAX", _M_MMAP_MAX, 0))


@dataclass(frozen=True)
class HeapSetting:
    """What this process set: ``kept`` when every option is in force; ``why`` says what was done or why not;
    ``options``: the mallopt options set (name -> value)."""

    kept: bool
    why: str
    options: tuple[tuple[str, int], ...] = ()


@dataclass
class _ProcessHeap:
    """This process's heap setting: ``setting``, what :func:`keep_freed_pages` did (None until it is called);
    ``libc``, the C library it loaded, kept for every stage end's trim (loading it looks the library up on
    disk: once per process, not once per stage)."""

    setting: HeapSetting | None = None
    libc: ctypes.CDLL | None = None


_state = _ProcessHeap()


def keep_freed_pages(*, under_data_limit: bool = False) -> bool:
    """Set glibc's malloc to keep freed pages mapped (once per process). True if the setting is in force.

    ``under_data_limit``: the process runs under an RLIMIT_DATA (a site's computing process): blocks above
    32 MiB keep their own mapping, so no freed hole counts against the limit."""
    if _state.setting is None:
        _state.setting = _apply(_LIMITED_OPTIONS if under_data_limit else _OPTIONS)
    return _state.setting.kept


def heap_setting() -> HeapSetting | None:
    """What :func:`keep_freed_pages` did in this process (None: it has not been called)."""
    return _state.setting


def release_freed_pages() -> None:
    """Hand the free pages of the heap back to the kernel (glibc's ``malloc_trim(0)``), at the end of a stage:
    a no-op where the setting is not in force (glibc then gives large blocks back on its own)."""
    setting = heap_setting()
    # any option in force (even where glibc refused another) keeps pages that only a trim hands back; an
    # option is in force only where _apply loaded glibc, so its handle is there
    if setting is not None and setting.options and _state.libc is not None:
        _state.libc.malloc_trim(0)


def _switched_off() -> bool:
    return os.environ.get(ENV_SWITCH, "").strip().lower() in ("0", "off", "no", "false")


def _apply(options: tuple[tuple[str, int, int], ...] = _OPTIONS) -> HeapSetting:
    if _switched_off():
        return HeapSetting(False, f"off ({ENV_SWITCH}={os.environ[ENV_SWITCH]}): glibc's own policy")
    libc_name = platform.libc_ver()[0]
    if platform.system() != "Linux" or libc_name != "glibc":
        return HeapSetting(False, f"not glibc ({platform.system()} {libc_name or 'libc'}): left as it is")
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return HeapSetting(False, "glibc without mallopt: left as it is")
    _state.libc = libc
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; every option or the setting is only partly there (reported as not kept)
    done = tuple((name, value) for name, param, value in options if mallopt(param, value) == 1)
    kept = len(done) == len(options)
    return HeapSetting(kept, "glibc: freed pages kept mapped" if kept else "glibc refused an option", done)
