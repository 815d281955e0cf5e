"""The node never creates its privacy ledger through a symbolic link: created through one, the ledger (and any
missing folders) lands wherever the link points, a place whoever can change the link chooses. `node start`
refused a link at ``--ledger`` only as given on the command line: node.toml's ``ledger`` (the site kit's way
to start a node) was resolved while the file was read, so the link was followed before it was looked at; and
the node config resolved the path again after the check, so a link put there in between was followed too.
The ledger's own name is now kept as given (its folder resolved), so the check sees it and the creation
itself (``O_EXCL | O_NOFOLLOW``) refuses a link that appears later."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import edge.launch
from coordinator.setup import prepare_federation
from edge import ledger_anchor
from edge.kit import read_node_toml
from edge.launch import NodeSettings, preflight
from feta_release.errors import FetaError
from tests.support.cli import run_cli
from tests.support.federation import node_settings, tiny_sites


def _site(tmp_path: Path) -> Any:
    return prepare_federation(tmp_path / "fed", tiny_sites(2)).site("site-a")


def _node_toml(s: Any, folder: Path, ledger: str) -> Path:
    """A node.toml (as `site init` writes one) naming the site's files, its ledger at ``ledger``."""
    folder.mkdir(parents=True, exist_ok=True)
    toml = folder / "node.toml"
    toml.write_text(
        "[node]\n"
        f'data = "{s.data}"\npolicy = "{s.policy}"\ntrusted_policy_key = "{s.policy_pub}"\n'
        f'ledger = "{ledger}"\nsite_key = "{s.site_key}"\ndata_secret = "{s.data_secret}"\n'
        "insecure = true\n"
    )
    return toml


@pytest.mark.parametrize("new_ledger", [True, False])
def test_a_node_toml_ledger_that_is_a_link_pointing_nowhere_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], new_ledger: bool
) -> None:
    s = _site(tmp_path)
    kit = tmp_path / "kit"
    target = tmp_path / "elsewhere" / "deep" / "ledger.db"
    toml = _node_toml(s, kit, "ledger.db")
    (kit / "ledger.db").symlink_to(target)

    def started(settings: Any, **_: Any) -> Any:  # the checks only: no SuperNode is started here
        preflight(settings).ledger.close()
        raise SystemExit(99)

    monkeypatch.setattr(edge.launch, "start_node", started)
    args = ["node", "start", "--config", str(toml), *(["--new-ledger"] if new_ledger else [])]
    code, _out, err = run_cli(args, capsys)
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("WARNING: --insecure")]
    assert code not in (0, 99) and len(lines) == 1, err
    assert str(kit / "ledger.db") in lines[0] and "symbolic link" in lines[0], err
    assert not (tmp_path / "elsewhere").exists()


def test_node_toml_keeps_the_ledgers_path_as_written(tmp_path: Path) -> None:
    s = _site(tmp_path)
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real)
    (real / "ledger.db").symlink_to(tmp_path / "vol" / "ledger.db")
    settings = read_node_toml(_node_toml(s, tmp_path / "alias" / "kit", "../ledger.db"))
    # the link itself, for `node start` to look at; its node config resolves the folder and keeps the name
    assert settings["ledger"].is_symlink()
    assert ledger_anchor.as_given(settings["ledger"]) == real / "ledger.db"
    assert settings["policy"] == s.policy.resolve()


@pytest.mark.parametrize("new_ledger", [True, False])
def test_a_link_put_at_the_ledger_path_after_the_check_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, new_ledger: bool
) -> None:
    """Whoever can write the ledger's folder puts a link there just after `node start` looked (a race)."""
    s = _site(tmp_path)
    target = tmp_path / "elsewhere" / "ledger.db"
    real_check_device = edge.launch.check_device

    def link_put_now(name: str) -> None:  # the first step after the link check
        s.ledger.symlink_to(target)
        real_check_device(name)

    monkeypatch.setattr(edge.launch, "check_device", link_put_now)
    settings: NodeSettings = node_settings(s, insecure=True, new_ledger=new_ledger)
    with pytest.raises(FetaError, match="link"):
        preflight(settings).ledger.close()
    assert not target.exists() and not target.parent.exists()
    assert s.ledger.is_symlink()  # the link itself is left for the admin to see


def test_the_node_config_names_the_ledger_as_given_under_its_resolved_folder(tmp_path: Path) -> None:
    s = _site(tmp_path)
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real)
    settings: NodeSettings = node_settings(s, insecure=True)
    settings.ledger = tmp_path / "alias" / "ledger.db"
    (real / "ledger.db").symlink_to(tmp_path / "vol" / "ledger.db")
    cfg = settings.node_config()
    assert cfg["ledger-path"] == str(real / "ledger.db")
    assert cfg["work-dir"] == str(real / "work")
    # a link that reaches a ledger (kept on another volume) is opened: the node stays on what it reaches now
    (tmp_path / "vol").mkdir()
    (tmp_path / "vol" / "ledger.db").write_bytes(b"")
    assert settings.node_config()["ledger-path"] == str(tmp_path / "vol" / "ledger.db")


def _run_node_start(
    args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, list[str]]:
    """`node start ARGS` through its checks only (no SuperNode): (exit code, the error lines)."""

    def started(settings: Any, **_: Any) -> Any:
        preflight(settings).ledger.close()
        raise SystemExit(99)

    monkeypatch.setattr(edge.launch, "start_node", started)
    code, _out, err = run_cli(["node", "start", *args], capsys)
    return code, [
        line for line in err.splitlines() if line.strip() and not line.startswith("WARNING: --insecure")
    ]


@pytest.mark.parametrize("new_ledger", [True, False])
@pytest.mark.parametrize("given_by", ["node.toml", "--ledger"])
def test_a_ledger_folder_that_is_a_link_pointing_nowhere_is_refused(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    new_ledger: bool,
    given_by: str,
) -> None:
    """The ledger's folder is a link to a volume that is not there (not mounted, renamed): the node created
    the folders and a fresh, empty ledger where the link pointed, and its anchor, in the default work folder
    beside the ledger, was on the missing volume too, so nothing refused the spent budget coming back."""
    s = _site(tmp_path)
    kit = tmp_path / "kit"
    kit.mkdir()
    gone = tmp_path / "volume" / "feta"
    (kit / "vol").symlink_to(gone)
    toml = _node_toml(s, kit, "vol/ledger.db")
    args = (
        ["--config", str(toml)]
        if given_by == "node.toml"
        else ["--config", str(toml), "--ledger", str(kit / "vol" / "ledger.db")]
    )
    code, lines = _run_node_start([*args, *(["--new-ledger"] if new_ledger else [])], monkeypatch, capsys)
    assert code not in (0, 99) and len(lines) == 1, lines
    assert str(kit / "vol") in lines[0] and "symbolic link" in lines[0] and str(gone) in lines[0], lines
    assert not (tmp_path / "volume").exists()
