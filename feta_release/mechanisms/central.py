"""Central images (DP-FETA): per-class noisy mean or mode images released from Poisson-sampled batches.

Neighbouring relation: add/remove ONE image of the site's dataset (the unit of privacy).

Each round draws a Poisson sample (each image joins independently with probability q = batch / n_public) and
releases one image per class.  Classes are disjoint, so one image touches exactly one class's output in a
round: the per-class releases compose in PARALLEL and one round costs one subsampled-Gaussian release.  The
whole stage is the event ``PrivacyEvent("central", sigma, q, rounds)``.

Mean images.  Query per class k: S_k = sum_{i in batch, y_i = k} clip_C(down(x_i)) where down() is nearest
downsampling and clip_C scales a vector to L2 norm <= C.  L2 sensitivity of S = (S_0..S_{K-1}) is C (one image
adds at most one clipped vector to one class).  Released: (S_k + N(0, (sigma C)^2 I)) / B_c with the FIXED,
PUBLIC denominator B_c = batch / n_classes.  Dividing by the actual (private) per-class count, as the
reference code does, would make the released value depend on the count in a way the noise does not cover.

Slant cells (``cells`` > 1, mean only).  Each class is split into ``cells`` disjoint sub-groups by a PUBLIC
function of the image alone, ``slant_cells``: the shear of the image's own intensity (dx/dy of its second
moment) binned at fixed edges (``SLANT_RANGE``, a prior on handwriting slant, not fitted to any dataset's
images).  The query becomes one clipped sum per (class, cell); an image still adds one clipped vector to
exactly ONE sum (its cell is a function of that image only, so adding or removing it moves no other image's
cell): L2 sensitivity C, the same event as ``cells = 1``.  Denominator: the fixed public B_c / cells.  Why:
one class mean is one blurry digit; cell means are several distinct prototypes (upright, right-leaning, ...)
for the same epsilon, each noisier by about the factor cells (fewer images per sum); a cell few images fall
into is mostly noise. Such cells stay among the SDEdit start images on purpose: dropping the cells whose
noise-to-signal figure (sqrt(d s^2 / (||v||^2 - d s^2)), s the public noise std per value) is over the
planner's line (``planning.MOSTLY_NOISE``) lowered the scored accuracy of the synthetic digits (4,000
digits, epsilon 1; fewer distinct starts per class), and so did drawing the starts in proportion to each
cell's estimated amplitude (docs/derived-job.md, "Sampler settings"). Prototype cells (``prototypes``,
``[central] cell_rule = "aux"``): the same split, each image into the cell of its nearest PUBLIC prototype
of its class (k-means centres of aux-generator images, post-processing of the earlier frequency release);
still a function of the image alone (and public values): the same sensitivity C and event. Why: the slant
prior is about handwriting; prototypes follow whatever the data's modes are (any dataset).

Mode images.  Query per class k: the per-pixel histogram H_k[p, b] = #{i in batch, y_i = k : bin(down(x_i)[p])
= b}.  One image adds 1 to exactly one bin of each of the P pixel values, so the L2 sensitivity is sqrt(P).
Released: argmax_b (H_k[p, b] + N(0, sigma^2 P)), reported as the bin midpoint.

Per PATIENT (patient ids known, ``--patient-cap k``): the loader keeps at most k images of each patient (the
first k in file order, a choice that depends on that patient's records only), so add/remove of one patient
adds or removes at most k records, each clipped as above: the unsampled sum moves by at most k·C (mean; by the
triangle inequality, also when the patient's images lie in different classes) or k·sqrt(P) (mode), and each of
those records is Poisson-sampled independently. The event is recorded per image (unit "image"); at a
patient-level site every budget counts it per patient by group privacy over k (``accounting.patient_epsilon``,
the figure ``ledger.check_spend`` caps and DP-SGD is calibrated around); nothing here depends on how many
images a patient has beyond the cap.

Everything after the noisy query (division by B_c, argmax, ``postprocess_central``, ``combine_central``) is
post-processing and costs no privacy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ..accounting import PrivacyEvent
from ..errors import DataError, PrivacyError
from ._checks import (
    check_clip,
    check_images,
    check_positive_int,
    check_sigma,
    require_generator,
    sampling_rate,
)
from .poisson import poisson_mask

__all__ = [
    "CentralRelease",
    "Kind",
    "central_images",
    "central_query",
    "combine_central",
    "postprocess_central",
]

Kind = Literal["mean", "mode"]


@dataclass(frozen=True)
class CentralRelease:
    """Raw released central images, before post-processing.

    ``values``: float32 (rounds * n_classes * cells, C, h, w) at the DOWNSAMPLED size; noisy and unclamped for
    ``mean``, bin midpoints for ``mode``.  Row (r * n_classes + k) * cells + j is cell j of class k of round
    r.
    """

    values: np.ndarray
    labels: np.ndarray
    rounds: int
    kind: Kind
    denominator: float  # public B_c = batch / n_classes (mean); 1.0 for mode
    image_shape: tuple[int, int, int]  # original (C, H, W), for post-processing
    n_classes: int
    sigma: float
    q: float
    clip: float | None  # L2 bound used (mean)
    bins: int | None  # histogram bins (mode)
    cells: int = 1  # slant cells per class (mean): rows are (round, class, cell)

    def to_arrays(self) -> dict[str, np.ndarray | np.generic]:
        """Plain arrays (for ``np.savez`` in a site's release directory); ``from_arrays`` inverts it."""
        return {
            "values": self.values,
            "labels": self.labels,
            "rounds": np.int64(self.rounds),
            "kind": np.array(self.kind),
            "denominator": np.float64(self.denominator),
            "image_shape": np.asarray(self.image_shape, dtype=np.int64),
            "n_classes": np.int64(self.n_classes),
            "sigma": np.float64(self.sigma),
            "q": np.float64(self.q),
            "clip": np.float64(np.nan if self.clip is None else self.clip),
            "bins": np.int64(0 if self.bins is None else self.bins),
            "cells": np.int64(self.cells),
        }

    @classmethod
    def from_arrays(cls, a: Mapping[str, Any]) -> CentralRelease:
        """The release of :meth:`to_arrays`'s arrays (a saved ``central.npz``)."""
        try:
            clip = float(a["clip"])
            bins = int(a["bins"])
            kind = str(np.asarray(a["kind"]))
            if kind not in ("mean", "mode"):
                raise DataError(f"central release arrays: unknown kind {kind!r}")
            return cls(
                values=np.asarray(a["values"], dtype=np.float32),
                labels=np.asarray(a["labels"], dtype=np.int64),
                rounds=int(a["rounds"]),
                kind=kind,  # type: ignore[arg-type]
                denominator=float(a["denominator"]),
                image_shape=tuple(int(v) for v in np.asarray(a["image_shape"])),  # type: ignore[arg-type]
                n_classes=int(a["n_classes"]),
                sigma=float(a["sigma"]),
                q=float(a["q"]),
                clip=None if math.isnan(clip) else clip,
                bins=None if bins == 0 else bins,
                cells=int(a["cells"]) if "cells" in a else 1,  # releases written before cells existed: 1
            )
        except KeyError as exc:
            raise DataError(f"central release arrays lack {exc}") from None


def downsample_nearest(images: np.ndarray, factor: float) -> np.ndarray:
    """Nearest-neighbour downsampling of (N,C,H,W) by ``factor`` in (0, 1] (factor 0.5: every other pixel)."""
    if not (0 < factor <= 1):
        raise PrivacyError(f"central images: downsample factor must be in (0, 1], got {factor}")
    _, _, h, w = images.shape
    h2, w2 = max(1, int(round(h * factor))), max(1, int(round(w * factor)))
    rows = np.minimum((np.arange(h2) * h) // h2, h - 1)
    cols = np.minimum((np.arange(w2) * w) // w2, w - 1)
    return images[:, :, rows][:, :, :, cols]


def clip_rows(x: np.ndarray, clip: float) -> np.ndarray:
    """Scale each row of (N, D) to L2 norm <= clip."""
    norms = np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    scale = np.minimum(1.0, clip / np.maximum(norms, 1e-12))
    return (x * scale).astype(np.float32)


# Public prior on handwriting slant (dx per dy of the ink): the cells split [-0.25, 0.55] evenly; values
# outside fall in the first/last cell. Fixed here, never fitted to a dataset's images (that would make the
# cells private).
SLANT_RANGE = (-0.25, 0.55)


def image_slant(images: np.ndarray) -> np.ndarray:
    """(N,) shear of each image's intensity (channel mean): -cov(row, col) / var(row), 0 for a blank image.

    A function of the one image only: assigning cells with it keeps the per-cell sums' sensitivity at C."""
    x = images.astype(np.float64).mean(axis=1)
    _, h, w = x.shape
    r = np.arange(h, dtype=np.float64)[None, :, None]
    c = np.arange(w, dtype=np.float64)[None, None, :]
    m = x.sum(axis=(1, 2))
    safe = np.maximum(m, 1e-12)
    mr = (x * r).sum(axis=(1, 2)) / safe
    mc = (x * c).sum(axis=(1, 2)) / safe
    dr = r - mr[:, None, None]
    var_r = (x * dr**2).sum(axis=(1, 2)) / safe
    cov = (x * dr * (c - mc[:, None, None])).sum(axis=(1, 2)) / safe
    out = np.where((m > 1e-9) & (var_r > 1e-9), -cov / np.maximum(var_r, 1e-12), 0.0)
    return out


def slant_cells(images: np.ndarray, cells: int) -> np.ndarray:
    """(N,) cell index in [0, cells) of each image by its slant, at the fixed public edges of
    ``SLANT_RANGE``."""
    if cells == 1:
        return np.zeros(len(images), dtype=np.int64)
    edges = np.linspace(SLANT_RANGE[0], SLANT_RANGE[1], cells + 1)[1:-1]
    return np.searchsorted(edges, image_slant(images)).astype(np.int64)


def nearest(x: np.ndarray, centres: np.ndarray) -> np.ndarray:
    """(m,) index of the nearest (L2) row of ``centres`` (k, d) for each row of ``x`` (m, d); ties go to the
    lower index. One matmul: ||x - c||^2 = ||x||^2 - 2 x.c + ||c||^2, and ||x||^2 is the same for every centre
    of a row, so it is left out."""
    return np.argmin((centres * centres).sum(1)[None, :] - 2.0 * (x @ centres.T), axis=1)


def prototype_cells(images: np.ndarray, labels: np.ndarray, prototypes: np.ndarray) -> np.ndarray:
    """(N,) index of each image's nearest (L2) prototype OF ITS OWN CLASS, ``prototypes`` (n_classes, cells,
    C*H*W).

    The prototypes are public (``[central] cell_rule = "aux"``: k-means centres of aux-generator images, i.e.
    post-processing of the frequency release), so an image's cell is a function of that image alone: adding or
    removing one image moves no other image's cell, and the per-cell sums keep sensitivity C."""
    flat = images.reshape(len(images), -1)
    out = np.zeros(len(images), dtype=np.int64)
    for k in range(prototypes.shape[0]):
        rows = np.flatnonzero(labels == k)
        if rows.size:
            out[rows] = nearest(flat[rows].astype(np.float64), prototypes[k])
    return out


def check_prototypes(
    prototypes: np.ndarray, n_classes: int, cells: int, image_shape: tuple[int, ...], where: str
) -> np.ndarray:
    want = (int(n_classes), int(cells), int(np.prod(image_shape)))
    p = np.asarray(prototypes, dtype=np.float64)
    if p.shape != want or not np.all(np.isfinite(p)):
        raise PrivacyError(
            f"{where}: cell prototypes must be finite numbers of shape (classes, cells, pixels) = "
            f'{want}, got {p.shape}; they come from [central] cell_rule = "aux" (the aux generator)'
        )
    return p


def _cells(images: np.ndarray, labels: np.ndarray, cells: int, prototypes: np.ndarray | None) -> np.ndarray:
    """Each image's cell: by its slant (the fixed public prior) or, given public prototypes, its nearest
    one."""
    return slant_cells(images, cells) if prototypes is None else prototype_cells(images, labels, prototypes)


def default_bins(channels: int) -> int:
    return 2 if channels == 1 else 16


def pixel_bins(x: np.ndarray, bins: int) -> np.ndarray:
    """Bin index of each pixel value in [0, 1] (bins of equal width; 1.0 falls in the last bin)."""
    return np.minimum((x * bins).astype(np.int64), bins - 1)


def _class_sums(x: np.ndarray, labels: np.ndarray, n_classes: int) -> np.ndarray:
    """(n_classes, d): sum of the rows of ``x`` per class.

    One masked sum per class: measured 250x faster here than a one-hot BLAS matmul (whose thread pool
    thrashes on small shared machines) and 15x faster than ``np.add.at``.
    """
    out = np.zeros((n_classes, x.shape[1]), dtype=np.float64)
    for k in range(n_classes):
        sel = labels == k
        if sel.any():
            out[k] = x[sel].sum(axis=0)
    return out


def _class_histograms(binned: np.ndarray, labels: np.ndarray, n_classes: int, nb: int) -> np.ndarray:
    """(n_classes, d, nb): per class and pixel value, how many images fall in each bin."""
    d = binned.shape[1]
    pix = np.arange(d, dtype=np.int64)
    flat_idx = ((labels[:, None] * d + pix[None, :]) * nb + binned).ravel()
    return np.bincount(flat_idx, minlength=n_classes * d * nb).astype(np.float64).reshape(n_classes, d, nb)


def _prepare(
    images: np.ndarray, kind: str, clip: float | None, downsample: float, bins: int | None, where: str
) -> tuple[np.ndarray, tuple[int, int, int], float]:
    """Downsampled, flattened per-image vectors the query sums (clipped for mean, bin indices for mode), the
    downsampled shape, and the clip bound (mean) or bin count (mode)."""
    if kind not in ("mean", "mode"):
        raise PrivacyError(f"{where}: kind must be 'mean' or 'mode', got {kind!r}")
    small = downsample_nearest(images, downsample)
    c, h, w = (int(v) for v in small.shape[1:])
    flat = small.reshape(small.shape[0], -1)
    if kind == "mean":
        bound = check_clip(math.sqrt(flat.shape[1]) if clip is None else clip, where)
        return clip_rows(flat, bound).astype(np.float64), (c, h, w), bound
    nb = default_bins(c) if bins is None else check_positive_int(bins, "bins", where)
    if nb < 2:
        raise PrivacyError(f"{where}: mode images need at least 2 histogram bins, got {nb}")
    return pixel_bins(flat, nb), (c, h, w), float(nb)


def _check_cells(cells: int, kind: str, where: str) -> int:
    cells = check_positive_int(cells, "cells", where)
    if cells > 1 and kind != "mean":
        raise PrivacyError(
            f"{where}: cells > 1 needs kind = 'mean' (got {kind!r} with cells = {cells}); set cells = 1"
        )
    return cells


def central_query(
    images: np.ndarray,
    labels: np.ndarray,
    n_classes: int,
    *,
    kind: Kind = "mean",
    clip: float | None = None,
    downsample: float = 0.5,
    bins: int | None = None,
    cells: int = 1,
) -> tuple[np.ndarray, float]:
    """The PRE-NOISE query over all given images (no sampling) and its L2 sensitivity.

    mean: per-(class, cell) sums of clipped downsampled images, (n_classes * cells, d), row k * cells + cell,
    sensitivity C.
    mode: per-class per-pixel histograms, (n_classes, d, bins), sensitivity sqrt(d).
    ``central_images`` adds noise to exactly this query on each round's Poisson sample.
    """
    where = "central images"
    images, labels = check_images(images, labels, n_classes, where)
    cells = _check_cells(cells, kind, where)
    vec, (c, h, w), param = _prepare(images, kind, clip, downsample, bins, where)
    if kind == "mean":
        groups = labels * cells + slant_cells(images, cells)
        return _class_sums(vec, groups, int(n_classes) * cells), param
    return _class_histograms(vec, labels, int(n_classes), int(param)), math.sqrt(c * h * w)


def central_images(
    images: np.ndarray,
    labels: np.ndarray,
    n_classes: int,
    *,
    kind: Kind = "mean",
    rounds: int,
    batch: int,
    sigma: float,
    clip: float | None = None,
    downsample: float = 0.5,
    bins: int | None = None,
    n_public: int,
    rng: np.random.Generator,
    cells: int = 1,
    prototypes: np.ndarray | None = None,
) -> tuple[CentralRelease, PrivacyEvent]:
    """Release ``rounds`` x ``cells`` noisy central images per class; return them with the privacy event they
    cost.

    ``prototypes`` (public, (n_classes, cells, C*H*W) at full size): split each class by nearest prototype
    (:func:`prototype_cells`) instead of by slant; the event is the same (one cell per image)."""
    where = "central images"
    images, labels = check_images(images, labels, n_classes, where)
    sigma = check_sigma(sigma, where)
    rounds = check_positive_int(rounds, "rounds", where)
    q = sampling_rate(batch, n_public, where)
    gen = require_generator(rng, where)
    cells = _check_cells(cells, kind, where)
    image_shape = tuple(int(s) for s in images.shape[1:])
    if prototypes is not None:
        prototypes = check_prototypes(prototypes, n_classes, cells, image_shape, where)
    vec, (c, h, w), param = _prepare(images, kind, clip, downsample, bins, where)
    n, d = vec.shape
    k = int(n_classes)
    row_labels = np.tile(np.repeat(np.arange(k, dtype=np.int64), cells), rounds)

    if kind == "mean":
        bound, denom = param, batch / (k * cells)
        # one (class, cell) per image, from it alone
        groups = labels * cells + _cells(images, labels, cells, prototypes)
        out = np.empty((rounds, k * cells, d), dtype=np.float64)
        for r in range(rounds):
            take = poisson_mask(n, q, gen)  # Poisson sampling: each image independently, probability <= q
            sums = _class_sums(vec[take], groups[take], k * cells)
            # std = sigma x sensitivity C per image; a patient (<= k capped images, each clipped to C) moves
            # the sum by <= k·C: the per-patient statement is group privacy over k (module docstring)
            sums += gen.normal(0.0, sigma * bound, size=sums.shape)
            out[r] = sums / denom  # fixed public denominator: post-processing
        values = out.reshape(rounds * k * cells, c, h, w).astype(np.float32)
        release = CentralRelease(
            values,
            row_labels,
            rounds,
            "mean",
            float(denom),
            image_shape,  # type: ignore[arg-type]
            k,
            sigma,
            q,
            bound,
            None,
            cells,
        )
    else:
        nb = int(param)
        # sensitivity sqrt(#pixel values) per image; k·sqrt(d) per capped patient
        noise_std = sigma * math.sqrt(d)
        out_idx = np.empty((rounds, k, d), dtype=np.int64)
        for r in range(rounds):
            take = poisson_mask(n, q, gen)
            hist = _class_histograms(vec[take], labels[take], k, nb)
            hist += gen.normal(0.0, noise_std, size=hist.shape)
            out_idx[r] = hist.argmax(axis=2)
        values = ((out_idx + 0.5) / nb).reshape(rounds * k, c, h, w).astype(np.float32)
        release = CentralRelease(
            values,
            row_labels,
            rounds,
            "mode",
            1.0,
            image_shape,  # type: ignore[arg-type]
            k,
            sigma,
            q,
            None,
            nb,
        )
    return release, PrivacyEvent("central", sigma, q, rounds)


# -- post-processing (no privacy cost: functions of the released values only) -----------------------------


def _upsample_bilinear(x: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Bilinear resize of (M,C,h,w) to ``size`` with half-pixel centres (torch align_corners=False)."""
    _, _, h, w = x.shape
    H, W = size

    def axis(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        pos = np.clip((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0, n_in - 1)
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, n_in - 1)
        return lo, hi, (pos - lo).astype(np.float32)

    r0, r1, fr = axis(h, H)
    c0, c1, fc = axis(w, W)
    top = x[:, :, r0] * (1 - fr)[:, None] + x[:, :, r1] * fr[:, None]
    return top[:, :, :, c0] * (1 - fc) + top[:, :, :, c1] * fc


def _neighbourhood(x: np.ndarray) -> np.ndarray:
    """The 9 shifted copies of (M,C,H,W) over a 3x3 window, edges replicated: (9, M, C, H, W)."""
    p = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), mode="edge")
    H, W = x.shape[2:]
    return np.stack([p[:, :, i : i + H, j : j + W] for i in range(3) for j in range(3)])


def median_blur3(x: np.ndarray) -> np.ndarray:
    return np.median(_neighbourhood(x), axis=0).astype(np.float32)


SHARPEN_3X3 = np.array([[0, -1, 0], [-1, 5, -1], [0, -1, 0]], dtype=np.float32)


def sharpen3(x: np.ndarray) -> np.ndarray:
    stack = _neighbourhood(x)
    return np.tensordot(SHARPEN_3X3.ravel(), stack, axes=1).astype(np.float32)


def stretch_contrast(x: np.ndarray, low_quantile: float = 0.6, high_quantile: float = 0.98) -> np.ndarray:
    """Per image: map its ``low_quantile`` value to 0 and its ``high_quantile`` value to 1, then clamp.

    Why: a mean of L2-clipped images is dim (clip 2 at 14x14 leaves strokes at ~0.4) and its background
    carries the mechanism's noise; real digits are bright strokes on black. Most pixels of a digit are
    background, so the low quantile is the noise floor. Pure post-processing of released values (no privacy
    cost).
    """
    if not 0 <= low_quantile < high_quantile <= 1:
        raise DataError(f"stretch_contrast: need 0 <= low < high <= 1, got {low_quantile}, {high_quantile}")
    flat = x.reshape(len(x), -1)
    shape = (len(x),) + (1,) * (x.ndim - 1)
    lo = np.quantile(flat, low_quantile, axis=1).reshape(shape)
    hi = np.quantile(flat, high_quantile, axis=1).reshape(shape)
    return np.clip((x - lo) / np.maximum(hi - lo, 1e-3), 0.0, 1.0).astype(np.float32)


def postprocess_central(release: CentralRelease, stretch: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Clamp to [0,1], bilinear upsample to the original size, 3x3 median blur, 3x3 sharpen for grey images,
    then (``stretch``, ``[central] stretch``) a per-image contrast stretch (``stretch_contrast``).

    Pure post-processing of released values: no privacy cost.  Returns float32 (M,C,H,W) in [0,1] and labels.
    """
    c, h, w = release.image_shape
    x = np.clip(release.values.astype(np.float32), 0.0, 1.0)
    if x.shape[2:] != (h, w):
        x = _upsample_bilinear(x, (h, w))
    x = median_blur3(x)
    if c == 1:
        x = sharpen3(x)
    x = np.clip(x, 0.0, 1.0)
    if stretch:
        x = stretch_contrast(x)
    return x.astype(np.float32), release.labels.copy()


def combine_central(releases: Sequence[CentralRelease], weights: Sequence[float]) -> CentralRelease:
    """Weighted average of several sites' released central images (federated case; post-processing).

    Weights are normalised; use the sites' PUBLIC sizes (never their private class counts).  All releases
    must share kind, rounds, classes and shapes.  The privacy of each site is that site's own event.
    """
    if not releases:
        raise DataError("combine_central: no releases given")
    if len(weights) != len(releases):
        raise DataError(f"combine_central: {len(weights)} weights for {len(releases)} releases")
    wts = np.asarray(weights, dtype=np.float64)
    if not np.all(np.isfinite(wts)) or np.any(wts < 0) or wts.sum() <= 0:
        raise DataError(f"combine_central: weights must be >= 0 and not all zero, got {list(weights)}")
    first = releases[0]
    for i, r in enumerate(releases[1:], 1):
        if (r.kind, r.values.shape, r.n_classes, r.image_shape) != (
            first.kind,
            first.values.shape,
            first.n_classes,
            first.image_shape,
        ):
            raise DataError(
                f"combine_central: release {i} ({r.kind}, {r.values.shape}) does not match release 0 "
                f"({first.kind}, {first.values.shape})"
            )
        if not np.array_equal(r.labels, first.labels):
            raise DataError(f"combine_central: release {i} orders its labels differently from release 0")
    wts = wts / wts.sum()
    values = sum(w * r.values.astype(np.float64) for w, r in zip(wts, releases))
    return CentralRelease(
        values=np.asarray(values, dtype=np.float32),
        labels=first.labels.copy(),
        rounds=first.rounds,
        kind=first.kind,
        denominator=first.denominator,
        image_shape=first.image_shape,
        n_classes=first.n_classes,
        sigma=first.sigma,
        q=first.q,
        clip=first.clip,
        bins=first.bins,
        cells=first.cells,
    )
