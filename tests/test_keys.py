"""Ed25519 key files: private key mode 0600, passphrases, fingerprints, CLI."""

from __future__ import annotations

import os
import stat

import pytest
from click.testing import CliRunner

from feta_release import signing
from feta_release.cli import cli
from feta_release.errors import PolicyError


def test_private_key_mode_0600_and_fingerprint(tmp_path) -> None:
    priv, pub = signing.generate_keypair(tmp_path, "site")
    assert stat.S_IMODE(os.stat(priv).st_mode) == 0o600
    key = signing.load_private_key(priv)
    fp = signing.fingerprint(signing.load_public_key(pub))
    assert fp == signing.fingerprint(key) and len(fp) == 16 and int(fp, 16) >= 0


def test_refuses_to_overwrite(tmp_path) -> None:
    signing.generate_keypair(tmp_path, "site")
    with pytest.raises(PolicyError, match="already exists"):
        signing.generate_keypair(tmp_path, "site")


def test_passphrase_protected_key(tmp_path) -> None:
    priv, _ = signing.generate_keypair(tmp_path, "site", passphrase=b"correct horse")
    assert b"ENCRYPTED" in priv.read_bytes()
    assert signing.load_private_key(priv, b"correct horse")
    with pytest.raises(PolicyError, match="wrong passphrase"):
        signing.load_private_key(priv, b"wrong")
    with pytest.raises(PolicyError, match="encrypted; give its passphrase"):
        signing.load_private_key(priv)


def test_passphrase_given_for_plain_key(tmp_path) -> None:
    priv, _ = signing.generate_keypair(tmp_path, "site")
    with pytest.raises(PolicyError, match="not encrypted"):
        signing.load_private_key(priv, b"pw")


def test_cli_generate_and_show(tmp_path) -> None:
    runner = CliRunner()
    pw = tmp_path / "pw.txt"
    pw.write_text("s3cret\n")
    res = runner.invoke(cli, ["keys", "generate", "--out", str(tmp_path / "k"), "--name", "coord",
                              "--passphrase-file", str(pw)])
    assert res.exit_code == 0, res.output
    fp = res.stdout.strip().splitlines()[0]
    priv, pub = tmp_path / "k" / "coord.key", tmp_path / "k" / "coord.pub"
    assert stat.S_IMODE(os.stat(priv).st_mode) == 0o600
    assert signing.fingerprint(signing.load_private_key(priv, b"s3cret")) == fp  # newline stripped
    res = runner.invoke(cli, ["keys", "show", str(pub), "--pem"])
    assert res.exit_code == 0 and res.stdout.splitlines()[0] == fp and "BEGIN PUBLIC KEY" in res.stdout
    res = runner.invoke(cli, ["keys", "show", str(priv), "--passphrase-file", str(pw)])
    assert res.exit_code == 0 and res.stdout.strip() == fp
    bad = tmp_path / "bad.txt"
    bad.write_text("nope")
    res = runner.invoke(cli, ["keys", "show", str(priv), "--passphrase-file", str(bad)])
    assert res.exit_code != 0 and isinstance(res.exception, PolicyError) and "wrong passphrase" in str(res.exception)


def test_cli_prompted_passphrase(tmp_path) -> None:
    runner = CliRunner()
    res = runner.invoke(cli, ["keys", "generate", "--out", str(tmp_path), "--passphrase-prompt"], input="pw1\npw1\n")
    assert res.exit_code == 0, res.output
    assert signing.load_private_key(tmp_path / "signing.key", b"pw1")
