"""What data a job can run on: the refusals a site's images meet before anything is planned or released."""

from __future__ import annotations

import numpy as np

from ..config import JobConfig
from ..data import ImageDataset
from ..errors import DataError
from ..mechanisms.feature_map import check_feature_map


def check_data(
    cfg: JobConfig, data: ImageDataset, n_public: int | None = None, declared: bool = False
) -> None:
    """Refuse data the job cannot be run on, with what to change.

    Sampling rates are batch / ``n_public`` (the PUBLIC nominal size, which may round the count up), so a
    batch is too large only when it exceeds the public size (q > 1), not the exact count. ``declared``: the
    classes are a site policy's public declaration, where a class without images is allowed."""
    check_data_content(cfg, data, declared)
    _check_batches(cfg, data, data.n if n_public is None else int(n_public))


def check_data_content(cfg: JobConfig, data: ImageDataset, declared: bool = False) -> None:
    """The checks of :func:`check_data` that do not read the dataset's size (a run that draws its public size
    makes them before the draw; the size checks wait for the drawn size)."""
    if data.n == 0:
        raise DataError(f"{data.source}: no images")
    check_feature_map(cfg.frequency, data.image_shape)
    counts = data.class_counts()
    empty = [data.class_names[c] for c in np.flatnonzero(counts == 0)]
    if empty and not declared:
        raise DataError(
            f"{data.source}: class(es) {', '.join(map(repr, empty))} have no images; every class needs "
            "training images (remove the empty class folders or add images)"
        )


def _check_batches(cfg: JobConfig, data: ImageDataset, n: int) -> None:
    if cfg.dpsgd.batch > n and cfg.dpsgd_steps(n) > 0:
        raise DataError(
            f"{data.source}: public size {n}, fewer than the DP-SGD batch [dpsgd] batch = {cfg.dpsgd.batch} "
            f"(sampling rate q = {cfg.dpsgd.batch / n:.3g} > 1); lower [dpsgd] batch below {n}, or give "
            f"[dpsgd] rate (a sampling rate: the batch then follows the dataset size)"
        )
    if cfg.central.rounds > 0 and cfg.central.batch > n:
        raise DataError(
            f"{data.source}: public size {n}, fewer than [central] batch = {cfg.central.batch} (q > 1); "
            f"lower [central] batch below {n}, or give [central] rate (a sampling rate: the batch then "
            f"follows the dataset size)"
        )
