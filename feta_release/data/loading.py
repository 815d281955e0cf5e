"""Load labelled images from an image folder, a labels CSV or an ``.npz`` into an ``ImageDataset``.

Layouts accepted:
- a folder with one sub-folder per class (class names = sub-folder names, sorted); PNG, JPEG, BMP,
  TIFF and DICOM files inside (``.dcm``/``.dicom``, or extension-less files with the DICM magic;
  nested folders allowed); anything else is skipped and counted;
- a ``.csv`` with a header ``path,label[,patient_id]`` (paths relative to the CSV's folder; class
  names = the sorted labels); a patient id groups the images of one patient (it is never shown);
- an ``.npz`` with ``images`` ((N,H,W), (N,H,W,C) or (N,C,H,W); uint8 0..255, uint16 0..65535, bool,
  or float in [0, 1]), ``labels`` (N,) (integers, or strings that name the classes) and optionally
  ``class_names``;
- the word ``embedded`` (when no such file exists): the MNIST subset shipped in the package.

Bad input never yields a bare traceback: it raises ``DataError`` naming the file(s) and the problem.
A folder or CSV is checked completely before failing: one error lists EVERY problem (empty class
folders, unreadable/corrupt/truncated files, decompression bombs, odd sizes), each naming its files,
so one run of ``data inspect`` shows everything to fix. Problems that are fixed automatically
(non-image files, colour-mode conversion, 16-bit/DICOM windowing, palettes, resizing when asked) are
counted in the ``LoadReport``. DICOM and 16-bit windowing: ``feta_release.data.dicom``.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import math
import os
import struct
import warnings
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
from PIL import Image, UnidentifiedImageError

from ..errors import ConfigError, DataError
from ..files import NpyHeader, read_npz
from ..privacy_unit import PatientIndex, cap_per_patient
from . import dicom
from .dataset import ImageDataset, check_dataset_memory
from .declared import DataDeclaration, conform_image, fit_image, unknown_label_message
from .dicom import Window, parse_window
from .embedded import EMBEDDED_SOURCE, embedded_path

PIL_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff"})
IMAGE_EXTENSIONS = PIL_EXTENSIONS | dicom.DICOM_EXTENSIONS
# Refuse any single image above this many pixels before decoding it: a few-KB PNG can claim
# 100k x 100k pixels and exhaust memory (decompression bomb). Pillow's own limit (89M) still
# applies on top; this one is lower because the method works on small images anyway.
DEFAULT_MAX_PIXELS = 50_000_000
# The most bytes the arrays of one .npz dataset may take (as stored, before the float32 conversion): a larger
# dataset is an image folder or a CSV, whose files are decoded one at a time.
MAX_NPZ_BYTES = 8 << 30
MAX_LISTED = 20  # files named in one error message before "... and N more"
_GREY_MODES = {"1", "L", "LA", "La", "I", "F", "I;16", "I;16L", "I;16B", "I;16N"}
_FLOAT_TOLERANCE = 1e-6  # float pixels this far outside [0, 1] are rounding noise and get clipped
_KINDS = "PNG/JPEG/BMP/TIFF/DICOM"

# refuse: list images whose size differs; resize: bilinear to the target (aspect not kept);
# crop: centre-crop to the target's aspect ratio, then resize (no distortion).
ResizePolicy = Literal["refuse", "resize", "crop"]
RESIZE_POLICIES = ("refuse", "resize", "crop")


@dataclass
class LoadReport:
    """What the loader found and what it changed."""

    source: str
    kind: str  # "folder" | "csv" | "npz" | "embedded"
    n_images: int = 0
    skipped_files: list[str] = field(default_factory=list)  # non-image files, not loaded
    warnings: list[str] = field(default_factory=list)  # human-readable, one per problem kind
    conversions: dict[str, int] = field(default_factory=dict)  # e.g. {"16-bit scaled as 12-bit": 3}
    n_resized: int = 0
    # Per image: the file it came from (folders and CSVs; empty for .npz), to name files in problems.
    files: list[str] = field(default_factory=list, repr=False)
    # Per image: an index 0..P-1 of its patient (None: no patient ids known). Pseudonymous by
    # construction (order of first appearance); the identifiers themselves are never kept.
    patients: np.ndarray | None = field(default=None, repr=False)
    # Files without a patient id when others have one (each counts as its own patient; a patient cap refuses
    # them).
    unidentified: list[str] = field(default_factory=list, repr=False)
    # at most this many images per patient were kept (feta_release.privacy_unit)
    patient_cap: int | None = None
    n_dropped_by_cap: int = 0

    @property
    def n_skipped(self) -> int:
        return len(self.skipped_files)

    @property
    def n_patients(self) -> int | None:
        return None if self.patients is None else int(len(np.unique(self.patients)))

    def count(self, what: str, k: int = 1) -> None:
        self.conversions[what] = self.conversions.get(what, 0) + k

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("patients")
        d.pop("files")
        d.pop("unidentified")
        d["n_skipped"] = self.n_skipped
        d["n_patients"] = self.n_patients
        d["max_images_per_patient"] = (
            None if self.patients is None else int(np.bincount(self.patients).max(initial=0))
        )
        return d


@dataclass(frozen=True)
class _Options:
    resize: ResizePolicy
    image_size: int | None
    max_pixels: int
    window: Window
    declared: DataDeclaration | None = None


@dataclass(frozen=True)
class LoadOptions:
    """The site's choices for turning files into model-sized images: one object shared by
    ``data inspect``, ``train``, ``site init`` and ``node start`` so all four read data alike."""

    resize: ResizePolicy = "refuse"
    image_size: int | None = None
    window: str = "auto"
    patient_cap: int | None = None  # keep the first k images of each patient (unit of privacy: the patient)
    # The fields the user set (command-line flags); empty: all of them. ``over`` keeps the others from a base.
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.resize not in RESIZE_POLICIES:
            raise ConfigError(f"resize must be one of {', '.join(RESIZE_POLICIES)}, not {self.resize!r}")
        if self.image_size is not None and (
            isinstance(self.image_size, bool) or not isinstance(self.image_size, int) or self.image_size < 1
        ):
            raise ConfigError(f"image_size must be a positive integer, not {self.image_size!r}")
        object.__setattr__(self, "window", str(parse_window(self.window)))
        if self.patient_cap is not None and (
            isinstance(self.patient_cap, bool)
            or not isinstance(self.patient_cap, int)
            or self.patient_cap < 1
        ):
            raise ConfigError(f"patient_cap must be a positive integer, not {self.patient_cap!r}")

    def kwargs(self) -> dict:
        return {
            "resize": self.resize,
            "image_size": self.image_size,
            "window": self.window,
            "patient_cap": self.patient_cap,
        }

    def over(self, base: LoadOptions) -> LoadOptions:
        """These options laid over ``base`` (a job's [job] or a node.toml's [data]): only the fields given
        replace base's. One flag used to replace all four, so ``--patient-cap 1`` also reset a job's window
        bits:12 to auto (other pixel values, silently) and its resize/image_size to refuse/None."""
        if not self.given:
            return self
        return replace(base, **{k: getattr(self, k) for k in self.given}, given=frozenset())


def load_dataset(
    path: str | os.PathLike,
    *,
    resize: ResizePolicy = "refuse",
    image_size: int | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    window: str | Window | None = None,
    patient_cap: int | None = None,
    declared: DataDeclaration | None = None,
) -> tuple[ImageDataset, LoadReport]:
    """Load an image folder, a labels ``.csv``, an ``.npz`` or ``"embedded"`` into canonical form.

    resize: ``"refuse"`` (default) raises ``DataError`` listing every image whose size differs from
        the target; ``"resize"`` resizes them (bilinear, antialiased); ``"crop"`` centre-crops them to the
        target's aspect ratio first. Resized images are counted in the report.
    image_size: target side length (square). ``None``: the size most images have.
    max_pixels: per-image pixel limit (decompression-bomb guard).
    window: how 16-bit and DICOM values map to [0, 1]: ``auto``, ``bits:N`` or ``CENTER,WIDTH``
        (see ``feta_release.data.dicom``).
    patient_cap: keep at most this many images per patient (the first in file order), making the
        patient the unit of privacy (``feta_release.privacy_unit``); needs patient ids.
    declared: the site policy's PUBLIC class list and image shape (``feta_release.data.declared``): labels are
        looked up by name in it (a label outside it is refused, a class without images is fine) and each image
        is converted to its channels and size on its own. ``None`` (``data inspect``, drafts, ``train``
        without a declaring policy): both are read off the data (the classes present; the majority colour mode
        and size), which is what a site's node never does.
    """
    ds, report = _load_any(path, resize, image_size, max_pixels, window, declared)
    if patient_cap is not None:
        ds = _cap_patients(ds, report, patient_cap)
    return ds, report


def patient_grouping(report: LoadReport) -> np.ndarray | None:
    """Per image its patient's index when the data were loaded under a patient cap (a patient-level policy's
    data), else None: what ``commitment.dataset_commitment(..., patients=)`` binds beside the pixels and
    labels."""
    return report.patients if report.patient_cap is not None else None


def cap_loaded(ds: ImageDataset, report: LoadReport, k: int) -> ImageDataset:
    """``load_dataset(..., patient_cap=k)`` applied to data already loaded without a cap (same images, same
    report)."""
    return _cap_patients(ds, report, k)


def check_cap_for_policy(
    policy: Any, patient_cap: int | None, *, cap_source: str, policy_source: str
) -> None:
    """Before any image is read: a patient cap asked for (``cap_source``, e.g. ``train --patient-cap 2``)
    that the site's signed policy does not make the unit of privacy is refused. Under an image-level policy
    the cap would drop every patient's images past the first K while the run stays image-level (DP-SGD
    samples images, every ε per image): not the patient-level run the cap asks for. A patient-level
    policy's cap of another value: its node uses its own (``policy_data``)."""
    if patient_cap is None:
        return
    if getattr(policy, "privacy_unit", "image") != "patient":
        raise ConfigError(
            f"{policy_source}: the policy makes the IMAGE the unit of privacy (no dataset.privacy_unit = "
            f'"patient") but {cap_source} asks for a patient-level run: the cap would drop each patient\'s '
            "images past the first and every ε would stay per image; drop the patient cap (every image used, "
            f'ε per image), or sign a policy with dataset.privacy_unit = "patient", patient_cap = '
            f"{patient_cap} and patients (site init --patient-cap {patient_cap})"
        )
    refuse_another_cap(policy_source, int(policy.patient_cap), patient_cap, cap_source)


def refuse_another_cap(policy_source: str, signed: int, asked: int | None, where: str) -> None:
    """A patient cap other than the signed policy's, in one line (every per-patient figure holds over the
    SIGNED cap): ``where`` names what asks for ``asked`` (a flag, the node's config)."""
    if asked is not None and asked != signed:
        raise ConfigError(
            f"{policy_source}: dataset.patient_cap = {signed} but {where} asks for a patient cap of {asked}; "
            f"set it to {signed} or remove it"
        )


def policy_data(
    policy: Any, ds: Any, report: Any, *, data_source: str, policy_source: str
) -> tuple[Any, PatientIndex | None]:
    """The site's data as its signed policy's unit of privacy needs them, and the patient index for DP-SGD.

    An image-level policy: the data as loaded, no index. A patient-level policy (``dataset.privacy_unit =
    "patient"``): the data must carry patient ids (refused otherwise: DP-SGD cannot sample patients it cannot
    tell apart), at most ``dataset.patient_cap`` images per patient are kept (the loader's cap, set here when
    the node's own config sets none; a different one is refused), and the index holds the PUBLIC patient
    count."""
    if getattr(policy, "privacy_unit", "image") != "patient":
        return ds, None
    if report.patients is None:
        raise ConfigError(
            f"{policy_source}: the policy makes the PATIENT the unit of privacy (dataset.privacy_unit = "
            f'"patient") but {data_source} has no patient ids; give the data a patient_id column (CSV '
            "path,label,patient_id) or DICOM files with PatientID, or sign a policy without privacy_unit"
        )
    cap = int(policy.patient_cap)
    where = f"the loader of {data_source} (node.toml [data] patient_cap, or train --patient-cap)"
    refuse_another_cap(policy_source, cap, report.patient_cap, where)
    if report.patient_cap is None:
        ds = cap_loaded(ds, report, cap)
    return ds, PatientIndex(np.asarray(report.patients), int(policy.patients), cap)


def _cap_patients(ds: ImageDataset, report: LoadReport, k: int) -> ImageDataset:
    if report.patients is None:
        raise ConfigError(
            f"{report.source}: a patient cap needs patient ids (a CSV patient_id column or DICOM "
            "PatientID); without them the unit of privacy is one image: drop the cap"
        )
    # each would pass the cap as a patient of its own: the cap would bound nobody's images
    if report.unidentified:
        raise DataError(
            f"{report.source}: a patient cap needs a patient id on every image, and "
            f"{len(report.unidentified)} have none (DICOM PatientID empty or missing, or not DICOM); give "
            "them ids with a CSV path,label,patient_id, or remove them:" + _listing(report.unidentified)
        )
    keep = cap_per_patient(report.patients, k)
    report.patient_cap, report.n_dropped_by_cap = k, ds.n - len(keep)
    if report.n_dropped_by_cap:
        report.warnings.append(
            f"patient cap {k}: kept the first {k} image(s) of each patient, dropped "
            f"{report.n_dropped_by_cap} image(s)"
        )
    report.patients = report.patients[keep]
    if len(report.files) == ds.n:
        report.files = [report.files[i] for i in keep]
    report.n_images = len(keep)
    return ImageDataset(ds.images[keep], ds.labels[keep], ds.class_names, ds.source)


def _load_any(
    path: str | os.PathLike,
    resize: ResizePolicy,
    image_size: int | None,
    max_pixels: int,
    window: str | Window | None,
    declared: DataDeclaration | None = None,
) -> tuple[ImageDataset, LoadReport]:
    if resize not in RESIZE_POLICIES:
        raise ConfigError(f"resize must be one of {', '.join(RESIZE_POLICIES)}, not {resize!r}")
    if image_size is not None and (not isinstance(image_size, int) or image_size < 1):
        raise ConfigError(f"image_size must be a positive integer or None, not {image_size!r}")
    if declared is not None and image_size is not None and declared.size != (image_size, image_size):
        raise ConfigError(
            f"image_size {image_size} (node.toml [data] / --image-size) differs from the policy's declared "
            f"image_shape {list(declared.image_shape)}; drop image_size (the declaration sets the size)"
        )
    opts = _Options(resize, image_size, max_pixels, parse_window(window), declared)
    p = Path(path)
    if not p.exists():
        if str(path) == "embedded":
            ds, report = _load_npz(embedded_path(), resize, image_size, declared)
            ds.source = report.source = EMBEDDED_SOURCE
            report.kind = "embedded"
            return ds, report
        raise DataError(f"{p}: no such file or directory")
    if p.is_dir():
        return _load_folder(p, opts)
    if p.suffix.lower() == ".npz":
        return _load_npz(p, resize, image_size, declared)
    if p.suffix.lower() == ".csv":
        return _load_csv(p, opts)
    raise DataError(
        f"{p}: not a dataset; expected a folder with one sub-folder per class ({_KINDS} inside), a .csv with "
        "columns path,label[,patient_id], or an .npz with arrays 'images' and 'labels'"
    )


# ------------------------------------------------------------------------------------------------
# image folders and CSV lists
# ------------------------------------------------------------------------------------------------
@dataclass
class _Header:
    path: Path
    label: str  # the class NAME (a folder's name, a CSV's label): looked up in the class list when building
    size: tuple[int, int]  # (H, W)
    channels: int  # 1 or 3: what the file holds before any unification
    is_dicom: bool = False
    patient_key: str | None = None  # opaque; never printed


@dataclass
class _Item:
    path: Path
    label: str
    patient_key: str | None = None


class _Problems:
    """Every problem of one dataset, grouped by kind; raised together at the end."""

    def __init__(self) -> None:
        self.sections: list[str] = []

    def add(self, title: str, items: list[str] | None = None) -> None:
        self.sections.append(title + (_listing(items) if items else ""))

    def raise_if_any(self, where: Path) -> None:
        if not self.sections:
            return
        if len(self.sections) == 1:
            raise DataError(f"{where}: {self.sections[0]}")
        body = "\n".join(f"[{i}] {s}" for i, s in enumerate(self.sections, 1))
        raise DataError(
            f"{where}: {len(self.sections)} kinds of problem; fix them all, then run again:\n{body}"
        )


def _listing(items: list[str]) -> str:
    shown = items[:MAX_LISTED]
    more = len(items) - len(shown)
    return "\n  " + "\n  ".join(shown) + (f"\n  ... and {more} more" if more else "")


def _is_hidden(p: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in p.relative_to(root).parts)


def _is_image(f: Path) -> bool:
    return f.suffix.lower() in IMAGE_EXTENSIONS or dicom.is_dicom(f)


def _load_folder(root: Path, opts: _Options) -> tuple[ImageDataset, LoadReport]:
    report = LoadReport(source=str(root), kind="folder")
    entries = sorted(e for e in root.iterdir() if not e.name.startswith("."))
    if not entries:
        raise DataError(f"{root}: empty directory; expected one sub-folder of images per class")
    class_dirs = [e for e in entries if e.is_dir()]
    loose = [e for e in entries if e.is_file()]
    if not class_dirs:
        if (root / "synthetic.npz").exists():
            raise DataError(f"{root}: looks like a run directory; pass {root / 'synthetic.npz'}")
        n_img = sum(_is_image(e) for e in loose)
        hint = f" ({n_img} images lie directly in it)" if n_img else ""
        raise DataError(
            f"{root}: no class sub-folders{hint}; expected one sub-folder per class, e.g. "
            f"{root}/<class>/001.png"
        )
    report.skipped_files.extend(str(e) for e in loose)
    problems = _Problems()
    items: list[_Item] = []
    empty: list[str] = []
    for cdir in class_dirs:
        n_before = len(items)
        for f in sorted(cdir.rglob("*")):
            if not f.is_file():
                continue
            if not _is_hidden(f, cdir) and _is_image(f):
                items.append(_Item(f, cdir.name))
            else:
                report.skipped_files.append(str(f))
        if len(items) == n_before:
            empty.append(f"{cdir}/")
    # With declared classes an empty (or absent) class folder is fine: the class list is public, not read off
    # here.
    if empty and opts.declared is None:
        problems.add(f"class folders without any {_KINDS} image:", empty)
    if len(class_dirs) < 2 and opts.declared is None:
        problems.add(
            f"only one class ({class_dirs[0].name!r}); class-conditional synthesis needs at least 2 "
            "class sub-folders"
        )
    _add_repeated(problems, [(it.path, str(it.path)) for it in items], "delete the copies or links")
    if report.skipped_files:
        report.warnings.append(
            f"skipped {report.n_skipped} non-image file(s) (only {', '.join(sorted(IMAGE_EXTENSIONS))} and "
            f"DICOM files are read):{_listing(report.skipped_files)}"
        )
    return _load_items(root, items, tuple(d.name for d in class_dirs), opts, report, problems)


def _load_csv(path: Path, opts: _Options) -> tuple[ImageDataset, LoadReport]:
    """``path,label[,patient_id]``; every bad row is listed (by line number; never quoting a patient id)."""
    report = LoadReport(source=str(path), kind="csv")
    problems = _Problems()
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            rows = list(csv.reader(fh))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"{path}: cannot be read as a UTF-8 CSV ({type(exc).__name__})") from exc
    header = [h.strip().lower() for h in rows[0]] if rows else []
    if header[:2] != ["path", "label"] or not set(header[2:]) <= {"patient_id"}:
        raise DataError(f"{path}: the first line must be the header path,label or path,label,patient_id")
    has_pid = "patient_id" in header
    bad, missing, parsed, outside = [], [], [], []
    lines: list[int] = []  # the CSV line of each parsed row, to name repeated files
    root = path.parent.resolve()
    for lineno, row in enumerate(rows[1:], start=2):
        if not any(c.strip() for c in row):
            continue
        if len(row) != len(header) or not row[0].strip() or not row[1].strip():
            bad.append(f"line {lineno}: expected {len(header)} non-empty fields ({','.join(header)})")
            continue
        # a NUL byte, an over-long name or a symlink loop: the OS refuses the path (used to be a traceback)
        try:
            why = _leaves_root(row[0].strip(), root)
            if why is not None:
                outside.append(f"line {lineno}: {why}")
                continue
            f = (root / row[0].strip()).resolve()
            is_file = f.is_file()
        except (OSError, ValueError, RuntimeError) as exc:
            bad.append(f"line {lineno}: the path cannot be used ({_os_reason(exc)})")
            continue
        if not is_file:
            missing.append(f"line {lineno}: {f}")
            continue
        pid = row[2].strip() if has_pid else None
        if has_pid and not pid:
            bad.append(f"line {lineno}: empty patient_id")
            continue
        parsed.append((f, row[1].strip(), pid))
        lines.append(lineno)
    if bad:
        problems.add(f"{len(bad)} malformed row(s):", bad)
    if outside:
        problems.add(
            f"{len(outside)} row(s) name a file outside the data folder {root} (the CSV's folder); list "
            "only images inside it, by a relative path without '..' (move or copy them in):",
            outside,
        )
    if missing:
        problems.add(f"{len(missing)} listed file(s) do not exist:", missing)
    _add_repeated(
        problems, [(f, f"line {n}: {f}") for n, (f, _, _) in zip(lines, parsed)], "delete the extra rows"
    )
    names = tuple(sorted({lab for _, lab, _ in parsed}))
    if not parsed:
        problems.add("no usable rows")
        problems.raise_if_any(path)
    if len(names) < 2 and opts.declared is None:
        problems.add(f"only one class ({names[0]!r}); class-conditional synthesis needs at least 2")
    items = [_Item(f, lab, _patient_key(pid)) for f, lab, pid in parsed]
    return _load_items(path, items, names, opts, report, problems)


def _leaves_root(listed: str, root: Path) -> str | None:
    """Why a CSV row's path leaves ``root`` (None: it stays inside): an absolute path, a '..' part, or a path
    that resolves (through symbolic links) outside it. Images from elsewhere on the node (another study's, a
    file an export tool was tricked into naming) would be trained on as this site's data."""
    shown = listed if len(listed) <= 80 else listed[:77] + "..."
    parts = listed.replace("\\", "/").split("/")
    if listed.startswith(("/", "\\")) or Path(listed).is_absolute() or (len(listed) > 1 and listed[1] == ":"):
        return f"{shown!r} is an absolute path"
    if ".." in parts:
        return f"{shown!r} goes up out of the folder ('..')"
    if not (root / listed).resolve().is_relative_to(root):
        return f"{shown!r} is (or lies below) a symbolic link that leads out of the data folder"
    return None


def _os_reason(exc: Exception) -> str:
    """Why the OS refused a path, in a few words (never the path again: it may be thousands of characters)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)[:80] or type(exc).__name__


def _file_key(f: Path) -> tuple[int, int] | str:
    """The file's identity: (device, inode) follows symlinks and sees hard links; the path when stat fails
    (the decoder reports that file as unreadable)."""
    try:
        st = f.stat()
    except (OSError, ValueError):
        return str(f)
    return st.st_dev, st.st_ino


def _add_repeated(problems: _Problems, named: list[tuple[Path, str]], fix: str) -> None:
    """One file read twice (a CSV row repeated, a symlink or hard link beside its target) is one image counted
    twice: under a patient cap with two patient ids it passes as two patients (twice the ε the policy signs),
    and with two labels it trains one image into two classes. Refused, each repeat named beside its first
    listing."""
    first: dict[tuple[int, int] | str, str] = {}
    repeats: list[str] = []
    for f, name in named:
        key = _file_key(f)
        if key in first:
            repeats.append(f"{name} (the same file as {first[key]})")
        else:
            first[key] = name
    if repeats:
        problems.add(
            f"{len(repeats)} image file(s) listed more than once (one image must count once: a copy "
            f"overweights it and can pass a patient cap as another patient); {fix}:",
            repeats,
        )


def _patient_key(pid: str | None) -> str | None:
    return None if pid is None else hashlib.sha256(pid.encode()).hexdigest()


def _load_items(
    where: Path,
    items: list[_Item],
    class_names: tuple[str, ...],
    opts: _Options,
    report: LoadReport,
    problems: _Problems,
) -> tuple[ImageDataset, LoadReport]:
    """Decode every listed file; collect every problem; raise them together or build the dataset.

    The class list and the target shape are the policy's declaration (``opts.declared``) when there is one,
    else read off the data (a draft); either way each image is then conformed to the target on its own. The
    target is fixed from the headers first, so each image is conformed as soon as it is decoded: only
    target-sized images are kept (holding every full-size scan until the end took N x its size: 5,000 chest
    X-rays of 2,500 x 2,000 pixels are 100 GB of float32 before the first resize)."""
    bad: list[str] = []
    headers: list[_Header] = []
    for it in items:
        try:
            headers.append(_read_header(it, opts.max_pixels))
        except DataError as exc:
            bad.append(str(exc))
    names = opts.declared.class_names if opts.declared is not None else class_names
    target: tuple[int, int] = (0, 0)
    size_problem = None
    if headers:
        target, off = _target_size([h.size for h in headers], opts)
        if off and opts.resize == "refuse":
            size_problem = _size_message(
                target,
                off,
                [(str(h.path), h.size) for h in headers],
                opts.image_size,
                opts.declared is not None,
            )
    channels = (
        opts.declared.image_shape[0]
        if opts.declared is not None
        else _choose_channels(headers, report)
        if headers
        else 1
    )
    images, decoded = _decode_all(headers, (channels, *target), opts, report, bad)
    if bad:
        problems.add(f"{len(bad)} unreadable, corrupt or truncated image file(s):", bad)
    _check_labels(items, names, opts.declared, problems)
    if size_problem is not None:
        problems.add(size_problem)
    problems.raise_if_any(where)
    _note_conversions(decoded, (channels, *target), opts, report)
    _note_sixteen_bit(report)
    _note_patients(report, [h for h, _, _ in decoded])
    index = {n: i for i, n in enumerate(names)}
    labels = np.array([index[h.label] for h, _, _ in decoded], dtype=np.int64)
    report.files = [str(h.path) for h, _, _ in decoded]
    ds = ImageDataset(images, labels, names, source=str(where))
    report.n_images = ds.n
    return ds, report


def _decode_all(
    headers: list[_Header], shape: tuple[int, int, int], opts: _Options, report: LoadReport, bad: list[str]
) -> tuple[np.ndarray, list[tuple[_Header, bool, bool]]]:
    """Each image decoded and at once conformed to ``shape`` by ``conform_image`` (a function of that image
    alone): (images, [(header, was it resized, were its channels converted)]) of those that decoded. Problems
    go to ``bad``; an image whose size is already a listed problem (``resize = "refuse"``) is decoded (to find
    corrupt data) but not conformed."""
    c, h, w = shape
    images = np.empty((len(headers), c, h, w), dtype=np.float32)
    decoded: list[tuple[_Header, bool, bool]] = []
    for hd in headers:
        try:
            arr = _read_pixels(hd, report, opts.window)
        except DataError as exc:
            bad.append(str(exc))
            continue
        resized = arr.shape[:2] != (h, w)
        if resized and opts.resize == "refuse":
            if hd.size == (h, w):  # its header said otherwise: the file changed between the two reads
                bad.append(
                    f"{hd.path}: changed while being read ({arr.shape[0]}x{arr.shape[1]}, header said "
                    f"{h}x{w}); run again when the export has finished"
                )
            continue
        images[len(decoded)] = conform_image(arr, shape, opts.resize)
        decoded.append((hd, resized, arr.shape[2] != c))
    return images[: len(decoded)], decoded


def _check_labels(
    items: list[_Item], names: tuple[str, ...], declared: DataDeclaration | None, problems: _Problems
) -> None:
    """A label outside the declared classes is a problem naming its file(s) and the fix (never mapped
    elsewhere)."""
    if declared is None:
        return
    known = set(names)
    outside: dict[str, list[str]] = {}
    for it in items:
        if it.label not in known:
            outside.setdefault(it.label, []).append(str(it.path))
    if outside:
        problems.add(unknown_label_message(declared, outside))


def _target_size(sizes: list[tuple[int, int]], opts: _Options) -> tuple[tuple[int, int], list[int]]:
    """(H, W) every image is brought to (the declared size, else ``_size_target``) and the images that
    differ."""
    if opts.declared is None:
        return _size_target(sizes, opts.image_size)
    target = opts.declared.size
    return target, [i for i, s in enumerate(sizes) if s != target]


def _note_conversions(
    decoded: list[tuple[_Header, bool, bool]], shape: tuple[int, int, int], opts: _Options, report: LoadReport
) -> None:
    """Count and name what ``_decode_all`` changed: images resized, and channels converted to the declared
    ones."""
    c, h, w = shape
    report.n_resized += sum(resized for _, resized, _ in decoded)
    converted = [str(hd.path) for hd, _, changed in decoded if changed]
    if converted and opts.declared is not None:
        what = "greyscale to RGB (channel copied)" if c == 3 else "RGB to greyscale (ITU-R 601 luma)"
        report.count(f"converted to the declared {c} channel(s): {what}", len(converted))
        report.warnings.append(
            f"converted {len(converted)} image(s) {what} to the declared image_shape "
            f"{list(shape)}:{_listing(converted)}"
        )
    if report.n_resized:
        how = "centre-cropped and resized" if opts.resize == "crop" else "resized"
        report.warnings.append(f"{how} {report.n_resized} image(s) to {h}x{w} (bilinear)")


def _note_sixteen_bit(report: LoadReport) -> None:
    depths = [k for k in report.conversions if k.startswith("16-bit scaled as")]
    if len(depths) > 1:
        report.warnings.append(
            "16-bit images of different bit depths were each scaled to their own depth "
            f"({', '.join(sorted(depths))}); if they share one depth, set the window, e.g. --window bits:12"
        )


def _note_patients(report: LoadReport, headers: list[_Header]) -> None:
    keys = [h.patient_key for h in headers]
    if not any(k is not None for k in keys):
        return
    report.unidentified = [str(h.path) for h in headers if h.patient_key is None]
    index: dict[str, int] = {}
    out: list[int] = []
    for k in keys:
        # An image without a patient id counts as its own patient (the image-level assumption).
        out.append(index.setdefault(k if k is not None else f"\0{len(out)}", len(index)))
    report.patients = np.asarray(out, dtype=np.int64)
    n_missing = sum(k is None for k in keys)
    if n_missing:
        report.warnings.append(f"{n_missing} image(s) without a patient id; each counts as its own patient")


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
            f"{path}: refused as a possible decompression bomb ({w}x{h} = {w * h:,} pixels > limit "
            f"{max_pixels:,})"
        )
    if w < 1 or h < 1:
        im.close()
        raise DataError(f"{path}: image has no pixels ({w}x{h})")
    return im


def _read_header(item: _Item, max_pixels: int) -> _Header:
    path = item.path
    if dicom.is_dicom(path):
        dh = dicom.read_header(path, max_pixels)
        return _Header(path, item.label, dh.size, dh.channels, True, item.patient_key or dh.patient_key)
    im = _open_guarded(path, max_pixels)
    try:
        mode = im.mode
        if mode in _GREY_MODES:
            channels = 1
        elif mode in ("P", "PA"):
            channels = 1 if _palette_is_grey(im, path) else 3
        else:
            channels = 3
        return _Header(path, item.label, (im.size[1], im.size[0]), channels, False, item.patient_key)
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


def _read_pixels(h: _Header, report: LoadReport, window: Window | None = None) -> np.ndarray:
    """Decode one image to float32 (H, W, C) in [0, 1], C = 1 or 3."""
    window = window if window is not None else Window()
    path = h.path
    if h.is_dicom:
        arr, rule = dicom.read_pixels(path, window)
        report.count(rule)
        return arr
    # The header pass already refused oversized images; no limit needed twice.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            warnings.filterwarnings("ignore", message="Palette images with Transparency")
            with Image.open(path) as im:
                if getattr(im, "n_frames", 1) > 1:
                    report.count("multi-frame: first frame used")
                im.load()
                return _pixels(im, path, report, window)
    except DataError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise DataError(f"{path}: refused as a possible decompression bomb ({exc})") from exc
    except (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error, IndexError) as exc:
        raise DataError(f"{path}: corrupt or truncated ({exc})") from exc


def _pixels(im: Image.Image, path: Path, report: LoadReport, window: Window) -> np.ndarray:
    mode = im.mode
    if mode == "1":
        arr = np.asarray(im, dtype=np.float32)
    elif mode == "L":
        arr = np.asarray(im, dtype=np.float32) / np.float32(255)
    elif mode in ("LA", "La"):
        report.count("alpha channel dropped")
        arr = np.asarray(im.getchannel(0), dtype=np.float32) / np.float32(255)
    elif mode.startswith("I;16") or mode == "I":
        raw = np.asarray(im)
        if mode == "I" and raw.size and (raw.min() < 0 or raw.max() > 65535):
            raise DataError(
                f"{path}: 32-bit integer pixels {int(raw.min())}..{int(raw.max())} outside 0..65535; "
                "save as 8- or 16-bit"
            )
        arr, rule = dicom.window_sixteen_bit(raw, window)
        report.count(rule)
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
    """Majority colour mode (ties: colour); converts the minority, says so and names those files."""
    n_grey = sum(h.channels == 1 for h in headers)
    n_colour = len(headers) - n_grey
    if n_grey and n_colour:
        target = 3 if n_colour >= n_grey else 1
        converted = n_grey if target == 3 else n_colour
        what = "greyscale to RGB (channel copied)" if target == 3 else "RGB to greyscale (ITU-R 601 luma)"
        report.count(f"mixed colour modes: {what}", converted)
        minority = [str(h.path) for h in headers if h.channels != target]
        report.warnings.append(
            f"mixed colour modes: {n_grey} greyscale and {n_colour} colour image(s); "
            f"converted {converted} {what} to match the majority:{_listing(minority)}"
        )
        return target
    return 3 if n_colour else 1


def _size_target(sizes: list[tuple[int, int]], image_size: int | None) -> tuple[tuple[int, int], list[int]]:
    """Target (H, W) (``image_size`` or the most common size) and the indices of images that differ."""
    counts = Counter(sizes)
    majority, _ = max(counts.items(), key=lambda kv: (kv[1], kv[0][0] * kv[0][1]))
    target = (image_size, image_size) if image_size is not None else majority
    return target, [i for i, s in enumerate(sizes) if s != target]


def _size_message(
    target: tuple[int, int],
    off: list[int],
    named: list[tuple[str, tuple[int, int]]],
    image_size: int | None,
    declared: bool = False,
) -> str:
    sizes = Counter(s for _, s in named)
    if declared:
        listed = [f"{named[i][0]} ({named[i][1][0]}x{named[i][1][1]})" for i in off]
        return (
            f"{len(off)} image(s) differ from the policy's declared image_shape size {target[0]}x{target[1]} "
            f'(height x width):{_listing(listed)}\nFix the files, or set resize = "resize" or "crop" '
            "(node.toml [data], --resize) to resize each of them to it."
        )
    if image_size is not None and len(sizes) == 1:
        ((h, w),) = sizes
        return (
            f'all images are {h}x{w} but image_size = {image_size}; set resize = "resize" (or "crop", '
            "--resize on the command line) to resize them, or drop image_size"
        )
    n_major = sizes[target]
    listed = [f"{named[i][0]} ({named[i][1][0]}x{named[i][1][1]})" for i in off]
    return (
        f"images differ in size; the target is {target[0]}x{target[1]}"
        f"{' (' + str(n_major) + ' images)' if image_size is None else ''} and {len(off)} differ "
        f'(height x width):{_listing(listed)}\nFix the files, or set resize = "resize" or "crop" (and '
        "image_size; --resize/--image-size on the command line) to resize them explicitly."
    )


def _choose_size(
    sizes: list[tuple[int, int]],
    names: list[str],
    resize: ResizePolicy,
    image_size: int | None,
    where: Path,
) -> tuple[int, int]:
    """Target (H, W); refuses (listing the files) unless resizing was asked for."""
    target, off = _size_target(sizes, image_size)
    if off and resize == "refuse":
        raise DataError(f"{where}: {_size_message(target, off, list(zip(names, sizes)), image_size)}")
    return target


# ------------------------------------------------------------------------------------------------
# .npz
# ------------------------------------------------------------------------------------------------
def _load_npz(
    path: Path, resize: ResizePolicy, image_size: int | None, declared: DataDeclaration | None = None
) -> tuple[ImageDataset, LoadReport]:
    """Read through ``files.read_npz``: every array's header is checked (an image over the pixel limit, a
    shape that is not the bytes its member holds, a total over ``MAX_NPZ_BYTES``, a decompression bomb, an
    object array) before numpy allocates it; a 1.2 MB archive of deflated zeros used to take the loader to 2.7
    GB."""
    report = LoadReport(source=str(path), kind="npz")
    if not path.is_file():
        raise DataError(f"{path}: not a regular file; give the .npz file itself")
    arrays = read_npz(
        path,
        str(path),
        names=("images", "labels"),
        optional=("class_names",),
        max_bytes=MAX_NPZ_BYTES,
        error=DataError,
        check=functools.partial(_check_npz_images, path),
    )
    ds = parse_arrays(
        arrays["images"],
        arrays["labels"],
        arrays.get("class_names"),
        source=str(path),
        report=report,
        declared=declared,
        resize=resize,
    )
    if declared is None:
        ds = _fit_size(ds, resize, image_size, report, path)
    report.n_images = ds.n
    return ds, report


@functools.lru_cache(maxsize=1)
def _embedded() -> ImageDataset:
    ds, _ = _load_npz(embedded_path(), "refuse", None)
    ds.source = EMBEDDED_SOURCE
    return ds


def load_embedded() -> ImageDataset:
    """The 5,000 embedded MNIST digits as float32 (5000, 1, 28, 28), classes "0".."9".

    Returns a fresh copy each call, so callers may modify it freely.
    """
    ds = _embedded()
    return ImageDataset(ds.images.copy(), ds.labels.copy(), ds.class_names, ds.source)


def _check_npz_images(path: Path, headers: dict[str, NpyHeader]) -> None:
    """An image over the pixel limit (as for image files) is refused from its header, before any data is
    read."""
    shape = headers["images"].shape
    per_item = math.prod(shape[1:]) if len(shape) > 1 else 1
    if per_item > 3 * DEFAULT_MAX_PIXELS:
        raise DataError(
            f"{path}: array 'images' declares {per_item:,} values per image (shape {shape}), over the "
            f"limit {3 * DEFAULT_MAX_PIXELS:,}; store smaller images"
        )
    check_dataset_memory(shape[0] if shape else 0, per_item, str(path))  # the float32 set it becomes


def _fit_size(
    ds: ImageDataset, resize: ResizePolicy, image_size: int | None, report: LoadReport, where: Path
) -> ImageDataset:
    if image_size is None:
        return ds
    _, h, w = ds.image_shape
    if (h, w) == (image_size, image_size):
        return ds
    _choose_size([(h, w)], [str(where)], resize, image_size, where)  # raises under "refuse"
    imgs = np.stack(
        [
            fit_image(im.transpose(1, 2, 0), (image_size, image_size), resize).transpose(2, 0, 1)
            for im in ds.images
        ]
    )
    report.n_resized = ds.n
    report.warnings.append(
        f"resized all {ds.n} image(s) from {h}x{w} to {image_size}x{image_size} (bilinear)"
    )
    return ImageDataset(imgs.astype(np.float32), ds.labels, ds.class_names, ds.source)


def parse_arrays(
    images: np.ndarray,
    labels: np.ndarray,
    class_names: np.ndarray | None = None,
    *,
    source: str = "<arrays>",
    report: LoadReport | None = None,
    declared: DataDeclaration | None = None,
    resize: ResizePolicy = "refuse",
) -> ImageDataset:
    """Validate and canonicalise raw arrays (the ``.npz`` parser); raises ``DataError`` on bad input.

    ``declared``: map the labels by name onto the declared classes (integer labels without ``class_names`` are
    indices into it) and conform each image to the declared shape on its own (``resize`` as
    ``load_dataset``)."""
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
            f"{source}: {images.shape[0]} images but {len(labels)} labels; the arrays must have the same "
            "length"
        )
    nchw = _to_nchw(images, source, report)
    pixels = _pixels_to_unit(nchw, source, report)
    if declared is not None:
        lab = _declared_labels(labels, class_names, declared, source)
        return ImageDataset(
            _conform_arrays(pixels, declared, resize, source, report),
            lab,
            declared.class_names,
            source=source,
        )
    lab, names = _labels(labels, class_names, source)
    counts = np.bincount(lab, minlength=len(names))
    if len(names) < 2:
        raise DataError(
            f"{source}: only one class ({names[0]!r}); class-conditional synthesis needs at least 2"
        )
    empty = [names[i] for i in np.flatnonzero(counts == 0)]
    if empty:
        raise DataError(f"{source}: class(es) without any image: {empty}")
    return ImageDataset(pixels, lab, tuple(names), source=source)


def _declared_labels(
    labels: np.ndarray, class_names: np.ndarray | None, declared: DataDeclaration, source: str
) -> np.ndarray:
    """The labels as indices into the declared classes: by name when the file names its classes (or the labels
    are names), else integer labels are indices into the declared list. A label outside it is refused."""
    lab, names = _labels(labels, class_names, source)
    if class_names is None and labels.dtype.kind not in "US":
        if int(lab.max(initial=0)) >= declared.n_classes:
            raise DataError(
                f"{source}: integer label {int(lab.max())} but the policy declares "
                f"{declared.n_classes} classes {list(declared.class_names)}; store 'class_names' in the "
                "file, or add the missing classes to dataset.classes of the policy and re-sign"
            )
        return lab
    index = {n: i for i, n in enumerate(declared.class_names)}
    outside = sorted({names[i] for i in np.unique(lab)} - set(index))
    if outside:
        raise DataError(f"{source}: " + unknown_label_message(declared, {n: [source] for n in outside}))
    return np.array([index[names[i]] for i in lab], dtype=np.int64)


def _conform_arrays(
    pixels: np.ndarray, declared: DataDeclaration, resize: ResizePolicy, source: str, report: LoadReport
) -> np.ndarray:
    """Each (C, H, W) image conformed to the declared shape on its own (``conform_image``)."""
    c, h, w = declared.image_shape
    if pixels.shape[2:] != (h, w) and resize == "refuse":
        raise DataError(
            f"{source}: images are {pixels.shape[2]}x{pixels.shape[3]} but the policy declares "
            f'image_shape {list(declared.image_shape)}; set resize = "resize" or "crop" (node.toml '
            "[data], --resize) to resize each image, or fix dataset.image_shape and re-sign"
        )
    if pixels.shape[1:] == (c, h, w):
        return pixels
    if pixels.shape[1] != c:
        report.count(f"converted to the declared {c} channel(s)", pixels.shape[0])
    if pixels.shape[2:] != (h, w):
        report.n_resized = pixels.shape[0]
    return np.stack([conform_image(im.transpose(1, 2, 0), declared.image_shape, resize) for im in pixels])


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
        f"{source}: cannot find the channel axis in {images.shape}; 1 (grey) or 3 (RGB) channels are "
        "supported, as (N,C,H,W) or (N,H,W,C)"
    )


def _pixels_to_unit(images: np.ndarray, source: str, report: LoadReport) -> np.ndarray:
    kind = images.dtype.kind
    if kind == "b":
        return np.ascontiguousarray(images, dtype=np.float32)
    if images.dtype == np.uint8:  # divided in place: the same bits without a second float32 copy of the set
        out = np.ascontiguousarray(images, dtype=np.float32)
        out /= np.float32(255)
        return out
    if images.dtype == np.uint16:
        report.count("16-bit scaled from 0..65535", images.shape[0])
        return np.ascontiguousarray(images, dtype=np.float32) / np.float32(65535)
    if kind in "iu":
        ilo, ihi = int(images.min()), int(images.max())
        if ilo < 0 or ihi > 255:
            raise DataError(
                f"{source}: integer pixels {ilo}..{ihi} outside 0..255; store uint8 (0..255), uint16 "
                "(0..65535) or floats in [0, 1]"
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
                f"{source}: float pixels must be in [0, 1]; found {lo:g}..{hi:g} in {len(rows)} image(s), "
                f"first at index {int(rows[0])}{hint}"
            )
        return np.clip(np.ascontiguousarray(images, dtype=np.float32), 0.0, 1.0)
    raise DataError(f"{source}: unsupported pixel dtype {images.dtype}; use uint8, uint16 or float in [0, 1]")


def _labels(labels: np.ndarray, class_names: np.ndarray | None, source: str) -> tuple[np.ndarray, list[str]]:
    names: list[str] | None = None
    if class_names is not None:
        cn = np.asarray(class_names)
        if cn.ndim != 1 or cn.dtype.kind not in ("U", "S", "i", "u"):
            raise DataError(
                f"{source}: 'class_names' must be a 1-D array of strings; got {cn.dtype} {cn.shape}"
            )
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
        raise DataError(
            f"{source}: unsupported label dtype {labels.dtype}; use integers or class-name strings"
        )
    lab = labels.astype(np.int64)
    lo, hi = int(lab.min()), int(lab.max())
    if lo < 0:
        raise DataError(f"{source}: negative label {lo}; labels must be 0..n_classes-1")
    if names is None:
        names = [str(i) for i in range(hi + 1)]
    elif hi >= len(names):
        raise DataError(f"{source}: label {hi} but only {len(names)} class names {names}")
    return lab, names
