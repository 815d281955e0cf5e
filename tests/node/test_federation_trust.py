"""The node's app-bundle allow-list gate (edge.trust) and its transport safety checks."""

from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path

import pytest

from edge import trust
from feta_release.errors import ConfigError, PolicyError


def _fab(app_dir: Path) -> bytes:
    from flwr.cli.build import build_fab_from_disk

    return build_fab_from_disk(app_dir)


@pytest.fixture()
def gate(monkeypatch, tmp_path):
    from flwr.supernode.runtime import run_clientapp as rc

    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr_home"))
    monkeypatch.setenv(trust.ENV_LOG, str(tmp_path / "trust.log"))
    monkeypatch.setattr(rc, "install_from_fab", rc.install_from_fab)  # restored after the test
    monkeypatch.setattr(rc, "pull_task_input", rc.pull_task_input)
    monkeypatch.setattr(trust, "_current", {})
    trust.install_gate()
    return rc


def test_fab_hash_is_deterministic_and_app_has_no_code():
    from coordinator.setup import APP_DIR, app_bundle_hash

    assert app_bundle_hash() == app_bundle_hash()
    names = zipfile.ZipFile(io.BytesIO(_fab(APP_DIR))).namelist()
    assert not [n for n in names if n.endswith(".py")], names


def test_untrusted_bundle_is_refused_before_unpacking(gate, monkeypatch, tmp_path):
    from coordinator.setup import APP_DIR

    # A bundle carrying code that would shadow an installed module at the site.
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "pyproject.toml").write_text((APP_DIR / "pyproject.toml").read_text())
    (evil / "edge").mkdir()
    (evil / "edge" / "clientapp.py").write_text("raise SystemExit('pwned')\n")
    fab = _fab(evil)
    monkeypatch.setenv(trust.ENV_ALLOWED, hashlib.sha256(_fab(APP_DIR)).hexdigest())
    with pytest.raises(trust.UntrustedAppError, match="not in this site's allow-list"):
        gate.install_from_fab(fab, skip_prompt=True)
    assert not (tmp_path / "flwr_home").exists() or not any((tmp_path / "flwr_home").rglob("clientapp.py"))
    assert "refused app bundle" in (tmp_path / "trust.log").read_text()


def test_allowed_bundle_installs(gate, monkeypatch, tmp_path):
    from types import SimpleNamespace

    from coordinator.setup import APP_DIR

    fab = _fab(APP_DIR)
    h = hashlib.sha256(fab).hexdigest()
    monkeypatch.setenv(trust.ENV_ALLOWED, h)
    # What the SuperNode hands flwr-clientapp: the run's names and the bundle. The gate checks both first.
    run = SimpleNamespace(fab_id="feta-release/feta-release-app", fab_version="0.1.0")
    monkeypatch.setattr(
        gate, "pull_task_input", lambda client: ("m", "c", run, SimpleNamespace(hash_str=h, content=fab))
    )
    trust.install_gate()
    gate.pull_task_input(None)
    path = gate.install_from_fab(fab, skip_prompt=True)
    assert (Path(path) / "pyproject.toml").exists()


def test_gate_refuses_on_an_unpinned_flower(monkeypatch):
    import flwr

    monkeypatch.setattr(flwr, "__version__", "9.9.9")
    with pytest.raises(PolicyError, match=trust.PINNED_FLWR.replace(".", r"\.")):
        trust.check_flower_internals()


def test_wrapper_script_runs_the_gate(tmp_path):
    shim = trust.write_wrapper(tmp_path / "bin")
    text = shim.read_text()
    assert shim.stat().st_mode & 0o111 and "edge.trust" in text


def test_insecure_only_for_loopback(tmp_path):
    from edge.launch import NodeSettings, check_transport

    base = dict(
        data=tmp_path,
        policy=tmp_path,
        trusted_policy_key=tmp_path,
        ledger=tmp_path / "l.db",
        site_key=tmp_path,
        data_secret=tmp_path,
    )
    check_transport(NodeSettings(**base, superlink="127.0.0.1:9092", insecure=True))
    with pytest.raises(ConfigError, match="non-loopback"):
        check_transport(NodeSettings(**base, superlink="10.1.2.3:9092", insecure=True))
    check_transport(NodeSettings(**base, superlink="10.1.2.3:9092", insecure=True, force_insecure=True))
    with pytest.raises(ConfigError, match="root-certificates"):
        check_transport(NodeSettings(**base, superlink="10.1.2.3:9092"))


def test_superlink_refuses_insecure_off_loopback(tmp_path):
    from coordinator.superlink import SuperLinkSettings, superlink_command

    cmd = superlink_command(SuperLinkSettings(insecure=True, database=tmp_path / "s.db"))
    assert "--disable-runtime-dependency-installation" in cmd and "--database" in cmd
    # the demo's SuperLink keeps its state in memory (no SQLite file to lock under load)
    assert "--database" not in superlink_command(SuperLinkSettings(insecure=True, database=None))
    with pytest.raises(ConfigError):
        superlink_command(SuperLinkSettings(host="0.0.0.0", insecure=True))
    with pytest.raises(ConfigError, match="TLS"):
        superlink_command(SuperLinkSettings(insecure=True, enable_supernode_auth=True))


def test_node_start_refuses_a_policy_signed_by_another_key(tmp_path):
    from click.testing import CliRunner

    from edge.cli import node
    from feta_release.signing import generate_keypair
    from tests.support.federation import make_federation, node_file_options

    fed = make_federation(tmp_path / "fed")
    s = fed.site("site-a")
    _, other_pub = generate_keypair(tmp_path / "other", "other")
    args = [
        "start",
        *node_file_options(s),
        "--superlink",
        "127.0.0.1:1",
        "--insecure",
    ]
    res = CliRunner().invoke(node, [*args, "--trusted", str(other_pub)])
    assert isinstance(res.exception, PolicyError) and "signature.signer" in str(res.exception)
    # Non-loopback without TLS is refused before anything starts.
    res = CliRunner().invoke(
        node, [*args[:-3], "--superlink", "10.0.0.1:9092", "--insecure", "--trusted", str(s.policy_pub)]
    )
    assert isinstance(res.exception, ConfigError)
