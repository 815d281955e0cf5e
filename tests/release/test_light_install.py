"""A data-protection officer's machine has no training stack: verify, report, synthesize and verify-synthetic
run in a process where torch, flwr, onnx and opacus cannot be imported (the README's light install)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")  # only to BUILD the release under test

from feta_release.release.onnx_export import export_denoiser  # noqa: E402
from feta_release.signing import generate_keypair  # noqa: E402
from tests.support.release import IMAGE_SHAPE, make_release, new_keys, signed_policy, small_denoiser  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# opacus: accounting is prv-accountant's, no file of opacus is read
HEAVY = ("torch", "flwr", "onnx", "opacus")

SCRIPT = """
import sys
HEAVY = {heavy!r}
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HEAVY:
            raise ImportError(f"No module named {{name!r}} (blocked: light install)", name=name)
        return None
sys.meta_path.insert(0, _Block())
from feta_release.cli import cli
for args in {commands!r}:
    cli.main(args=args, standalone_mode=False)
print("loaded:", sorted(m for m in sys.modules if m.split(".")[0] in HEAVY or "opacus" in m))
"""


def _run(commands: list[list[str]], heavy: tuple[str, ...] = HEAVY) -> subprocess.CompletedProcess:
    code = SCRIPT.format(heavy=heavy, commands=commands)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_verify_report_synthesize_and_verify_synthetic_without_the_training_stack(tmp_path):
    keys = new_keys()
    release = make_release(
        tmp_path / "release", export_denoiser(small_denoiser(), IMAGE_SHAPE), keys, policy=signed_policy(keys)
    )
    coord_pub, _, admin_pub = keys.pub_files(tmp_path / "keys")
    me_priv, me_pub = generate_keypair(tmp_path / "me", "dpo")
    trusted = ["--trusted", f"a={admin_pub}", "--coordinator", coord_pub]  # role-bound, as in the README
    synth = tmp_path / "synthetic"
    commands = [
        ["verify", str(release), "--json", *trusted],
        ["report", str(release), "--out", str(tmp_path / "report.html"), "--per-class", "2", *trusted],
        [
            "synthesize",
            "--release",
            str(release),
            "--num",
            "6",
            "--out",
            str(synth),
            "--no-progress",
            "--threads",
            "1",
            "--key",
            str(me_priv),
            *trusted,
        ],
        ["verify-synthetic", str(synth), "--certificate-key", str(me_pub), *trusted],
    ]
    proc = _run(commands)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert "loaded: []" in proc.stdout  # none of the heavy packages was imported, not even partly
    assert "Release VERIFIED" in (tmp_path / "report.html").read_text("utf-8")
    assert len(json.loads((synth / "certificate.json").read_text())["files"]) == 6


def test_the_block_is_real():
    proc = _run([["export", "--help"]], heavy=("torch",))
    blocked = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(heavy=("torch",), commands=[]) + "import torch"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert "blocked: light install" in blocked.stderr
    assert proc.returncode == 0  # --help of a torch command imports nothing heavy either


def test_light_requirements_hold_the_accountant_and_no_training_stack():
    """requirements-verify.txt is the light install: prv-accountant (the accountant, pinned as in pyproject)
    is in it; torch, flwr, onnx and opacus are not, and the README's light install no longer installs
    opacus."""
    import re
    import tomllib

    reqs = [ln.split("#")[0].strip() for ln in (REPO / "requirements-verify.txt").read_text().splitlines()]
    names = {re.split(r"[<>=!~\[ ]", r)[0].lower(): r for r in reqs if r}
    assert not set(names) & {"torch", "flwr", "onnx", "opacus"}
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert names["prv-accountant"] in deps
    readme = (REPO / "README.md").read_text("utf-8")
    light = readme[readme.index("Light install for verifiers") :][:400]
    assert "opacus==" not in light and "pip install -r requirements-verify.txt" in light
