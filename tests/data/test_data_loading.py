"""Image-folder loader: formats, conversions, and every bad-input case with its error."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from feta_release.data import load_dataset
from feta_release.errors import ConfigError, DataError


def grey(value: int, size: tuple[int, int] = (8, 8)) -> Image.Image:
    """(W, H) greyscale image of a constant value, plus a marker pixel so images differ."""
    arr = np.full((size[1], size[0]), value, np.uint8)
    return Image.fromarray(arr, mode="L")


def write(path: Path, img: Image.Image, **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, **kw)
    return path


def two_class_folder(root: Path, n: int = 3, size: tuple[int, int] = (8, 8)) -> Path:
    for c, value in (("cat", 40), ("dog", 200)):
        for i in range(n):
            write(root / c / f"{i}.png", grey(value + i, size))
    return root


# -- happy path ---------------------------------------------------------------------------------
def test_folder_all_formats(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrs = {}
    for c in ("a", "b"):
        for ext in ("png", "bmp", "tif", "tiff"):  # lossless: exact values
            arr = rng.integers(0, 256, (6, 5), dtype=np.uint8)
            arrs[f"{c}/{ext}"] = arr
            write(tmp_path / c / f"img.{ext}", Image.fromarray(arr, "L"))
        write(tmp_path / c / "sub" / "x.JPEG", grey(128, (5, 6)))  # nested + upper-case + lossy
    ds, report = load_dataset(tmp_path)
    assert ds.class_names == ("a", "b")
    assert ds.n == 10 and ds.image_shape == (1, 6, 5)
    assert ds.class_counts().tolist() == [5, 5]
    assert report.kind == "folder" and report.n_skipped == 0 and report.warnings == []
    # Files within a class are sorted by path: bmp, png, tif, tiff, sub/x.JPEG.
    a = ds.images[ds.labels == 0]
    for i, ext in enumerate(("bmp", "png", "tif", "tiff")):
        assert np.array_equal(a[i, 0], arrs[f"a/{ext}"] / np.float32(255))
    assert abs(float(a[4].mean()) - 128 / 255) < 3 / 255


def test_rgb_folder(tmp_path: Path) -> None:
    for c, colour in (("red", (255, 0, 0)), ("blue", (0, 0, 255))):
        for i in range(2):
            write(tmp_path / c / f"{i}.png", Image.new("RGB", (4, 4), colour))
    ds, _ = load_dataset(tmp_path)
    assert ds.image_shape == (3, 4, 4) and ds.class_names == ("blue", "red")
    assert ds.images[ds.labels == 1][:, 0].min() == 1.0 and ds.images[ds.labels == 1][:, 2].max() == 0.0


# -- structure errors ---------------------------------------------------------------------------
def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nope: no such file or directory"):
        load_dataset(tmp_path / "nope")


def test_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="empty directory"):
        load_dataset(tmp_path)


def test_images_without_class_folders(tmp_path: Path) -> None:
    write(tmp_path / "1.png", grey(1))
    with pytest.raises(DataError, match=r"no class sub-folders \(1 images lie directly in it\)"):
        load_dataset(tmp_path)


def test_empty_class_folder(tmp_path: Path) -> None:
    two_class_folder(tmp_path)
    (tmp_path / "zebra").mkdir()
    (tmp_path / "zebra" / "notes.txt").write_text("no images here")
    with pytest.raises(
        DataError, match=r"class folders without any PNG/JPEG/BMP/TIFF/DICOM image:\n  .*zebra/"
    ):
        load_dataset(tmp_path)


def test_single_class(tmp_path: Path) -> None:
    write(tmp_path / "only" / "1.png", grey(1))
    write(tmp_path / "only" / "2.png", grey(2))
    with pytest.raises(DataError, match=r"only one class \('only'\).*at least 2"):
        load_dataset(tmp_path)


def test_not_a_dataset_file(tmp_path: Path) -> None:
    f = write(tmp_path / "one.png", grey(1))
    with pytest.raises(DataError, match="not a dataset"):
        load_dataset(f)


def test_bad_policy_arguments(tmp_path: Path) -> None:
    two_class_folder(tmp_path)
    with pytest.raises(ConfigError):
        load_dataset(tmp_path, resize="stretch")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        load_dataset(tmp_path, image_size=0)


# -- unreadable files: listed, never dropped ----------------------------------------------------
def test_corrupt_and_truncated_files_listed(tmp_path: Path) -> None:
    two_class_folder(tmp_path)
    (tmp_path / "cat" / "garbage.jpg").write_bytes(b"this is not a jpeg at all" * 10)
    noise = np.random.default_rng(0).integers(0, 256, (64, 64), dtype=np.uint8)
    good = write(tmp_path / "dog" / "full.png", Image.fromarray(noise, "L"))
    data = good.read_bytes()
    (tmp_path / "dog" / "truncated.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path)
    msg = str(err.value)
    assert "2 unreadable, corrupt or truncated image file(s)" in msg
    assert "garbage.jpg: not a readable image" in msg and "truncated.png: corrupt or truncated" in msg
    # A truncated file alone is found while decoding (its header is intact).
    (tmp_path / "cat" / "garbage.jpg").unlink()
    with pytest.raises(
        DataError, match=r"1 unreadable, corrupt .*:\n  .*truncated\.png: corrupt or truncated"
    ):
        load_dataset(tmp_path, resize="resize")


def test_every_unreadable_file_is_named(tmp_path: Path) -> None:
    two_class_folder(tmp_path)
    for i in range(3):
        (tmp_path / "cat" / f"bad{i}.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    with pytest.raises(DataError, match=r"3 unreadable, corrupt or truncated image file\(s\)") as err:
        load_dataset(tmp_path)
    assert all(f"bad{i}.png" in str(err.value) for i in range(3))


# -- non-image files: skipped, warned, counted --------------------------------------------------
def test_non_image_files_skipped_with_count(tmp_path: Path) -> None:
    two_class_folder(tmp_path)
    (tmp_path / "cat" / "readme.txt").write_text("hi")
    (tmp_path / "dog" / ".DS_Store").write_bytes(b"\0\0")
    (tmp_path / "LICENSE").write_text("top-level file")
    ds, report = load_dataset(tmp_path)
    assert ds.n == 6
    assert report.n_skipped == 3
    assert {Path(p).name for p in report.skipped_files} == {"readme.txt", ".DS_Store", "LICENSE"}
    assert any("skipped 3 non-image file(s)" in w for w in report.warnings)


# -- sizes --------------------------------------------------------------------------------------
def test_mixed_sizes_refused_and_listed(tmp_path: Path) -> None:
    two_class_folder(tmp_path, size=(8, 8))
    write(tmp_path / "cat" / "wide.png", grey(9, (10, 8)))
    write(tmp_path / "dog" / "tall.png", grey(9, (8, 12)))
    with pytest.raises(DataError) as err:
        load_dataset(tmp_path)
    msg = str(err.value)
    assert "differ in size" in msg and "target is 8x8 (6 images)" in msg
    assert "wide.png (8x10)" in msg and "tall.png (12x8)" in msg and 'resize = "resize"' in msg


def test_resize_policy_explicit(tmp_path: Path) -> None:
    two_class_folder(tmp_path, size=(8, 8))
    write(tmp_path / "cat" / "big.png", grey(100, (16, 16)))
    ds, report = load_dataset(tmp_path, resize="resize")
    assert ds.image_shape == (1, 8, 8) and report.n_resized == 1
    big = ds.images[ds.labels == 0][-1]  # "big.png" sorts after "0.png".."2.png"
    assert np.allclose(big, 100 / 255, atol=1e-5)  # a constant image stays constant
    ds2, report2 = load_dataset(tmp_path, resize="resize", image_size=12)
    assert ds2.image_shape == (1, 12, 12) and report2.n_resized == 7
    with pytest.raises(DataError, match=r"all images are 8x8 but image_size = 4"):
        (tmp_path / "cat" / "big.png").unlink()
        load_dataset(tmp_path, image_size=4)


# -- colour modes, bit depth, palettes ----------------------------------------------------------
def test_mixed_colour_modes_majority_grey(tmp_path: Path) -> None:
    two_class_folder(tmp_path)  # 6 greyscale
    write(tmp_path / "cat" / "z_colour.png", Image.new("RGB", (8, 8), (255, 0, 0)))
    ds, report = load_dataset(tmp_path)
    assert ds.image_shape[0] == 1
    z = ds.images[ds.labels == 0][-1]
    assert np.allclose(z, 0.299, atol=1e-6)  # ITU-R 601 luma of pure red
    assert report.conversions == {"mixed colour modes: RGB to greyscale (ITU-R 601 luma)": 1}
    assert any("6 greyscale and 1 colour" in w for w in report.warnings)


def test_mixed_colour_modes_majority_colour(tmp_path: Path) -> None:
    for c in ("a", "b"):
        for i in range(2):
            write(tmp_path / c / f"{i}.png", Image.new("RGB", (4, 4), (10, 20, 30)))
    write(tmp_path / "a" / "g.png", grey(77, (4, 4)))
    ds, report = load_dataset(tmp_path)
    assert ds.image_shape == (3, 4, 4)
    g = ds.images[ds.labels == 0][2]
    assert np.allclose(g, 77 / 255) and "greyscale to RGB" in " ".join(report.warnings)


def test_sixteen_bit_scaled(tmp_path: Path) -> None:
    for c in ("lo", "hi"):
        for i, v in enumerate((0, 32768, 65535)):
            write(tmp_path / c / f"{i}.png", Image.fromarray(np.full((4, 4), v, np.uint16)))
            write(tmp_path / c / f"{i}.tif", Image.fromarray(np.full((4, 4), v, np.uint16)))
    ds, report = load_dataset(tmp_path, window="bits:16")
    means = sorted({round(float(x.mean()), 6) for x in ds.images})
    assert means == [0.0, round(32768 / 65535, 6), 1.0]
    assert report.conversions["16-bit scaled as 16-bit (0..65535)"] == 12


def test_palette_images(tmp_path: Path) -> None:
    colour = Image.new("P", (4, 4))
    colour.putpalette([0, 0, 0, 255, 0, 0] + [0] * (254 * 3))
    colour.putpixel((0, 0), 1)
    grey_pal = Image.new("P", (4, 4))
    grey_pal.putpalette([v for i in range(256) for v in (i, i, i)])
    grey_pal.putpixel((1, 1), 200)
    for c in ("a", "b"):
        write(tmp_path / "colour" / c / "p.png", colour)
        write(tmp_path / "colour" / c / "q.gif.png", colour)
        write(tmp_path / "grey" / c / "p.png", grey_pal)
    ds, report = load_dataset(tmp_path / "colour")
    assert ds.image_shape == (3, 4, 4) and report.conversions["palette converted"] == 4
    assert ds.images[0, :, 0, 0].tolist() == [1.0, 0.0, 0.0] and ds.images[0, :, 1, 1].tolist() == [
        0.0,
        0.0,
        0.0,
    ]
    dg, _ = load_dataset(tmp_path / "grey")
    assert dg.image_shape == (1, 4, 4) and dg.images[0, 0, 1, 1] == pytest.approx(200 / 255)


def test_alpha_dropped_and_counted(tmp_path: Path) -> None:
    for c in ("a", "b"):
        write(tmp_path / c / "x.png", Image.new("RGBA", (4, 4), (0, 255, 0, 100)))
    ds, report = load_dataset(tmp_path)
    assert ds.image_shape == (3, 4, 4) and np.allclose(ds.images[:, 1], 1.0)
    assert report.conversions["alpha channel dropped"] == 2


# -- decompression bombs ------------------------------------------------------------------------
def _png_header_only(width: int, height: int) -> bytes:
    """A tiny PNG that claims width x height 1-bit pixels (a decompression bomb's header)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def test_decompression_bomb_refused(tmp_path: Path) -> None:
    two_class_folder(tmp_path)
    (tmp_path / "cat" / "bomb.png").write_bytes(_png_header_only(100_000, 100_000))
    with pytest.raises(DataError, match=r"bomb\.png: refused as a possible decompression bomb"):
        load_dataset(tmp_path)


def test_pixel_limit_below_pillow_default(tmp_path: Path) -> None:
    two_class_folder(tmp_path)
    # 60M pixels: under Pillow's own 89M guard, over our 50M default.
    (tmp_path / "dog" / "huge.png").write_bytes(_png_header_only(10_000, 6_000))
    with pytest.raises(DataError, match=r"huge\.png: refused .*60,000,000 pixels > limit 50,000,000"):
        load_dataset(tmp_path)
    with pytest.raises(DataError, match=r"0\.png: refused .* > limit 10"):
        load_dataset(two_class_folder(tmp_path / "small"), max_pixels=10)


# -- CLI ----------------------------------------------------------------------------------------
def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    from feta_release.cli import main

    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_inspect_folder_json(tmp_path: Path, capsys) -> None:
    two_class_folder(tmp_path)
    write(tmp_path / "cat" / "dup.png", grey(40))  # duplicate of cat/0.png
    (tmp_path / "dog" / "notes.md").write_text("x")
    code, out, _ = run_cli(["data", "inspect", str(tmp_path), "--json"], capsys)
    assert code == 0
    info = json.loads(out)
    assert info["n"] == 7 and info["class_counts"] == {"cat": 4, "dog": 3}
    assert info["image_shape"] == [1, 8, 8] and info["n_skipped"] == 1 and len(info["fingerprint"]) == 64
    assert any("duplicate" in w for w in info["warnings"]) and any("non-image" in w for w in info["warnings"])


def test_cli_inspect_tables_embedded(capsys) -> None:
    code, out, _ = run_cli(["data", "inspect"], capsys)
    assert code == 0
    assert "embedded:mnist_5k" in out and "5,000" in out and "(1, 28, 28)" in out and "500" in out
    assert "2a0b2348be7e627d" in out


def test_cli_inspect_error_exit(tmp_path: Path, capsys) -> None:
    write(tmp_path / "only" / "1.png", grey(1))
    code, _, err = run_cli(["data", "inspect", str(tmp_path)], capsys)
    assert code == 3 and "only one class" in err and "Traceback" not in err
