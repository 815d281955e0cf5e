"""Hospital data: DICOM, 12-bit data in 16-bit files, CSV labels with patient ids, one-pass problem reports,
resize/crop, and no PHI in anything the data path prints or writes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from feta_release.data import load_dataset
from feta_release.data.dicom import Window, linear_window, parse_window
from feta_release.errors import ConfigError, DataError
from tests.support.dicom import PHI, write_dicom


def ramp(h: int = 8, w: int = 8, top: int = 4095, dtype=np.uint16) -> np.ndarray:
    return np.linspace(0, top, h * w).reshape(h, w).astype(dtype)


def dicom_folder(root: Path, **kw) -> Path:
    for c, top in (("normal", 2000), ("effusion", 4095)):
        for i in range(3):
            write_dicom(root / c / f"im{i}.dcm", ramp(top=top - i), **kw)
    return root


# -- DICOM ------------------------------------------------------------------------------------------
def test_dicom_folder_twelve_bit_uses_bits_stored(tmp_path: Path) -> None:
    ds, report = load_dataset(dicom_folder(tmp_path))
    assert ds.n == 6 and ds.class_names == ("effusion", "normal") and ds.image_shape == (1, 8, 8)
    # 12-bit data is scaled over 0..4095, not 0..65535: the brightest pixel is ~1, not ~0.06.
    assert ds.images[ds.labels == 0].max() == pytest.approx(1.0, abs=1e-6)
    assert ds.images[ds.labels == 1].max() == pytest.approx(2000 / 4095, abs=1e-4)
    assert report.conversions["DICOM scaled over its 12-bit range"] == 6


def test_monochrome1_is_inverted(tmp_path: Path) -> None:
    dicom_folder(tmp_path / "m2")
    dicom_folder(tmp_path / "m1", photometric="MONOCHROME1")
    a, _ = load_dataset(tmp_path / "m2")
    b, report = load_dataset(tmp_path / "m1")
    np.testing.assert_allclose(b.images, 1.0 - a.images, atol=1e-6)
    assert any("MONOCHROME1 inverted" in k for k in report.conversions)


def test_rescale_and_file_window(tmp_path: Path) -> None:
    # CT-like: stored 0..4095, HU = stored - 1024; file window 40/400 (soft tissue).
    raw = np.array([[1024 + 40 - 200, 1024 + 40, 1024 + 40 + 200, 0]], np.uint16).repeat(4, 0)
    for c in ("a", "b"):
        write_dicom(tmp_path / c / "x.dcm", raw, slope=1.0, intercept=-1024.0, window=(40, 400))
    ds, report = load_dataset(tmp_path)
    row = ds.images[0, 0, 0]
    assert row[0] == pytest.approx(0.0, abs=0.01) and row[1] == pytest.approx(0.5, abs=0.01)
    assert row[2] == pytest.approx(1.0, abs=0.01) and row[3] == 0.0
    assert report.conversions["DICOM windowed by its Window Center/Width"] == 2
    # The site's window overrides the file's.
    ds2, _ = load_dataset(tmp_path, window="40,80")
    assert ds2.images[0, 0, 0, 1] == pytest.approx(0.5, abs=0.02) and ds2.images[0, 0, 0, 0] == 0.0
    # bits: ignore the file window, full 12-bit range through the rescale.
    ds3, _ = load_dataset(tmp_path, window="bits:12")
    assert ds3.images[0, 0, 0, 1] == pytest.approx((1024 + 40) / 4095, abs=1e-4)


def test_eight_bit_and_signed_dicom(tmp_path: Path) -> None:
    for c in ("a", "b"):
        write_dicom(tmp_path / "u8" / c / "x.dcm", ramp(top=255, dtype=np.uint8), bits_stored=8)
        write_dicom(
            tmp_path / "s16" / c / "x.dcm",
            (ramp(top=4095).astype(np.int32) - 2048).astype(np.int16),
            bits_stored=12,
            signed=True,
        )
    u8, _ = load_dataset(tmp_path / "u8")
    assert u8.images.max() == pytest.approx(1.0) and u8.images.min() == 0.0
    s16, _ = load_dataset(tmp_path / "s16")
    assert s16.images.min() == pytest.approx(0.0) and s16.images.max() == pytest.approx(1.0, abs=1e-3)


def test_colour_dicom_converted(tmp_path: Path) -> None:
    rgb = np.zeros((6, 6, 3), np.uint8)
    rgb[..., 0] = 255
    for c in ("a", "b"):
        write_dicom(tmp_path / c / "x.dcm", rgb, photometric="RGB", bits_stored=8)
    ds, _ = load_dataset(tmp_path)
    assert ds.image_shape == (3, 6, 6)
    np.testing.assert_allclose(ds.images[:, 0].min(), 1.0)
    np.testing.assert_allclose(ds.images[:, 1:].max(), 0.0)


def test_extensionless_dicom_found(tmp_path: Path) -> None:
    for c in ("a", "b"):
        write_dicom(tmp_path / c / "IM00001", ramp())
    (tmp_path / "a" / "README").write_text("not an image")
    ds, report = load_dataset(tmp_path)
    assert ds.n == 2 and report.n_skipped == 1


def test_refused_dicom_layouts_named_with_reason(tmp_path: Path) -> None:
    write_dicom(tmp_path / "a" / "cine.dcm", np.stack([ramp(), ramp()]), frames=2)
    write_dicom(
        tmp_path / "a" / "pal.dcm", ramp(top=255, dtype=np.uint8), bits_stored=8, photometric="PALETTE COLOR"
    )
    write_dicom(tmp_path / "b" / "ok.dcm", ramp())
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path)
    msg = str(err.value)
    assert "cine.dcm: multi-frame DICOM (2 frames) is not supported" in msg
    assert "pal.dcm: DICOM photometric interpretation PALETTE COLOR is not supported" in msg


# -- 16-bit PNG/TIFF ----------------------------------------------------------------------------------
def test_twelve_bit_png_not_black(tmp_path: Path) -> None:
    for c in ("a", "b"):
        for ext in ("png", "tif"):
            p = tmp_path / c / f"x.{ext}"
            p.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(ramp(top=3900)).save(p)
    ds, report = load_dataset(tmp_path)
    assert ds.images.max() == pytest.approx(3900 / 4095, abs=1e-4)  # was 3900 / 65535 = 0.06
    assert report.conversions["16-bit scaled as 12-bit (0..4095)"] == 4
    ds2, _ = load_dataset(tmp_path, window="bits:16")
    assert ds2.images.max() == pytest.approx(3900 / 65535, abs=1e-5)
    ds3, _ = load_dataset(tmp_path, window="1950,3900")
    assert ds3.images.max() == pytest.approx(1.0) and ds3.images.min() == 0.0


def test_mixed_depths_warned(tmp_path: Path) -> None:
    for c, top in (("a", 900), ("b", 4000)):
        p = tmp_path / c / "x.png"
        p.parent.mkdir(parents=True)
        Image.fromarray(ramp(top=top)).save(p)
    _, report = load_dataset(tmp_path)
    assert any("different bit depths" in w and "bits:12" in w for w in report.warnings)


@settings(max_examples=60, deadline=None)
@given(
    c=st.floats(-5000, 5000), w=st.floats(1, 10000), x=st.lists(st.floats(-1e5, 1e5), min_size=2, max_size=20)
)
def test_linear_window_bounded_and_monotone(c: float, w: float, x: list[float]) -> None:
    xs = np.sort(np.array(x))
    y = linear_window(xs, c, w)
    assert (y >= 0).all() and (y <= 1).all() and (np.diff(y) >= -1e-7).all()


@given(st.text(max_size=12))
def test_parse_window_total(text: str) -> None:
    try:
        w = parse_window(text)
    except ConfigError:
        return
    assert isinstance(w, Window) and parse_window(str(w)) == w


# -- CSV labels and patients ------------------------------------------------------------------------
def test_csv_labels_with_patient_ids(tmp_path: Path) -> None:
    lines = ["path,label,patient_id"]
    for i in range(6):
        name = f"img/{i}.png"
        p = tmp_path / name
        p.parent.mkdir(exist_ok=True)
        Image.fromarray(np.full((8, 8), 30 * i, np.uint8)).save(p)
        lines.append(f"{name},{'sick' if i % 2 else 'well'},MRN-{i // 3}")
    (tmp_path / "labels.csv").write_text("\n".join(lines) + "\n")
    ds, report = load_dataset(tmp_path / "labels.csv")
    assert ds.class_names == ("sick", "well") and ds.n == 6 and report.kind == "csv"
    assert report.n_patients == 2 and report.patients.tolist() == [0, 0, 0, 1, 1, 1]
    d = report.to_dict()
    assert d["n_patients"] == 2 and d["max_images_per_patient"] == 3
    assert "MRN" not in json.dumps(d)


def test_csv_every_bad_row_listed_without_patient_id(tmp_path: Path) -> None:
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(tmp_path / "a.png")
    (tmp_path / "l.csv").write_text(
        "path,label,patient_id\na.png,x,SECRET-1\nmissing.png,y,SECRET-2\na.png,,SECRET-3\na.png,y,\n"
    )
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path / "l.csv")
    msg = str(err.value)
    assert (
        "line 3:" in msg and "missing.png" in msg and "line 4:" in msg and "line 5: empty patient_id" in msg
    )
    assert "SECRET" not in msg


def test_dicom_patient_id_groups(tmp_path: Path) -> None:
    for i in range(4):
        write_dicom(
            tmp_path / ("a" if i < 2 else "b") / f"{i}.dcm", ramp(top=100 * i + 5), patient_id=f"P{i % 3}"
        )
    _, report = load_dataset(tmp_path)
    assert report.n_patients == 3 and report.patients.tolist() == [0, 1, 2, 0]


# -- every problem in one pass ----------------------------------------------------------------------
def _folder_with_every_problem(root: Path) -> dict[str, str]:
    good = Image.fromarray(np.full((8, 8), 100, np.uint8))
    for c in ("cat", "dog"):
        (root / c).mkdir(parents=True)
        for i in range(3):
            good.save(root / c / f"{i}.png")
    (root / "empty_class").mkdir()
    (root / "cat" / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    buf = root / "dog" / "full.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (14, 14), np.uint8)).save(buf)
    (root / "dog" / "truncated.png").write_bytes(buf.read_bytes()[:120])
    buf.unlink()
    Image.fromarray(np.zeros((12, 9), np.uint8)).save(root / "dog" / "odd_size.png")
    Image.new("L", (20, 20)).save(root / "cat" / "bomb.png")
    write_dicom(root / "cat" / "cine.dcm", np.stack([ramp(), ramp()]), frames=2)
    return {
        "empty_class/": "class folders without any",
        "corrupt.png": "cannot be opened",
        "truncated.png": "corrupt or truncated",
        "odd_size.png": "(12x9)",
        "bomb.png": "> limit 200",
        "cine.dcm": "multi-frame",
    }


def test_every_problem_reported_in_one_pass(tmp_path: Path) -> None:
    expected = _folder_with_every_problem(tmp_path)
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path, max_pixels=200)
    msg = str(err.value)
    assert "kinds of problem" in msg
    for name, what in expected.items():
        line = next((ln for ln in msg.splitlines() if name in ln), "")
        assert line, f"{name} not named in:\n{msg}"
        assert what in line or what in msg, (name, what, msg)


def test_cli_inspect_lists_every_problem(tmp_path: Path, capsys) -> None:
    from feta_release.cli import main

    expected = _folder_with_every_problem(tmp_path)
    with pytest.raises(SystemExit) as ex:
        main(["data", "inspect", str(tmp_path)])
    err = capsys.readouterr().err
    assert ex.value.code == 3 and "Traceback" not in err
    for name in expected:
        if name != "bomb.png":  # only a bomb under the default 50M-pixel limit here
            assert name in err


# -- resize / crop ----------------------------------------------------------------------------------
def test_crop_keeps_aspect(tmp_path: Path) -> None:
    wide = np.zeros((8, 16), np.uint8)
    wide[:, 4:12] = 255  # the centre square is white, the side bands black
    for c in ("a", "b"):
        (tmp_path / c).mkdir()
        Image.fromarray(wide).save(tmp_path / c / "w.png")
    cropped, rep = load_dataset(tmp_path, resize="crop", image_size=8)
    assert cropped.image_shape == (1, 8, 8) and cropped.images.min() == 1.0 and rep.n_resized == 2
    squeezed, _ = load_dataset(tmp_path, resize="resize", image_size=8)
    assert squeezed.images.min() < 0.5


# -- PHI --------------------------------------------------------------------------------------------
def _phi_values() -> list[str]:
    return [v for v in PHI.values()] + ["Doe", "Johanna", "1961", "7731", "Elsewhere"]


def test_no_phi_in_inspect_or_errors(tmp_path: Path, capsys) -> None:
    from feta_release.cli import main

    dicom_folder(tmp_path / "good")
    bad = dicom_folder(tmp_path / "bad")
    p = bad / "normal" / "im0.dcm"
    p.write_bytes(p.read_bytes()[:-40])  # truncated pixel data
    (bad / "effusion" / "im1.dcm").write_bytes(b"\0" * 128 + b"DICM" + b"\x02\x00\x10\x00garbage" * 3)
    outputs = []
    for args in (
        ["data", "inspect", str(tmp_path / "good"), "--json"],
        ["data", "inspect", str(tmp_path / "good")],
        ["data", "inspect", str(bad)],
    ):
        try:
            main(args)
        except SystemExit:
            pass
        out, err = capsys.readouterr()
        outputs.append(out + err)
    assert "truncated" in outputs[2] or "cannot be decoded" in outputs[2]
    text = "\n".join(outputs)
    for v in _phi_values():
        assert v not in text, v


# -- one set of load options everywhere ---------------------------------------------------------------
def _mixed_sizes(root: Path) -> Path:
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        Image.fromarray(np.full((8, 8), 200, np.uint8)).save(root / c / "square.png")
        Image.fromarray(np.full((8, 16), 200, np.uint8)).save(root / c / "wide.png")
    return root


def test_same_options_in_inspect_and_node(tmp_path: Path, capsys) -> None:
    from edge.launch import NodeSettings
    from edge.site import load_options, load_site_data
    from feta_release.cli import main

    root = _mixed_sizes(tmp_path / "d")
    with pytest.raises(SystemExit):
        main(["data", "inspect", str(root)])
    assert "square.png (8x8)" in capsys.readouterr().err  # a tie goes to the larger size
    main(["data", "inspect", str(root), "--resize", "crop", "--image-size", "8", "--json"])
    info = json.loads(capsys.readouterr().out)
    assert info["n_resized"] == 2 and info["image_shape"] == [1, 8, 8]
    from feta_release.data import LoadOptions

    s = NodeSettings(
        data=root,
        policy=tmp_path / "p",
        trusted_policy_key=tmp_path / "k",
        ledger=tmp_path / "l",
        site_key=tmp_path / "s",
        data_secret=tmp_path / "d",
        load=LoadOptions("crop", 8, "bits:12"),
    )
    cfg = s.node_config()
    assert load_options(cfg) == LoadOptions("crop", 8, "bits:12")
    assert load_site_data(root, load_options(cfg)).image_shape == (1, 8, 8)
    with pytest.raises(DataError, match="differ in size"):
        load_site_data(
            root,
            load_options(
                NodeSettings(
                    data=root,
                    policy=root,
                    trusted_policy_key=root,
                    ledger=root / "l",
                    site_key=root,
                    data_secret=root,
                ).node_config()
            ),
        )


def test_job_window_and_crop_validated() -> None:
    from feta_release.config import load_preset

    base = load_preset("tiny")
    assert base.replace(job={"resize": "crop", "image_size": 64, "window": "40,400"}).job.window == "40,400"
    with pytest.raises(ConfigError, match=r"\[job\] window"):
        base.replace(job={"window": "bright"})


def test_inspect_names_duplicate_files_and_patients(tmp_path: Path, capsys) -> None:
    from feta_release.cli import main

    lines = ["path,label,patient_id"]
    for i in range(6):
        p = tmp_path / f"{i}.png"
        Image.fromarray(np.full((8, 8), 40 * (i % 5) + 1, np.uint8)).save(p)  # 0 and 5 are equal
        lines.append(f"{p.name},{'x' if i < 3 else 'y'},MRN-{i % 2}")
    (tmp_path / "l.csv").write_text("\n".join(lines) + "\n")
    main(["data", "inspect", str(tmp_path / "l.csv"), "--json"])
    info = json.loads(capsys.readouterr().out)
    assert info["n_patients"] == 2 and info["max_images_per_patient"] == 3
    dup = next(w for w in info["warnings"] if "duplicate" in w)
    assert "0.png" in dup and "5.png" in dup and "unit of privacy is the patient" in dup
    assert "MRN" not in json.dumps(info)
