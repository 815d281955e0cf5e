"""Hospital pixel data: DICOM files (pydicom) and the windowing rule shared with 16-bit PNG/TIFF.

Windowing maps stored values to [0, 1]; the rule is chosen once per dataset (``Window``) and applied to
each image on its own, so one image never changes how another is scaled (a data-dependent, cross-image
rule would break the per-record sensitivity the privacy mechanisms assume):

- ``auto`` (default): DICOM: the file's first Window Center/Width (after Rescale Slope/Intercept);
  without one, the full range of its Bits Stored. 16-bit PNG/TIFF: the smallest even bit depth
  ``b`` in 8..16 with ``max pixel < 2**b`` (12-bit scans stored in 16-bit files come out in full
  contrast, not divided by 65535); ``data inspect`` warns when images of one folder get different depths.
- ``bits:N``: stored values over the full N-bit range (DICOM: through Rescale Slope/Intercept).
- ``C,W``: the DICOM linear window (PS3.3 C.11.2.1.2) with centre C and width W, in modality units
  (DICOM after rescale; raw values for PNG/TIFF).
MONOCHROME1 is inverted after windowing. Colour DICOM (RGB/YBR, 8-bit) is converted to RGB;
multi-frame, palette-colour and other layouts are refused with the reason.

No PHI leaves this module: error messages name the file and the problem only, never an element
value, and pydicom's own exception text (which may quote values) is never passed on. The patient
identifier is returned only as an opaque key for grouping images of one patient in memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError, DataError

DICOM_EXTENSIONS = frozenset({".dcm", ".dicom"})
_PREAMBLE = 128  # the 'DICM' magic follows a 128-byte preamble (PS3.10 7.1)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """pydicom warns AND logs about malformed elements quoting their values (PHI): silence both."""
    pylog = logging.getLogger("pydicom")
    old = pylog.propagate, pylog.level
    pylog.propagate, pylog.level = False, logging.CRITICAL + 1
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        pylog.propagate, pylog.level = old


@dataclass(frozen=True)
class Window:
    """How stored pixel values become [0, 1]; see the module docstring."""

    kind: str = "auto"  # "auto" | "bits" | "linear"
    bits: int | None = None
    center: float | None = None
    width: float | None = None

    def __str__(self) -> str:
        if self.kind == "bits":
            return f"bits:{self.bits}"
        if self.kind == "linear":
            return f"{self.center:g},{self.width:g}"
        return "auto"

    def fixed_bits(self) -> int:
        """The N of ``bits:N``; a hand-built ``Window("bits")`` without N is refused here, not deep in
        numpy."""
        if self.bits is None:
            raise ConfigError(
                "window kind 'bits' has no bit depth: build it with parse_window('bits:N'), N = 1..16"
            )
        return self.bits

    def linear(self) -> tuple[float, float]:
        """(centre, width) of ``C,W``; a hand-built ``Window("linear")`` without both is refused here."""
        if self.center is None or self.width is None:
            raise ConfigError(
                "window kind 'linear' needs a centre and a width: build it with "
                "parse_window('CENTER,WIDTH'), e.g. 40,400"
            )
        return self.center, self.width


def parse_window(text: str | Window | None) -> Window:
    """``auto``, ``bits:N`` (N = 1..16) or ``CENTER,WIDTH`` (WIDTH ≥ 1)."""
    if text is None:
        return Window()
    if isinstance(text, Window):
        return text
    s = str(text).strip().lower()
    if s == "auto":
        return Window()
    m = re.fullmatch(r"bits:(\d+)", s)
    if m and 1 <= int(m.group(1)) <= 16:
        return Window("bits", bits=int(m.group(1)))
    m = re.fullmatch(r"\s*([-+0-9.eE]+)\s*,\s*([-+0-9.eE]+)\s*", s)
    if m:
        try:
            c, w = float(m.group(1)), float(m.group(2))
        except ValueError:
            c, w = math.nan, math.nan
        if math.isfinite(c) and math.isfinite(w) and w >= 1:
            return Window("linear", center=c, width=w)
    raise ConfigError(
        f"window {text!r}: use 'auto', 'bits:N' (N = 1..16) or 'CENTER,WIDTH' with WIDTH >= 1, e.g. 40,400"
    )


def linear_window(x: np.ndarray, center: float, width: float) -> np.ndarray:
    """DICOM PS3.3 C.11.2.1.2.1 linear VOI function onto [0, 1]."""
    if width <= 1:  # the standard's degenerate case: a threshold at the centre
        return (x > center - 0.5).astype(np.float32)
    return np.clip((x - (center - 0.5)) / (width - 1.0) + 0.5, 0.0, 1.0).astype(np.float32)


def bits_range(
    x: np.ndarray, bits: int, slope: float = 1.0, intercept: float = 0.0, signed: bool = False
) -> np.ndarray:
    """Map the full stored range of ``bits`` (through a rescale) onto [0, 1]."""
    lo_raw, hi_raw = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    lo, hi = sorted((lo_raw * slope + intercept, hi_raw * slope + intercept))
    return np.clip((x - lo) / max(hi - lo, 1e-12), 0.0, 1.0).astype(np.float32)


def auto_bits(raw: np.ndarray) -> int:
    """Smallest even bit depth in 8..16 that holds every value of one image (the 16-bit PNG/TIFF rule)."""
    top = int(raw.max()) if raw.size else 0
    need = max(8, top.bit_length())
    return min(16, need + (need % 2))


def window_sixteen_bit(raw: np.ndarray, window: Window) -> tuple[np.ndarray, str]:
    """16-bit PNG/TIFF values (0..65535) to [0, 1] and a short description of the rule used."""
    x = raw.astype(np.float32)
    if window.kind == "linear":
        return linear_window(x, *window.linear()), f"16-bit windowed at {window}"
    bits = window.fixed_bits() if window.kind == "bits" else auto_bits(raw)
    return bits_range(x, bits), f"16-bit scaled as {bits}-bit (0..{2**bits - 1})"


def is_dicom(path: Path) -> bool:
    """``.dcm``/``.dicom``, or any extension-less file with the DICM magic (scanners often write no
    extension)."""
    if path.suffix.lower() in DICOM_EXTENSIONS:
        return True
    if path.suffix:
        return False
    try:
        with open(path, "rb") as fh:
            head = fh.read(_PREAMBLE + 4)
    except OSError:
        return False
    return head[_PREAMBLE:] == b"DICM"


@dataclass
class DicomHeader:
    size: tuple[int, int]  # (H, W)
    channels: int
    patient_key: str | None  # opaque digest for grouping; never shown


def _read(path: Path, *, pixels: bool):  # noqa: ANN202 - pydicom Dataset
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        with _quiet():
            return pydicom.dcmread(path, stop_before_pixels=not pixels)
    except InvalidDicomError as exc:
        raise DataError(f"{path}: not a readable DICOM file (no DICOM header)") from exc
    except Exception as exc:  # noqa: BLE001 - pydicom raises many types; their text may quote values (PHI)
        raise DataError(f"{path}: corrupt or truncated DICOM file ({type(exc).__name__})") from exc


def _int(ds, keyword: str, default: int) -> int:  # noqa: ANN001
    try:
        v = ds.get(keyword, default)
        return int(v if v not in (None, "") else default)
    except (TypeError, ValueError):
        return default


def read_header(path: Path, max_pixels: int) -> DicomHeader:
    """Size, channels and patient key without decoding pixels; refuses layouts we cannot use."""
    ds = _read(path, pixels=False)
    with _quiet():
        return _header(ds, path, max_pixels)


def _header(ds, path: Path, max_pixels: int) -> DicomHeader:  # noqa: ANN001
    rows, cols = _int(ds, "Rows", 0), _int(ds, "Columns", 0)
    if rows < 1 or cols < 1:
        raise DataError(
            f"{path}: DICOM file holds no image (no Rows/Columns; a report or structured document?)"
        )
    frames, spp = _int(ds, "NumberOfFrames", 1), _int(ds, "SamplesPerPixel", 1)
    if rows * cols * max(frames, 1) > max_pixels:
        raise DataError(
            f"{path}: refused as a possible decompression bomb ({cols}x{rows}x{frames} frames > limit "
            f"{max_pixels:,} pixels)"
        )
    if frames > 1:
        raise DataError(
            f"{path}: multi-frame DICOM ({frames} frames) is not supported; export the frames you want "
            "as single-frame files"
        )
    photometric = str(ds.get("PhotometricInterpretation", "")).upper()
    if spp == 1 and photometric not in ("MONOCHROME1", "MONOCHROME2"):
        raise DataError(
            f"{path}: DICOM photometric interpretation {photometric or 'missing'} is not supported "
            "(use MONOCHROME1/2 greyscale or 8-bit RGB/YBR colour)"
        )
    if spp not in (1, 3):
        raise DataError(f"{path}: DICOM with {spp} samples per pixel is not supported (1 = grey, 3 = colour)")
    if spp == 3 and _int(ds, "BitsAllocated", 8) != 8:
        raise DataError(
            f"{path}: colour DICOM with {_int(ds, 'BitsAllocated', 0)} bits per sample is not supported "
            "(8-bit colour only)"
        )
    pid = ds.get("PatientID", None)
    key = hashlib.sha256(str(pid).encode()).hexdigest() if pid not in (None, "") else None
    return DicomHeader(size=(rows, cols), channels=3 if spp == 3 else 1, patient_key=key)


def read_pixels(path: Path, window: Window) -> tuple[np.ndarray, str]:
    """float32 (H, W, C) in [0, 1] and the conversion applied (for the load report)."""
    ds = _read(path, pixels=True)
    try:
        with _quiet():
            arr = ds.pixel_array
    except Exception as exc:  # noqa: BLE001 - missing codec, truncated pixel data, ...
        tsuid = getattr(getattr(ds, "file_meta", None), "TransferSyntaxUID", None)
        what = f"transfer syntax {tsuid.name}" if tsuid is not None else "pixel data"
        raise DataError(
            f"{path}: DICOM pixel data cannot be decoded ({what}; {type(exc).__name__}): truncated, or "
            "compressed with a codec that is not installed (e.g. pip install pylibjpeg)"
        ) from exc
    photometric = str(ds.get("PhotometricInterpretation", "")).upper()
    if _int(ds, "SamplesPerPixel", 1) == 3:
        if photometric.startswith("YBR"):
            from pydicom.pixels import convert_color_space

            arr = convert_color_space(arr, photometric, "RGB")
        return np.ascontiguousarray(arr, dtype=np.float32) / np.float32(255), "DICOM colour (8-bit RGB)"
    out, rule = _grey_checked(ds, arr, window, path)
    if photometric == "MONOCHROME1":
        out = 1.0 - out
        rule += ", MONOCHROME1 inverted"
    return np.ascontiguousarray(out[:, :, None], dtype=np.float32), rule


def _grey_checked(ds, arr: np.ndarray, window: Window, path: Path) -> tuple[np.ndarray, str]:  # noqa: ANN001
    """``_grey``, with a rescale pydicom cannot parse (a Rescale Slope of 'abc') or one that makes values
    NaN/inf refused naming the file: the first used to escape as a bare ValueError, the second to surface
    later as a 'pixel values must be finite' for the whole folder, naming no file. Never pydicom's text (it
    may quote PHI)."""
    fix = "fix Rescale Slope/Intercept (or the Modality LUT) in the file, or re-export it"
    try:
        with _quiet():
            out, rule = _grey(ds, arr, window)
    except (ConfigError, DataError):
        raise
    except Exception as exc:  # noqa: BLE001 - pydicom's value conversions raise many types
        raise DataError(
            f"{path}: DICOM rescale values cannot be read ({type(exc).__name__}); {fix}"
        ) from None
    if not np.isfinite(out).all():
        raise DataError(f"{path}: DICOM rescale values make pixel values NaN or infinite; {fix}")
    return out, rule


def _grey(ds, arr: np.ndarray, window: Window) -> tuple[np.ndarray, str]:  # noqa: ANN001
    from pydicom.pixels import apply_modality_lut

    slope = float(ds.get("RescaleSlope", 1) or 1)
    intercept = float(ds.get("RescaleIntercept", 0) or 0)
    x = np.asarray(apply_modality_lut(arr, ds), dtype=np.float64)
    if window.kind == "linear":
        return linear_window(x, *window.linear()), f"DICOM windowed at {window} (job/site setting)"
    if window.kind == "auto":
        c, w = _file_window(ds)
        if c is not None and w is not None:
            return linear_window(x, c, w), "DICOM windowed by its Window Center/Width"
    bits = window.fixed_bits() if window.kind == "bits" else _int(ds, "BitsStored", arr.dtype.itemsize * 8)
    signed = _int(ds, "PixelRepresentation", 0) == 1
    return bits_range(x, bits, slope, intercept, signed), f"DICOM scaled over its {bits}-bit range"


def _file_window(ds) -> tuple[float | None, float | None]:  # noqa: ANN001
    def first(v) -> float | None:  # noqa: ANN001
        if v is None:
            return None
        try:
            v = (
                v[0]
                if isinstance(v, (list, tuple)) or hasattr(v, "__getitem__") and not isinstance(v, str)
                else v
            )
            f = float(v)
        except (TypeError, ValueError, IndexError):
            return None
        return f if math.isfinite(f) else None

    c, w = first(ds.get("WindowCenter")), first(ds.get("WindowWidth"))
    return (c, w) if c is not None and w is not None and w >= 1 else (None, None)
