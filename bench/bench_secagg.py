"""Secure aggregation + Skellam: CPU cost of one in-process round per stage, and the decoded sum's error.

    python bench/bench_secagg.py                       # 3 sites, FedSGD-sized vector (2^17), 250 records per site
    python bench/bench_secagg.py --sites 5 --dim 2000 --records 1333 --drop 1 --json out.json

Reports seconds per protocol stage (all sites together, one process: the cryptography a real round adds to the
per-message overhead), the Skellam quantization time per site, and the max |decoded - true sum| against the
noise std sigma * clip. The goal (per-round wall time <= 2x Flower's no-op round trip) is measured end to end
once the protocol is wired into the node; this bench says how much of that budget the cryptography takes.
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from feta_release.federation import secagg as sa
from feta_release.mechanisms import skellam as sk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", type=int, default=3)
    ap.add_argument("--dim", type=int, default=100_000)
    ap.add_argument("--records", type=int, default=250)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--drop", type=int, default=0, help="sites that drop before masking")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    g = np.random.default_rng(0)
    base = sk.SkellamParams(
        dim=args.dim, clip=1.0, scale=1024.0, noise_multiplier=args.sigma, n_sites=args.sites
    )
    bits = sk.choose_modulus_bits(base, args.sites * args.records, 1e-12)
    p = sk.SkellamParams(args.dim, 1.0, 1024.0, args.sigma, args.sites, bits)
    ids = tuple(range(1, args.sites + 1))
    cfg = sa.RoundConfig("bench", ids, args.sites // 2 + 1, p.padded_dim, bits)
    records = {i: g.normal(size=(args.records, args.dim)) / np.sqrt(args.dim) for i in ids}
    times: dict[str, float] = {}

    t = time.perf_counter()
    contrib = {i: sk.site_contribution(records[i], p, g) for i in ids}
    times["quantize+noise per site"] = (time.perf_counter() - t) / args.sites
    # the sites' long-term keys (signed key adverts)
    site_keys = {i: Ed25519PrivateKey.generate() for i in ids}
    verify = sa.ed25519_verifier({i: k.public_key() for i, k in site_keys.items()})
    sites = {i: sa.SecAggSite(i, cfg, sa.ed25519_signer(site_keys[i]), verify) for i in ids}
    co = sa.SecAggCoordinator(cfg)
    alive = ids[args.drop :]
    t = time.perf_counter()
    keys = co.collect_keys({i: s.setup() for i, s in sites.items()})
    times["setup"] = time.perf_counter() - (t0 := t)
    routed = co.route_shares({i: s.share_keys(keys) for i, s in sites.items()})
    times["share_keys"] = time.perf_counter() - t0 - times["setup"]
    t = time.perf_counter()
    requests = co.collect_masked({i: sites[i].masked_vector(routed[i], contrib[i]) for i in alive})
    times["masked_vector"] = time.perf_counter() - t
    t = time.perf_counter()
    total = co.finish({i: sites[i].unmask(*requests[i]) for i in alive})
    times["unmask+decode"] = time.perf_counter() - t
    decoded = sk.dequantize_sum(total, p)
    true = sum(records[i].clip(-np.inf, np.inf).sum(axis=0) for i in alive)
    out = {
        "sites": args.sites,
        "dropped": args.drop,
        "dim": args.dim,
        "padded_dim": p.padded_dim,
        "modulus_bits": bits,
        "wrap_probability": sk.wrap_probability(p, args.sites * args.records),
        "seconds": {k: round(v, 4) for k, v in times.items()},
        "max_abs_error": float(np.abs(decoded - true).max()),
        "noise_std": args.sigma * p.clip,
    }
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
