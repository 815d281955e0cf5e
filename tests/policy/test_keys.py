"""Ed25519 key files: private key mode 0600, passphrases, fingerprints, CLI."""

from __future__ import annotations

import os
import stat

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    res = runner.invoke(
        cli,
        ["keys", "generate", "--out", str(tmp_path / "k"), "--name", "coord", "--passphrase-file", str(pw)],
    )
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
    assert (
        res.exit_code != 0
        and isinstance(res.exception, PolicyError)
        and "wrong passphrase" in str(res.exception)
    )


def test_cli_prompted_passphrase(tmp_path) -> None:
    runner = CliRunner()
    res = runner.invoke(
        cli, ["keys", "generate", "--out", str(tmp_path), "--passphrase-prompt"], input="pw1\npw1\n"
    )
    assert res.exit_code == 0, res.output
    assert signing.load_private_key(tmp_path / "signing.key", b"pw1")


# -- a secret that other accounts can read or change is refused where it is loaded
# -----------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mode=st.integers(min_value=0o400, max_value=0o777))
def test_a_private_key_open_to_group_or_others_is_refused(tmp_path, mode) -> None:
    """Attack: a site key left 0644 (a copy, a restored backup, a umask of 022) lets every local account sign
    the site's attestations; it was loaded and used."""
    d = tmp_path / f"k{mode:o}"
    priv, _ = signing.generate_keypair(d, "site")
    os.chmod(priv, mode)
    if mode & 0o077:
        with pytest.raises(
            PolicyError,
            match=rf"^{priv}: the private key is (readable|writable) by other users "
            rf"\(mode {mode:o}\); run `chmod 600 {priv}`$",
        ):
            signing.load_private_key(priv)
    else:
        assert signing.load_private_key(priv)


def test_node_start_refuses_a_world_readable_site_key(tmp_path) -> None:
    from edge.launch import preflight
    from tests.support.federation import make_federation, node_settings

    s = make_federation(tmp_path / "fed").site("site-a")
    os.chmod(s.site_key, 0o644)
    settings = node_settings(s, insecure=True)
    with pytest.raises(PolicyError, match=f"{s.site_key}: the private key is readable by other users"):
        preflight(settings)
    assert not s.ledger.exists()  # refused before the ledger was opened


def test_node_start_refuses_a_group_readable_node_authentication_key(tmp_path) -> None:
    """Flower loads the node-auth key itself, with no mode check: whoever reads it can join the federation as
    this site (the coordinator binds the site to that key)."""
    from coordinator.tls import make_certificates
    from edge.launch import preflight
    from feta_release.signing import make_node_auth_key
    from tests.support.federation import make_federation, node_settings

    s = make_federation(tmp_path / "fed").site("site-a")
    certs = make_certificates(tmp_path / "certs")
    auth, _ = make_node_auth_key(tmp_path / "nodes", "site-a")
    os.chmod(auth, 0o640)
    settings = node_settings(s, root_certificates=certs["ca_cert"], auth_key=auth)
    with pytest.raises(
        PolicyError,
        match=f"{auth}: the node authentication key is readable by other users "
        r"\(mode 640\); run `chmod 600",
    ):
        preflight(settings)
    assert not s.ledger.exists()
