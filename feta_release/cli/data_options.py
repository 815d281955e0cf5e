"""The data-reading options shared by ``data inspect``, ``train``, ``site init`` and ``node start``.

One decorator, one ``LoadOptions``, one ``load_dataset``: the same flags mean the same thing
everywhere, so a folder that ``data inspect`` accepts is read identically by the node.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

from ..data.loading import RESIZE_POLICIES, LoadOptions


def data_load_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Adds --resize/--image-size/--window/--patient-cap; the command receives them as ``load: LoadOptions |
    None`` (None when none was given); ``load.over(base)`` keeps a job file's or node.toml's settings for the
    flags not given."""

    @click.option(
        "--resize",
        type=click.Choice(RESIZE_POLICIES),
        default=None,
        help="Images whose size differs from the target: refuse (list them; default), resize "
        "(bilinear) or crop (centre-crop to square, then resize). E.g. --resize crop --image-size 64.",
    )
    @click.option(
        "--image-size",
        type=click.IntRange(min=1),
        default=None,
        help="Target side length in pixels (square); default: the size most images have.",
    )
    @click.option(
        "--window",
        default=None,
        metavar="auto|bits:N|C,W",
        help="16-bit PNG/TIFF and DICOM values to [0, 1]: auto (DICOM Window Center/Width, else Bits "
        "Stored; PNG/TIFF: smallest bit depth that holds them), bits:12 (full 12-bit range), or a "
        "window CENTER,WIDTH such as 40,400.",
    )
    @click.option(
        "--patient-cap",
        type=click.IntRange(min=1),
        default=None,
        metavar="K",
        help="Use at most K images per patient (the first in file order; needs a CSV patient_id column "
        "or DICOM PatientID): the unit of privacy becomes the patient. K = 1 keeps the accountant's ε "
        "exact per patient; K > 1 gives (K·ε, K·e^((K-1)ε)·δ) per patient.",
    )
    @functools.wraps(fn)
    def wrapper(
        *args: Any,
        resize: str | None,
        image_size: int | None,
        window: str | None,
        patient_cap: int | None,
        **kw: Any,
    ) -> Any:
        values = {"resize": resize, "image_size": image_size, "window": window, "patient_cap": patient_cap}
        given = frozenset(k for k, v in values.items() if v is not None)
        # ``given`` lets a command lay the flags over its job's or node.toml's settings (LoadOptions.over)
        load = (
            LoadOptions(
                resize=resize or "refuse",  # type: ignore[arg-type]
                image_size=image_size,
                window=window or "auto",
                patient_cap=patient_cap,
                given=given,
            )
            if given
            else None
        )
        return fn(*args, load=load, **kw)

    return wrapper
