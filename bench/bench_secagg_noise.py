"""Noise in the coordinator's combined central images: per-site noise (today's default) vs secure aggregation.

    python bench/bench_secagg_noise.py                         # 3 sites x 1,333 embedded digits, cpu-eps1 central
    python bench/bench_secagg_noise.py --sites 5 --repeats 20 --json out.json

Both modes release the same job (cpu-eps1's [central]: mean images, the same sigma, clip, batch per site,
rounds) from the same sites, and the coordinator combines them as it does (per-site: ``combine_central``
weighted by public sizes; secure: the decoded Skellam sum over the public denominator). Reported: the std of
(combined - noise-free combined mean image) over all pixels, i.e. the noise the warm-up trains on, and its
ratio (sqrt(sites) expected). Sites' epsilons are not equal across the modes (Skellam's L1 term, the honest
shares counted): the bench prints each mode's epsilon of the central stage at one site for the default policy.
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import math

import numpy as np

from feta_release.accountants.skellam import honest_shares
from feta_release.accounting import PrivacyEvent, epsilon
from feta_release.config import load_preset
from feta_release.data import load_embedded
from feta_release.data.splits import split_sites
from feta_release.mechanisms import secure_sums as ss
from feta_release.mechanisms import skellam as sk
from feta_release.mechanisms.central import central_images, combine_central


def _per_site(sites: list, c: object, n_public: int, gen: np.random.Generator) -> np.ndarray:
    rels = [
        central_images(
            s.images,
            s.labels,
            10,
            kind="mean",
            rounds=c.rounds,
            batch=c.batch,
            sigma=c.sigma,
            clip=c.clip,
            downsample=c.downsample,
            n_public=n_public,
            rng=gen,
        )[0]
        for s in sites
    ]
    return combine_central(rels, [n_public] * len(rels)).values.astype(np.float64).reshape(-1)


def _secure(sites: list, c: object, n_public: int, gen: np.random.Generator) -> np.ndarray:
    shape = tuple(int(v) for v in sites[0].images.shape[1:])
    lay = ss.central_layout(shape, 10, c.rounds, c.clip, c.downsample)
    vecs = [
        ss.central_contribution(
            s.images,
            s.labels,
            10,
            rounds=c.rounds,
            batch=c.batch,
            sigma=c.sigma,
            clip=c.clip,
            downsample=c.downsample,
            n_public=n_public,
            n_sites=len(sites),
            modulus_bits=64,
            rng=gen,
        )
        for s in sites
    ]
    params = ss.block_params(lay.block_dim, lay.clip, c.sigma, len(sites))
    rel = ss.decode_central(
        sk.modular_sum(vecs, 64),
        lay,
        params,
        rounds=c.rounds,
        n_classes=10,
        denominator=len(sites) * c.batch / 10,
        image_shape=shape,
        small_shape=ss.small_shape(shape, c.downsample),
        sigma=c.sigma,
        q=c.batch / n_public,
    )
    return rel.values.astype(np.float64).reshape(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", type=int, default=3)
    ap.add_argument("--per-site", type=int, default=1333)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cfg = load_preset("cpu-eps1").for_size(a.per_site)
    c = cfg.central
    ds = load_embedded()
    pick = np.sort(np.random.default_rng(1).permutation(ds.n)[: a.sites * a.per_site])
    sites = split_sites(ds.subset(pick), a.sites, seed=0)
    gen = np.random.default_rng(0)
    # reference: the expected noise-free combined image (both modes also carry the same Poisson-sampling
    # spread)
    per, sec = [], []
    for _ in range(a.repeats):
        per.append(np.std(_per_site(sites, c, a.per_site, gen) - _per_site_mean(sites, c, a.per_site)))
        sec.append(np.std(_secure(sites, c, a.per_site, gen) - _per_site_mean(sites, c, a.per_site)))
    t = ss.secagg_threshold(None, a.sites)
    h = honest_shares(a.sites, t, 0)
    q = c.batch / a.per_site
    out = {
        "sites": a.sites,
        "per_site_images": a.per_site,
        "sigma": c.sigma,
        "clip": c.clip,
        "rounds": c.rounds,
        "batch": c.batch,
        "noise_std_per_site_mode": float(np.mean(per)),
        "noise_std_secure": float(np.mean(sec)),
        "ratio": float(np.mean(per) / np.mean(sec)),
        "sqrt_sites": math.sqrt(a.sites),
        "central_epsilon_per_site_mode": epsilon([PrivacyEvent("central", c.sigma, q, c.rounds)], 1e-5),
        "central_epsilon_secure_assumed": epsilon(
            ss.secagg_warmup_events(
                cfg, a.per_site, tuple(int(v) for v in ds.images.shape[1:]), 10, a.sites, 0
            )[:1],
            1e-5,
        ),
        "honest_shares": h,
    }
    print(json.dumps(out, indent=2))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=2)


def _per_site_mean(sites: list, c: object, n_public: int) -> np.ndarray:
    """Expected noise-free combined image: per round and class, the mean clipped downsampled image of the
    sampled images x q x (class share) is what both modes estimate; approximated by the full-data sums / the
    public denominator, which is the sampled sum's expectation (q x full sum) / (sites x batch / 10)."""
    from feta_release.mechanisms.central import central_query

    total = sum(
        central_query(s.images, s.labels, 10, kind="mean", clip=c.clip, downsample=c.downsample)[0]
        for s in sites
    )
    q = c.batch / n_public
    mean = q * total / (len(sites) * c.batch / 10)  # (10, d)
    return np.tile(mean, (c.rounds, 1)).reshape(-1)


if __name__ == "__main__":
    main()
