"""The privacy ledger's folder was never checked: whoever can write it (group or others: a shared folder, a
folder made under umask 002, ``/tmp``, sticky or not) can swap the ledger's files between the node's checks
and SQLite's open, or plant its ``-wal``/``-shm`` journal as links before SQLite makes them, whatever the
ledger file's own mode. The node now refuses such a ledger folder, and such a work folder (its anchor, cache
and round checkpoints), before anything is written, in one line naming the folder, its mode and the fix;
the folders the node creates itself are owner-only. ``train`` opens its site the same way (its own ledger
lies in an owner-only run folder; a site's own ``--ledger`` is held to the node's rule)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from coordinator.setup import prepare_federation
from edge.launch import preflight
from edge.site import CFG_DATA, CFG_LEDGER, CFG_WORK, Site, forget_sites
from feta_release.errors import ConfigError
from tests.support.federation import node_settings, tiny_sites


@pytest.fixture()
def site(tmp_path: Path) -> Iterator[Any]:
    fed = prepare_federation(tmp_path / "fed", tiny_sites(2))
    yield fed.site("site-a")
    forget_sites()


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o1777], ids=lambda m: f"{m:04o}")
def test_node_start_refuses_a_ledger_folder_group_or_others_can_write(site: Any, mode: int) -> None:
    folder = site.ledger.parent
    os.chmod(folder, mode)
    try:
        with pytest.raises(ConfigError) as err:
            preflight(node_settings(site, insecure=True))
    finally:
        os.chmod(folder, 0o700)
    line = str(err.value)
    assert f"{folder}" in line and f"mode {mode:04o}" in line and f"chmod go-w {folder}" in line, line
    assert len(line.splitlines()) == 1
    # refused before anything was written: no ledger, no work folder, no anchor
    assert not site.ledger.exists() and not (folder / "work").exists()


def test_node_start_refuses_a_work_folder_others_can_write(site: Any, tmp_path: Path) -> None:
    work = tmp_path / "shared-work"
    work.mkdir()
    os.chmod(work, 0o777)
    with pytest.raises(ConfigError, match=rf"{work}.*mode 0777.*chmod go-w {work}"):
        preflight(node_settings(site, insecure=True, work_dir=work))
    assert not site.ledger.exists() and list(work.iterdir()) == []


def test_the_folders_the_node_creates_for_its_ledger_are_owner_only(site: Any, tmp_path: Path) -> None:
    """Made under a umask that lets the group write (umask 002, common with per-user groups), the ledger's
    new folders would be refused at the next start; the node makes them for its own account only."""
    ledger = tmp_path / "node" / "state" / "ledger.db"
    old = os.umask(0o002)
    try:
        first = preflight(replace(node_settings(site, insecure=True), ledger=ledger))
        first.ledger.close()
        forget_sites()
    finally:
        os.umask(old)
    assert _mode(ledger.parent) == 0o700 and _mode(ledger.parent.parent) == 0o700
    preflight(replace(node_settings(site, insecure=True), ledger=ledger)).ledger.close()  # started again


def test_a_site_held_in_memory_refuses_a_ledger_folder_others_can_write(site: Any, tmp_path: Path) -> None:
    """``train --ledger`` (a site's own ledger, under its signed policy) opens its site in memory: the same
    rule, before the ledger is opened."""
    opened = Site.open(site.node_config())
    data = opened.data
    opened.ledger.close()
    forget_sites()
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o775)
    config = {k: v for k, v in site.node_config().items() if k != CFG_DATA}
    config.update({CFG_LEDGER: str(shared / "ledger.db"), CFG_WORK: str(tmp_path / "w")})
    with pytest.raises(ConfigError, match=rf"{shared}.*mode 0775.*chmod go-w {shared}"):
        Site.in_memory(config, data)
    assert list(shared.iterdir()) == []


def test_a_federation_made_under_a_group_umask_starts(tmp_path: Path) -> None:
    """The demo's sites (``coordinator.setup.prepare_federation``): their folders hold each node's ledger and
    are made for the site's account only, so a node starts under a umask that lets the group write."""
    old = os.umask(0o002)
    try:
        fed = prepare_federation(tmp_path / "fed", tiny_sites(2))
    finally:
        os.umask(old)
    s = fed.site("site-a")
    assert _mode(s.ledger.parent) == 0o700
    try:
        preflight(node_settings(s, insecure=True)).ledger.close()
    finally:
        forget_sites()
