"""Data ingestion attacks: one file counted twice, CSV paths the OS refuses, DICOM values pydicom cannot
parse.

Each test failed on the code before its fix."""

from __future__ import annotations

import os
import string
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from feta_release.data import load_dataset
from feta_release.errors import ConfigError, DataError
from tests.support.dicom import write_dicom


def _png(path: Path, value: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = np.full((8, 8), value, np.uint8)
    arr[0, 0] = 255 - value  # images differ, so only the SAME file is a duplicate here
    Image.fromarray(arr, mode="L").save(path)
    return path


def _pngs(root: Path, n: int = 4) -> None:
    for i in range(n):
        _png(root / f"{i}.png", 10 + 20 * i)


# -- the same file counted twice: the patient cap (and the one-image unit) is bypassed
# ----------------------------
def test_csv_same_file_twice_with_two_patient_ids_is_refused(tmp_path: Path) -> None:
    """One image listed twice under two patient ids passed a cap of 1 as two patients (twice the signed ε)."""
    _pngs(tmp_path)
    csv = tmp_path / "labels.csv"
    csv.write_text("path,label,patient_id\n0.png,a,P1\n1.png,a,P3\n./0.png,b,P2\n2.png,b,P4\n")
    with pytest.raises(DataError) as err:
        load_dataset(csv, patient_cap=1)
    msg = str(err.value)
    assert str(csv) in msg and "more than once" in msg and "line 2" in msg and "line 4" in msg
    assert "P1" not in msg and "P2" not in msg  # patient ids are never quoted


def test_csv_same_file_twice_without_patient_ids_is_refused(tmp_path: Path) -> None:
    """A multi-label export (one row per finding) trains on one image twice, in two classes."""
    _pngs(tmp_path)
    csv = tmp_path / "labels.csv"
    csv.write_text("path,label\n0.png,a\n1.png,a\n0.png,b\n2.png,b\n")
    with pytest.raises(DataError, match="more than once"):
        load_dataset(csv)


def test_folder_symlink_to_an_image_of_another_class_is_refused(tmp_path: Path) -> None:
    for c in ("a", "b"):
        for i in range(2):
            _png(tmp_path / c / f"{i}.png", 40 * i + (0 if c == "a" else 100))
    (tmp_path / "b" / "copy.png").symlink_to(tmp_path / "a" / "0.png")
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path)
    assert "more than once" in str(err.value) and "copy.png" in str(err.value)


def test_folder_hard_link_is_refused(tmp_path: Path) -> None:
    for c in ("a", "b"):
        for i in range(2):
            _png(tmp_path / c / f"{i}.png", 40 * i + (0 if c == "a" else 100))
    os.link(tmp_path / "a" / "1.png", tmp_path / "a" / "again.png")
    with pytest.raises(DataError, match="more than once"):
        load_dataset(tmp_path)


# -- CSV paths the OS refuses: one clear line per row, never a traceback
# ----------------------------------------
@pytest.mark.parametrize("bad", ["a\0b.png", "x" * 5000 + ".png", "loop1"])
def test_csv_path_the_os_refuses_is_a_data_error(tmp_path: Path, bad: str) -> None:
    _pngs(tmp_path)
    (tmp_path / "loop1").symlink_to("loop2")
    (tmp_path / "loop2").symlink_to("loop1")
    csv = tmp_path / "labels.csv"
    csv.write_text(f"path,label\n0.png,a\n1.png,a\n{bad},b\n2.png,b\n")
    with pytest.raises(DataError) as err:
        load_dataset(csv)
    assert str(csv) in str(err.value) and "line 4" in str(err.value)


_CELL = st.text(
    alphabet=string.ascii_letters[:4] + "0123./\\\0 ,\"'\n\r\t\u00e9", max_size=12
) | st.sampled_from(["0.png", "1.png", "x" * 300, "a\0.png", "/", ".."])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.lists(_CELL, min_size=2, max_size=3), max_size=6), header=st.booleans())
def test_csv_parser_never_raises_anything_but_a_clear_error(
    tmp_path: Path, rows: list[list[str]], header: bool
) -> None:
    """Any CSV text: loaded, or DataError/ConfigError (one message naming the file), never another
    exception."""
    if not (tmp_path / "0.png").exists():
        _pngs(tmp_path)
    lines = (["path,label,patient_id"] if header else []) + [",".join(r) for r in rows]
    csv = tmp_path / "labels.csv"
    csv.write_text("\n".join(lines), encoding="utf-8")
    try:
        load_dataset(csv)
    except (DataError, ConfigError) as exc:
        assert str(csv) in str(exc)


# -- DICOM values pydicom cannot parse: named file, no traceback, no PHI
# -----------------------------------------
def _dicom_folder(root: Path, patch: bytes) -> Path:
    for c in ("a", "b"):
        for i in range(2):
            write_dicom(
                root / c / f"{i}.dcm",
                (np.arange(64).reshape(8, 8) * (10 + i)).astype(np.uint16),
                slope=9.5,
                intercept=7.5,
            )
    p = root / "a" / "0.dcm"
    raw = p.read_bytes()
    assert raw.count(b"9.5 ") == 1  # the Rescale Slope's DS text, padded to even length
    p.write_bytes(raw.replace(b"9.5 ", patch))
    return p


def test_dicom_rescale_slope_that_is_not_a_number_names_the_file(tmp_path: Path) -> None:
    bad = _dicom_folder(tmp_path, b"abc ")
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path)
    msg = str(err.value)
    assert str(bad) in msg and "Rescale" in msg and "PID-7731-XQ" not in msg and "Doe" not in msg


@pytest.mark.parametrize("patch", [b"NaN ", b"inf "])
def test_dicom_non_finite_rescale_names_the_file(tmp_path: Path, patch: bytes) -> None:
    """NaN/inf slopes used to surface as 'pixel values must be finite' for the whole folder, naming no
    file."""
    bad = _dicom_folder(tmp_path, patch)
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path)
    assert str(bad) in str(err.value)


# -- memory: full-size scans are not all held at once
# -------------------------------------------------------------
def test_full_size_scans_are_conformed_one_at_a_time(tmp_path: Path) -> None:
    """Every decoded full-size image used to be kept until all were read, then resized: memory N x the scan
    size (5,000 chest X-rays of 2,500 x 2,000 pixels: 100 GB of float32). Now only one full-size image lives
    at a time."""
    import tracemalloc

    side, n = 400, 16
    for c in ("a", "b"):
        for i in range(n // 2):
            arr = np.random.default_rng(i + (100 if c == "b" else 0)).integers(
                0, 255, (side, side), dtype=np.uint8
            )
            (tmp_path / c).mkdir(exist_ok=True)
            Image.fromarray(arr, mode="L").save(tmp_path / c / f"{i}.png")
    one_image = side * side * 4  # float32 bytes of one decoded scan
    tracemalloc.start()
    try:
        ds, _ = load_dataset(tmp_path, resize="resize", image_size=8)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ds.images.shape == (n, 1, 8, 8)
    assert peak < 5 * one_image, f"peak {peak / one_image:.1f} decoded scans held at once"


# -- one --flag on the command line dropped the job's / node.toml's other data settings
# --------------------------
def _cli_load(args: list[str]):  # noqa: ANN202 - the LoadOptions (or None) the decorated command receives
    import click
    from click.testing import CliRunner

    from feta_release.cli.data_options import data_load_options

    got: dict = {}

    @click.command()
    @data_load_options
    def cmd(load) -> None:  # noqa: ANN001
        got["load"] = load

    res = CliRunner().invoke(cmd, args)
    assert res.exit_code == 0, res.output
    return got["load"]


def test_train_patient_cap_flag_keeps_the_jobs_window_and_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """``train --job J --patient-cap 1`` read the data with window auto / resize refuse / no image size,
    whatever J's [job] said: one flag silently replaced all four settings (a bits:12 window became auto: other
    pixels)."""
    from types import SimpleNamespace

    import feta_release.data as data_pkg
    import feta_release.data.loading as loading
    from feta_release.cli.train_cmd import _training_data

    seen: dict = {}

    def fake_load(path, **kw):  # noqa: ANN001, ANN202
        seen.update(kw)
        return object(), SimpleNamespace(n_skipped=0, patient_cap=None, patients=None)

    def fake_cap(ds, report, k):  # noqa: ANN001, ANN202
        seen["patient_cap"] = k  # the cap, applied in memory to the one read
        return ds

    monkeypatch.setattr(data_pkg, "load_dataset", fake_load)
    monkeypatch.setattr(loading, "cap_loaded", fake_cap)
    cfg = SimpleNamespace(job=SimpleNamespace(resize="crop", image_size=64, window="bits:12"))
    _training_data(cfg, "some/data", _cli_load(["--patient-cap", "1"]), None)
    assert seen == {
        "resize": "crop",
        "image_size": 64,
        "window": "bits:12",
        "patient_cap": 1,
        "declared": None,
    }


def test_node_start_flag_keeps_node_toml_data_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``node start --config node.toml --window bits:12`` dropped node.toml's [data] resize, image_size and
    patient_cap (the node then refused its own data, or read it otherwise than ``site init`` committed to)."""
    from click.testing import CliRunner

    import edge.launch
    from edge.cli import node

    toml = tmp_path / "node.toml"
    toml.write_text(
        '[node]\ndata = "d"\npolicy = "p"\ntrusted_policy_key = "k"\nledger = "l"\nsite_key = "s"\n'
        'data_secret = "x"\n[data]\nresize = "crop"\nimage_size = 64\nwindow = "40,400"\npatient_cap = 2\n'
    )
    seen: dict = {}

    def fake_run(settings) -> int:  # noqa: ANN001
        seen["load"] = settings.load
        return 0

    monkeypatch.setattr(edge.launch, "run_node", fake_run)
    res = CliRunner().invoke(node, ["start", "--config", str(toml), "--window", "bits:12"])
    assert res.exit_code == 0, res.output
    load = seen["load"]
    assert (load.resize, load.image_size, load.window, load.patient_cap) == ("crop", 64, "bits:12", 2)


# -- a patient cap with images that carry no patient id
# -------------------------------------------------------
def test_patient_cap_refuses_images_without_a_patient_id(tmp_path: Path) -> None:
    """Each image without a DICOM PatientID used to count as its own patient under the cap, with a warning
    that ``train`` and the node never show: a patient whose id is blank on some files passes the cap once per
    such file (the 'per patient' guarantee then holds for nobody in particular)."""
    ramp = (np.arange(64).reshape(8, 8) * 10).astype(np.uint16)
    for i, (cls, pid) in enumerate([("a", "P1"), ("a", "P2"), ("b", "P1"), ("b", "P3")]):
        write_dicom(tmp_path / cls / f"{i}.dcm", ramp + i, patient_id=pid, phi=False)
    anon = write_dicom(tmp_path / "b" / "anon.dcm", ramp + 9, phi=False)  # P1's scan, its PatientID blanked
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path, patient_cap=1)
    assert str(tmp_path) in str(err.value) and str(anon) in str(err.value) and "patient id" in str(err.value)
    _, report = load_dataset(tmp_path)  # without a cap the unit is the image: loaded, and the warning stays
    assert any("without a patient id" in w for w in report.warnings)


# -- the data commitment binds the patient grouping a patient-level policy was signed for
# ------------------------
def test_commitment_changes_when_the_patient_ids_are_regrouped(tmp_path: Path) -> None:
    """The keyed commitment bound pixels and labels only: after the admin signed a patient-level policy, a
    local user could give every CSV row its own patient_id (same images, same labels, same commitment); the
    node then clipped each image as a 'patient' and a real patient's k images moved the sum by k x C, not
    C."""
    from feta_release.data.commitment import dataset_commitment
    from feta_release.data.loading import patient_grouping

    _pngs(tmp_path)
    signed_for = tmp_path / "signed.csv"
    signed_for.write_text("path,label,patient_id\n0.png,a,P1\n1.png,a,P1\n2.png,b,P2\n3.png,b,P2\n")
    regrouped = tmp_path / "regrouped.csv"
    regrouped.write_text("path,label,patient_id\n0.png,a,X1\n1.png,a,X2\n2.png,b,X3\n3.png,b,X4\n")
    secret = b"\x01" * 32
    ds1, rep1 = load_dataset(signed_for, patient_cap=2)
    ds2, rep2 = load_dataset(regrouped, patient_cap=2)
    assert ds1.fingerprint() == ds2.fingerprint()  # the same images and labels
    c1 = dataset_commitment(ds1, secret, patients=patient_grouping(rep1))
    c2 = dataset_commitment(ds2, secret, patients=patient_grouping(rep2))
    assert c1 != c2
    # the same grouping under other ids: the same commitment (ids never enter it)
    renamed = tmp_path / "renamed.csv"
    renamed.write_text("path,label,patient_id\n0.png,a,Q7\n1.png,a,Q7\n2.png,b,Q9\n3.png,b,Q9\n")
    ds3, rep3 = load_dataset(renamed, patient_cap=2)
    assert dataset_commitment(ds3, secret, patients=patient_grouping(rep3)) == c1
    # image-level commitments are unchanged by this (no grouping part)
    assert dataset_commitment(ds1, secret) != c1


# -- .npz whose array headers claim more data than the file can hold
# -------------------------------------------
def _npz_claiming(path: Path, shape: tuple[int, ...], payload: bytes = b"\0" * 1000) -> Path:
    import io
    import zipfile

    from numpy.lib import format as npy_format

    hdr = io.BytesIO()
    npy_format.write_array_header_1_0(hdr, {"descr": "|u1", "fortran_order": False, "shape": shape})
    labels = io.BytesIO()
    np.save(labels, np.zeros(shape[0], np.int64))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("images.npy", hdr.getvalue() + payload)
        z.writestr("labels.npy", labels.getvalue())
    return path


@pytest.mark.parametrize("shape", [(10**6, 10**4, 10**4), (100, 20000, 20000), (10**7, 64, 64)])
def test_npz_header_claiming_a_huge_array_is_refused_before_allocating(
    tmp_path: Path, shape: tuple[int, ...]
) -> None:
    """A 2 KB .npz whose header claims 91 TiB, 37 GiB or 38 GiB (small images, 10 million of them): numpy
    allocated it first (MemoryError traceback, or tens of GB taken before the short data ran out). Refused
    from the headers and the zip's own sizes (an image over the pixel limit; more bytes than the member
    holds), naming file and array."""
    bomb = _npz_claiming(tmp_path / "bomb.npz", shape)
    with pytest.raises(DataError) as err:
        load_dataset(bomb)
    assert str(bomb) in str(err.value) and "'images'" in str(err.value)
