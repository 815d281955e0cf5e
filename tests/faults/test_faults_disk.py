"""Faults: the disk under a site's ledger fills up while the ledger commits a charge.

A small tmpfs is mounted for the ledger where this runs as root; elsewhere the same failure (SQLite's
``database or disk is full``) is injected at the commit. Each case ends with: nothing charged by the failed
write (ledger rows counted), the ledger's chain and signed head intact, the job stopped with the reason, and a
re-run that resumes and charges every request exactly once."""

from __future__ import annotations

import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.setup import prepare_federation, sign_job_file
from edge.site import forget_sites
from feta_release.accounting import PrivacyEvent
from feta_release.errors import PrivacyError
from feta_release.federation.driver import SiteUnavailable
from feta_release.ledger import Budget, Ledger
from feta_release.signing import generate_keypair, load_private_key
from tests.support.federation import harness, run_harness_job, tiny_job, tiny_sites

pytestmark = pytest.mark.slow

BUDGET = Budget(job_epsilon=50.0, lifetime_epsilon=50.0, delta=1e-5)
EVENT = [PrivacyEvent("central", 5.0, 0.1, 1)]


class Disk:
    """A directory whose free space a test can use up (``fill``) and give back (``free``)."""

    def __init__(self, root: Path, mounted: bool) -> None:
        self.root, self.mounted, self.full = root, mounted, False

    def fill(self) -> None:
        self.full = True
        if not self.mounted:
            return
        fd = os.open(self.root / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while True:
                os.write(fd, b"\0" * 65536)
        except OSError:  # ENOSPC: the disk is full now
            pass
        finally:
            os.close(fd)

    def free(self) -> None:
        self.full = False
        (self.root / "filler").unlink(missing_ok=True)


@pytest.fixture
def disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Disk]:
    root = tmp_path / "small-disk"
    root.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(root)], capture_output=True
        ).returncode
        == 0
    )
    d = Disk(root, mounted)
    if not mounted:  # no mount here: the ledger's commit fails as SQLite fails on a full disk
        real = sqlite3.Connection.execute

        class Conn(sqlite3.Connection):
            def execute(self, sql: str, *args: object) -> sqlite3.Cursor:  # type: ignore[override]
                if d.full and sql.strip().upper() == "COMMIT":
                    raise sqlite3.OperationalError("database or disk is full")
                return real(self, sql, *args)

        connect = sqlite3.connect
        monkeypatch.setattr(sqlite3, "connect", lambda *a, **k: connect(*a, **{**k, "factory": Conn}))
    try:
        yield d
    finally:
        forget_sites()
        if mounted:
            subprocess.run(["umount", "-l", str(root)], capture_output=True)


def test_a_full_disk_during_a_charge_records_nothing_and_the_same_request_charges_once_later(disk, tmp_path):
    key = load_private_key(generate_keypair(tmp_path / "keys", "site")[0])
    led = Ledger(disk.root / "ledger.db", key=key)
    led.charge("job", "r0", "central", EVENT, BUDGET, response=b"first")
    disk.fill()
    with pytest.raises(
        PrivacyError,
        match=r"could not record this request \(database or disk is full\); nothing "
        r"was charged or released\. Fix: free disk space",
    ):
        led.charge("job", "r1", "central", EVENT, BUDGET, response=b"x" * 200_000)
    assert led.anchor()["rows"] == 1
    led.close()
    disk.free()
    led = Ledger(disk.root / "ledger.db", key=key, deep=True)  # chain, signed head and stored answers intact
    assert [r["request_id"] for r in led.requests()] == ["r0"]
    assert not led.charge("job", "r1", "central", EVENT, BUDGET, response=b"x" * 200_000).replay
    assert led.charge("job", "r1", "central", EVENT, BUDGET).replay  # sent again: answered, not charged
    assert [r["request_id"] for r in led.requests()] == ["r0", "r1"]
    led.close()


def test_a_job_whose_site_disk_fills_while_charging_stops_with_the_reason_and_a_rerun_resumes(
    disk, tmp_path, monkeypatch
):
    fed = prepare_federation(tmp_path / "fed", tiny_sites(2))
    a = fed.site("site-a")
    a.ledger = disk.root / "ledger.db"  # site-a's ledger (and work directory) on the small disk
    real, fills = Ledger._assess, []

    def assess_then_fill(self, job_id, mechanism, new, policy):  # noqa: ANN001, ANN202 - inside the charge's write
        if self.path == a.ledger and not fills and mechanism == "dpsgd":  # the first DP-SGD charge only
            fills.append(job_id)
            disk.fill()
        return real(self, job_id, mechanism, new, policy)

    monkeypatch.setattr(Ledger, "_assess", assess_then_fill)
    signed, _ = sign_job_file(fed, tiny_job(federation={"rounds": 2, "local_steps": 1}), "job-disk")
    with pytest.raises(
        SiteUnavailable,
        match=r"round 1: only 1 site\(s\).*site-a.*could not record this request "
        r"\(database or disk is full\); nothing was charged",
    ):
        run_harness_job(fed, harness(fed), signed, tmp_path / "out")
    with Ledger(a.ledger) as led:
        assert [r["request_id"] for r in led.requests()] == []
    disk.free()
    forget_sites()
    res = run_harness_job(fed, harness(fed), signed, tmp_path / "out")  # the same --out: resumed
    assert res.rounds_done == 2
    for s in fed.sites:
        with Ledger(s.ledger) as led:
            ids = [r["request_id"] for r in led.requests()]
        # each once: site-b's round 1 answered from its record
        assert ids == ["job-disk:train:0", "job-disk:train:1"]
