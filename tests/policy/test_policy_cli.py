"""CLI round trip: keys generate → policy sign/verify/show → job sign/verify, and refusals naming the rule."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from feta_release import signing
from feta_release.cli import cli
from feta_release.policy import PolicySchemaError, PolicyViolation, make_policy


@pytest.fixture()
def setup(tmp_path):
    runner = CliRunner()
    for name in ("site", "coord"):
        res = runner.invoke(cli, ["keys", "generate", "--out", str(tmp_path / "keys"), "--name", name])
        assert res.exit_code == 0, res.output
    coord_pem = (tmp_path / "keys" / "coord.pub").read_text()
    rng = np.random.default_rng(0)
    data = tmp_path / "data.npz"
    images = rng.random((12, 1, 8, 8)).astype(np.float32)
    labels = np.arange(12) % 3
    np.savez(data, images=images, labels=labels)
    from feta_release.data import load_dataset
    from feta_release.data.commitment import create_secret, dataset_commitment, load_secret

    ds, _ = load_dataset(data)
    secret = load_secret(create_secret(tmp_path / "data.secret"))
    doc = make_policy(
        "site-a",
        dataset_commitment(ds, secret),
        10,
        [coord_pem],
        not_before="2026-01-01T00:00:00Z",
        valid_days=36500,
    )
    (tmp_path / "policy.json").write_text(json.dumps(doc))
    (tmp_path / "job.toml").write_text(
        "[central]\nbatch = 4\nrounds = 1\n[dpsgd]\nsteps = 20\nbatch = 4\n[privacy]\nepsilon = 0.5\n"
    )
    return runner, tmp_path


def test_round_trip(setup) -> None:
    runner, d = setup
    k = d / "keys"
    res = runner.invoke(
        cli,
        [
            "policy",
            "sign",
            str(d / "policy.json"),
            "--key",
            str(k / "site.key"),
            "--out",
            str(d / "signed.json"),
        ],
    )
    assert res.exit_code == 0, res.output
    signed = json.loads((d / "signed.json").read_text())
    assert set(signed) == {"policy", "signature"}
    site_fp = signing.fingerprint(signing.load_public_key(k / "site.pub"))
    assert signed["signature"]["signer"] == site_fp

    res = runner.invoke(
        cli,
        [
            "policy",
            "verify",
            str(d / "signed.json"),
            "--trusted",
            str(k / "site.pub"),
            "--data",
            str(d / "data.npz"),
            "--secret",
            str(d / "data.secret"),
            "--now",
            "2026-03-01T00:00:00Z",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "OK: policy site-a v1" in res.output and "commitment matches" in res.output

    res = runner.invoke(cli, ["policy", "show", str(d / "signed.json"), "--trusted", str(k / "site.pub")])
    assert res.exit_code == 0, res.output
    assert site_fp in res.output and "2026-01-01T00:00:00Z" in res.output and "dpsgd" in res.output

    res = runner.invoke(
        cli,
        [
            "job",
            "sign",
            str(d / "job.toml"),
            "--key",
            str(k / "coord.key"),
            "--job-id",
            "j-1",
            "--sites",
            "site-a,site-b",
            "--out",
            str(d / "job.signed.json"),
        ],
    )
    assert res.exit_code == 0, res.output
    job = json.loads((d / "job.signed.json").read_text())
    assert job["job"]["sites"] == ["site-a", "site-b"] and job["job"]["config"]["privacy"]["epsilon"] == 0.5

    (d / "job2.toml").write_text('[dpsgd]\nsteps = 20\n[federation]\nsites = ["site-a", "site-c"]\n')
    res = runner.invoke(
        cli, ["job", "sign", str(d / "job2.toml"), "--key", str(k / "coord.key"), "--job-id", "j-2"]
    )
    assert res.exit_code == 0, res.output
    assert json.loads((d / "job2.signed.json").read_text())["job"]["sites"] == ["site-a", "site-c"]

    res = runner.invoke(
        cli, ["job", "verify", str(d / "job.signed.json"), "--coordinator", str(k / "coord.pub")]
    )
    assert res.exit_code == 0 and "OK: job j-1" in res.output
    # The node's view: accepted under the site's signed policy (which lists the coordinator's PEM).
    res = runner.invoke(
        cli,
        [
            "job",
            "verify",
            str(d / "job.signed.json"),
            "--policy",
            str(d / "signed.json"),
            "--trusted",
            str(k / "site.pub"),
        ],
    )
    # two sites: secure aggregation by default, so without the data only its Gaussian form is judged: exit 8,
    # not a full pass
    assert res.exit_code == 8, res.output
    assert (
        res.output.startswith("PASSED IN THE GAUSSIAN FORM ONLY") and "accepted by site site-a" in res.output
    )


def test_refusals_name_the_rule(setup) -> None:
    runner, d = setup
    k = d / "keys"
    runner.invoke(
        cli,
        [
            "policy",
            "sign",
            str(d / "policy.json"),
            "--key",
            str(k / "site.key"),
            "--out",
            str(d / "signed.json"),
        ],
    )
    cases = [
        (["policy", "verify", str(d / "signed.json"), "--trusted", str(k / "coord.pub")], "signature.signer"),
        (
            [
                "policy",
                "verify",
                str(d / "signed.json"),
                "--trusted",
                str(k / "site.pub"),
                "--now",
                "2025-01-01T00:00:00Z",
            ],
            "not_before",
        ),
        (
            [
                "policy",
                "verify",
                str(d / "signed.json"),
                "--trusted",
                str(k / "site.pub"),
                "--min-version",
                "2",
            ],
            "version",
        ),
        (
            ["policy", "verify", str(d / "policy.json"), "--trusted", str(k / "site.pub")],
            "signature.required",
        ),
    ]
    for args, rule in cases:
        res = runner.invoke(cli, args)
        assert res.exit_code != 0 and isinstance(res.exception, PolicyViolation), (args, res.output)
        assert res.exception.rule == rule
    # Data changed since signing.
    np.savez(d / "data.npz", images=np.zeros((12, 1, 8, 8), np.float32) + 0.5, labels=np.arange(12) % 3)
    res = runner.invoke(
        cli,
        [
            "policy",
            "verify",
            str(d / "signed.json"),
            "--trusted",
            str(k / "site.pub"),
            "--data",
            str(d / "data.npz"),
            "--secret",
            str(d / "data.secret"),
        ],
    )
    assert isinstance(res.exception, PolicyViolation) and res.exception.rule == "dataset.commitment"
    # A job signed by the site key is not from an allowed coordinator.
    runner.invoke(
        cli,
        [
            "job",
            "sign",
            str(d / "job.toml"),
            "--key",
            str(k / "site.key"),
            "--job-id",
            "j-2",
            "--sites",
            "site-a",
            "--out",
            str(d / "bad-job.json"),
        ],
    )
    res = runner.invoke(
        cli,
        [
            "job",
            "verify",
            str(d / "bad-job.json"),
            "--policy",
            str(d / "signed.json"),
            "--trusted",
            str(k / "site.pub"),
        ],
    )
    assert isinstance(res.exception, PolicyViolation) and res.exception.rule == "coordinators"


def test_sign_refuses_malformed_policy(setup) -> None:
    runner, d = setup
    doc = json.loads((d / "policy.json").read_text())
    doc["mechanisms"]["dpsgd"]["min_sigma"] = 0
    (d / "bad.json").write_text(json.dumps(doc))
    res = runner.invoke(cli, ["policy", "sign", str(d / "bad.json"), "--key", str(d / "keys" / "site.key")])
    assert isinstance(res.exception, PolicySchemaError) and "mechanisms.dpsgd.min_sigma" in str(res.exception)
    assert not (d / "bad.signed.json").exists()


def test_main_prints_rule_and_exits_with_policy_code(setup, capsys) -> None:
    from feta_release.cli import main

    runner, d = setup
    runner.invoke(
        cli,
        [
            "policy",
            "sign",
            str(d / "policy.json"),
            "--key",
            str(d / "keys" / "site.key"),
            "--out",
            str(d / "signed.json"),
        ],
    )
    with pytest.raises(SystemExit) as exc:
        main(["policy", "verify", str(d / "signed.json"), "--trusted", str(d / "keys" / "coord.pub")])
    assert exc.value.code == 6
    assert "policy rule signature.signer" in capsys.readouterr().err
