"""Labelled image data: the canonical ``ImageDataset``, loaders, the embedded MNIST subset, splits.

Importing this package needs numpy and Pillow only (no torch).
"""

from .dataset import ImageDataset, save_npz
from .embedded import EMBEDDED_SOURCE, embedded_path
from .loading import (
    DEFAULT_MAX_PIXELS,
    IMAGE_EXTENSIONS,
    RESIZE_POLICIES,
    LoadOptions,
    LoadReport,
    load_dataset,
    load_embedded,
    parse_arrays,
)
from .splits import split_sites, train_heldout_split

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "EMBEDDED_SOURCE",
    "IMAGE_EXTENSIONS",
    "ImageDataset",
    "LoadOptions",
    "LoadReport",
    "RESIZE_POLICIES",
    "embedded_path",
    "load_dataset",
    "load_embedded",
    "parse_arrays",
    "save_npz",
    "split_sites",
    "train_heldout_split",
]
