"""`policy check POLICY JOB` without --data, and `job verify JOB --policy POLICY`, can judge a
secure-aggregation job only in its Gaussian form (the Skellam form the node charges needs the data's image
shape and classes), yet exited 0 like a full pass: a script testing `$? -eq 0` took a partial check for the
node's verdict. Such a check now exits 8 (``feta_release.policy.partial.PARTIAL_CHECK_EXIT``), its line
starting "PASSED IN THE GAUSSIAN FORM ONLY", then what was not checked and the fix; a full check still exits
0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from coordinator.setup import sign_job_file
from feta_release.cli import main
from tests.support.federation import make_federation, tiny_job

REPO = Path(__file__).resolve().parents[2]
PARTIAL = "PASSED IN THE GAUSSIAN FORM ONLY"


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    f = make_federation(tmp_path_factory.mktemp("f5") / "fed")
    cfg = tiny_job(central={"rounds": 1, "batch": 8}, frequency={"sigma": 8.0})
    _, secure = sign_job_file(f, cfg.replace(federation={"secure_aggregation": True}), "job-secure")
    _, plain = sign_job_file(f, cfg, "job-plain")  # per-site noise: the check needs no data, it is full
    return SimpleNamespace(site=f.sites[0], secure=secure, plain=plain)


def _exit(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Exit status and stdout of the `feta-release` entry point (``cli.main``, as the console script runs
    it)."""
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().out


def _policy_check(fed: SimpleNamespace, job: Path, *extra: str) -> list[str]:
    return ["policy", "check", str(fed.site.policy), str(job), "--trusted", str(fed.site.policy_pub), *extra]


def _job_verify(fed: SimpleNamespace, job: Path) -> list[str]:
    return [
        "job",
        "verify",
        str(job),
        "--policy",
        str(fed.site.policy),
        "--trusted",
        str(fed.site.policy_pub),
    ]


def _is_partial_line(out: str) -> None:
    first = out.splitlines()[0]
    assert first.startswith(PARTIAL), out
    # after the verdict: what was NOT checked, then the fix (the command that makes it a full check)
    nc, fix = (
        first.index("NOT checked: the ε the node charges"),
        first.index("Fix: run `feta-release policy check"),
    )
    assert nc < fix and "worst-case cap" in first[nc:fix] and "--data DATA" in first[fix:]


def test_policy_check_without_data_of_a_secure_job_exits_8(
    fed: SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _exit(_policy_check(fed, fed.secure), capsys)
    assert code == 8, out
    _is_partial_line(out)


def test_job_verify_with_a_policy_of_a_secure_job_exits_8(
    fed: SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _exit(_job_verify(fed, fed.secure), capsys)
    assert code == 8, out
    _is_partial_line(out)
    assert "sha256" in out  # the job's details still follow the verdict


def test_full_checks_still_exit_0(fed: SimpleNamespace, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _exit(_policy_check(fed, fed.secure, "--data", str(fed.site.data)), capsys)
    assert code == 0 and out.startswith("ACCEPTED") and "Skellam form the node charges" in out, out
    code, out = _exit(_policy_check(fed, fed.plain), capsys)
    assert code == 0 and out.startswith("ACCEPTED"), out
    code, out = _exit(_job_verify(fed, fed.plain), capsys)
    assert code == 0 and out.startswith("OK: job job-plain"), out


def test_the_cli_status_is_the_policy_packages() -> None:
    from feta_release.cli.policy_cmd import PartialCheckExit
    from feta_release.policy.partial import PARTIAL_CHECK_EXIT, PartialCheck

    assert PartialCheckExit.exit_code == PartialCheck.exit_code == PARTIAL_CHECK_EXIT == 8


def test_the_console_script_exits_8(fed: SimpleNamespace) -> None:
    """What a site administrator's script sees: `$?` of the installed `feta-release` (this checkout's
    code)."""
    exe = Path(sys.executable).parent / "feta-release"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [str(exe), *_policy_check(fed, fed.secure)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 8, out.stdout + out.stderr
    assert out.stdout.startswith(PARTIAL) and not out.stderr.strip(), out.stderr
