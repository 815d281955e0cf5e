"""Per-round wall time of a federated DP-SGD round vs Flower's no-op round trip, with and without the warm
worker.

Real processes on loopback, the same set-up for both: a SuperLink and ``--sites`` site nodes started by
``edge.launch.start_node`` (the site's checks, the FAB gate, and -- unless ``--no-worker`` mode -- the warm
worker ``edge.worker``). On those same processes it runs
  1. Flower's no-op round trip: the ping app (``bench/ping_app``: a ClientApp that answers at once; allowed by
     the sites' policies beside the job's bundle), ``--rounds`` rounds;
  2. a small signed job of ``--rounds`` DP-SGD rounds (one local step each, the demo's ``--quick`` model, no
     warm-up stages), each round's wall time as the coordinator logs it (``progress.jsonl``).
Both modes get a fresh federation (fresh ledgers). Prints per-mode medians and the ratio DP-SGD / no-op.

Usage:  python bench/bench_round.py [--sites 2] [--rounds 5] [--per-site 200] [--modes worker,no-worker]
Timings on a shared, loaded machine are approximate: the load average is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PING_DIR = ROOT / "bench" / "ping_app"
QUICK_MODEL = {"channels": 8, "channel_mult": [1], "num_res_blocks": 1, "attn_resolutions": []}


def federation(root: Path, sites: int, per_site: int) -> Any:
    import numpy as np

    from coordinator.setup import app_bundle_hash, prepare_federation
    from feta_release.data.loading import load_embedded
    from feta_release.data.splits import split_sites

    ds = load_embedded()
    rng = np.random.default_rng(0)
    idx = np.concatenate(
        [rng.choice(np.flatnonzero(ds.labels == c), per_site * sites // 10, replace=False) for c in range(10)]
    )
    parts = split_sites(ds.subset(np.sort(idx), source="embedded subset"), sites, seed=0)
    data = {f"site-{chr(ord('a') + i)}": p for i, p in enumerate(parts)}
    return prepare_federation(root, data, app_hashes=[app_bundle_hash(), app_bundle_hash(PING_DIR)])


def job_config(rounds: int, sites: int) -> Any:
    from feta_release.config import JobConfig

    return JobConfig.from_dict(
        {
            "job": {"name": "bench-round", "seed": 0},
            "privacy": {"epsilon": 1.0, "delta": 1e-5},
            "central": {"rounds": 0},
            "frequency": {"sigma": None},
            "model": QUICK_MODEL,
            "warmup": {"spatial_iterations": 0, "frequency_epochs": 0},
            "dpsgd": {"batch": 16, "steps": rounds, "noise_multiplicity": 1, "physical_batch": 16},
            "federation": {"min_sites": sites, "rounds": rounds, "local_steps": 1, "round_timeout": 900.0},
        }
    )


def ping(address: str, rounds: int, work: Path) -> list[float]:
    from coordinator.superlink import submit, write_flwr_config

    home, out_file = work / "ping_cli", work / "ping.json"
    write_flwr_config(home, address, insecure=True)
    code = submit(PING_DIR, home, {"rounds": str(rounds), "payload-floats": "0", "out-file": str(out_file)})
    if code != 0 or not out_file.exists():
        raise SystemExit(f"ping run failed (code {code}); logs in {work}")
    return [float(t) for t in json.loads(out_file.read_text())["round_seconds"]]


def dpsgd(fed: Any, address: str, rounds: int, work: Path) -> list[float]:
    from coordinator.runner import run_signed_job, sign_or_resume
    from feta_release import job_rules

    job_toml = work / "job.toml"
    job_toml.write_text(job_rules.job_toml(job_config(rounds, len(fed.sites))), "utf-8")
    out = work / "job"
    signed = sign_or_resume(job_toml, [s.site_id for s in fed.sites], fed.coordinator_key, out, "bench-round")
    run_signed_job(signed, fed.coordinator_key, out, address, insecure=True)
    rows = [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines()]
    return [
        float(r["seconds"]) for r in rows if r.get("phase") == "dpsgd" and "round" in r and "seconds" in r
    ]


def run_mode(worker: bool, sites: int, rounds: int, per_site: int, work: Path) -> dict[str, Any]:
    from coordinator.superlink import SuperLinkSettings, start_superlink
    from edge.launch import NodeSettings, start_node
    from feta_release.federation.procs import free_port

    fed = federation(work / "fed", sites, per_site)
    port = free_port()
    procs = []
    try:
        t0 = time.monotonic()
        procs.append(
            start_superlink(
                SuperLinkSettings(
                    port=port, database=work / "link" / "state.db", insecure=True, home=work / "link"
                )
            )
        )
        for s in fed.sites:
            procs.append(
                start_node(
                    NodeSettings(
                        data=s.data,
                        policy=s.policy,
                        trusted_policy_key=s.policy_pub,
                        ledger=s.ledger,
                        site_key=s.site_key,
                        data_secret=s.data_secret,
                        superlink=f"127.0.0.1:{port}",
                        port=free_port(),
                        insecure=True,
                        worker=worker,
                    )
                )
            )
        started = time.monotonic() - t0
        time.sleep(3)  # let the nodes register
        no_op = ping(f"127.0.0.1:{port}", rounds, work)
        rounds_s = dpsgd(fed, f"127.0.0.1:{port}", rounds, work)
    finally:
        for p in procs:
            p.stop()
    return {
        "worker": worker,
        "start_seconds": started,
        "noop_round_seconds": no_op,
        "dpsgd_round_seconds": rounds_s,
        "noop_median": statistics.median(no_op),
        "dpsgd_median": statistics.median(rounds_s),
        "ratio": statistics.median(rounds_s) / statistics.median(no_op),
    }


def _list(xs: list[float]) -> str:
    return ", ".join(f"{t:.2f}" for t in xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sites", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-site", type=int, default=200)
    ap.add_argument("--modes", default="worker,no-worker", help="comma-separated: worker, no-worker")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    a = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="feta-bench-round-") as tmp:
        for mode in a.modes.split(","):
            load = os.getloadavg()[0]
            r = run_mode(mode.strip() == "worker", a.sites, a.rounds, a.per_site, Path(tmp) / mode.strip())
            r["load_before"] = load
            results.append(r)
            print(
                f"{mode:>9}: {a.sites} sites, {a.rounds} rounds, load {load:.1f}, node start "
                f"{r['start_seconds']:.1f} s"
            )
            print(
                f"           Flower no-op round : median {r['noop_median']:.2f} s  "
                f"({_list(r['noop_round_seconds'])})"
            )
            print(
                f"           DP-SGD round       : median {r['dpsgd_median']:.2f} s  "
                f"({_list(r['dpsgd_round_seconds'])})"
            )
            print(f"           ratio DP-SGD / no-op: {r['ratio']:.2f}x (goal <= 2x)", flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
