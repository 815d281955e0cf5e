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
from edge.ledger_anchor import refuse_open_folders
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
    # a sticky shared folder (/tmp) stays shared: the fix named is a private folder in it, not chmod
    fix = f"mkdir -m 700 {folder / 'feta-node'}" if mode & stat.S_ISVTX else f"chmod go-w {folder}"
    assert f"{folder}" in line and f"mode {mode:04o}" in line and fix in line, line
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


@pytest.mark.parametrize("mode", [0o777, 0o770], ids=lambda m: f"{m:04o}")
def test_a_ledger_folder_below_a_folder_others_can_write_is_refused(
    site: Any, tmp_path: Path, mode: int
) -> None:
    """The ledger's own folder is 0700, but whoever can write the folder above it (not sticky) can rename it
    away and put their own folder, ledger files and journal links in its place: refused as the folder itself
    would be, naming the folder above."""
    shared = tmp_path / "shared"
    ledger = shared / "node" / "ledger.db"
    ledger.parent.mkdir(parents=True)
    os.chmod(ledger.parent, 0o700)
    os.chmod(shared, mode)
    # the threat itself: renaming an owner-only folder needs write access to its parent only
    (shared / "node").rename(shared / "node.away")
    (shared / "node.away").rename(shared / "node")
    with pytest.raises(ConfigError) as err:
        preflight(replace(node_settings(site, insecure=True), ledger=ledger))
    line = str(err.value)
    assert f"{shared}: a folder above the node's privacy ledger's folder" in line, line
    assert f"mode {mode:04o}" in line and f"chmod go-w {shared}" in line and len(line.splitlines()) == 1
    assert not ledger.exists()


def test_a_ledger_folder_below_a_sticky_shared_folder_starts(site: Any, tmp_path: Path) -> None:
    """A sticky folder above (``/tmp``) lets only an entry's owner rename it: the node's own 0700 folder
    there is safe, and starts."""
    shared = tmp_path / "sticky"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    ledger = shared / "node" / "ledger.db"
    ledger.parent.mkdir(mode=0o700)
    try:
        preflight(replace(node_settings(site, insecure=True), ledger=ledger)).ledger.close()
    finally:
        forget_sites()
    assert _mode(ledger.parent) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another account takes root")
def test_a_ledger_folder_another_account_owns_is_refused(site: Any, tmp_path: Path) -> None:
    """Its owner can rename or change a folder whatever its mode says (a link's owner can point it
    elsewhere): a ledger folder, or a folder above it, of another account is refused."""
    ledger = tmp_path / "theirs" / "node" / "ledger.db"
    ledger.parent.mkdir(parents=True)
    os.chmod(ledger.parent.parent, 0o755)
    os.chown(ledger.parent.parent, 12345, 12345)
    theirs = ledger.parent.parent
    with pytest.raises(ConfigError, match=rf"{theirs}: .* belongs to another account \(uid 12345\)"):
        preflight(replace(node_settings(site, insecure=True), ledger=ledger))
    # a link (``train --ledger`` keeps the path as given) whose owner can point it elsewhere
    os.chown(ledger.parent.parent, 0, 0)
    link = tmp_path / "link"
    link.symlink_to(ledger.parent.parent)
    os.lchown(link, 12345, 12345)
    with pytest.raises(ConfigError, match=rf"{link}: .* belongs to another account \(uid 12345\)"):
        refuse_open_folders(link / "node" / "ledger.db", tmp_path / "work")


def test_a_train_run_made_under_a_group_umask_opens_its_site(tmp_path: Path) -> None:
    """``train --out`` into folders still to be made, under a umask that lets the group write: the run's
    folders above its site's ledger are made for this account only, so its site is not refused."""
    from coordinator.local_run import TrainOptions, _make_site, _site_files

    root = tmp_path / "runs" / "first"
    old = os.umask(0o002)
    try:
        files = _site_files(root, TrainOptions())
        _make_site(files)
    finally:
        os.umask(old)
    assert _mode(root) == 0o700 and _mode(root.parent) == 0o700
    refuse_open_folders(files.ledger, files.work)
