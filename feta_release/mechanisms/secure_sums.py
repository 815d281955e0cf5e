"""The one-shot releases (semantic selection, mean central images, frequency embedding) as Skellam
contributions to a secure sum.

Each site turns its images into ONE integer vector per release: its records (one per image) clipped, scaled by
s = 2^SCALE_BITS / c and conditionally rounded ONE RECORD AT A TIME (:func:`skellam.quantize_records`), summed
in place, plus its noise share Sk(mu / n), reduced mod 2^b. The coordinator decodes the modular sum of the
sites' vectors and divides by a PUBLIC denominator (post-processing), giving a ``CentralRelease`` /
``FrequencyRelease`` that the warm-up stages read as today (the selection: the summed noisy histogram).

Sensitivity (add/remove one image of one site), in integer units:
  * central mean images: vector = rounds x classes x cells blocks of d = C h w (downsampled) values; in one
    round an image is in one (class, cell) block only, as ONE rounded record of L2 norm <= Delta2(c s, d):
    each round is one Poisson-subsampled (q = batch / n_public) Skellam release with the block's Delta2 /
    Delta1; ``rounds`` compositions. Slant cells (``[central] cells``): the cell is ``central.slant_cells`` of
    the image ALONE (the single-site stage's public function), so adding or removing one image still changes
    one block by one record: the sensitivity and the event do not depend on ``cells``; only the number of
    blocks does;
  * frequency embedding: vector = classes blocks of F random features; phi(x) has norm 1 exactly (c = 1), one
    record in one block: one unsampled release (q = 1) with Delta2(s, F);
  * semantic selection (``mechanisms.selection``): vector = the G = ``[public] selection_groups`` vote
    counts. One image's record is the one-hot e_g of its nearest centroid (norm 1 exactly: c = 1), scaled to
    s e_g with s = 2^SCALE_BITS, an integer vector already: the conditional rounding is the identity on it,
    so the site's integer sum is exactly s x its vote counts (:func:`selection_contribution`, which computes
    it so). Adding or removing one image moves ONE count by s, whatever the centroids: exact sensitivities
    Delta2 = Delta1 = s = 2^10. The event charges the bounds every secure sum charges, Delta2(s, G) =
    sqrt(s^2 + G/4 + sqrt(2 ln 1/beta) (s + sqrt(G)/2)) >= s (1024.503 for G = 16) and Delta1 = Delta2
    min(sqrt(G), Delta2) >= s: upper bounds, so conservative. One unsampled release (q = 1), ``(selection,
    q = 1, 1)``; the total noise Sk((sigma s)^2) decodes to std sigma votes per group, the per-site Gaussian
    query's sigma.
The noise multiplier sigma is the job's stage sigma: the n shares sum to Sk(mu), mu = (sigma c s)^2, i.e.
noise std sigma c in real units, the POOLED mechanism's. Modulus 2^64 by default (vectors travel as uint64
anyway): the wrap-around probability, :func:`skellam.wrap_probability`, is stated per release.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import DataError, PrivacyError
from . import selection as sel
from . import skellam as sk
from ._checks import check_images, check_positive_int, check_sigma, require_generator, sampling_rate
from .central import CentralRelease, _prepare, slant_cells
from .poisson import poisson_mask

SCALE_BITS = 10  # c s = 2^10: Delta2 within 2 % of c s for d <= 2^17 (docs/secure-aggregation.md, Parameters)
DEFAULT_MODULUS_BITS = 64


def block_params(
    dim: int, clip: float, sigma: float, n_sites: int, modulus_bits: int = DEFAULT_MODULUS_BITS
) -> sk.SkellamParams:
    """Skellam parameters of ONE block (the span of one record): its sensitivities are the release's."""
    return sk.SkellamParams(
        dim=dim,
        clip=float(clip),
        scale=float(2**SCALE_BITS) / float(clip),
        noise_multiplier=float(sigma),
        n_sites=n_sites,
        modulus_bits=modulus_bits,
    )


def fedsgd_scale_bits(dim: int) -> int:
    """log2(c s) for a FedSGD gradient of ``dim`` values: at least SCALE_BITS, and c s >= 8 sqrt(dim) so that
    the rounding term d/4 of Delta2 stays below 0.4 % of (c s)^2 for large models."""
    return max(SCALE_BITS, math.ceil(math.log2(8.0 * math.sqrt(dim))))


def fedsgd_params(
    dim: int, clip: float, sigma: float, n_sites: int, modulus_bits: int = DEFAULT_MODULUS_BITS
) -> sk.SkellamParams:
    """Skellam parameters of one FedSGD round: a record is one example's clipped gradient (all ``dim``
    trainable values, L2 <= ``clip``); the n shares sum to Sk((sigma c s)^2), the pooled DP-SGD step's noise
    sigma c."""
    return sk.SkellamParams(
        dim=dim,
        clip=float(clip),
        scale=float(2 ** fedsgd_scale_bits(dim)) / float(clip),
        noise_multiplier=float(sigma),
        n_sites=n_sites,
        modulus_bits=modulus_bits,
    )


def model_dim(model_cfg: object, image_shape: tuple[int, ...], n_classes: int) -> int:
    """The number of trainable values of the job's model: the length of a FedSGD gradient vector (public)."""
    from ..model_size import (
        denoiser_parameters,  # counted from the config: every parameter trains, none is built
    )

    return denoiser_parameters(model_cfg, tuple(image_shape), int(n_classes))


def fedsgd_layout(dim: int, clip: float) -> Layout:
    return Layout(1, int(dim), float(clip))


@dataclass(frozen=True)
class Layout:
    """Public shape of one secure-sum release: ``blocks`` blocks of ``block_dim`` values."""

    blocks: int
    block_dim: int
    clip: float

    @property
    def dim(self) -> int:
        return self.blocks * self.block_dim


def central_layout(
    image_shape: tuple[int, ...],
    n_classes: int,
    rounds: int,
    clip: float | None,
    downsample: float,
    cells: int = 1,
) -> Layout:
    """One block per (round, class, cell), in the row order of a single site's ``CentralRelease``."""
    blank = np.zeros((1, *image_shape), dtype=np.float32)
    vec, _, bound = _prepare(blank, "mean", clip, downsample, None, "central images (secure sum)")
    cells = check_positive_int(cells, "cells", "central images (secure sum)")
    return Layout(int(rounds) * int(n_classes) * cells, int(vec.shape[1]), float(bound))


def small_shape(image_shape: tuple[int, ...], downsample: float) -> tuple[int, int, int]:
    blank = np.zeros((1, *image_shape), dtype=np.float32)
    _, shape, _ = _prepare(blank, "mean", 1.0, downsample, None, "central images (secure sum)")
    return shape


def frequency_layout(n_classes: int, features: int) -> Layout:
    return Layout(int(n_classes), int(features), 1.0)


def selection_layout(groups: int) -> Layout:
    """One block of the ``groups`` vote counts (each record a one-hot of norm 1)."""
    return Layout(1, check_positive_int(groups, "[public] selection_groups", "semantic selection"), 1.0)


def selection_params(
    groups: int, sigma: float, n_sites: int, modulus_bits: int = DEFAULT_MODULUS_BITS
) -> sk.SkellamParams:
    """Skellam parameters of the secure selection sum: c = 1, s = 2^SCALE_BITS (an integer, so s e_g needs no
    rounding), the n shares summing to Sk((sigma s)^2)."""
    return block_params(selection_layout(groups).block_dim, 1.0, sigma, n_sites, modulus_bits)


def selection_contribution(
    images: np.ndarray, centroids: np.ndarray, *, sigma: float, n_sites: int, rng: np.random.Generator
) -> np.ndarray:
    """This site's integer input to the secure selection sum, not yet reduced mod 2^b: s x its exact vote
    counts (the sum of its records s e_g, each exactly its conditionally rounded self: module docstring) plus
    its noise share Sk(mu / n). The vote counts never leave this function unnoised."""
    where = "semantic selection (secure sum)"
    gen = require_generator(rng, where)
    c = np.asarray(centroids, dtype=np.float64)
    params = selection_params(len(c), check_sigma(sigma, where), n_sites)
    scaled = sel.vote_counts(images, c) * np.int64(params.scale)  # s = 2^SCALE_BITS exactly (c = 1)
    return scaled + sk.skellam_noise(len(c), params.site_mu, gen)


def decode_selection(residues: np.ndarray, groups: int, sigma: float, n_sites: int) -> np.ndarray:
    """The modular sum of the sites' selection contributions -> the summed noisy histogram in votes (float64,
    one count per group): the total vote counts plus noise of std sigma per group (post-processing)."""
    params = selection_params(groups, sigma, n_sites)
    return decode(residues, selection_layout(groups), params).reshape(-1)


def _finish(total: np.ndarray, params: sk.SkellamParams, rng: np.random.Generator) -> np.ndarray:
    noisy = total + sk.skellam_noise(total.shape[0], params.site_mu, rng)  # this site's share Sk(mu / n)
    return sk.to_modular(noisy, params.modulus_bits)


def central_contribution(
    images: np.ndarray,
    labels: np.ndarray,
    n_classes: int,
    *,
    rounds: int,
    batch: int,
    sigma: float,
    clip: float | None,
    downsample: float,
    n_public: int,
    n_sites: int,
    modulus_bits: int,
    rng: np.random.Generator,
    cells: int = 1,
) -> np.ndarray:
    """This site's masked-sum input for ``rounds`` rounds of mean central images (Poisson rate batch /
    n_public), one block per (round, class, cell). ``cells``: each image's block is ``slant_cells`` of that
    image alone, the single-site stage's public function (sensitivity: one record in one block, whatever
    ``cells`` is)."""
    where = "central images (secure sum)"
    images, labels = check_images(images, labels, n_classes, where)
    sigma, rounds = check_sigma(sigma, where), check_positive_int(rounds, "rounds", where)
    cells = check_positive_int(cells, "cells", where)
    q = sampling_rate(batch, n_public, where)
    gen = require_generator(rng, where)
    vec, _, bound = _prepare(images, "mean", clip, downsample, None, where)
    groups = labels * cells + slant_cells(images, cells)  # (class, cell) of each image, as central_images
    blocks, d = int(n_classes) * cells, vec.shape[1]
    params = block_params(d, bound, sigma, n_sites, modulus_bits)
    total = np.zeros(rounds * blocks * d, dtype=np.int64)
    for r in range(rounds):
        # Poisson sampling: each image independently, probability <= q
        take = poisson_mask(vec.shape[0], q, gen)
        for g in range(blocks):
            recs = vec[take & (groups == g)]
            if len(recs):
                at = (r * blocks + g) * d
                total[at : at + d] += sk.quantize_records(recs, params, gen)
    return _finish(total, params, gen)


def frequency_contribution(
    images: np.ndarray,
    labels: np.ndarray,
    n_classes: int,
    *,
    features: int,
    sigma: float,
    bandwidth2: float,
    seed: int,
    chunk: int,
    n_sites: int,
    modulus_bits: int,
    rng: np.random.Generator,
    patch: int = 0,
    stride: int = 1,
    n_public: int | None = None,
) -> np.ndarray:
    """This site's masked-sum input for the per-class RFF embedding sum (records phi(x_i) in block y_i; phi
    the job's ``feature_map.FeatureMap``, norm 1 per record whatever ``patch``/``stride``)."""
    import torch

    from .feature_map import FeatureMap, release_chunk

    where = "frequency statistics (secure sum)"
    images, labels = check_images(images, labels, n_classes, where)
    sigma, chunk = check_sigma(sigma, where), check_positive_int(chunk, "chunk", where)
    # a node's release: steps of at most half the public size (feature_map.release_chunk)
    if n_public is not None:
        chunk = release_chunk(chunk, n_public)
    gen = require_generator(rng, where)
    c, h, w = (int(v) for v in images.shape[1:])
    fmap = FeatureMap((c, h, w), features, float(bandwidth2), int(seed), int(patch), int(stride))
    params = block_params(features, 1.0, sigma, n_sites, modulus_bits)
    k = int(n_classes)
    total = np.zeros(k * features, dtype=np.int64)
    with torch.no_grad():
        for start in range(0, images.shape[0], chunk):
            phi = fmap(torch.from_numpy(np.ascontiguousarray(images[start : start + chunk])))
            phi64, lab = phi.double().numpy(), labels[start : start + chunk]
            for c in np.unique(lab):
                total[int(c) * features : (int(c) + 1) * features] += sk.quantize_records(
                    phi64[lab == c], params, gen
                )
    return _finish(total, params, gen)


def job_contribution(
    phase: str,
    images: np.ndarray,
    labels: np.ndarray,
    n_classes: int,
    cfg: object,
    *,
    n_public: int,
    n_sites: int,
    modulus_bits: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """A site's ``phase`` ("central" / "frequency") contribution with the job config's parameters: the ONE
    call both the charged release (``edge.secure.masked_contribution``) and its latency padding
    (``edge.padded_releases.pad_secure``) make, so the dummy rows cost what real rows cost."""
    if phase == "central":
        c = cfg.central  # type: ignore[attr-defined]
        return central_contribution(
            images,
            labels,
            n_classes,
            rounds=c.rounds,
            batch=c.batch,
            sigma=c.sigma,
            clip=c.clip,
            downsample=c.downsample,
            n_public=n_public,
            n_sites=n_sites,
            modulus_bits=modulus_bits,
            rng=rng,
            cells=c.cells,
        )
    if phase == "frequency":
        f = cfg.frequency  # type: ignore[attr-defined]
        if f.sigma is None:
            raise PrivacyError(
                "[frequency] sigma is not calibrated; a secure frequency contribution needs it"
            )
        return frequency_contribution(
            images,
            labels,
            n_classes,
            features=f.features,
            sigma=f.sigma,
            bandwidth2=f.bandwidth2,
            seed=f.seed,
            chunk=f.chunk,
            n_sites=n_sites,
            modulus_bits=modulus_bits,
            rng=rng,
            patch=f.patch,
            stride=f.stride,
            n_public=n_public,
        )
    raise PrivacyError(f"secure aggregation: no job contribution for phase {phase!r}")


def decode(residues: np.ndarray, layout: Layout, params: sk.SkellamParams) -> np.ndarray:
    """The modular sum -> the noisy sum of the clipped records in real units, (blocks, block_dim) float64."""
    v = sk.check_contribution(np.asarray(residues), _full(layout, params), "secure sum")
    return (sk.centered(v, params.modulus_bits).astype(np.float64) / params.scale).reshape(
        layout.blocks, layout.block_dim
    )


def _full(layout: Layout, params: sk.SkellamParams) -> sk.SkellamParams:
    return sk.SkellamParams(
        layout.dim, params.clip, params.scale, params.noise_multiplier, params.n_sites, params.modulus_bits
    )


def decode_central(
    residues: np.ndarray,
    layout: Layout,
    params: sk.SkellamParams,
    *,
    rounds: int,
    n_classes: int,
    denominator: float,
    image_shape: tuple[int, int, int],
    small_shape: tuple[int, int, int],
    sigma: float,
    q: float,
    cells: int = 1,
) -> CentralRelease:
    """The decoded per-(round, class, cell) sums divided by the PUBLIC total denominator (sum of the
    contributing sites' batch / (n_classes x cells)): a ``CentralRelease`` as one site's would be
    (post-processing)."""
    if not (math.isfinite(denominator) and denominator > 0):
        raise DataError(f"secure central sum: the public denominator must be > 0, got {denominator!r}")
    sums = decode(residues, layout, params) / denominator
    values = sums.reshape(rounds * n_classes * cells, *small_shape).astype(np.float32)
    labels = np.tile(np.repeat(np.arange(n_classes, dtype=np.int64), cells), rounds)
    return CentralRelease(
        values,
        labels,
        rounds,
        "mean",
        float(denominator),
        image_shape,
        n_classes,
        sigma,
        q,
        layout.clip,
        None,
        cells,
    )


def decode_frequency(
    residues: np.ndarray,
    layout: Layout,
    params: sk.SkellamParams,
    *,
    total_public: int,
    bandwidth2: float,
    seed: int,
    sigma: float,
    image_shape: tuple[int, int, int],
    patch: int = 0,
    stride: int = 1,
) -> object:
    """The decoded embedding sum divided by the PUBLIC total size of the contributing sites: a
    ``FrequencyRelease`` (features x classes) as ``combine_frequency`` of per-site releases would be."""
    from .frequency import FrequencyRelease

    check_positive_int(total_public, "total public size", "secure frequency sum")
    emb = decode(residues, layout, params).T / float(total_public)  # (features, classes)
    return FrequencyRelease(
        embedding=emb.astype(np.float32),
        n_public=int(total_public),
        features=layout.block_dim,
        bandwidth2=float(bandwidth2),
        seed=int(seed),
        sigma=float(sigma),
        n_classes=layout.blocks,
        image_shape=image_shape,
        patch=int(patch),
        stride=int(stride),
    )


# -- the events a site charges
# ---------------------------------------------------------------------------------


def secagg_threshold(threshold: int | None, n_sites: int) -> int:
    """The job's ``[federation] secagg_threshold`` (None: every site), checked to be a strict majority."""
    t = n_sites if threshold is None else int(threshold)
    if n_sites < 2 or not (n_sites // 2 < t <= n_sites):
        raise PrivacyError(
            f"secure aggregation needs >= 2 sites and a threshold that is a strict majority of them "
            f"({n_sites // 2 + 1}..{n_sites}); got threshold {t} for {n_sites} site(s)"
        )
    return t


def secagg_warmup_events(
    cfg: object, n_public: int, image_shape: tuple[int, ...], n_classes: int, n_sites: int, colluders: int
) -> list[object]:
    """The ``SkellamEvent`` of each one-shot release of a job under secure aggregation at one site, in the
    order they are released (the semantic selection first, then central, frequency): ``mu`` counts the honest
    shares under its assumption (``colluders`` other sites), ``mu_worst`` its own share."""
    from ..accountants.skellam import honest_shares, skellam_event

    c, f, fed, pb = cfg.central, cfg.frequency, cfg.federation, cfg.public  # type: ignore[attr-defined]
    t = secagg_threshold(fed.secagg_threshold, n_sites)
    h = honest_shares(n_sites, t, min(int(colluders), n_sites - 1))
    out: list[object] = []
    if pb.selection:
        p_sel = selection_params(pb.selection_groups, pb.selection_sigma, n_sites)
        out.append(skellam_event(p_sel, "selection", 1.0, 1, h))
    if c.rounds > 0:
        lay = central_layout(image_shape, n_classes, c.rounds, c.clip, c.downsample, c.cells)
        p = block_params(lay.block_dim, lay.clip, c.sigma, n_sites)
        out.append(
            skellam_event(p, "central", sampling_rate(c.batch, n_public, "central images"), int(c.rounds), h)
        )
    if f.sigma is not None:
        out.append(skellam_event(block_params(f.features, 1.0, f.sigma, n_sites), "frequency", 1.0, 1, h))
    return out
