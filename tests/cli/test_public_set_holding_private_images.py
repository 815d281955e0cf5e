"""A public pretraining set that holds the private images themselves costs no epsilon and would release them
unprotected: where one process reads both (``train --data --public``, ``demo --public PATH``) it is refused in
one line naming the file, how many of its images are copies and the fix, before anything is charged, written
or trained."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.demo import refuse_site_images, site_datasets
from coordinator.demo_public import DemoPublic
from feta_release.cli import main
from feta_release.data import ImageDataset, load_embedded, save_npz
from feta_release.data.procedural import generate_dataset
from feta_release.errors import PrivateImagesInPublicSet
from tests.support.cli import run_cli, run_cli_merged

N_COPIES = 5


class Started(Exception):
    """The run was handed to the trainer: the public set was accepted."""


@pytest.fixture
def trainer(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Stands in for the run that charges and trains; records that it was reached."""
    reached: list[Any] = []

    def run_train(cfg: Any, data: Any, out_dir: Any, opts: Any) -> None:
        reached.append(opts.public)
        raise Started

    monkeypatch.setattr("coordinator.local_run.run_train", run_train)
    return reached


def _digits(per_class: int, skip: int = 0) -> ImageDataset:
    """``per_class`` embedded digits of each class, after the first ``skip`` of it."""
    full = load_embedded()
    idx = [np.flatnonzero(full.labels == c)[skip : skip + per_class] for c in range(10)]
    return full.subset(np.sort(np.concatenate(idx)))


@pytest.fixture(scope="module")
def private_npz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("private") / "digits.npz"
    save_npz(_digits(12), path)  # 120 images, float32 pixels
    return path


def _strokes_with(copies: np.ndarray, path: Path) -> Path:
    """40 generated pen strokes and ``copies`` among them, stored as uint8 (a float round trip of the
    private pixels)."""
    strokes = generate_dataset("strokes", 40, size=28, seed=5)
    images = np.concatenate([strokes.images, copies]).astype(np.float32)
    order = np.random.default_rng(0).permutation(len(images))
    labels = np.concatenate([strokes.labels, np.zeros(len(copies), np.int64)])
    save_npz(ImageDataset(images[order], labels[order], strokes.class_names), path, dtype="uint8")
    return path


def _train(data: Path, public: Path, out: Path) -> list[str]:
    return ["train", "--preset", "tiny", "--data", str(data), "--public", str(public), "--out", str(out)]


def test_train_refuses_the_private_data_given_as_its_own_public_set(private_npz, tmp_path, trainer, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli([*_train(private_npz, private_npz, out), "--no-progress"], capsys)
    assert code == PrivateImagesInPublicSet.exit_code == 3, err
    assert f"{private_npz}: 120 of its 120 images are exact copies of images in the private data" in err
    assert "use a public set from another source" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert trainer == [] and not out.exists()  # nothing charged: no ledger, no run folder, no training


def test_train_refuses_a_public_set_with_a_few_private_images_among_generated_ones(
    private_npz, tmp_path, trainer, capsys
):
    private = _digits(12).images
    public = _strokes_with(private[[3, 17, 17, 64, 119]], tmp_path / "mixed.npz")
    out = tmp_path / "run"
    code, _, err = run_cli([*_train(private_npz, public, out), "--no-progress"], capsys)
    assert code == 3 and f"{public}: {N_COPIES} of its 45 images are exact copies" in err, err
    assert trainer == [] and not out.exists()


def test_train_accepts_a_public_set_disjoint_from_the_private_data(private_npz, tmp_path, trainer):
    others = _digits(1, skip=12).images[:N_COPIES]  # digits, but not the private ones
    public = _strokes_with(others, tmp_path / "disjoint.npz")
    with pytest.raises(Started):
        main([*_train(private_npz, public, tmp_path / "run"), "--no-progress"])
    assert trainer[0].data.n == 45


def _site_copies(tmp_path: Path, per_site: int | None) -> Path:
    sites, _ = site_datasets(per_site)
    site_b = sites["site-b"].images
    return _strokes_with(site_b[:N_COPIES], tmp_path / "with-site-digits.npz")


def test_demo_refuses_a_public_path_holding_its_sites_digits_before_anything_is_written(
    tmp_path, monkeypatch
):
    def prepare(*args: Any) -> None:  # writing the federation and starting its processes: never reached
        raise Started

    monkeypatch.setattr("coordinator.demo._prepare", prepare)
    public = _site_copies(tmp_path, None)
    out = tmp_path / "demo"
    code, text = run_cli_merged(["demo", "--out", str(out), "--public", str(public), "--no-progress"])
    assert code == 3 and f"{public}: {N_COPIES} of its 45 images are exact copies" in text, text
    assert "digits of the demo's sites" in text and "from another source" in text
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1
    assert not out.exists()  # no federation, keys or processes


def test_the_demo_check_counts_only_the_sites_digits(tmp_path):
    sites, heldout = site_datasets(50)
    fine = _strokes_with(heldout.images[:3], tmp_path / "heldout.npz")  # not a site's: no privacy at stake
    refuse_site_images(DemoPublic(fine, "", _load(fine)), sites)
    copied = _strokes_with(sites["site-c"].images[-2:], tmp_path / "site-c.npz")
    with pytest.raises(PrivateImagesInPublicSet, match="2 of its 42 images"):
        refuse_site_images(DemoPublic(copied, "", _load(copied)), sites)


def _load(path: Path) -> ImageDataset:
    from feta_release.data import load_dataset

    return load_dataset(path)[0]


def _two_scans_per_patient(root: Path) -> tuple[Path, np.ndarray]:
    """30 patients with two scans each (CSV path,label,patient_id) and the second scans: the ones a cap of 1
    drops."""
    from PIL import Image

    rng = np.random.default_rng(0)
    rows, second = ["path,label,patient_id"], []
    for p in range(30):
        for j in range(2):
            pixels = rng.integers(0, 256, (28, 28), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"p{p}_{j}.png")
            rows.append(f"p{p}_{j}.png,{'ab'[p % 2]},pat{p}")
            if j == 1:
                second.append(pixels)
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    return root / "labels.csv", np.stack(second)[:, None].astype(np.float32) / 255


def test_train_refuses_a_public_set_of_the_scans_the_patient_cap_drops(tmp_path, trainer, capsys):
    """``--patient-cap 1`` trains on one scan a patient; the others are still that patient's private images,
    so a public set made of them is refused as copies."""
    data, dropped = _two_scans_per_patient(tmp_path)
    public = tmp_path / "dropped.npz"
    save_npz(ImageDataset(dropped, np.arange(30) % 2, ("a", "b")), public, dtype="uint8")
    out = tmp_path / "run"
    argv = [*_train(data, public, out), "--patient-cap", "1", "--public-patients", "30", "--no-progress"]
    code, _, err = run_cli(argv, capsys)
    assert code == 3 and f"{public}: 30 of its 30 images are exact copies" in err, err
    assert trainer == [] and not out.exists()


def test_a_data_file_rewritten_after_it_is_read_cannot_hide_copies_of_the_scans_trained_on(
    tmp_path, trainer, capsys, monkeypatch
):
    """``--patient-cap`` with ``--public``: the scans trained on and the scans the public set is checked
    against come from ONE read of --data. Read twice (capped to train, uncapped to check), a labels file
    rewritten between the reads to name other scans hid a public set made of the very scans trained on: the
    check judged bytes the run never trained on, and the set was accepted."""
    from PIL import Image

    import feta_release.data as data_pkg

    data, _ = _two_scans_per_patient(tmp_path)
    first = np.stack([np.asarray(Image.open(tmp_path / f"p{p}_0.png")) for p in range(30)])
    public = tmp_path / "first-scans.npz"
    save_npz(ImageDataset(first[:, None].astype(np.float32) / 255, np.arange(30) % 2, ("a", "b")), public)
    read = data_pkg.load_dataset
    reads: list[str] = []

    def read_then_rewrite(path, **kw):  # noqa: ANN001, ANN202
        out = read(path, **kw)
        if str(path) == str(data):
            reads.append(str(path))
            other = ["path,label,patient_id"]
            rng = np.random.default_rng(7)
            for p in range(30):
                for j in range(2):
                    pixels = rng.integers(0, 256, (28, 28), dtype=np.uint8)
                    Image.fromarray(pixels).save(tmp_path / f"other{p}_{j}.png")
                    other.append(f"other{p}_{j}.png,{'ab'[p % 2]},pat{p}")
            data.write_text("\n".join(other) + "\n")
        return out

    monkeypatch.setattr(data_pkg, "load_dataset", read_then_rewrite)
    out = tmp_path / "run"
    argv = [*_train(data, public, out), "--patient-cap", "1", "--public-patients", "30", "--no-progress"]
    code, _, err = run_cli(argv, capsys)
    assert reads == [str(data)], "the private data were read more than once"
    assert code == 3 and f"{public}: 30 of its 30 images are exact copies" in err, err
    assert trainer == [] and not out.exists()
