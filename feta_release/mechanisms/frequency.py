"""Frequency statistics (FETA-Pro): a noisy per-class mean embedding in random Fourier features.

Features (``feature_map.py``; ``[frequency] patch`` picks the patch map there, whose rows also have norm 1, so
everything below holds for it unchanged).  phi(x) = [cos(x W), sin(x W)] / sqrt(F/2) on raw pixels x in [0,1]
flattened over all channels, with
W in R^{D x F/2}, W_ij ~ N(0, 1/bandwidth2): random Fourier features of the Gaussian kernel
k(x, x') = exp(-||x - x'||^2 / (2 bandwidth2)).  Because cos^2 + sin^2 = 1, ||phi(x)|| = 1 for EVERY x.
W is drawn with numpy's PCG64 generator from a PUBLIC seed, so every site and the coordinator obtain
bit-identical frequencies on any machine (torch's generators differ across devices and versions).

Statistic.  E = sum_i phi(x_i) (outer) onehot(y_i) / N, a (F x n_classes) matrix, with N the PUBLIC dataset
size.

Neighbouring relation: add/remove ONE image.  That changes E by phi(x) (outer) e_y / N, whose Frobenius norm
is ||phi(x)|| / N = 1/N: the L2 sensitivity is 1/N for every image, with no clipping needed.  Released:
E + N(0, (sigma/N)^2 I), one unsampled Gaussian release: ``PrivacyEvent("frequency", sigma, 1.0, 1)``.

Per PATIENT (``--patient-cap k``): at most k images per patient are loaded (first k in file order), each with
||phi(x)|| = 1, so add/remove of one patient changes E by at most k/N (N the PUBLIC image count after the cap;
triangle inequality across the patient's classes): the event is recorded per image and every budget of a
patient-level site counts it per patient by group privacy over k (``accounting.patient_epsilon``); no clipping
is needed, the feature map bounds every image already.

The sum is streamed over chunks of images, so memory is chunk x F (never N x F).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..accounting import PrivacyEvent
from ..errors import DataError
from ._checks import check_images, check_positive_int, check_sigma, require_generator
from .feature_map import FeatureMap, _check_features, _finite, release_chunk, rff_features, rff_frequencies

__all__ = [
    "FeatureMap",
    "FrequencyRelease",
    "combine_frequency",
    "embedding_sum",
    "frequency_statistics",
    "rff_features",
    "rff_frequencies",
]


@dataclass(frozen=True)
class FrequencyRelease:
    """The released noisy embedding and the public parameters needed to match it (same omega everywhere)."""

    embedding: np.ndarray  # float32 (features, n_classes)
    n_public: int
    features: int
    bandwidth2: float
    seed: int
    sigma: float
    n_classes: int
    image_shape: tuple[int, int, int] | None = None  # (C, H, W) of the images; None when loaded without it
    # the feature map (``feature_map.FeatureMap``): 0 = all pixels, k = k x k patches at ``stride``
    patch: int = 0
    stride: int = 1

    def feature_map(self) -> FeatureMap:
        """The released statistic's own map, rebuilt from its public parameters."""
        if self.image_shape is None:
            raise DataError(
                "frequency release: image shape unknown, cannot rebuild omega; pass the image size"
            )
        return FeatureMap(
            self.image_shape, self.features, self.bandwidth2, self.seed, self.patch, self.stride
        )

    def omega(self) -> torch.Tensor:
        return self.feature_map().omega

    def to_arrays(self) -> dict[str, np.ndarray | np.generic]:
        """Plain arrays (for ``np.savez``); ``from_arrays`` inverts it."""
        out: dict[str, np.ndarray | np.generic] = {
            "embedding": self.embedding,
            "n_public": np.int64(self.n_public),
            "features": np.int64(self.features),
            "bandwidth2": np.float64(self.bandwidth2),
            "seed": np.int64(self.seed),
            "sigma": np.float64(self.sigma),
        }
        if self.image_shape is not None:
            out["image_shape"] = np.asarray(self.image_shape, dtype=np.int64)
        if self.patch:  # left out for the pixel map: files written before the option read back the same
            out["patch"], out["stride"] = np.int64(self.patch), np.int64(self.stride)
        return out

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, Any]) -> FrequencyRelease:
        try:
            emb = np.asarray(arrays["embedding"], dtype=np.float32)
            shape = arrays.get("image_shape") if hasattr(arrays, "get") else None
            patch = int(arrays["patch"]) if "patch" in arrays else 0
            return cls(
                embedding=emb,
                n_public=int(arrays["n_public"]),
                features=int(arrays["features"]),
                bandwidth2=float(arrays["bandwidth2"]),
                seed=int(arrays["seed"]),
                sigma=float(arrays["sigma"]),
                n_classes=int(emb.shape[1]),
                image_shape=None if shape is None else tuple(int(v) for v in np.asarray(shape)),  # type: ignore[arg-type]
                patch=patch,
                stride=int(arrays["stride"]) if patch else 1,
            )
        except KeyError as exc:
            raise DataError(f"frequency release arrays lack {exc}") from None


def _features_into(
    x: torch.Tensor, omega: torch.Tensor, proj: torch.Tensor, phi: torch.Tensor
) -> torch.Tensor:
    """Unscaled [cos(x omega), sin(x omega)] written into preallocated buffers (rows of ``x`` only).

    Reusing two chunk-sized buffers keeps the resident memory flat: fresh temporaries per chunk let the
    allocator's heap grow with the number of chunks (measured: +80 MiB from 2k to 20k images).
    """
    b, half = x.shape[0], omega.shape[1]
    p, out = proj[:b], phi[:b]
    torch.mm(x, omega, out=p)
    torch.cos(p, out=out[:, :half])
    torch.sin(p, out=out[:, half:])
    return _finite(out)


def embedding_sum(
    images: np.ndarray, labels: np.ndarray, n_classes: int, omega: torch.Tensor | FeatureMap, chunk: int = 512
) -> np.ndarray:
    """Sum_i phi(x_i) (outer) onehot(y_i): (F, n_classes) float64, streamed over ``chunk`` images at a time.

    ``omega``: the pixel map's frequencies (buffered path: the same values as summing ``rff_features`` rows,
    the 1/sqrt(F/2) scale applied once at the end) or any ``FeatureMap``.
    """
    if isinstance(omega, FeatureMap):
        if omega.patch:
            return _map_sum(images, labels, n_classes, omega, chunk)
        omega = omega.omega
    n = images.shape[0]
    flat = images.reshape(n, -1)
    omega = torch.as_tensor(omega, dtype=torch.float32)
    half = omega.shape[1]
    rows = min(chunk, n)
    proj = torch.empty((rows, half), dtype=torch.float32)
    phi = torch.empty((rows, 2 * half), dtype=torch.float32)
    total = torch.zeros((n_classes, 2 * half), dtype=torch.float64)  # float64: no drift over millions of rows
    with torch.no_grad():
        for start in range(0, n, chunk):
            x = torch.from_numpy(np.ascontiguousarray(flat[start : start + chunk], dtype=np.float32))
            y = torch.from_numpy(np.ascontiguousarray(labels[start : start + chunk]))
            feats = _features_into(x, omega, proj, phi)
            onehot = torch.nn.functional.one_hot(y, n_classes).to(torch.float32)
            total += onehot.T @ feats  # (K, F): a small GEMM, contiguous output
    return (total.T * (1.0 / math.sqrt(half))).numpy()


def _map_sum(
    images: np.ndarray, labels: np.ndarray, n_classes: int, fmap: FeatureMap, chunk: int
) -> np.ndarray:
    total = torch.zeros((n_classes, fmap.features), dtype=torch.float64)
    with torch.no_grad():
        for start in range(0, images.shape[0], chunk):
            x = torch.from_numpy(np.ascontiguousarray(images[start : start + chunk], dtype=np.float32))
            y = torch.from_numpy(np.ascontiguousarray(labels[start : start + chunk]))
            total += torch.nn.functional.one_hot(y, n_classes).to(torch.float32).T @ fmap(x)
    return total.T.numpy()


def frequency_statistics(
    images: np.ndarray,
    labels: np.ndarray,
    n_classes: int,
    *,
    features: int,
    sigma: float,
    bandwidth2: float = 105.0,
    seed: int = 1234,
    chunk: int = 512,
    n_public: int,
    rng: np.random.Generator,
    patch: int = 0,
    stride: int = 1,
) -> tuple[FrequencyRelease, PrivacyEvent]:
    """Release the noisy per-class RFF embedding E + N(0, (sigma/N)^2) with N = ``n_public``;
    ``patch``/``stride`` choose the feature map (``feature_map.FeatureMap``: every row norm 1 either way, so
    the same sensitivity)."""
    where = "frequency statistics"
    images, labels = check_images(images, labels, n_classes, where)
    sigma = check_sigma(sigma, where)
    features = _check_features(features, where)
    n_public = check_positive_int(n_public, "n_public (public dataset size)", where)
    chunk = check_positive_int(chunk, "chunk", where)
    gen = require_generator(rng, where)
    c, h, w = (int(s) for s in images.shape[1:])
    fmap = FeatureMap((c, h, w), features, float(bandwidth2), int(seed), int(patch), int(stride))
    total = embedding_sum(images, labels, int(n_classes), fmap, release_chunk(chunk, n_public))
    # std sigma x sensitivity 1/N per image; a patient of <= k capped images moves E by <= k/N (module
    # docstring)
    noisy = total / n_public + gen.normal(0.0, sigma / n_public, size=total.shape)
    release = FrequencyRelease(
        embedding=noisy.astype(np.float32),
        n_public=n_public,
        features=features,
        bandwidth2=float(bandwidth2),
        seed=int(seed),
        sigma=sigma,
        n_classes=int(n_classes),
        image_shape=(c, h, w),
        patch=fmap.patch,
        stride=fmap.stride,
    )
    return release, PrivacyEvent("frequency", sigma, 1.0, 1)


def combine_frequency(
    releases: Sequence[FrequencyRelease | Mapping[str, Any]], sizes: Sequence[int] | None = None
) -> FrequencyRelease:
    """Federated embedding: sum_s N_s E_s / sum_s N_s (weights are the sites' PUBLIC sizes; post-processing).

    ``releases`` may be ``FrequencyRelease`` objects or their ``to_arrays()`` mappings (e.g. a loaded .npz);
    ``sizes`` overrides each release's ``n_public`` (the coordinator's record of the sites' public sizes).
    """
    if not releases:
        raise DataError("combine_frequency: no releases given")
    rels = [r if isinstance(r, FrequencyRelease) else FrequencyRelease.from_arrays(r) for r in releases]
    if sizes is not None:
        if len(sizes) != len(rels) or any(int(s) < 1 for s in sizes):
            raise DataError(f"combine_frequency: need one public size >= 1 per release, got {list(sizes)}")
        rels = [dataclasses.replace(r, n_public=int(s)) for r, s in zip(rels, sizes)]
    first = rels[0]
    key = (first.features, first.bandwidth2, first.seed, first.n_classes, first.patch, first.stride)
    for i, r in enumerate(rels[1:], 1):
        other = (r.features, r.bandwidth2, r.seed, r.n_classes, r.patch, r.stride)
        if other != key:
            raise DataError(
                f"combine_frequency: release {i} (features, bandwidth2, seed, classes, patch, stride) = "
                f"{other} differs from release 0 {key}: sites must use the same public frequencies"
            )
    n_total = sum(r.n_public for r in rels)
    combined = sum(r.n_public * r.embedding.astype(np.float64) for r in rels) / n_total
    return FrequencyRelease(
        embedding=np.asarray(combined, dtype=np.float32),
        n_public=n_total,
        features=first.features,
        bandwidth2=first.bandwidth2,
        seed=first.seed,
        sigma=first.sigma,
        n_classes=first.n_classes,
        image_shape=first.image_shape,
        patch=first.patch,
        stride=first.stride,
    )
