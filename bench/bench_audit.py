"""Empirical privacy audit: tightness (measured lower bound / claimed ε) and run time, per mechanism.

    python bench/bench_audit.py                          # cpu-eps1 preset, 20,000 runs, 1,000 canaries
    python bench/bench_audit.py --preset cpu-eps10 --trials 100000 --json out.json
    python bench/bench_audit.py --sigma 2 --trials 100000  # the one-shot mechanisms at sigma 2 (tighter regime)
    python bench/bench_audit.py --sigma 2 --trials 2000000 --mechanisms "central mode"
    python bench/bench_audit.py --runs-needed --sigma 2,4,7.4,8,10   # runs an audit needs (no runs: the model)

Goals: each one-shot audit within 2x of its claim (ratio >= 0.5), the DP-SGD one-run audit in <= 10 min
on 2 cores. An audit gives a LOWER bound: a ratio below 1 is expected (the accountant is an upper bound and a
finite number of runs cannot certify the tail); a ratio above 1 is a privacy bug.

``--runs-needed`` prints, per mechanism and σ, the runs per neighbour after which the TYPICAL audit (every
count at its expectation) shows a bound above 0, and reaches half the claim, and the best any number of runs
can show. The model: the mean and frequency audits are threshold tests on a Gaussian shift of mu = 1/σ with
half of the runs evaluating (the other half fits the threshold); the mode audit is one on mu = 1/(σ·sqrt 2)
(the argmax sees a difference of two noisy bins) with every run evaluating. The measured rows above check that
model.
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import math
import time

GOAL_RATIO = 0.5
GOAL_DPSGD_SECONDS = 600.0
ONE_SHOT = ("central mean", "central mode", "frequency")


def runs_needed(mechanism: str, sigma: float, claim: float, delta: float = 1e-5) -> dict[str, float | None]:
    """Runs per neighbour for a typical bound > 0 and >= claim / 2 (None: not below 10^12), and the
    ceiling."""
    from feta_release.audit.stats import expected_gaussian_bound

    mu, share = (1.0 / (sigma * math.sqrt(2.0)), 1.0) if mechanism == "central mode" else (1.0 / sigma, 0.5)

    def bound(n: float) -> float:
        return expected_gaussian_bound(mu, max(1, int(n * share)), delta)

    def first(goal: float) -> float | None:
        n = 100.0
        while n <= 1e12:
            if bound(n) > goal:
                lo, hi = n / 2, n
                for _ in range(20):
                    mid = math.sqrt(lo * hi)
                    lo, hi = (lo, mid) if bound(mid) > goal else (mid, hi)
                return hi
            n *= 2
        return None

    return {"mu": mu, "any": first(1e-9), "half_claim": first(claim / 2), "ceiling": _gdp_epsilon(mu, delta)}


def _gdp_epsilon(mu: float, delta: float) -> float:
    """The exact ε(δ) of a Gaussian shift mu (Balle & Wang 2018): what infinitely many runs could show at
    best."""

    def d(e: float) -> float:
        phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2.0))  # noqa: E731
        return phi(-e / mu + mu / 2) - math.exp(e) * phi(-e / mu - mu / 2)

    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if d(mid) > delta else (lo, mid)
    return lo


def _print_runs_needed(sigmas: list[float], delta: float) -> list[dict]:
    from feta_release.accounting import PrivacyEvent, epsilon

    rows = []
    for s in sigmas:
        claim = epsilon([PrivacyEvent("central", s, 1.0, 1)], delta, "rdp")
        for m in ONE_SHOT:
            r = runs_needed(m, s, claim, delta)
            rows.append({"mechanism": m, "sigma": s, "claimed_epsilon": claim, **r})
            fmt = lambda v: "never" if v is None else f"{v:.2g}"  # noqa: E731
            print(
                f"σ {s:<5g} {m:<13} claimed {claim:.3f}  runs/neighbour for a bound > 0: {fmt(r['any']):>7}  "
                f"for >= claim/2: {fmt(r['half_claim']):>7}  ceiling (infinite runs) {r['ceiling']:.3f}"
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu-eps1")
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--trials", type=int, default=20000)
    ap.add_argument("--canaries", type=int, default=1000)
    ap.add_argument(
        "--sigma",
        default=None,
        help="audit the one-shot mechanisms at this σ (comma list with --runs-needed) instead of the preset",
    )
    ap.add_argument(
        "--mechanisms", default=",".join(ONE_SHOT), help="with --sigma: which one-shot mechanisms"
    )
    ap.add_argument(
        "--runs-needed", action="store_true", help="print the runs an audit needs (model, no runs)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from feta_release.audit.games import audit_one_shot
    from feta_release.audit.run import run_audit
    from feta_release.config import load_preset

    t0 = time.perf_counter()
    if args.runs_needed:
        rows = _print_runs_needed([float(s) for s in (args.sigma or "2,4,7.4,8,10").split(",")], 1e-5)
        _dump(args, rows)
        return
    if args.sigma is None:
        audits = run_audit(
            load_preset(args.preset), args.n, trials=args.trials, canaries=args.canaries, seed=args.seed
        )["audits"]
    else:
        audits = [
            audit_one_shot(
                m.strip(), float(args.sigma), trials=args.trials, delta=1e-5, seed=args.seed
            ).to_dict()
            for m in args.mechanisms.split(",")
        ]
    rows = []
    for a in audits:
        ratio = a["lower_bound"] / a["claimed_epsilon"]
        goal = a["seconds"] <= GOAL_DPSGD_SECONDS if a["mechanism"] == "DP-SGD" else ratio >= GOAL_RATIO
        rows.append({**a, "tightness": ratio, "goal_met": goal})
        print(
            f"{a['mechanism']:<14} claimed {a['claimed_epsilon']:.4g}  lower bound {a['lower_bound']:.4g}  "
            f"tightness {ratio:.2f}  {a['seconds']:.1f} s  goal {'met' if goal else 'NOT met'}  "
            f"runs/neighbour {a['trials']}"
        )
    print(f"total {time.perf_counter() - t0:.1f} s")
    _dump(args, rows)


def _dump(args: argparse.Namespace, rows: list[dict]) -> None:
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
