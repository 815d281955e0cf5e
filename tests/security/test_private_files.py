"""Run files a local user must not read: the noise secret and the checkpoints (``dpsgd.pt`` holds the DP-SGD
noise generator's state). Review findings H1/H2: they were written through a predictable ``.NAME.tmp-PID``
file opened with plain ``open`` (a planted link received the bytes) at the umask's 0644, in a 0755
``checkpoints/``."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from feta_release import files
from feta_release.files import atomic_write_bytes, private_dir


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _spy_replace(monkeypatch) -> list[int]:
    """The mode of each file as ``os.replace`` moves it into place (the window a reader could open it in)."""
    modes: list[int] = []
    real = os.replace

    def spy(src, dst):  # noqa: ANN001, ANN202
        modes.append(os.stat(src).st_mode & 0o777)
        return real(src, dst)

    monkeypatch.setattr(files.os, "replace", spy)
    return modes


def test_a_private_write_is_never_readable_by_others(tmp_path: Path, umask_022, monkeypatch) -> None:
    modes = _spy_replace(monkeypatch)
    p = atomic_write_bytes(tmp_path / "noise_seed.txt", b"123\n", private=True)
    assert modes and all(m & 0o077 == 0 for m in modes)
    assert p.stat().st_mode & 0o077 == 0 and p.read_bytes() == b"123\n"


def test_an_ordinary_write_keeps_the_umask_mode(tmp_path: Path, umask_022) -> None:
    p = atomic_write_bytes(tmp_path / "released.npz", b"x")
    assert p.stat().st_mode & 0o777 == 0o644


def test_a_planted_link_at_the_old_temporary_name_receives_nothing(tmp_path: Path) -> None:
    stolen = tmp_path / "attacker-file"
    stolen.write_bytes(b"")
    (tmp_path / f".noise_seed.txt.tmp-{os.getpid()}").symlink_to(stolen)
    atomic_write_bytes(tmp_path / "noise_seed.txt", b"424242\n", private=True)
    assert stolen.read_bytes() == b""
    assert (tmp_path / "noise_seed.txt").read_bytes() == b"424242\n"
    assert not (tmp_path / "noise_seed.txt").is_symlink()


def test_a_failed_write_leaves_no_temporary_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(files.os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk gone")))
    with pytest.raises(OSError, match="disk gone"):
        atomic_write_bytes(tmp_path / "x.pt", b"data", private=True)
    assert list(tmp_path.iterdir()) == []


def test_private_dir_tightens_a_loose_directory(tmp_path: Path) -> None:
    d = tmp_path / "checkpoints"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    assert private_dir(d).stat().st_mode & 0o777 == 0o700


def test_a_checkpoint_with_the_noise_stream_is_owner_only(tmp_path: Path, umask_022) -> None:
    import torch

    from feta_release.config import load_preset
    from feta_release.ledger import Ledger
    from feta_release.planning import plan
    from feta_release.signing import generate_keypair, load_private_key
    from feta_release.stages import RunAccount, run_budget
    from feta_release.stages.context import RunDir, save_checkpoint

    cfg = load_preset("tiny")
    key = load_private_key(generate_keypair(tmp_path / "keys", "site")[0])
    account = RunAccount(
        Ledger(tmp_path / "ledger.sqlite", key=key),
        "job",
        plan(cfg, 60000),
        run_budget(cfg),
        tmp_path / "privacy.json",
    )
    (tmp_path / "run" / "checkpoints").mkdir(parents=True, mode=0o755)
    rd = RunDir(tmp_path / "run")
    save_checkpoint(
        SimpleNamespace(rd=rd, account=account),
        "dpsgd.pt",
        {"noise": torch.Generator().manual_seed(5).get_state()},
    )
    assert rd.ckpt("dpsgd.pt").stat().st_mode & 0o077 == 0
    assert rd.ckpt("dpsgd.pt").parent.stat().st_mode & 0o777 == 0o700
