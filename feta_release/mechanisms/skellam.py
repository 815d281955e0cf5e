"""The distributed Skellam mechanism (Agarwal, Kairouz, Liu 2021, "The Skellam Mechanism for Differentially
Private Federated Learning", NeurIPS 2021), for sums computed by secure aggregation.

Pipeline of one release of a sum over sites (each site holds records x_r in R^d, one record = the unit of
privacy):

1. clip: each record is scaled to L2 norm <= ``clip`` (c);
2. rotate (optional, off by default): zero-pad to d' = 2^k and apply a randomized Walsh-Hadamard transform
   H D / sqrt(d') whose signs D come from a PUBLIC seed (an orthogonal map, norms are kept; it spreads a
   vector over all coordinates).  It shrinks the per-coordinate signal (hence the modulus a packed b-bit
   transport needs) but not :func:`wrap_probability`'s bound, which uses only Delta2, and it costs most of the
   quantization time and up to 2x in dimension: worth it only with a bit-packed transport (vectors travel as
   uint64 here);
3. scale by s (``scale``; the grid step is gamma = 1 / s) and round EACH RECORD to the integer grid with
   conditional randomized rounding (Kairouz, Liu, Steinke 2021, Thm 1): unbiased randomized rounding, redrawn
   until the rounded record has L2 norm <= ``Delta2`` = min(cs + sqrt(d'), sqrt((cs)^2 + d'/4 + sqrt(2
   log(1/beta)) (cs + sqrt(d')/2))); one draw exceeds it with probability <= beta, and cs + sqrt(d') holds
   always.  Every record gets the same fixed number of candidates whatever its norm
   (:func:`conditional_round`), so the work of a release does not tell how many records were clipped;
4. the site sums its rounded records and adds integer noise Sk(mu/n): Poisson(mu/2n) - Poisson(mu/2n) per
   coordinate (``n`` sites; Skellam variables add, so the n shares sum to exactly Sk(mu), variance mu);
5. reduce mod m = 2^b (``modulus_bits``); secure aggregation adds the sites' vectors mod m;
6. the coordinator maps the modular sum to [-m/2, m/2), divides by s and undoes the rotation
   (post-processing).

Sensitivity (stated in integer units, add/remove ONE record of one site): the integer sum changes by one
rounded record Q(x_r), so ||Delta||_2 <= Delta2 (above) and, as an integer vector has |v_j| <= v_j^2,
||Delta||_1 <= Delta1 = min(sqrt(d'), Delta2) * Delta2.  The rounding randomness of the other records and of
x_r itself is a mixture over fixed outcomes, each of which is a Skellam mechanism with these sensitivities,
and Renyi divergence is jointly quasi-convex, so the bound holds for the randomized rounding as a whole.
Rounding is per record (not of the site's sum) precisely so that this bound is a per-record one.  The RDP of
Sk(mu) with these sensitivities is in :mod:`feta_release.accountants.skellam`.

Wrap-around: if a coordinate of the true integer sum leaves [-m/2, m/2) the decoded sum is wrong in that
coordinate.  That costs utility, never privacy (the modular sum is a post-processing of the noisy sum).
:func:`wrap_probability` bounds its probability for a public cap on the number of records summed.

Randomness: the noise generator is numpy's PCG64 seeded with 256 OS bits (:func:`os_generator`); numpy's
Poisson sampler is not an exact sampler (floating point), the same known limitation as the Gaussian noise.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import numpy as np

from ..errors import DataError, PrivacyError
from ._checks import check_positive_int, check_sigma, require_generator

MAX_MODULUS_BITS = 64  # vectors travel as uint64: additions wrap mod 2^64, and 2^b divides 2^64
DEFAULT_BETA = math.exp(-0.5)  # conditional rounding parameter of Kairouz et al. 2021 (their default)
MAX_ROUNDING_TRIES = 10_000
ROUNDING_CANDIDATES = 8  # per record and batch, drawn whatever the data (conditional_round)
QUANTIZE_CHUNK_VALUES = 1 << 22  # float64 values rotated at once (32 MiB)


def os_generator() -> np.random.Generator:
    """A PCG64 generator seeded with 256 OS bits (numpy-only: this module must not import torch)."""
    return np.random.default_rng(secrets.randbits(256))


def rounded_l2_bound(scaled_norm: float, beta: float, dim: int) -> float:
    """L2 bound of a randomized-rounded vector of L2 norm <= ``scaled_norm`` in dimension ``dim`` that holds
    with probability >= 1 - beta per draw (Kairouz, Liu, Steinke 2021, Thm 1); ``beta`` = 0: the sure
    bound."""
    if not (0 <= beta < 1):
        raise PrivacyError(f"conditional rounding: beta must be in [0, 1), got {beta!r}")
    sure = scaled_norm + math.sqrt(dim)
    if beta == 0:
        return sure
    squared = (
        scaled_norm**2 + dim / 4 + math.sqrt(2 * math.log(1 / beta)) * (scaled_norm + math.sqrt(dim) / 2)
    )
    return min(sure, math.sqrt(squared))


def rounded_l1_bound(l2_bound: float, dim: int) -> float:
    """L1 bound of an integer vector of L2 norm <= ``l2_bound``: <= sqrt(d) L2, and <= L2^2 as |v| <= v^2."""
    return l2_bound * min(math.sqrt(dim), l2_bound)


@dataclass(frozen=True)
class SkellamParams:
    """Public parameters of one distributed Skellam release (all sites and the coordinator use the same).

    ``noise_multiplier`` sigma: the TOTAL noise (all n shares) has std sigma * clip in real units, i.e.
    variance mu = (sigma * clip * scale)^2 in integer units; each site adds Sk(mu / n_sites).
    """

    dim: int
    clip: float
    scale: float
    noise_multiplier: float
    n_sites: int
    modulus_bits: int = 32
    beta: float = DEFAULT_BETA
    rotate: bool = False
    rotation_seed: int = 0  # public: the rotation hides nothing, it only spreads the vector

    def __post_init__(self) -> None:
        where = "Skellam parameters"
        check_positive_int(self.dim, "dim", where)
        check_positive_int(self.n_sites, "n_sites", where)
        check_sigma(self.noise_multiplier, where)
        for name in ("clip", "scale"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise PrivacyError(f"{where}: {name} must be a finite number > 0, got {v!r}")
        if (
            isinstance(self.modulus_bits, bool)
            or not isinstance(self.modulus_bits, int)
            or not (2 <= self.modulus_bits <= MAX_MODULUS_BITS)
        ):
            raise PrivacyError(
                f"{where}: modulus_bits must be an integer in [2, {MAX_MODULUS_BITS}], "
                f"got {self.modulus_bits!r}"
            )
        if not (0 <= self.beta < 1):
            raise PrivacyError(f"{where}: beta must be in [0, 1), got {self.beta!r}")

    @property
    def padded_dim(self) -> int:
        return 1 << (self.dim - 1).bit_length() if self.rotate else self.dim

    @property
    def modulus(self) -> int:
        return 1 << self.modulus_bits

    @property
    def mu(self) -> float:
        """Variance of the total (all-sites) integer noise."""
        return (self.noise_multiplier * self.clip * self.scale) ** 2

    @property
    def site_mu(self) -> float:
        return self.mu / self.n_sites

    @property
    def l2_sensitivity(self) -> float:
        """Integer-domain L2 sensitivity Delta2 (one record's conditionally rounded vector)."""
        return rounded_l2_bound(self.clip * self.scale, self.beta, self.padded_dim)

    @property
    def l1_sensitivity(self) -> float:
        return rounded_l1_bound(self.l2_sensitivity, self.padded_dim)


# -- rotation ------------------------------------------------------------------------------------------------


def _fwht(x: np.ndarray) -> np.ndarray:
    """Orthonormal Walsh-Hadamard transform along the last axis (length a power of two); H/sqrt(d) is
    symmetric and its own inverse.  In-place butterflies on one copy (memory traffic dominates for long
    vectors)."""
    x = np.array(x, dtype=np.float64, copy=True)
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    h = 1
    while h < d:
        y = rows.reshape(rows.shape[0], d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        diff = a - b
        a += b
        b[...] = diff
        h *= 2
    x /= math.sqrt(d)
    return x


def _signs(params: SkellamParams) -> np.ndarray:
    return np.random.default_rng(params.rotation_seed).choice(np.array([-1.0, 1.0]), size=params.padded_dim)


def rotate(x: np.ndarray, params: SkellamParams) -> np.ndarray:
    """Rows of ``x`` (..., dim) zero-padded to d' and mapped by H D / sqrt(d') (identity when
    rotate=False)."""
    x = np.asarray(x, dtype=np.float64)
    pad = params.padded_dim - x.shape[-1]
    if pad:
        x = np.concatenate([x, np.zeros((*x.shape[:-1], pad))], axis=-1)
    return _fwht(x * _signs(params)) if params.rotate else x


def unrotate(y: np.ndarray, params: SkellamParams) -> np.ndarray:
    """Inverse of :func:`rotate` (D H / sqrt(d'), then the padding dropped)."""
    y = np.asarray(y, dtype=np.float64)
    x = _fwht(y) * _signs(params) if params.rotate else y
    return x[..., : params.dim]


# -- quantization --------------------------------------------------------------------------------------------


def conditional_round(x: np.ndarray, bound: float, rng: np.random.Generator) -> np.ndarray:
    """Unbiased randomized rounding of each row of ``x`` to integers, conditioned on the rounded L2 norm being
    <= ``bound`` (so every returned row has norm <= bound): each row's value is the first of its i.i.d.
    candidates within the bound, i.e. exactly rejection sampling.

    Constant work: every row gets ``ROUNDING_CANDIDATES`` candidates and the first accepted one is selected by
    a masked ``where``, whatever the data.  Redrawing only the rejected rows would do work that grows with the
    records near the clip norm (a record at the norm is rejected ~10 % of the time, one at half the norm
    never), so the reply latency of a release would follow how many records were clipped.  A row with no
    accepted candidate (probability <= beta^K per row, ~0.15^K measured at the clip norm) gets K more, for
    every row."""
    floor = np.floor(x)
    frac = x - floor
    out = floor.copy()
    done = np.zeros(x.shape[:-1], dtype=bool)
    tries = 0
    while True:
        for _ in range(ROUNDING_CANDIDATES):
            candidate = floor + (rng.random(x.shape) < frac)
            ok = np.linalg.norm(candidate, axis=-1) <= bound
            out = np.where((ok & ~done)[..., None], candidate, out)
            done |= ok
        tries += ROUNDING_CANDIDATES
        if done.all():
            return out.astype(np.int64)
        if tries >= MAX_ROUNDING_TRIES:
            raise PrivacyError(
                f"conditional rounding: {int((~done).sum())} record(s) still exceed the norm bound "
                f"{bound:.4g} after {tries} draws; raise beta or the scale"
            )


def _clip_rows(records: np.ndarray, clip: float) -> np.ndarray:
    norms = np.linalg.norm(records, axis=-1, keepdims=True)
    return records * np.minimum(1.0, clip / np.maximum(norms, 1e-300))


def quantize_records(records: np.ndarray, params: SkellamParams, rng: np.random.Generator) -> np.ndarray:
    """Sum over the rows of ``records`` (R, dim) of their clipped, rotated, scaled and conditionally rounded
    integer vectors: an int64 vector of length d' (no noise)."""
    records = np.asarray(records, dtype=np.float64)
    if records.ndim != 2 or records.shape[1] != params.dim:
        raise DataError(
            f"Skellam quantization: records must have shape (R, {params.dim}), got {records.shape}"
        )
    if not np.isfinite(records).all():
        raise DataError("Skellam quantization: records contain NaN or infinite values")
    gen = require_generator(rng, "Skellam quantization")
    if records.shape[0] == 0:
        return np.zeros(params.padded_dim, dtype=np.int64)
    total = np.zeros(params.padded_dim, dtype=np.int64)
    # bounded memory for many long records (gradients)
    rows = max(1, QUANTIZE_CHUNK_VALUES // params.padded_dim)
    for start in range(0, records.shape[0], rows):
        scaled = rotate(_clip_rows(records[start : start + rows], params.clip), params) * params.scale
        total += conditional_round(scaled, params.l2_sensitivity, gen).sum(axis=0, dtype=np.int64)
    return total


def skellam_noise(size: int, mu: float, rng: np.random.Generator) -> np.ndarray:
    """``size`` draws of Sk(mu/2, mu/2) = Poisson(mu/2) - Poisson(mu/2): integer, mean 0, variance mu."""
    if not (math.isfinite(mu) and mu > 0):
        raise PrivacyError(f"Skellam noise: variance mu must be a finite number > 0, got {mu!r}")
    gen = require_generator(rng, "Skellam noise")
    return gen.poisson(mu / 2, size).astype(np.int64) - gen.poisson(mu / 2, size).astype(np.int64)


# -- modular arithmetic --------------------------------------------------------------------------------------


def to_modular(v: np.ndarray, bits: int) -> np.ndarray:
    """Integers -> uint64 residues in [0, 2^bits) (two's complement wrap, then the low bits)."""
    v = np.asarray(v)
    if not np.issubdtype(v.dtype, np.integer):
        raise DataError(f"modular reduction: expected an integer vector, got dtype {v.dtype}")
    return v.astype(np.int64).astype(np.uint64) & _mask(bits)


def _mask(bits: int) -> np.uint64:
    return np.uint64((1 << bits) - 1)


def modular_sum(vectors: list[np.ndarray] | np.ndarray, bits: int) -> np.ndarray:
    """Sum of uint64 residues mod 2^bits (uint64 addition wraps mod 2^64, a multiple of 2^bits)."""
    total = np.zeros_like(np.asarray(vectors[0], dtype=np.uint64))
    for v in vectors:
        total = total + np.asarray(v, dtype=np.uint64)
    return total & _mask(bits)


def centered(residues: np.ndarray, bits: int) -> np.ndarray:
    """uint64 residues mod 2^bits -> the representatives in [-2^(bits-1), 2^(bits-1)) as int64."""
    shift = np.uint64(64 - bits)
    return (np.asarray(residues, dtype=np.uint64) << shift).astype(np.int64) >> np.int64(64 - bits)


def site_contribution(records: np.ndarray, params: SkellamParams, rng: np.random.Generator) -> np.ndarray:
    """What one site hands to secure aggregation: its quantized records plus its noise share Sk(mu/n), mod
    m."""
    gen = require_generator(rng, "Skellam site contribution")
    integer = quantize_records(records, params, gen) + skellam_noise(params.padded_dim, params.site_mu, gen)
    return to_modular(integer, params.modulus_bits)


def check_contribution(vector: np.ndarray, params: SkellamParams, where: str) -> np.ndarray:
    """Refuse a vector that is not d' residues in [0, m) (a malformed share would corrupt the whole sum)."""
    v = np.asarray(vector)
    if v.shape != (params.padded_dim,) or v.dtype != np.uint64:
        raise PrivacyError(
            f"{where}: expected {params.padded_dim} uint64 residues, got shape {v.shape} "
            f"dtype {v.dtype}; the site must send its Skellam contribution unchanged"
        )
    if params.modulus_bits < 64 and (v >= np.uint64(params.modulus)).any():
        raise PrivacyError(
            f"{where}: {int((v >= np.uint64(params.modulus)).sum())} value(s) outside the "
            f"modulus 2^{params.modulus_bits}; refused"
        )
    return v


def dequantize_sum(residues: np.ndarray, params: SkellamParams) -> np.ndarray:
    """The modular sum of all contributions -> the estimate of the sum of the clipped records (real units)."""
    return unrotate(centered(residues, params.modulus_bits).astype(np.float64) / params.scale, params)


# -- wrap-around ---------------------------------------------------------------------------------------------


def skellam_log_tail(t: float, mu: float) -> float:
    """log of the Chernoff bound on P(Z >= t) for Z ~ Sk(mu/2, mu/2): E e^{lZ} = exp(mu (cosh l - 1)),
    minimised at l = asinh(t / mu), giving mu (sqrt(1 + u^2) - 1) - t asinh(u) with u = t / mu."""
    if t <= 0:
        return 0.0
    u = t / mu
    return mu * (math.sqrt(1 + u * u) - 1) - t * math.asinh(u)


def wrap_probability(params: SkellamParams, max_records: int) -> float:
    """Upper bound on the probability that the decoded sum is wrong in some coordinate (wrap-around mod m).

    ``max_records``: the PUBLIC cap on the number of records summed over all sites in the release.  Each
    rounded record has L2 (hence L-infinity) norm <= Delta2, so the signal is within R * Delta2 of 0 in every
    coordinate; a wrap needs |noise_j| >= m/2 - R * Delta2.  The total noise of all n shares is Sk(mu) (fewer
    shares after a dropout only shrink it, and the Chernoff bound grows with mu).  Union bound over the d'
    coordinates and both tails.  More records than the cap cost utility only: the modular sum is
    post-processing of the noisy sum.
    """
    check_positive_int(max_records, "max_records", "wrap-around bound")
    t = params.modulus / 2 - max_records * params.l2_sensitivity - 1
    if t <= 0:
        return 1.0
    log_p = math.log(2 * params.padded_dim) + skellam_log_tail(t, params.mu)
    return 1.0 if log_p >= 0 else math.exp(log_p)


def choose_modulus_bits(params: SkellamParams, max_records: int, target: float = 1e-12) -> int:
    """Smallest modulus 2^b (b <= 64) whose wrap-around probability for ``max_records`` records is <=
    target."""
    if not (0 < target < 1):
        raise PrivacyError(f"wrap-around target must be in (0, 1), got {target!r}")
    for bits in range(2, MAX_MODULUS_BITS + 1):
        candidate = SkellamParams(
            params.dim,
            params.clip,
            params.scale,
            params.noise_multiplier,
            params.n_sites,
            bits,
            params.beta,
            params.rotate,
            params.rotation_seed,
        )
        if wrap_probability(candidate, max_records) <= target:
            return bits
    raise PrivacyError(
        f"no modulus up to 2^{MAX_MODULUS_BITS} keeps the wrap-around probability of {max_records} "
        f"records below {target:g}; lower the scale ({params.scale:g}) or the record cap"
    )
