"""``feta-release demo --quick --public strokes:N`` with REAL Flower processes on loopback (SuperLink + 3
SuperNodes): the coordinator pretrains on generated pen strokes, the signed job, the release manifest, the
privacy report, the DPO's page and the synthesis certificate name them by the generated set's sha256,
``verify --public`` checks that hash, and nothing of the public set reaches a site. Slow: minutes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from feta_release.data import load_dataset, save_npz
from feta_release.data.procedural import generate_dataset

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "feta_release"]
N_PUBLIC = 48


def _generated_set(tmp_path: Path):
    """The set `data generate strokes --n N --seed 7 --out X.npz` writes, read back as the loaders read it."""
    save_npz(generate_dataset("strokes", N_PUBLIC, size=28, seed=7), tmp_path / "strokes.npz", dtype="uint8")
    return load_dataset(tmp_path / "strokes.npz")[0]


def _site_files_holding(sites: Path, needles: list[bytes]) -> list[str]:
    return [str(f) for f in sites.rglob("*") if f.is_file() and any(n in f.read_bytes() for n in needles)]


def test_demo_public_strokes_are_signed_released_reported_and_never_reach_a_site(tmp_path):
    out = tmp_path / "demo"
    argv = ["demo", "--out", str(out), "--quick", "--rounds", "1", "--local-steps", "1", "--per-site", "40"]
    r = subprocess.run(
        [*CLI, *argv, "--public", f"strokes:{N_PUBLIC}", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    public = _generated_set(tmp_path)
    sha = public.fingerprint()
    named = {"sha256": sha, "count": N_PUBLIC, "shape": [1, 28, 28]}

    signed = json.loads((out / "job" / "signed_job.json").read_text())["job"]["config"]["public"]
    manifest = json.loads((out / "release" / "manifest.json").read_text())["manifest"]["job"]["config"]
    report = json.loads((out / "privacy_report.json").read_text())["public_pretraining"]
    for section in (signed, manifest["public"], report):
        assert {k: section[k] for k in named} == named
    assert "generated pen strokes" in signed["description"] and signed["pretrain_iterations"] > 0
    assert sha[:16] in (out / "report.html").read_text(
        "utf-8"
    )  # the DPO's page: "seen before any private image"
    said = " ".join((r.stdout + r.stderr).split())
    assert f"public pretraining on {N_PUBLIC} images 1x28x28" in said and sha[:16] in said
    assert "it cost no epsilon" in said
    summary = json.loads((out / "demo_summary.json").read_text())
    assert summary["public"]["sha256"] == sha and max(summary["site_epsilon"].values()) <= 1.0 + 1e-9

    fed = out / "federation"
    trusted = ["--coordinator", str(fed / "coordinator" / "coordinator.pub")]
    for s in ("site-a", "site-b", "site-c"):
        trusted += ["--trusted", f"{s}={fed / 'sites' / s / 'keys' / 'policy-admin.pub'}"]
    v = subprocess.run(
        [
            *CLI,
            "verify",
            str(out / "release"),
            *trusted,
            "--public",
            str(out / "public" / "strokes-48.npz"),
            "--explain",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert v.returncode == 0 and "hash checked" in v.stdout, v.stdout[-2000:] + v.stderr[-2000:]
    synth = tmp_path / "synthetic"
    g = subprocess.run(
        [*CLI, "synthesize", "--release", str(out / "release"), "--num", "10", "--out", str(synth), *trusted],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert g.returncode == 0, g.stdout[-2000:] + g.stderr[-2000:]
    assert sha[:16] in (synth / "certificate.json").read_text("utf-8")  # the certificate's release checks

    # Nothing of the public set in any site's folder (data, ledger, work files, logs): neither an image's
    # pixels (as generated or as floats) nor the path the coordinator reads it from. The messages themselves:
    # test_a_federated_job_sends_the_sites_the_public_hash_never_the_public_images
    # (tests/training/test_public_pretraining.py)
    pixels = np.rint(public.images * 255).astype(np.uint8)
    needles = [pixels[i].tobytes() for i in range(public.n)]
    needles += [np.ascontiguousarray(public.images[i], "<f4").tobytes() for i in range(public.n)]
    needles.append(str((out / "public").resolve()).encode())
    assert _site_files_holding(fed / "sites", needles) == []
