"""The HTML report and the file listing of a release directory a hostile coordinator assembled.

Each test failed on the code before its fix."""

from __future__ import annotations

import hashlib
import tracemalloc
from pathlib import Path

from feta_release.release.report import _files


def test_symlink_in_a_release_is_not_followed_into_the_verifiers_machine(tmp_path: Path) -> None:
    """A release unpacked from a tar may hold symlinks: ``notes.txt -> ~/.feta/site-secret`` put the size and
    sha256 of a file of the verifier's own machine into a page meant to be shared (a short secret's hash is
    guessable)."""
    outside = tmp_path / "private.txt"
    outside.write_text("patients=1234\n")
    rd = tmp_path / "release"
    rd.mkdir()
    (rd / "manifest.json").write_text("{}")
    (rd / "notes.txt").symlink_to(outside)
    page = _files(rd)
    assert hashlib.sha256(outside.read_bytes()).hexdigest() not in page
    assert "notes.txt" in page and "symbolic link" in page
    assert hashlib.sha256(b"{}").hexdigest() in page  # plain files are still listed with their hash


def test_large_release_file_is_hashed_in_chunks(tmp_path: Path) -> None:
    """``read_bytes`` held a whole file in memory (a 'file' of many GB: the verifier's machine runs out)."""
    rd = tmp_path / "release"
    rd.mkdir()
    big = rd / "big.bin"
    with open(big, "wb") as fh:
        for _ in range(16):
            fh.write(b"\x07" * (1 << 20))
    tracemalloc.start()
    try:
        page = _files(rd)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert hashlib.sha256(big.read_bytes()).hexdigest() in page
    assert peak < 4 << 20, f"peak {peak / (1 << 20):.1f} MiB for a 16 MiB file"
