"""Noise in the coordinator's DP-SGD update at the same per-site epsilon: per-site noise (FedAvg of local
steps, today's default) vs FedSGD over secure aggregation (one pooled step per round, the sites' noise SHARES
summed).

    python bench/bench_fedsgd_noise.py                      # the demo's job: cpu-eps1 at 3 sites x 1,333 images, eps 1
    python bench/bench_fedsgd_noise.py --sites 5 --steps 40 --json out.json

Planner figures only (no training): for both modes the per-site sigma comes from THE planner (``stage_events``
/ ``secure_stage_events``: the whole history, warm-up included, calibrated to the same epsilon; the secure
mode counts the honest shares of the default policy, 0 colluders, threshold = all sites). Reported per DP-SGD
step of the global model: the noise std per coordinate of the averaged gradient, in units of C / B (B = one
site's expected batch):
  per-site: each site's step carries sigma_local C / B, FedAvg of n sites averages n independent noises: sigma_local / sqrt(n);
  FedSGD:   the sum of n shares carries sigma_fedsgd C over the pooled batch n B: sigma_fedsgd / n.
Both modes take the same number of steps (per-site: rounds x local_steps local steps; FedSGD: that many
rounds).
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import math

from feta_release.accounting import epsilon, worst_case_epsilon
from feta_release.config import load_preset
from feta_release.mechanisms.secure_sums import secagg_warmup_events
from feta_release.planning import fedsgd_shape, secure_stage_events, stage_event, stage_events, target


def job(preset: str, eps: float, size: int, sites: int, steps: int, fedsgd: bool) -> object:
    cfg = load_preset(preset).for_size(size)
    return cfg.replace(
        privacy={"epsilon": eps},
        dpsgd={"steps": steps},
        federation={
            "sites": [f"s{i}" for i in range(sites)],
            "rounds": steps,
            "local_steps": 1,
            "secure_aggregation": True,
            "fedsgd": fedsgd,
        },
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-eps1")
    ap.add_argument("--epsilon", type=float, default=1.0)
    ap.add_argument("--sites", type=int, default=3)
    ap.add_argument("--size", type=int, default=1333, help="public size of each site")
    ap.add_argument("--steps", type=int, default=40, help="DP-SGD steps of the global model")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    shape, classes, n = (1, 28, 28), 10, a.sites
    local = job(a.preset, a.epsilon, a.size, n, a.steps, False)
    # per-site mode: per-site Gaussian rounds over the job's per-site-noise warm-up (the same warm-up in both
    # modes: its secure form, so only the DP-SGD mode differs)
    warm = secagg_warmup_events(local, a.size, shape, classes, n, 0)
    ev_local = secure_stage_events(local, a.size, warm, budget=target(local))
    s_local = stage_event(ev_local, "dpsgd").sigma  # type: ignore[union-attr]
    fed = job(a.preset, a.epsilon, a.size, n, a.steps, True)
    ev_fed = secure_stage_events(
        fed, a.size, warm, budget=target(fed), fedsgd=fedsgd_shape(fed, shape, classes, n, 0)
    )
    sk = stage_event(ev_fed, "dpsgd")
    s_fed = math.sqrt(sk.mu_worst * n) / sk.l2  # type: ignore[union-attr]  # pooled sigma (Delta2 ~ C s)
    out = {
        "sites": n,
        "site_size": a.size,
        "steps": a.steps,
        "batch": fed.dpsgd.batch,
        "q": sk.q,  # type: ignore[union-attr]
        "per_site": {
            "sigma": s_local,
            "epsilon": epsilon(ev_local, 1e-5),
            "noise_per_step": s_local / math.sqrt(n),
        },
        "fedsgd": {
            "sigma_pooled": s_fed,
            "epsilon": epsilon(ev_fed, 1e-5),
            "epsilon_worst_case": worst_case_epsilon(ev_fed, 1e-5),
            "noise_per_step": s_fed / n,
        },
        "gaussian_only_reference": stage_event(stage_events(local, a.size, federated=True), "dpsgd").sigma,  # type: ignore[union-attr]
    }
    out["ratio_per_site_over_fedsgd"] = out["per_site"]["noise_per_step"] / out["fedsgd"]["noise_per_step"]
    print(json.dumps(out, indent=2))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
