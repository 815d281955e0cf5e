"""The data-protection officer's path of docs/how-to/review-a-release.md, run as written, with the real
``feta-release`` command.

In a working folder that holds a signed two-site release under secure aggregation (``release/``) and each site
administrator's ``policy-admin.pub`` as received (``received/SITE/``), every command of the how-to's bash
blocks runs unchanged: the keys are obtained and their fingerprints shown, then verify -> report -> synthesize
-> verify-synthetic. Slow: real processes and the ONNX generator.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")  # only to BUILD the test release

from feta_release.release.onnx_export import export_denoiser  # noqa: E402
from feta_release.signing import fingerprint, public_key_pem  # noqa: E402
from tests.support.release import IMAGE_SHAPE, secure_release, small_denoiser  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_one_thread")]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DOC = REPO / "docs" / "how-to" / "review-a-release.md"


def doc_commands() -> list[str]:
    """Every command of the how-to's bash blocks, in order (continuations joined, comments dropped)."""
    text = DOC.read_text("utf-8")
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        out += [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return out


def _run(cmd: str, cwd: Path) -> str:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc.stdout


def test_the_how_to_is_the_path_keys_verify_report_synthesize_verify_synthetic():
    cmds = doc_commands()
    tools = [c.split()[1] for c in cmds if c.startswith("feta-release ")]
    assert tools == ["keys", "keys", "verify", "report", "keys", "synthesize", "verify-synthetic"], cmds


def test_dpo_runs_the_how_to_as_written_against_a_signed_two_site_release(tmp_path: Path) -> None:
    keys = secure_release(tmp_path / "release", export_denoiser(small_denoiser(), IMAGE_SHAPE))
    for sid, k in keys.items():  # what each administrator handed over: its kit's keys/policy-admin.pub
        (tmp_path / "received" / sid).mkdir(parents=True)
        (tmp_path / "received" / sid / "policy-admin.pub").write_text(public_key_pem(k.policy))
    outputs = {}
    for cmd in doc_commands():
        outputs[cmd] = _run(cmd, tmp_path)
    shown = [o for c, o in outputs.items() if c.startswith("feta-release keys show")]
    # the fingerprints the officer compares with what each administrator reads out
    assert [s.strip() for s in shown] == [fingerprint(keys[s].policy) for s in ("st-mary", "st-luke")]
    verified = next(o for c, o in outputs.items() if c.startswith("feta-release verify release"))
    lines = verified.splitlines()
    assert lines[0].startswith("VERIFIED: ") and lines[1].strip().startswith("site st-mary: per image")
    assert "worst case (all other sites collude)" in lines[1] and "(cap 3)" in lines[1]
    shown_in_doc = re.search(r"```text\n(.*?)```", DOC.read_text("utf-8"), re.S)
    # the how-to shows the real output
    assert shown_in_doc and shown_in_doc.group(1).splitlines()[:3] == lines[:3]
    page = (tmp_path / "report.html").read_text("utf-8")
    assert "Release VERIFIED" in page and page.index('id="at-a-glance"') < page.index(
        'id="privacy-statement"'
    )
    assert len(list((tmp_path / "synthetic").rglob("*.png"))) == 1000
    checked = next(o for c, o in outputs.items() if c.startswith("feta-release verify-synthetic"))
    assert checked.splitlines()[0].startswith("VERIFIED: the synthetic folder")
