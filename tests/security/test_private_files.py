"""Run files a local user must not read: secrets and the checkpoints (a DP-SGD round's checkpoint holds its
noise generator's state). Review findings H1/H2: they were written through a predictable ``.NAME.tmp-PID``
file opened with plain ``open`` (a planted link received the bytes) at the umask's 0644, in a 0755
``checkpoints/``."""

from __future__ import annotations

import os
from pathlib import Path

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
    p = atomic_write_bytes(tmp_path / "data.secret", b"123\n", private=True)
    assert modes and all(m & 0o077 == 0 for m in modes)
    assert p.stat().st_mode & 0o077 == 0 and p.read_bytes() == b"123\n"


def test_an_ordinary_write_keeps_the_umask_mode(tmp_path: Path, umask_022) -> None:
    p = atomic_write_bytes(tmp_path / "released.npz", b"x")
    assert p.stat().st_mode & 0o777 == 0o644


def test_a_planted_link_at_the_old_temporary_name_receives_nothing(tmp_path: Path) -> None:
    stolen = tmp_path / "attacker-file"
    stolen.write_bytes(b"")
    (tmp_path / f".data.secret.tmp-{os.getpid()}").symlink_to(stolen)
    atomic_write_bytes(tmp_path / "data.secret", b"424242\n", private=True)
    assert stolen.read_bytes() == b""
    assert (tmp_path / "data.secret").read_bytes() == b"424242\n"
    assert not (tmp_path / "data.secret").is_symlink()


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


class Killed(BaseException):
    """The process dies (not an exception a handler catches)."""


@pytest.mark.slow  # a tiny `train` run up to its second DP-SGD step
def test_a_round_checkpoint_with_the_noise_stream_is_owner_only(
    tmp_path: Path, umask_022, monkeypatch
) -> None:
    """The site's DP-SGD round checkpoint (the round's noise generator among its state) of a `train` run
    killed inside the round: owner-only, inside the site's owner-only side of the run, loose folders planted
    there beforehand tightened."""
    from feta_release.config import load_preset
    from feta_release.training.dpsgd import DPSGDTrainer
    from tests.support.training import embedded_subset, train_run

    real_step = DPSGDTrainer.step

    def step(self: DPSGDTrainer, *args: object) -> object:
        if self.steps_done == 2:
            raise Killed
        return real_step(self, *args)

    monkeypatch.setattr(DPSGDTrainer, "step", step)
    out = tmp_path / "run"
    (out / "site" / "work").mkdir(parents=True, mode=0o755)
    for d in (out, out / "site", out / "site" / "work"):
        os.chmod(d, 0o755)
    cfg = load_preset("tiny").replace(warmup={"spatial_iterations": 1}, frequency={"sigma": None})
    with pytest.raises(Killed):
        train_run(cfg, embedded_subset(), out, public_size=240, checkpoint_every=1)
    (ck,) = (out / "site" / "work").rglob("round-*.pt")
    assert ck.stat().st_mode & 0o077 == 0
    assert (out / "site").stat().st_mode & 0o777 == 0o700
    assert (out / "site" / "work").stat().st_mode & 0o777 == 0o700
