"""`node start` resolves the paths of its node config, the ledger's included, so a ledger path that is a
symbolic link was never seen as one: under --new-ledger, a link pointing nowhere had the node create the new
ledger (and every missing folder) wherever the link pointed, a place whoever can change the link chooses, and
a plain first start did the same. The node now never creates its ledger through a link: --new-ledger refuses
any link, a plain start refuses one that points nowhere, each in one line naming the path and the fix, before
anything is written. A plain start still opens an existing ledger through a link (a ledger kept on another
volume); what the link reaches is checked against the node's anchor like any ledger file."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest

import edge.launch
from coordinator.setup import prepare_federation
from edge import ledger_anchor
from edge.launch import preflight
from edge.site import forget_sites
from feta_release.errors import ConfigError
from tests.support.cli import run_cli
from tests.support.federation import node_file_options, node_settings, tiny_sites
from tests.support.lost_ledger import charge


def _site(tmp_path: Path) -> Any:
    return prepare_federation(tmp_path / "fed", tiny_sites(2)).site("site-a")


def _settings(s: Any, ledger: Path, **more: Any) -> Any:
    """The node's settings with its ledger at ``ledger`` (the path as given, before the node config)."""
    return dataclasses.replace(node_settings(s, insecure=True, **more), ledger=ledger)


def _written(*paths: Path) -> list[Path]:
    return [p for p in paths if p.exists()]


@pytest.mark.parametrize("new_ledger", [True, False])
def test_a_ledger_link_pointing_nowhere_is_refused_before_anything_is_written(
    tmp_path: Path, new_ledger: bool
) -> None:
    s = _site(tmp_path)
    target = tmp_path / "elsewhere" / "deep" / "ledger.db"
    link, work = tmp_path / "ledger.db", tmp_path / "work"
    link.symlink_to(target)
    with pytest.raises(ConfigError) as exc:
        preflight(_settings(s, link, new_ledger=new_ledger, work_dir=work)).ledger.close()
    msg = str(exc.value)
    assert msg.startswith(f"{link}: ") and "\n" not in msg, msg
    assert str(target) in msg and "symbolic link" in msg and "Fix: give --ledger" in msg, msg
    assert "real file path" in msg if new_ledger else "real path of the ledger file" in msg, msg
    assert _written(target.parent.parent, work) == []


def test_new_ledger_refuses_a_link_to_an_existing_file(tmp_path: Path) -> None:
    """It said "one is there; move it aside" naming the link's TARGET, as if moving the target would do."""
    s = _site(tmp_path)
    target = tmp_path / "vol" / "ledger.db"
    target.parent.mkdir()
    target.write_bytes(b"")
    link, work = tmp_path / "ledger.db", tmp_path / "work"
    link.symlink_to(target)
    with pytest.raises(ConfigError, match=f"^{link}: --new-ledger creates the privacy ledger only at a real"):
        preflight(_settings(s, link, new_ledger=True, work_dir=work)).ledger.close()
    assert target.read_bytes() == b"" and _written(work) == []


def test_node_start_new_ledger_says_one_line_for_a_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    s = _site(tmp_path)
    target = tmp_path / "elsewhere" / "ledger.db"
    s.ledger.symlink_to(target)

    def started(settings: Any, **_: Any) -> Any:  # the checks only: no SuperNode is started here
        preflight(settings).ledger.close()
        raise SystemExit(99)

    monkeypatch.setattr(edge.launch, "start_node", started)
    code, _out, err = run_cli(
        [
            "node",
            "start",
            *node_file_options(s),
            "--trusted",
            str(s.policy_pub),
            "--insecure",
            "--new-ledger",
        ],
        capsys,
    )
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("WARNING: --insecure")]
    assert code not in (0, 99) and len(lines) == 1, err
    assert str(s.ledger) in lines[0] and "real file path" in lines[0], err
    assert _written(target.parent) == []


def test_a_plain_start_opens_an_existing_ledger_through_a_link_and_checks_it_against_the_anchor(
    tmp_path: Path,
) -> None:
    s = _site(tmp_path)
    work = tmp_path / "work"
    site = preflight(node_settings(s, insecure=True, work_dir=work))
    charge(site.ledger, 1)
    site.ledger.close()
    old = tmp_path / "old-ledger.db"
    shutil.copy2(s.ledger, old)
    forget_sites()
    site = preflight(node_settings(s, insecure=True, work_dir=work))
    charge(site.ledger, 1)
    ledger_anchor.record(site.ledger, work)
    site.ledger.close()
    forget_sites()
    # the ledger moved to another volume, reached through a link
    vol = tmp_path / "vol"
    vol.mkdir()
    for p in s.ledger.parent.glob(s.ledger.name + "*"):
        shutil.move(p, vol / p.name)
    link = tmp_path / "ledger-link.db"
    link.symlink_to(vol / s.ledger.name)
    site = preflight(_settings(s, link, work_dir=work))
    assert site.ledger.anchor()["rows"] == 2
    site.ledger.close()
    forget_sites()
    # the link moved to the older copy: refused as a restored older copy is
    link.unlink()
    link.symlink_to(old)
    with pytest.raises(ledger_anchor.LedgerRegressedError, match=r"an older copy of it \(1 row"):
        preflight(_settings(s, link, work_dir=work))
