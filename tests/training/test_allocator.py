"""feta_release.allocator: every process that trains or samples keeps freed pages mapped from its start, so
a step reuses the last step's pages instead of faulting fresh ones in; ``FETA_KEEP_FREED_PAGES=0`` turns it
off."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from feta_release import allocator

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
ROOT = Path(__file__).resolve().parents[2]

# After the entry point ran: where glibc puts a 24 MiB block. glibc's own policy maps a block that large on
# its own (its threshold starts at 128 KiB and only moves up to a size this process freed); with the setting
# it comes from the heap (the [heap] mapping of /proc/self/maps). Printed with what the module says it set.
_WHERE_A_BLOCK_GOES = textwrap.dedent("""
    import ctypes, json
    from feta_release import allocator
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    p = libc.malloc(24 << 20)
    spans = [l.split()[0].split("-") for l in open("/proc/self/maps") if l.rstrip().endswith("[heap]")]
    in_heap = any(int(lo, 16) <= p < int(hi, 16) for lo, hi in spans)
    libc.free(p)
    s = allocator.heap_setting()
    print(json.dumps({"in_heap": in_heap, "kept": None if s is None else s.kept,
                      "why": None if s is None else s.why}))
""")

# Each entry point called so that it stops right after its start (a refusal or --help); the check then runs in
# the same process.
_ENTRIES = {
    "cli": "from feta_release.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n    pass\n",
    "node worker": "from edge.worker import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n",
    "node clientapp": (
        "import edge.trust as t\n"
        "def stop():\n    raise SystemExit(0)\n"
        "t.install_gate = stop\n"
        "try:\n    t.main()\nexcept SystemExit:\n    pass\n"
    ),
    "coordinator serverapp": (
        "from types import SimpleNamespace\nfrom coordinator.serverapp import main\n"
        "try:\n    main(None, SimpleNamespace(run_config={}))\nexcept RuntimeError:\n    pass\n"
    ),
}


def _last_line(code: str, *args: str, **env: str) -> str:
    """The last line a fresh interpreter prints running ``code``, with no allocator setting inherited."""
    full = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", allocator.ENV_SWITCH)}
    full.update(PYTHONPATH=str(ROOT), **env)
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=full,
        cwd=ROOT,
    )
    return out.stdout.strip().splitlines()[-1]


def _run_entry(entry: str, where: str = _WHERE_A_BLOCK_GOES, **env: str) -> dict[str, object]:
    return dict(json.loads(_last_line(_ENTRIES[entry] + where, **env)))


@pytest.mark.skipif(not GLIBC, reason="the setting exists in glibc's malloc only")
@pytest.mark.parametrize("entry", sorted(_ENTRIES))
def test_every_process_that_trains_keeps_freed_pages_from_its_start(entry: str) -> None:
    got = _run_entry(entry)
    assert got["kept"] is True, got
    assert got["in_heap"] is True, got


@pytest.mark.skipif(not GLIBC, reason="the setting exists in glibc's malloc only")
def test_the_switch_leaves_glibc_its_own_policy() -> None:
    got = _run_entry("cli", **{allocator.ENV_SWITCH: "0"})
    assert got["kept"] is False and "off" in str(got["why"]), got
    assert got["in_heap"] is False, got  # glibc maps the block on its own, as it does without the module


# One DP-SGD step of the cpu-eps1 denoiser (64 examples, physical batch 32), after two warm steps, in a fresh
# process; prints the minor page faults of that step.
_STEP = textwrap.dedent("""
    import resource
    import torch
    import feta_release.training.dpsgd as dp
    from feta_release.config import load_preset
    from feta_release.models.edm import build_denoiser
    cfg = load_preset("cpu-eps1")
    torch.manual_seed(0)
    x, y = torch.rand(64, 1, 28, 28) * 2 - 1, torch.arange(64) % 10
    model = build_denoiser(cfg.model, (1, 28, 28), 10)
    tr = dp.DPSGDTrainer(model, cfg, 1.0, 1.0, torch.Generator().manual_seed(2), image_shape=(1, 28, 28),
                         n_classes=10)
    for _ in range(2):
        tr.step(x, y)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tr.step(x, y)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _step_faults(**env: str) -> int:
    full = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", allocator.ENV_SWITCH)}
    full.update(PYTHONPATH=str(ROOT), **env)
    out = subprocess.run(
        [sys.executable, "-c", _STEP], capture_output=True, text=True, timeout=300, check=True, env=full
    )
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="the setting exists in glibc's malloc only")
def test_a_dpsgd_step_faults_far_fewer_pages_with_the_setting() -> None:
    # measured 17,900 faults without and 4,700 with (the per-example gradients of each chunk reuse the last
    # chunk's pages); the margin is wide so that the count's run-to-run noise cannot flip it
    off, on = _step_faults(**{allocator.ENV_SWITCH: "0"}), _step_faults()
    assert on * 2 < off, (on, off)


@pytest.mark.skipif(not GLIBC, reason="the setting exists in glibc's malloc only")
def test_the_setting_is_in_force_after_the_first_call_and_idempotent() -> None:
    assert allocator.keep_freed_pages() is True
    assert allocator.keep_freed_pages() is True
    setting = allocator.heap_setting()
    assert setting is not None and dict(setting.options) == {
        "M_MMAP_THRESHOLD": 32 << 20,
        "M_TRIM_THRESHOLD": 1 << 30,
        "M_MMAP_MAX": 0,
    }


def test_another_libc_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(allocator.ENV_SWITCH, raising=False)
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert allocator._apply().kept is False
    monkeypatch.setattr(allocator.platform, "system", lambda: "Darwin")
    assert allocator._apply().kept is False


@pytest.mark.parametrize("value", ["0", "off", "No", "false"])
def test_the_switch_is_read_before_anything_is_set(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(allocator.ENV_SWITCH, value)
    got = allocator._apply()
    assert got.kept is False and got.options == ()


# 256 MiB touched, freed below a live block (so no trim at the top can return it), then handed back: the
# resident set before the free, after it, and after release_freed_pages, in MiB.
_HOLE = textwrap.dedent("""
    import ctypes, json
    from feta_release import allocator
    allocator.keep_freed_pages()
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    page = 4096
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * page >> 20
    big = libc.malloc(256 << 20)
    ctypes.memset(big, 1, 256 << 20)
    live = libc.malloc(64)
    before = rss()
    libc.free(big)
    held = rss()
    allocator.release_freed_pages()
    print(json.dumps({"before": before, "held": held, "released": rss()}))
""")


@pytest.mark.skipif(not GLIBC, reason="the setting exists in glibc's malloc only")
def test_a_stage_end_hands_its_freed_pages_back() -> None:
    full = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", allocator.ENV_SWITCH)}
    full.update(PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", _HOLE], capture_output=True, text=True, timeout=120, check=True, env=full
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["held"] > got["before"] - 32, got  # kept mapped after the free: the next step reuses it
    assert got["released"] < got["held"] - 200, got  # handed back at the stage's end


# A site's computing process runs under the policy's RLIMIT_DATA (edge/resources.py), which counts the heap's
# address space: stages that free a large block below a live small one and then allocate a larger block.
# Under the unlimited setting the freed holes stay in the heap and count; a site's setting must fit where
# glibc's own policy fits. Prints "fits" or the step that failed.
_STAGES_UNDER_A_DATA_LIMIT = textwrap.dedent("""
    import resource, sys
    import numpy as np
    from feta_release.allocator import keep_freed_pages, release_freed_pages
    if sys.argv[1] != "glibc":
        keep_freed_pages(under_data_limit=sys.argv[1] == "site")
    MB = 2**20
    vm = int([l for l in open("/proc/self/status") if l.startswith("VmData")][0].split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_DATA, (vm + 450 * MB, resource.RLIM_INFINITY))
    keep = []
    try:
        for step in range(4):
            a = np.ones((100 * (step + 1) // 2 + 40) * MB // 8)
            keep.append(np.ones(1024))
            del a
            release_freed_pages()
            c = np.ones((240 + 30 * step) * MB // 8)
            del c
        print("fits")
    except MemoryError:
        print(f"MemoryError at step {step}")
""")


def _stages_under_a_data_limit(setting: str) -> str:
    return _last_line(_STAGES_UNDER_A_DATA_LIMIT, setting)


@pytest.mark.skipif(not GLIBC, reason="the setting exists in glibc's malloc only")
def test_a_site_process_fits_under_its_data_limit_where_glibc_own_policy_fits() -> None:
    assert _stages_under_a_data_limit("glibc") == "fits"
    assert _stages_under_a_data_limit("site") == "fits"
    # what the site's setting avoids: the heap-only setting leaves freed holes that count against the limit
    assert _stages_under_a_data_limit("unlimited").startswith("MemoryError")


# Where a 48 MiB block goes (above the 32 MiB threshold): its own mapping under a site's setting, the heap
# under the unlimited one.
_WHERE_A_LARGE_BLOCK_GOES = _WHERE_A_BLOCK_GOES.replace("24 << 20", "48 << 20")


@pytest.mark.skipif(not GLIBC, reason="the setting exists in glibc's malloc only")
@pytest.mark.parametrize("entry", sorted(_ENTRIES))
def test_only_a_site_process_keeps_large_blocks_mapped_on_their_own(entry: str) -> None:
    got = _run_entry(entry, _WHERE_A_LARGE_BLOCK_GOES)
    assert got["kept"] is True, got
    assert got["in_heap"] is (not entry.startswith("node")), got


class _FakeLibc:
    """glibc as ctypes loads it, counting what the allocator does with it: the loads (``opened``), the trims
    and which options it refuses (``refuse``: mallopt parameters)."""

    def __init__(self, refuse: tuple[int, ...] = ()) -> None:
        self.opened, self.lookups, self.trims = 0, 0, list[int]()
        # a plain function, as ctypes' are: the allocator sets its argtypes and restype
        self.mallopt = lambda param, value: 0 if param in refuse else 1

    def load(self, name: str) -> _FakeLibc:
        self.opened += 1
        return self

    def find_library(self, name: str) -> str:
        self.lookups += 1
        return "libc.so.6"

    def malloc_trim(self, pad: int) -> int:
        self.trims.append(pad)
        return 1


def _fake_process(monkeypatch: pytest.MonkeyPatch, libc: _FakeLibc, libc_name: str = "glibc") -> None:
    """A fresh process (no setting made yet) on Linux with ``libc_name``, loading ``libc``."""
    monkeypatch.setattr(allocator.platform, "system", lambda: "Linux")
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: (libc_name, "2.36"))
    monkeypatch.setattr(allocator.ctypes, "CDLL", libc.load)
    monkeypatch.setattr(allocator.ctypes.util, "find_library", libc.find_library)
    monkeypatch.delenv(allocator.ENV_SWITCH, raising=False)
    monkeypatch.setattr(allocator, "_state", allocator._ProcessHeap())


def test_a_partly_refused_setting_still_trims_at_a_stage_end(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = _FakeLibc(refuse=(-3,))  # glibc refuses the mmap threshold (a 32-bit heap), takes the rest
    _fake_process(monkeypatch, libc)
    assert allocator.keep_freed_pages() is False
    allocator.release_freed_pages()
    assert libc.trims == [0]


def test_every_stage_end_trims_through_the_c_library_loaded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = _FakeLibc()
    _fake_process(monkeypatch, libc)
    assert allocator.keep_freed_pages() is True
    for _ in range(5):
        allocator.release_freed_pages()
    assert libc.trims == [0] * 5
    assert (libc.opened, libc.lookups) == (1, 1)  # the library is looked up at the setting, not at each trim


def test_a_stage_end_outside_glibc_touches_no_c_library(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = _FakeLibc()
    _fake_process(monkeypatch, libc, libc_name="musl")
    assert allocator.keep_freed_pages() is False
    allocator.release_freed_pages()
    assert (libc.opened, libc.lookups, libc.trims) == (0, 0, [])


# The sampler's draw of 8,000 64x64 images (131 MB a copy: the draw's noise, its batches, the images
# returned), with the denoiser replaced by a map of its noise (what is measured is where the draw's own blocks
# go, not the model's): the resident set after the draw, the images alive, above the one before it; and the
# images' MiB.
_SAMPLER_DRAW = textwrap.dedent("""
    import json, sys
    import torch
    from feta_release import allocator
    from feta_release.config import SamplerSection, load_preset
    from feta_release.models import sampler
    from feta_release.models.edm import build_denoiser
    allocator.keep_freed_pages()
    torch.set_num_threads(1)
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
    sampler.sample = lambda denoiser, labels, noise, **kw: (noise * 0.1 + 0.5).clamp(0, 1)
    model = build_denoiser(load_preset("tiny").model, (1, 64, 64), 4)
    sampler.generate(model, 64, 0, SamplerSection())
    before = rss()
    images, _ = sampler.generate(model, 2000, 0, SamplerSection())
    print(json.dumps({"grew": rss() - before, "images": images.numel() * 4 / 2**20}))
""")


@pytest.mark.skipif(not GLIBC, reason="the setting exists in glibc's malloc only")
def test_a_sampler_draw_keeps_only_its_images_resident_at_its_end() -> None:
    kept = json.loads(_last_line(_SAMPLER_DRAW))
    own = json.loads(_last_line(_SAMPLER_DRAW, **{allocator.ENV_SWITCH: "0"}))
    # the noise and the batches are freed before the draw's trim, so it hands them back too: only the images
    # stay (trimmed before they were freed, they stayed: two more copies, 363 MiB), at most what glibc's own
    # policy keeps (measured 117 or 265 MiB: some of its batches stay in its heap, by its dynamic threshold)
    assert kept["grew"] < kept["images"] + 48, kept
    assert kept["grew"] < own["grew"] + 48, (kept, own)


# The peak resident set a draw of 100 images of a 64 px aux generator (the derived job's width 32) adds (one
# pass), and what a draw of 512 then adds to that peak (the cell prototypes draw 256 a class at once), in MiB.
_AUX_DRAW = textwrap.dedent("""
    import json
    import numpy as np
    import torch
    from feta_release import allocator
    from feta_release.models.auxgen import AuxGenerator
    from feta_release.training.frequency import aux_draw
    allocator.keep_freed_pages()
    torch.set_num_threads(1)
    gen = AuxGenerator(1, 64, 4, z_dim=32, width=32)
    def peak():
        # VmHWM: this address space's own high-water mark. Not ru_maxrss, which Linux carries over from the
        # forking parent (a test worker of several GB would hide every growth here).
        return int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]) / 1024
    start = peak()
    aux_draw(gen, np.arange(100) % 4, torch.Generator().manual_seed(0))
    small = peak()
    aux_draw(gen, np.arange(512) % 4, torch.Generator().manual_seed(0))
    print(json.dumps({"grew": peak() - small, "pass": small - start}))
""")


@pytest.mark.skipif(not GLIBC, reason="the setting exists in glibc's malloc only")
def test_an_aux_draw_holds_the_activations_of_one_pass_whatever_it_draws() -> None:
    got = json.loads(_last_line(_AUX_DRAW))
    # drawn in one pass, 512 images held ~5x the activations of 100 (measured: the peak grew 2,616 MiB over a
    # pass's 450-590); in passes of AUX_DRAW_BATCH only the images and the heap's layout of the passes add
    # (measured: 60-250 MiB)
    assert got["grew"] < got["pass"], got
