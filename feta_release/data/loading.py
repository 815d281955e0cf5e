"""Load labelled images from an image folder or an ``.npz`` into an ``ImageDataset``.

Layouts accepted:
- a folder with one sub-folder per class (class names = sub-folder names, sorted); PNG, JPEG, BMP
  and TIFF files inside (nested folders allowed); anything else is skipped and counted;
- an ``.npz`` with ``images`` ((N,H,W), (N,H,W,C) or (N,C,H,W); uint8 0..255, uint16 0..65535, bool,
  or float in [0, 1]), ``labels`` (N,) (integers, or strings that name the classes) and optionally
  ``class_names``;
- the word ``embedded`` (when no such file exists): the MNIST subset shipped in the package.

Bad input never yields a bare traceback: it raises ``DataError`` naming the file(s) and the problem.
Problems that are fixed automatically (non-image files, colour-mode conversion, 16-bit scaling,
palettes, resizing when asked) are counted in the ``LoadReport``.
"""

from __future__ import annotations

import os
import struct
import warnings
import zipfile
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image, UnidentifiedImageError

from ..errors import ConfigError, DataError
from .dataset import ImageDataset

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff"})
# Refuse any single image above this many pixels before decoding it: a few-KB PNG can claim
# 100k x 100k pixels and exhaust memory (decompression bomb). Pillow's own limit (89M) still
# applies on top; this one is lower because the method works on small images anyway.
DEFAULT_MAX_PIXELS = 50_000_000
MAX_LISTED = 20  # files named in one error message before "... and N more"
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)  # ITU-R 601-2, as Pillow's convert("L")
_GREY_MODES = {"1", "L", "LA", "La", "I", "F", "I;16", "I;16L", "I;16B", "I;16N"}
_FLOAT_TOLERANCE = 1e-6  # float pixels this far outside [0, 1] are rounding noise and get clipped

ResizePolicy = Literal["refuse", "resize"]


@dataclass
class LoadReport:
    """What the loader found and what it changed."""

    source: str
    kind: str  # "folder" | "npz" | "embedded"
    n_images: int = 0
    skipped_files: list[str] = field(default_factory=list)  # non-image files, not loaded
    warnings: list[str] = field(default_factory=list)  # human-readable, one per problem kind
    conversions: dict[str, int] = field(default_factory=dict)  # e.g. {"16-bit scaled": 3}
    n_resized: int = 0

    @property
    def n_skipped(self) -> int:
        return len(self.skipped_files)

    def count(self, what: str, k: int = 1) -> None:
        self.conversions[what] = self.conversions.get(what, 0) + k

    def to_dict(self) -> dict:
        d = asdict(self)
        d["n_skipped"] = self.n_skipped
        return d


def load_dataset(
    path: str | os.PathLike,
    *,
    resize: ResizePolicy = "refuse",
    image_size: int | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> tuple[ImageDataset, LoadReport]:
    """Load an image folder, an ``.npz`` or ``"embedded"`` into canonical form.

    resize: ``"refuse"`` (default) raises ``DataError`` listing every image whose size differs from
        the target; ``"resize"`` resizes them (bilinear, antialiased) and counts them in the report.
    image_size: target side length (square). ``None``: the size most images have.
    max_pixels: per-image pixel limit (decompression-bomb guard).
    """
    if resize not in ("refuse", "resize"):
        raise ConfigError(f"resize must be 'refuse' or 'resize', not {resize!r}")
    if image_size is not None and (not isinstance(image_size, int) or image_size < 1):
        raise ConfigError(f"image_size must be a positive integer or None, not {image_size!r}")
    p = Path(path)
    if not p.exists():
        if str(path) == "embedded":
            from .embedded import EMBEDDED_SOURCE, embedded_path

            ds, report = _load_npz(embedded_path(), resize, image_size)
            ds.source = report.source = EMBEDDED_SOURCE
            report.kind = "embedded"
            return ds, report
        raise DataError(f"{p}: no such file or directory")
    if p.is_dir():
        return _load_folder(p, resize, image_size, max_pixels)
    if p.suffix.lower() == ".npz":
        return _load_npz(p, resize, image_size)
    raise DataError(
        f"{p}: not a dataset; expected a folder with one sub-folder per class (PNG/JPEG/BMP/TIFF inside) "
        "or an .npz with arrays 'images' and 'labels'"
    )


# ------------------------------------------------------------------------------------------------
# image folders
# ------------------------------------------------------------------------------------------------
@dataclass
class _Header:
    path: Path
    label: int
    size: tuple[int, int]  # (H, W)
    channels: int  # 1 or 3: what the file holds before any unification


def _listing(items: list[str]) -> str:
    shown = items[:MAX_LISTED]
    more = len(items) - len(shown)
    return "\n  " + "\n  ".join(shown) + (f"\n  ... and {more} more" if more else "")


def _is_hidden(p: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in p.relative_to(root).parts)


def _load_folder(
    root: Path, resize: ResizePolicy, image_size: int | None, max_pixels: int
) -> tuple[ImageDataset, LoadReport]:
    report = LoadReport(source=str(root), kind="folder")
    entries = sorted(e for e in root.iterdir() if not e.name.startswith("."))
    if not entries:
        raise DataError(f"{root}: empty directory; expected one sub-folder of images per class")
    class_dirs = [e for e in entries if e.is_dir()]
    loose = [e for e in entries if e.is_file()]
    if not class_dirs:
        if (root / "synthetic.npz").exists():
            raise DataError(f"{root}: looks like a run directory; pass {root / 'synthetic.npz'}")
        n_img = sum(e.suffix.lower() in IMAGE_EXTENSIONS for e in loose)
        hint = f" ({n_img} images lie directly in it)" if n_img else ""
        raise DataError(
            f"{root}: no class sub-folders{hint}; expected one sub-folder per class, e.g. {root}/<class>/001.png"
        )
    report.skipped_files.extend(str(e) for e in loose)

    # Listing first: structural problems are reported before any pixel is decoded.
    files: list[tuple[Path, int]] = []
    empty: list[str] = []
    for label, cdir in enumerate(class_dirs):
        n_before = len(files)
        for f in sorted(cdir.rglob("*")):
            if not f.is_file():
                continue
            if f.suffix.lower() in IMAGE_EXTENSIONS and not _is_hidden(f, cdir):
                files.append((f, label))
            else:
                report.skipped_files.append(str(f))
        if len(files) == n_before:
            empty.append(f"{cdir}/")
    if empty:
        raise DataError(f"{root}: class folders without any PNG/JPEG/BMP/TIFF image:{_listing(empty)}")
    if len(class_dirs) < 2:
        raise DataError(
            f"{root}: only one class ({class_dirs[0].name!r}); class-conditional synthesis needs at least 2 "
            "class sub-folders"
        )
    if report.skipped_files:
        report.warnings.append(
            f"skipped {report.n_skipped} non-image file(s) (only {', '.join(sorted(IMAGE_EXTENSIONS))} are read):"
            f"{_listing(report.skipped_files)}"
        )

    headers, errors = [], []
    for f, label in files:
        try:
            headers.append(_read_header(f, label, max_pixels))
        except DataError as exc:
            errors.append(str(exc))
    if errors:
        # Decode the rest too (only on this failure path) so one message lists every bad file.
        for h in headers:
            try:
                _read_pixels(h.path, LoadReport(source="", kind=""))
            except DataError as exc:
                errors.append(str(exc))
        raise DataError(f"{root}: {len(errors)} unreadable, corrupt or truncated image file(s):{_listing(errors)}")

    channels = _choose_channels(headers, report)
    target = _choose_size([h.size for h in headers], [str(h.path) for h in headers], resize, image_size, root)
    c = channels
    images = np.empty((len(headers), c, target[0], target[1]), dtype=np.float32)
    for i, h in enumerate(headers):
        try:
            arr = _read_pixels(h.path, report)
        except DataError as exc:
            errors.append(str(exc))
            continue
        arr = _convert_channels(arr, c)
        if arr.shape[:2] != target:
            arr = _resize(arr, target)
            report.n_resized += 1
        images[i] = arr.transpose(2, 0, 1)
    if errors:
        raise DataError(f"{root}: {len(errors)} unreadable, corrupt or truncated image file(s):{_listing(errors)}")
    if report.n_resized:
        report.warnings.append(f"resized {report.n_resized} image(s) to {target[0]}x{target[1]} (bilinear)")
    labels = np.array([h.label for h in headers], dtype=np.int64)
    ds = ImageDataset(images, labels, tuple(d.name for d in class_dirs), source=str(root))
    report.n_images = ds.n
    return ds, report


def _open_guarded(path: Path, max_pixels: int) -> Image.Image:
    """Image.open with the bomb check turned into DataError; caller must close."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            im = Image.open(path)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise DataError(f"{path}: refused as a possible decompression bomb ({exc})") from exc
        except UnidentifiedImageError as exc:
            raise DataError(f"{path}: not a readable image (unknown format or corrupt header)") from exc
        except (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error) as exc:
            raise DataError(f"{path}: cannot be opened ({exc})") from exc
    w, h = im.size
    if w * h > max_pixels:
        im.close()
        raise DataError(
            f"{path}: refused as a possible decompression bomb ({w}x{h} = {w * h:,} pixels > limit {max_pixels:,})"
        )
    if w < 1 or h < 1:
        im.close()
        raise DataError(f"{path}: image has no pixels ({w}x{h})")
    return im


def _read_header(path: Path, label: int, max_pixels: int) -> _Header:
    im = _open_guarded(path, max_pixels)
    try:
        mode = im.mode
        if mode in _GREY_MODES:
            channels = 1
        elif mode in ("P", "PA"):
            channels = 1 if _palette_is_grey(im, path) else 3
        else:
            channels = 3
        return _Header(path=path, label=label, size=(im.size[1], im.size[0]), channels=channels)
    finally:
        im.close()


def _palette_is_grey(im: Image.Image, path: Path) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "palette with transparency" advice; we convert via RGBA
            pal = im.getpalette()  # decodes the image: also finds truncation early
    except (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error) as exc:
        raise DataError(f"{path}: corrupt or truncated ({exc})") from exc
    if not pal:
        return False
    rgb = np.asarray(pal, dtype=np.int64).reshape(-1, 3)
    return bool((rgb[:, 0] == rgb[:, 1]).all() and (rgb[:, 1] == rgb[:, 2]).all())


def _read_pixels(path: Path, report: LoadReport) -> np.ndarray:
    """Decode one image to float32 (H, W, C) in [0, 1], C = 1 or 3."""
    # The header pass already refused oversized images; no limit needed twice.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            warnings.filterwarnings("ignore", message="Palette images with Transparency")
            with Image.open(path) as im:
                if getattr(im, "n_frames", 1) > 1:
                    report.count("multi-frame: first frame used")
                im.load()
                return _pixels(im, path, report)
    except DataError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise DataError(f"{path}: refused as a possible decompression bomb ({exc})") from exc
    except (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error, IndexError) as exc:
        raise DataError(f"{path}: corrupt or truncated ({exc})") from exc


def _pixels(im: Image.Image, path: Path, report: LoadReport) -> np.ndarray:
    mode = im.mode
    if mode == "1":
        arr = np.asarray(im, dtype=np.float32)
    elif mode == "L":
        arr = np.asarray(im, dtype=np.float32) / np.float32(255)
    elif mode in ("LA", "La"):
        report.count("alpha channel dropped")
        arr = np.asarray(im.getchannel(0), dtype=np.float32) / np.float32(255)
    elif mode.startswith("I;16"):
        report.count("16-bit scaled from 0..65535")
        arr = np.asarray(im).astype(np.float32) / np.float32(65535)
    elif mode == "I":
        raw = np.asarray(im)
        if raw.size and (raw.min() < 0 or raw.max() > 65535):
            raise DataError(
                f"{path}: 32-bit integer pixels {int(raw.min())}..{int(raw.max())} outside 0..65535; "
                "save as 8- or 16-bit"
            )
        report.count("16-bit scaled from 0..65535")
        arr = raw.astype(np.float32) / np.float32(65535)
    elif mode == "F":
        arr = np.asarray(im, dtype=np.float32)
        if arr.size and not (np.isfinite(arr).all() and arr.min() >= 0.0 and arr.max() <= 1.0):
            raise DataError(f"{path}: floating-point pixels must be finite and in [0, 1]")
    elif mode in ("P", "PA"):
        report.count("palette converted")
        rgba = np.asarray(im.convert("RGBA"), dtype=np.float32) / np.float32(255)
        if (rgba[..., 3] < 1.0).any():
            report.count("alpha channel dropped")
        arr = rgba[..., :3]
    elif mode == "RGB":
        arr = np.asarray(im, dtype=np.float32) / np.float32(255)
    elif mode in ("RGBA", "RGBa", "RGBX"):
        if mode != "RGBX":
            report.count("alpha channel dropped")
        arr = np.asarray(im.convert("RGB"), dtype=np.float32) / np.float32(255)
    else:  # CMYK, YCbCr, LAB, HSV, ...
        report.count(f"{mode} converted to RGB")
        arr = np.asarray(im.convert("RGB"), dtype=np.float32) / np.float32(255)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return np.ascontiguousarray(arr)


def _choose_channels(headers: list[_Header], report: LoadReport) -> int:
    """Majority colour mode (ties: colour); converts the minority and says so."""
    n_grey = sum(h.channels == 1 for h in headers)
    n_colour = len(headers) - n_grey
    if n_grey and n_colour:
        target = 3 if n_colour >= n_grey else 1
        converted = n_grey if target == 3 else n_colour
        what = "greyscale to RGB (channel copied)" if target == 3 else "RGB to greyscale (ITU-R 601 luma)"
        report.count(f"mixed colour modes: {what}", converted)
        report.warnings.append(
            f"mixed colour modes: {n_grey} greyscale and {n_colour} colour image(s); "
            f"converted {converted} {what} to match the majority"
        )
        return target
    return 3 if n_colour else 1


def _convert_channels(arr: np.ndarray, channels: int) -> np.ndarray:
    if arr.shape[2] == channels:
        return arr
    if channels == 3:
        return np.repeat(arr, 3, axis=2)
    return np.clip(arr @ _LUMA, 0.0, 1.0)[:, :, None].astype(np.float32)


def _choose_size(
    sizes: list[tuple[int, int]],
    names: list[str],
    resize: ResizePolicy,
    image_size: int | None,
    where: Path,
) -> tuple[int, int]:
    """Target (H, W); refuses (listing the files) unless resizing was asked for."""
    counts = Counter(sizes)
    majority, n_major = max(counts.items(), key=lambda kv: (kv[1], kv[0][0] * kv[0][1]))
    target = (image_size, image_size) if image_size is not None else majority
    off = [f"{n} ({s[0]}x{s[1]})" for n, s in zip(names, sizes) if s != target]
    if off and resize == "refuse":
        if image_size is not None and len(counts) == 1:
            raise DataError(
                f"{where}: all images are {majority[0]}x{majority[1]} but image_size = {image_size}; "
                "set resize = \"resize\" to resize them, or drop image_size"
            )
        raise DataError(
            f"{where}: images differ in size; the target is {target[0]}x{target[1]}"
            f"{' (' + str(n_major) + ' images)' if image_size is None else ''} and {len(off)} differ "
            f"(height x width):{_listing(off)}\nFix the files, or set resize = \"resize\" (and image_size) "
            "to resize them explicitly."
        )
    return target


def _resize(arr: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Bilinear (antialiased when shrinking) resize of float (H, W, C) to (h, w, C), per channel."""
    h, w = size
    out = np.empty((h, w, arr.shape[2]), dtype=np.float32)
    for c in range(arr.shape[2]):
        ch = Image.fromarray(np.ascontiguousarray(arr[:, :, c]), mode="F")
        out[:, :, c] = np.asarray(ch.resize((w, h), Image.Resampling.BILINEAR), dtype=np.float32)
    return np.clip(out, 0.0, 1.0)


# ------------------------------------------------------------------------------------------------
# .npz
# ------------------------------------------------------------------------------------------------
def _load_npz(path: Path, resize: ResizePolicy, image_size: int | None) -> tuple[ImageDataset, LoadReport]:
    report = LoadReport(source=str(path), kind="npz")
    if not zipfile.is_zipfile(path):  # np.load would otherwise try it as a pickle
        raise DataError(f"{path}: not a readable .npz file (not a zip archive; corrupt or truncated?)")
    try:
        with np.load(path, allow_pickle=False) as z:
            keys = set(z.files)
            missing = {"images", "labels"} - keys
            if missing:
                raise DataError(
                    f"{path}: missing array(s) {sorted(missing)}; an .npz dataset needs 'images' and 'labels' "
                    f"(found {sorted(keys)})"
                )
            raw_images = z["images"]
            raw_labels = z["labels"]
            raw_names = z["class_names"] if "class_names" in keys else None
    except DataError:
        raise
    except ValueError as exc:  # object arrays need pickle, which we never allow
        raise DataError(f"{path}: unsupported array contents ({exc}); store plain numeric/string arrays") from exc
    except (OSError, zipfile.BadZipFile, EOFError, zlib.error, KeyError) as exc:
        raise DataError(f"{path}: not a readable .npz file (corrupt or truncated: {exc})") from exc
    ds = parse_arrays(raw_images, raw_labels, raw_names, source=str(path), report=report)
    ds = _fit_size(ds, resize, image_size, report, path)
    report.n_images = ds.n
    return ds, report


def _fit_size(
    ds: ImageDataset, resize: ResizePolicy, image_size: int | None, report: LoadReport, where: Path
) -> ImageDataset:
    if image_size is None:
        return ds
    _, h, w = ds.image_shape
    if (h, w) == (image_size, image_size):
        return ds
    _choose_size([(h, w)], [str(where)], resize, image_size, where)  # raises under "refuse"
    imgs = np.stack([_resize(im.transpose(1, 2, 0), (image_size, image_size)).transpose(2, 0, 1) for im in ds.images])
    report.n_resized = ds.n
    report.warnings.append(f"resized all {ds.n} image(s) from {h}x{w} to {image_size}x{image_size} (bilinear)")
    return ImageDataset(imgs.astype(np.float32), ds.labels, ds.class_names, ds.source)


def parse_arrays(
    images: np.ndarray,
    labels: np.ndarray,
    class_names: np.ndarray | None = None,
    *,
    source: str = "<arrays>",
    report: LoadReport | None = None,
) -> ImageDataset:
    """Validate and canonicalise raw arrays (the ``.npz`` parser); raises ``DataError`` on bad input."""
    report = report if report is not None else LoadReport(source=source, kind="npz")
    images = np.asarray(images)
    labels = np.asarray(labels)
    if images.ndim not in (3, 4):
        raise DataError(
            f"{source}: 'images' must have shape (N,H,W), (N,H,W,C) or (N,C,H,W); got {images.shape}"
        )
    if images.shape[0] == 0:
        raise DataError(f"{source}: 'images' is empty (0 images)")
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if labels.ndim != 1:
        raise DataError(f"{source}: 'labels' must be one-dimensional (N,); got shape {labels.shape}")
    if len(labels) != images.shape[0]:
        raise DataError(
            f"{source}: {images.shape[0]} images but {len(labels)} labels; the arrays must have the same length"
        )
    nchw = _to_nchw(images, source, report)
    pixels = _pixels_to_unit(nchw, source, report)
    lab, names = _labels(labels, class_names, source)
    counts = np.bincount(lab, minlength=len(names))
    if len(names) < 2:
        raise DataError(f"{source}: only one class ({names[0]!r}); class-conditional synthesis needs at least 2")
    empty = [names[i] for i in np.flatnonzero(counts == 0)]
    if empty:
        raise DataError(f"{source}: class(es) without any image: {empty}")
    return ImageDataset(pixels, lab, tuple(names), source=source)


def _to_nchw(images: np.ndarray, source: str, report: LoadReport) -> np.ndarray:
    if images.ndim == 3:
        return images[:, None, :, :]
    chan_first = images.shape[1] in (1, 3)
    chan_last = images.shape[3] in (1, 3)
    if chan_first and chan_last:
        raise DataError(
            f"{source}: ambiguous image layout {images.shape}: both axis 1 and axis 3 could be channels; "
            "store (N,C,H,W) with H, W > 3"
        )
    if chan_first:
        return images
    if chan_last:
        return images.transpose(0, 3, 1, 2)
    raise DataError(
        f"{source}: cannot find the channel axis in {images.shape}; 1 (grey) or 3 (RGB) channels are supported, "
        "as (N,C,H,W) or (N,H,W,C)"
    )


def _pixels_to_unit(images: np.ndarray, source: str, report: LoadReport) -> np.ndarray:
    kind = images.dtype.kind
    if kind == "b":
        return np.ascontiguousarray(images, dtype=np.float32)
    if images.dtype == np.uint8:
        return np.ascontiguousarray(images, dtype=np.float32) / np.float32(255)
    if images.dtype == np.uint16:
        report.count("16-bit scaled from 0..65535", images.shape[0])
        return np.ascontiguousarray(images, dtype=np.float32) / np.float32(65535)
    if kind in "iu":
        lo, hi = int(images.min()), int(images.max())
        if lo < 0 or hi > 255:
            raise DataError(
                f"{source}: integer pixels {lo}..{hi} outside 0..255; store uint8 (0..255), uint16 (0..65535) "
                "or floats in [0, 1]"
            )
        report.count("integer pixels read as 8-bit", images.shape[0])
        return np.ascontiguousarray(images, dtype=np.float32) / np.float32(255)
    if kind == "f":
        flat = images.reshape(images.shape[0], -1)
        bad = ~np.isfinite(flat)
        if bad.any():
            rows = np.flatnonzero(bad.any(axis=1))
            raise DataError(
                f"{source}: {int(bad.sum())} NaN/inf pixel value(s) in {len(rows)} image(s), first at index "
                f"{int(rows[0])}"
            )
        lo, hi = float(flat.min()), float(flat.max())
        if lo < -_FLOAT_TOLERANCE or hi > 1 + _FLOAT_TOLERANCE:
            rows = np.flatnonzero(((flat < -_FLOAT_TOLERANCE) | (flat > 1 + _FLOAT_TOLERANCE)).any(axis=1))
            if hi > 1.5 and lo >= 0:
                hint = " (looks like 0..255: divide by 255)"
            elif lo >= -1 - _FLOAT_TOLERANCE and hi <= 1 + _FLOAT_TOLERANCE:
                hint = " (looks like [-1, 1]: map with (x + 1) / 2)"
            else:
                hint = ""
            raise DataError(
                f"{source}: float pixels must be in [0, 1]; found {lo:g}..{hi:g} in {len(rows)} image(s), first "
                f"at index {int(rows[0])}{hint}"
            )
        return np.clip(np.ascontiguousarray(images, dtype=np.float32), 0.0, 1.0)
    raise DataError(f"{source}: unsupported pixel dtype {images.dtype}; use uint8, uint16 or float in [0, 1]")


def _labels(labels: np.ndarray, class_names: np.ndarray | None, source: str) -> tuple[np.ndarray, list[str]]:
    names: list[str] | None = None
    if class_names is not None:
        cn = np.asarray(class_names)
        if cn.ndim != 1 or cn.dtype.kind not in ("U", "S", "i", "u"):
            raise DataError(f"{source}: 'class_names' must be a 1-D array of strings; got {cn.dtype} {cn.shape}")
        names = [c.decode() if isinstance(c, bytes) else str(c) for c in cn.tolist()]
        if len(set(names)) != len(names):
            raise DataError(f"{source}: duplicate entries in 'class_names': {names}")
    kind = labels.dtype.kind
    if kind in "US":
        strs = [c.decode() if isinstance(c, bytes) else str(c) for c in labels.tolist()]
        if names is None:
            names = sorted(set(strs))
        index = {n: i for i, n in enumerate(names)}
        unknown = sorted(set(strs) - set(index))
        if unknown:
            raise DataError(f"{source}: labels {unknown[:MAX_LISTED]} are not in 'class_names' {names}")
        return np.array([index[s] for s in strs], dtype=np.int64), names
    if kind == "f":
        if not np.isfinite(labels).all() or (labels != np.round(labels)).any():
            raise DataError(f"{source}: 'labels' must be integers; found non-integral or NaN values")
    elif kind not in "iub":
        raise DataError(f"{source}: unsupported label dtype {labels.dtype}; use integers or class-name strings")
    lab = labels.astype(np.int64)
    lo, hi = int(lab.min()), int(lab.max())
    if lo < 0:
        raise DataError(f"{source}: negative label {lo}; labels must be 0..n_classes-1")
    if names is None:
        names = [str(i) for i in range(hi + 1)]
    elif hi >= len(names):
        raise DataError(f"{source}: label {hi} but only {len(names)} class names {names}")
    return lab, names
