"""``feta-release train``: a tiny run from the command line, and its errors with exit codes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from feta_release.data import load_embedded, save_npz
from tests.support.cli import run_cli as _run


@pytest.fixture(scope="module")
def small_npz(tmp_path_factory):
    # 400 images: `train` without a declared size draws its public size from a count with noise std 50
    # (mechanisms.count.SIZE_SIGMA), and the tiny preset's central batch is 100. At 200 images a draw below 95
    # (about 2 % of runs; CI saw one) refuses the job, correctly; at 400 that needs a 6-sigma draw.
    full = load_embedded()
    rng = np.random.default_rng(3)
    idx = np.concatenate([rng.choice(np.flatnonzero(full.labels == c), 40, replace=False) for c in range(10)])
    path = tmp_path_factory.mktemp("data") / "small.npz"
    save_npz(full.subset(np.sort(idx)), path)
    return path


def _tiny(data: Path, out: Path, *more: str) -> list[str]:
    """``train --preset tiny`` on ``data`` into ``out``, with ``more`` options."""
    return ["train", "--preset", "tiny", "--data", str(data), "--out", str(out), *more]


@pytest.mark.slow
def test_train_tiny_preset_from_the_cli(small_npz, tmp_path, capsys):
    out = tmp_path / "run"
    argv = _tiny(small_npz, out, "--synthetic", "10", "--no-progress")
    code, stdout, err = _run([*argv, "--json"], capsys)
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["epsilon"] <= 10.0 and summary["delta"] == 1e-5
    assert [e["stage"] for e in summary["events"]] == ["size", "central", "frequency", "dpsgd"]
    assert (out / "COMPLETE").exists()
    assert np.load(out / "synthetic.npz")["images"].shape[0] == 10
    # the same command again: already complete, nothing re-spent
    code, stdout, _ = _run([*argv, "--json"], capsys)
    assert code == 0 and json.loads(stdout)["already_complete"] is True
    # a plain run's release verifies under the run's own one-site policy, with the key and commands it prints
    code, stdout, _ = _run(argv, capsys)
    key = out / "keys" / "policy-admin.key"
    assert code == 0 and key.is_file() and key.stat().st_mode & 0o077 == 0
    line = f"feta-release verify {out / 'release'} --trusted site={out / 'keys' / 'policy-admin.pub'}"
    assert line in stdout and f"feta-release synthesize --release {out / 'release'}" in stdout, stdout
    code, stdout, err = _run(line.split()[1:] + ["--json"], capsys)
    assert code == 0 and json.loads(stdout)["ok"] is True, (stdout, err)


def test_cli_errors_have_exit_codes(small_npz, tmp_path, capsys):
    job = tmp_path / "job.toml"
    job.write_text("[dpsgd]\nsteps = 2\nbatchsize = 3\n")
    code, _, err = _run(["train", str(job), "--data", str(small_npz), "--out", str(tmp_path / "a")], capsys)
    assert code == 2 and "unknown key" in err and "batchsize" in err

    code, _, err = _run(["train", str(job), "--preset", "tiny", "--out", str(tmp_path / "b")], capsys)
    assert code == 2 and "exactly one" in err

    job.write_text("[dpsgd]\nsteps = 2\nbatch = 1000\n")
    code, _, err = _run(
        ["train", str(job), "--data", str(small_npz), "--out", str(tmp_path / "c"), "--public-size", "400"],
        capsys,
    )
    assert code == 3 and "fewer than the DP-SGD batch" in err
    assert not (tmp_path / "c").exists()  # a declared size: refused before anything is written

    code, _, err = _run(["train", "--preset", "no-such", "--out", str(tmp_path / "d")], capsys)
    assert code == 2 and "available" in err


def test_presets_load_and_plan():
    from feta_release.config import load_preset
    from feta_release.planning import plan

    for name, n in [("cpu-eps1", 4000), ("cpu-eps10", 4000), ("tiny", 200), ("paper-mnist", 55000)]:
        cfg = load_preset(name)
        p = plan(cfg, n)
        assert p.epsilon <= cfg.privacy.epsilon + 1e-9
        assert p.noise_multiplier is not None and p.noise_multiplier > 0
    e1, e10 = load_preset("cpu-eps1").dpsgd, load_preset("cpu-eps10").dpsgd
    # Same DP-SGD compute (examples per run = rate x steps x N); cpu-eps1 takes it in fewer, larger steps.
    assert (
        e1.rate is not None
        and e10.rate is not None
        and e1.rate * e1.steps == pytest.approx(e10.rate * e10.steps)
    )
    assert replace(e1, rate=None, steps=None) == replace(e10, rate=None, steps=None)
    assert load_preset("cpu-eps1").model == load_preset("cpu-eps10").model


def test_train_with_a_site_ledger_but_no_policy_is_refused_in_one_line(small_npz, tmp_path, capsys):
    code, _, err = _run(
        _tiny(small_npz, tmp_path / "r", "--ledger", str(tmp_path / "site.sqlite"), "--no-progress"), capsys
    )
    assert code != 0 and "--policy SITE.signed.json --trusted ADMIN.pub" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    code, _, err = _run(_tiny(small_npz, tmp_path / "s", "--policy", str(small_npz), "--no-progress"), capsys)
    assert code != 0 and "--trusted ADMIN.pub" in err


def test_train_with_a_policy_that_declares_no_schema_is_refused_in_one_line(small_npz, tmp_path, capsys):
    """As ``node start`` refuses it: exit code 6 (PolicyError) naming the policy file and the fix, before the
    data are read or a ledger written; never a node that "did not join"."""
    from feta_release.policy import make_policy, sign_policy, write_signed_policy
    from feta_release.signing import generate_keypair, load_private_key

    admin, admin_pub = generate_keypair(tmp_path / "k", "admin")
    coord, _ = generate_keypair(tmp_path / "k", "coordinator")
    (tmp_path / "k" / "data.secret").write_bytes(b"s" * 32)
    doc = make_policy("hosp", "1" * 64, 400, [load_private_key(coord).public_key()])
    pol = write_signed_policy(tmp_path / "site.signed.json", sign_policy(doc, load_private_key(admin)))
    argv = _tiny(small_npz, tmp_path / "r")
    argv += [
        "--policy",
        str(pol),
        "--trusted",
        str(admin_pub),
        "--data-secret",
        str(tmp_path / "k" / "data.secret"),
    ]
    code, _, err = _run([*argv, "--coordinator-key", str(coord), "--no-progress"], capsys)
    assert code == 6 and f"{pol}: the policy declares no public data schema" in err
    assert "policy sign" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r" / "site").exists()
