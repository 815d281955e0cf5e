"""Torch-free synthesis: per-class PNGs + certificate, all-or-nothing output, refusal on bad releases."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("torch")

from feta_release.errors import ConfigError, ReleaseError  # noqa: E402
from feta_release.release.synthesize import class_counts, class_dirs, label_batches, synthesize  # noqa: E402
from tests.support.release import (  # noqa: E402
    BLOCK_TORCH,
    CLASSES,
    IMAGE_SHAPE,
    REPO,
    cli_process,
    signed_policy,
)

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # fixtures: tests/conftest.py


def _only_children(parent: Path) -> set[str]:
    return {p.name for p in parent.iterdir()}


def test_writes_per_class_pngs_and_certificate(release, keys, tmp_path):
    out = tmp_path / "synthetic"
    rep = synthesize(
        release, out, keys.trust(), per_class=[3, 0, 5], seed=7, batch=4, progress=False, threads=1
    )
    assert rep.n_images == 8
    assert sorted(p.name for p in out.iterdir()) == ["certificate.json", "one", "two", "zero"]
    assert len(list((out / "zero").glob("*.png"))) == 3
    assert len(list((out / "one").glob("*.png"))) == 0
    assert len(list((out / "two").glob("*.png"))) == 5
    cert = json.loads((out / "certificate.json").read_text())
    files = cert["files"]
    assert len(files) == 8
    for rel, digest in files.items():
        data = (out / rel).read_bytes()
        assert hashlib.sha256(data).hexdigest() == digest
        with Image.open(out / rel) as img:
            assert img.mode == "L" and img.size == (IMAGE_SHAPE[2], IMAGE_SHAPE[1])
    man = json.loads((release / "manifest.json").read_text())
    assert cert["manifest"] == man
    assert cert["certificate"]["verification"]["ok"] is True
    assert cert["certificate"]["generation"]["per_class"] == {"zero": 3, "one": 0, "two": 5}
    (site,) = cert["certificate"]["privacy"]
    assert site["epsilon"] == man["manifest"]["sites"][0]["epsilon"]
    assert site["statement"].startswith(f"Site a: ε = {site['epsilon']:.3g} at δ = 1e-05")
    # No leftovers: the temp dir was renamed into place.
    assert _only_children(tmp_path) == {"release", "synthetic"}


def test_images_match_the_torch_sampler(release, keys, tmp_path, den):
    """The PNGs are the PyTorch sampler's images for the same noise (to 8-bit rounding)."""
    import torch

    from feta_release.models.sampler import sample

    out = tmp_path / "s"
    synthesize(release, out, keys.trust(), num=3, seed=11, batch=3, progress=False, threads=1)
    rng = np.random.Generator(np.random.PCG64(11))
    noise = rng.standard_normal((3, *IMAGE_SHAPE), dtype=np.float32)
    ref = sample(den, torch.tensor([0, 1, 2]), torch.from_numpy(noise), steps=6).numpy()
    for i, d in enumerate(class_dirs(CLASSES)):
        got = np.asarray(Image.open(out / d / "000000.png"), dtype=np.float32) / 255.0
        assert np.abs(got - ref[i, 0]).max() <= 1 / 255 + 1e-6


def test_batch_size_does_not_change_images(release, keys, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    synthesize(release, a, keys.trust(), num=7, seed=3, batch=2, progress=False, threads=1)
    synthesize(release, b, keys.trust(), num=7, seed=3, batch=7, progress=False, threads=1)
    for rel in json.loads((a / "certificate.json").read_text())["files"]:
        x = np.asarray(Image.open(a / rel), dtype=np.int16)
        y = np.asarray(Image.open(b / rel), dtype=np.int16)
        assert np.abs(x - y).max() <= 1  # float rounding of batched kernels may move a pixel by one level


@pytest.mark.parametrize("damage", ["generator", "manifest", "signer", "policy"])
def test_refusal_writes_nothing(release, keys, tmp_path, damage):
    trusted = keys.trust()
    if damage == "generator":
        g = release / "generator.onnx"
        data = bytearray(g.read_bytes())
        data[100] ^= 0xFF
        g.write_bytes(bytes(data))
    elif damage == "manifest":
        (release / "manifest.json").write_text(
            (release / "manifest.json").read_text().replace('"heun"', '"euler"')
        )
    elif damage == "signer":
        trusted = [keys.site.public_key(), keys.policy.public_key()]
    elif damage == "policy":
        (release / "policies" / "a.signed.json").write_text(json.dumps(signed_policy(keys, per_job_eps=0.1)))
    before = _only_children(tmp_path)
    with pytest.raises(ReleaseError, match="refused"):
        synthesize(release, tmp_path / "out", trusted, num=3, progress=False, threads=1)
    assert _only_children(tmp_path) == before


def test_out_must_be_new_or_empty(release, keys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ReleaseError, match="not empty"):
        synthesize(release, out, keys.trust(), num=3, progress=False, threads=1)
    assert _only_children(out) == {"keep.txt"}
    empty = tmp_path / "empty"
    empty.mkdir()
    synthesize(release, empty, keys.trust(), num=3, progress=False, threads=1)
    assert (empty / "certificate.json").is_file()


def test_failure_midway_leaves_nothing(release, keys, tmp_path, monkeypatch):
    import feta_release.release.synthesize as mod

    calls = {"n": 0}
    real = mod._to_png

    def failing(img, *rest):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk full")
        return real(img, *rest)

    monkeypatch.setattr(mod, "_to_png", failing)
    with pytest.raises(OSError, match="disk full"):
        synthesize(release, tmp_path / "out", keys.trust(), num=9, batch=2, progress=False, threads=1)
    assert _only_children(tmp_path) == {"release"}


def test_counts_and_labels():
    assert class_counts(10, 3, None) == [4, 3, 3]
    assert class_counts(None, 3, [1, 2, 3]) == [1, 2, 3]
    with pytest.raises(ConfigError):
        class_counts(None, 3, [1, 2])
    with pytest.raises(ConfigError):
        class_counts(5, 3, [1, 2, 3])
    with pytest.raises(ConfigError):
        class_counts(0, 3, None)
    batches = list(label_batches([3, 0, 5], 4))
    assert [len(b) for b in batches] == [4, 4]
    assert np.concatenate(batches).tolist() == [0, 0, 0, 2, 2, 2, 2, 2]
    assert class_dirs(["a/b", "..", "a/b", ""]) == ["a_b", "class_1", "a_b_2", "class_3"]


def test_cli_synthesize_without_torch(release, keys, tmp_path):
    """The whole CLI path runs in a process where `import torch` fails."""
    out = tmp_path / "out"
    args = [
        "synthesize",
        "--release",
        str(release),
        "--per-class",
        "2,1,1",
        "--out",
        str(out),
        "--seed",
        "1",
        "--batch",
        "3",
        "--no-progress",
        "--threads",
        "1",
    ] + keys.trusted_args(tmp_path / "keys")
    proc = cli_process(args, without_torch=True)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert proc.stdout.startswith("VERIFIED: ") and "site a: per image, δ = 1e-05: ε this job" in proc.stdout
    cert = json.loads((out / "certificate.json").read_text())
    assert len(cert["files"]) == 4
    blocked = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH + "import torch"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert blocked.returncode != 0 and "blocked by the test" in blocked.stderr  # the block is real
    # And refusal through the CLI: exit code of ReleaseError, reason printed, nothing written.
    # The site key is not the administrator key: trusting it for site a's policy must fail.
    site_pub = keys.pub_files(tmp_path / "keys")[1]
    bad = cli_process([*args[:-2], "--trusted", f"a={site_pub}"], without_torch=True)
    assert bad.returncode == ReleaseError.exit_code
    assert "unknown key" in bad.stderr + bad.stdout


MEM_CHECK = """
import sys
from feta_release.release.synthesize import synthesize
from feta_release.signing import load_public_key
synthesize(sys.argv[1], sys.argv[2], {"a": load_public_key(sys.argv[4])}, num=int(sys.argv[3]), batch=8,
           threads=1, progress=False)
print(next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc for peak RSS")
def test_memory_does_not_grow_with_n(release, keys, tmp_path):
    """Peak RSS (VmHWM, KiB) of a fresh synthesis process: 16 vs 400 images differ by less than 8 MiB."""
    admin_pub = keys.pub_files(tmp_path / "keys")[2]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    peaks = []
    for n in (16, 400):
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                BLOCK_TORCH + MEM_CHECK,
                str(release),
                str(tmp_path / f"o{n}"),
                str(n),
                admin_pub,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        peaks.append(int(proc.stdout.strip().splitlines()[-1]))
    assert peaks[1] - peaks[0] < 8 * 1024, peaks
