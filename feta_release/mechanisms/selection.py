"""Semantic selection of the public set (PrivImage, Li et al. 2024): which PUBLIC images resemble the private
ones.

Two parts, only the second reads private data:

1. **Groups of the public set (public, free).** Each public image's features (its area-averaged ``SIDE`` x
   ``SIDE`` thumbnail per channel) are clustered by k-means into ``groups`` semantic groups, seeded from
   the job's public seed: :func:`public_groups` returns the centroids and each public image's group. A
   function of the public set, the job and the code only, so it costs nothing. Only the CENTROIDS
   (``groups`` x ``feature_dim`` floats, means of public thumbnails) go to a site: never a public image.
2. **The query (private, charged).** Each private image votes for its nearest centroid; the histogram of
   the votes plus N(0, sigma^2) in each group is released (:func:`selection_histogram`). Sensitivity:
   adding or removing one image changes exactly one count by 1, so the histogram has L2 (and L1)
   sensitivity 1, WHATEVER the centroids (coordinator-chosen ones included: an image's vote is a function
   of that image and the public centroids alone). The release is the Gaussian mechanism with noise
   multiplier sigma: the event ``(selection, sigma, q = 1, 1)`` (:func:`selection_event`), charged in the
   site's ledger before the computation runs. A patient-level site counts it by group privacy over its
   patient cap (``accounting.patient_epsilon``), as every image-level release (the secure sum's
   ``SkellamEvent`` below included).

How the query is released depends on the job:

* ``train`` and a federated job with per-site noise (``[federation] secure_aggregation = false``): each site
  releases its own histogram with the FULL noise N(0, sigma^2) per group (:func:`selection_histogram`, the
  event above); the coordinator sums the sites' released histograms.
* a federated job summed by secure aggregation (``[federation] secure_aggregation``, the default for >= 2
  sites): each site turns its votes into 2^10 x the counts, adds only its SHARE of distributed Skellam noise,
  Sk((sigma 2^10)^2 / n), and masks the vector (``secure_sums.selection_contribution``,
  ``edge/secure.py``); the coordinator unmasks only the SUM of the sites' vectors, with the threshold and
  dropout rules of every secure sum, and decodes it to the summed histogram plus noise of std sigma per
  group (``secure_sums.decode_selection``). Sensitivity after the integer scaling: one image moves one count
  by exactly 2^10 (L2 = L1, the one-hot needs no rounding; ``secure_sums``' docstring states it and the
  bound charged). The event is then a ``SkellamEvent`` ``(selection, q = 1, 1)`` counting the honest
  sites' shares (``secure_sums.secagg_warmup_events``); a site's ``mechanisms.selection.min_sigma`` is
  checked against its OWN share, about sigma / sqrt(n), so a coordinator cannot make it small by summing
  over many sites.

Either way the coordinator then keeps the public images of the groups whose noisy count is highest
(:func:`select_groups`, a rule fixed by the signed job): a function of the noisy (summed) histogram and
public values only, i.e. post-processing, and pretraining on the kept images is post-processing of that (it
reads no private image).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..accounting import PrivacyEvent
from ..errors import DataError, PrivacyError
from ._checks import check_positive_int, check_sigma, require_generator

SELECTION_STAGE = "selection"
SIDE = 8  # thumbnail side of the features: coarse layout and brightness, the "semantics" pixels carry cheaply
KMEANS_ITERATIONS = 30
CHUNK = 4096  # images per feature chunk: a large site is read in slices, never copied whole


def selection_event(sigma: float) -> PrivacyEvent:
    """One selection query's event: the Gaussian mechanism (sensitivity 1), unsampled, one composition."""
    return PrivacyEvent(SELECTION_STAGE, check_sigma(sigma, "[public] selection_sigma"), 1.0, 1)


def feature_dim(image_shape: tuple[int, ...]) -> int:
    """Length of one image's feature vector: ``SIDE`` x ``SIDE`` per channel (public: from the shape only)."""
    return int(image_shape[0]) * SIDE * SIDE


def _pool_matrix(size: int) -> np.ndarray:
    """(SIDE, size): row b averages the pixels whose index falls in bin b (area averaging for any size)."""
    bins = (np.arange(size) * SIDE) // size
    m = (bins[None, :] == np.arange(SIDE)[:, None]).astype(np.float64)
    return m / np.maximum(m.sum(axis=1, keepdims=True), 1.0)


def _feature_chunks(images: np.ndarray) -> Iterator[np.ndarray]:
    if images.ndim != 4 or images.shape[0] == 0:
        raise DataError(
            f"semantic selection: images must be a non-empty (N, C, H, W) array, got {images.shape}"
        )
    rows, cols = _pool_matrix(images.shape[2]), _pool_matrix(images.shape[3])
    for start in range(0, images.shape[0], CHUNK):
        x = np.asarray(images[start : start + CHUNK], dtype=np.float64)
        yield np.einsum("bh,nchw,dw->ncbd", rows, x, cols).reshape(len(x), -1)


def features(images: np.ndarray) -> np.ndarray:
    """(N, feature_dim) thumbnails of ``images`` (N, C, H, W) in [0, 1]."""
    return np.concatenate(list(_feature_chunks(images)))


def nearest_group(feats: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """Index of each row's nearest centroid (squared L2; a tie goes to the lower index)."""
    d = (feats**2).sum(1, keepdims=True) - 2 * feats @ centroids.T + (centroids**2).sum(1)[None, :]
    return np.argmin(d, axis=1)


def _kmeans_pp(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    centres = [x[int(rng.integers(len(x)))]]
    d2 = ((x - centres[0]) ** 2).sum(1)
    for _ in range(1, k):
        p = d2 / d2.sum() if d2.sum() > 0 else np.full(len(x), 1.0 / len(x))
        centres.append(x[int(rng.choice(len(x), p=p))])
        d2 = np.minimum(d2, ((x - centres[-1]) ** 2).sum(1))
    return np.stack(centres)


def public_groups(public_images: np.ndarray, groups: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(centroids (groups, feature_dim), each public image's group) by k-means++ and Lloyd iterations from
    the PUBLIC ``seed``: deterministic, a function of public inputs only. An emptied group is re-seeded at
    the public image farthest from its centroid, so every group holds public images."""
    k = check_positive_int(groups, "[public] selection_groups", "semantic selection")
    x = features(public_images)
    if k > len(x):
        raise DataError(
            f"semantic selection: {k} groups for {len(x)} public images; lower [public] selection_groups"
        )
    rng = np.random.default_rng([int(seed), 0x5E1EC7])  # public seed: the same groups at every run of the job
    c = _kmeans_pp(x, k, rng)
    for _ in range(KMEANS_ITERATIONS):
        a = nearest_group(x, c)
        for g in range(k):
            members = x[a == g]
            if len(members):
                c[g] = members.mean(0)
            else:
                c[g] = x[int(np.argmax(((x - c[a]) ** 2).sum(1)))]
    return c.astype(np.float32), nearest_group(x, c.astype(np.float32).astype(np.float64))


def check_centroids(centroids: np.ndarray, groups: int, image_shape: tuple[int, ...]) -> np.ndarray:
    """Refuse centroids that are not ``groups`` finite feature vectors of this image shape (a site checks the
    coordinator's array before it charges: public input only)."""
    c = np.asarray(centroids)
    want = (int(groups), feature_dim(image_shape))
    if c.dtype.kind not in "fiu" or c.shape != want:
        raise PrivacyError(
            f"semantic selection: centroids are {c.dtype} {tuple(c.shape)}, the job's are {want} floats"
        )
    if not np.isfinite(c).all():
        raise PrivacyError("semantic selection: the centroids hold NaN or infinite values; refused")
    return c.astype(np.float64)


def vote_counts(images: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """The EXACT histogram: how many of ``images`` have each centroid as their nearest (never released)."""
    counts = np.zeros(len(centroids), dtype=np.int64)
    c = np.asarray(centroids, dtype=np.float64)
    for f in _feature_chunks(images):
        counts += np.bincount(nearest_group(f, c), minlength=len(c))
    return counts


def selection_histogram(
    images: np.ndarray, centroids: np.ndarray, sigma: float, rng: np.random.Generator
) -> tuple[np.ndarray, PrivacyEvent]:
    """The released noisy histogram (one vote per image, sensitivity 1) and its event. ``rng``: the request's
    fresh OS-seeded generator (a node) or the run's secret one (``train``); an integer seed is refused."""
    event = selection_event(sigma)
    gen = require_generator(rng, "semantic selection")
    counts = vote_counts(images, centroids).astype(np.float64)
    return counts + event.sigma * gen.standard_normal(len(counts)), event


def select_groups(noisy: np.ndarray, public_group: np.ndarray, keep: float) -> np.ndarray:
    """Indices (ascending) of the public images kept: whole groups in decreasing order of their noisy count
    (ties: lower group first) until at least ``keep`` of the public set is kept. Reads the noisy histogram
    and public values only (post-processing)."""
    h = np.asarray(noisy, dtype=np.float64)
    if h.ndim != 1 or not np.isfinite(h).all():
        raise PrivacyError(
            "semantic selection: the released histogram is not a finite vector; nothing selected"
        )
    if not 0 < keep <= 1:
        raise PrivacyError(f"semantic selection: keep must be in (0, 1], got {keep}")
    group = np.asarray(public_group)
    if group.size and (group.min() < 0 or group.max() >= len(h)):
        raise PrivacyError(f"semantic selection: public groups outside the histogram's {len(h)} groups")
    sizes = np.bincount(group, minlength=len(h))
    want, kept = keep * len(group), 0
    chosen: list[int] = []
    for g in np.argsort(-h, kind="stable"):
        if kept >= want:
            break
        chosen.append(int(g))
        kept += int(sizes[g])
    return np.flatnonzero(np.isin(group, chosen))
