"""The PUBLIC shape of a site's data: its class list and its image shape, declared by the site's
administrator.

The class list (which classes, their order, how many) and the image shape (channels, height, width)
fix the shape of every release and of the model, and the node's ``hello`` sends them un-noised. Read off the
private images they are a count > 0 query per class (one 'sarcoma' image adds a class) and a majority vote
over the colour modes and sizes (one RGB image flips every image to 3 channels). So they are DECLARED instead:
the signed site policy holds ``dataset.classes`` and ``dataset.image_shape`` (``site init`` and ``policy
data-commitment`` draft them from the data as a proposal the administrator reviews and signs, like the public
size), and the node maps its data onto them:

  * each image is converted to the declared channels and size by :func:`conform_image`, a function of that
    image and the public declaration alone (never of the other images);
  * each label is looked up by NAME in the declared list; a label outside it refuses to open the site (a local
    error naming the file and the fix); a declared class without any image is fine.

Imports numpy and Pillow only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from PIL import Image

from ..errors import DataError, PolicyError

LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)  # ITU-R 601-2, as Pillow's convert("L")
Resize = Literal["refuse", "resize", "crop"]


@dataclass(frozen=True)
class DataDeclaration:
    """``class_names`` (label order = list order) and ``image_shape`` (C, H, W), both public."""

    class_names: tuple[str, ...]
    image_shape: tuple[int, ...]  # (C, H, W)

    def __post_init__(self) -> None:
        names = tuple(str(c) for c in self.class_names)
        object.__setattr__(self, "class_names", names)
        object.__setattr__(self, "image_shape", tuple(int(v) for v in self.image_shape))
        if len(names) < 2 or len(set(names)) != len(names) or not all(n.strip() for n in names):
            raise PolicyError(
                f"dataset.classes {list(names)}: give at least 2 distinct, non-empty class names"
            )
        c, h, w = self.image_shape if len(self.image_shape) == 3 else (0, 0, 0)
        if len(self.image_shape) != 3 or c not in (1, 3) or h < 1 or w < 1:
            raise PolicyError(
                f"dataset.image_shape {list(self.image_shape)}: give [channels, height, width] with "
                "1 (greyscale) or 3 (RGB) channels, e.g. [1, 64, 64]"
            )

    @property
    def n_classes(self) -> int:
        return len(self.class_names)

    @property
    def size(self) -> tuple[int, int]:
        return self.image_shape[1], self.image_shape[2]

    @classmethod
    def from_dataset_table(cls, table: Mapping[str, Any]) -> DataDeclaration | None:
        """From a policy's ``[dataset]`` table; None when it declares neither field (a policy signed before
        both)."""
        if "classes" not in table and "image_shape" not in table:
            return None
        if "classes" not in table or "image_shape" not in table:
            raise PolicyError(
                "dataset: declare both classes and image_shape (the public schema of the data), or neither"
            )
        return cls(tuple(table["classes"]), tuple(table["image_shape"]))

    @classmethod
    def draft_from(cls, ds: Any) -> DataDeclaration:
        """A PROPOSAL read off a dataset loaded without a declaration (its classes present, its majority
        shape): for the administrator to review and sign, never what a node uses on its own."""
        return cls(tuple(ds.class_names), tuple(ds.image_shape))

    def policy_fields(self) -> dict[str, Any]:
        return {"classes": list(self.class_names), "image_shape": list(self.image_shape)}

    def toml_lines(self) -> str:
        """The two ``[dataset]`` lines of a policy draft, with a comment saying they are the admin's
        declaration."""
        names = ", ".join('"' + n.replace("\\", "\\\\").replace('"', '\\"') + '"' for n in self.class_names)
        return (
            f"# PUBLIC schema of the data, YOUR declaration (drafted from the data: review it). Every "
            f"release and\n# the model have this shape; the node maps each image onto it alone and refuses "
            f"labels outside\n# classes (a declared class without images is fine: declare rare classes "
            f"whether or not you hold any).\nclasses = [{names}]\n"
            f"image_shape = [{', '.join(str(v) for v in self.image_shape)}]  # [channels 1|3, height, "
            "width]\n"
        )


def convert_channels(arr: np.ndarray, channels: int) -> np.ndarray:
    """float32 (H, W, C) in [0, 1] to ``channels`` (greyscale is copied to RGB; RGB becomes ITU-R 601
    luma)."""
    if arr.shape[2] == channels:
        return arr
    if channels == 3:
        return np.repeat(arr, 3, axis=2)
    return np.clip(arr @ LUMA, 0.0, 1.0)[:, :, None].astype(np.float32)


def fit_image(arr: np.ndarray, size: tuple[int, int], resize: Resize) -> np.ndarray:
    """``crop``: centre-crop float (H, W, C) to the aspect ratio of ``size`` first; then resize (bilinear)."""
    if resize == "crop":
        h, w = arr.shape[:2]
        th, tw = size
        if h * tw > w * th:  # too tall
            nh = max(1, round(w * th / tw))
            top = (h - nh) // 2
            arr = arr[top : top + nh]
        elif h * tw < w * th:  # too wide
            nw = max(1, round(h * tw / th))
            left = (w - nw) // 2
            arr = arr[:, left : left + nw]
    if arr.shape[:2] == size:
        return np.ascontiguousarray(arr)
    h, w = size
    out = np.empty((h, w, arr.shape[2]), dtype=np.float32)
    for c in range(arr.shape[2]):
        ch = Image.fromarray(np.ascontiguousarray(arr[:, :, c]), mode="F")
        out[:, :, c] = np.asarray(ch.resize((w, h), Image.Resampling.BILINEAR), dtype=np.float32)
    return np.clip(out, 0.0, 1.0)


def conform_image(arr: np.ndarray, shape: Sequence[int], resize: Resize) -> np.ndarray:
    """One image, float32 (H, W, C) in [0, 1], as the declared (C, H, W): its channels converted and, when its
    size differs and ``resize`` allows it, resized. A function of this image and the public declaration only.

    Raises ``DataError`` when the size differs under ``resize = "refuse"`` (the caller names the file)."""
    c, h, w = (int(v) for v in shape)
    out = convert_channels(np.asarray(arr, dtype=np.float32), c)
    if out.shape[:2] != (h, w):
        if resize == "refuse":
            raise DataError(f"{out.shape[0]}x{out.shape[1]} differs from the declared {h}x{w}")
        out = fit_image(out, (h, w), resize)
    return np.ascontiguousarray(out.transpose(2, 0, 1), dtype=np.float32)


def unknown_label_message(declared: DataDeclaration, found: Mapping[str, list[str]]) -> str:
    """The admin-facing line for labels outside the declared classes: which labels, which files, and the
    fix."""
    parts = [
        f"{lab!r} ({files[0]}{f' and {len(files) - 1} more' if len(files) > 1 else ''})"
        for lab, files in sorted(found.items())
    ]
    return (
        f"label(s) outside the policy's declared classes {list(declared.class_names)}: {'; '.join(parts)}; "
        "add them to dataset.classes of the site policy (then recompute the commitment with `feta-release "
        "policy data-commitment` and re-sign), or remove those images"
    )
