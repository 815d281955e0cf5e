"""Per-round overhead of feta-release's federated DP-SGD vs Flower's minimum round trip, same machine.

1. Flower's minimum: a SuperLink + N plain SuperNodes on loopback and a no-op ping app
   (``feta_release.federation.ping``), R rounds; once with an empty payload and once with a payload the
   size of the job's model weights.
2. feta-release: from a finished job directory (``--job-out``, e.g. ``feta-demo/job`` from
   ``feta-release demo``), each round's wall time minus the slowest site's on-site compute time
   (logged by each site in its own ``work/compute_seconds.jsonl``; sites never send it, as it tracks the
   realised batch size) = the round's overhead.

Usage:  python bench/bench_federation.py --nodes 3 --rounds 3 \
            [--job-out feta-demo/job --sites-root feta-demo/federation]
Timings on a shared, loaded machine are approximate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def ping_rounds(nodes: int, rounds: int, floats: int, work: Path) -> list[float]:
    from coordinator.superlink import SuperLinkSettings, start_superlink, submit, write_flwr_config
    from feta_release.federation.procs import ManagedProcess, flower_env, free_port

    port = free_port()
    procs = []
    out_file = work / f"ping-{floats}.json"
    try:
        procs.append(
            start_superlink(
                SuperLinkSettings(port=port, database=work / "state.db", insecure=True, home=work / "link")
            )
        )
        for i in range(nodes):
            env = flower_env(work / f"node{i}")
            procs.append(
                ManagedProcess(
                    f"node{i}",
                    [
                        "flower-supernode",
                        "--insecure",
                        "--superlink",
                        f"127.0.0.1:{port}",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(free_port()),
                    ],
                    env,
                    work / f"node{i}.log",
                )
            )
        home = work / "cli"
        write_flwr_config(home, f"127.0.0.1:{port}", insecure=True)
        code = submit(
            ROOT / "bench" / "ping_app",
            home,
            {"rounds": str(rounds), "payload-floats": str(floats), "out-file": str(out_file)},
        )
        if code != 0 or not out_file.exists():
            raise SystemExit(f"ping run failed (code {code}); logs in {work}")
        return json.loads(out_file.read_text())["round_seconds"]
    finally:
        for p in procs:
            p.stop()


def site_compute(sites_root: Path) -> dict[int, float]:
    """Slowest site's compute seconds per DP-SGD round (0-based), from the sites' local timing logs."""
    out: dict[int, float] = {}
    for f in sites_root.rglob("compute_seconds.jsonl"):
        for line in f.read_text().splitlines():
            row = json.loads(line)
            _job, phase, rnd = row["request_id"].rsplit(":", 2)
            if phase == "train":
                out[int(rnd)] = max(out.get(int(rnd), 0.0), float(row["seconds"]))
    return out


def job_overheads(job_out: Path, sites_root: Path) -> list[dict[str, float]]:
    rows = []
    per_round = site_compute(sites_root)
    for line in (job_out / "progress.jsonl").read_text().splitlines():
        ev = json.loads(line)
        if ev.get("phase") == "dpsgd" and "round" in ev and (ev["round"] - 1) in per_round:
            compute = per_round[ev["round"] - 1]
            rows.append(
                {
                    "round": ev["round"],
                    "wall": ev["seconds"],
                    "site_compute_max": compute,
                    "overhead": ev["seconds"] - compute,
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--payload-floats",
        type=int,
        default=None,
        help="weights-sized payload (default: the demo model's parameter count)",
    )
    ap.add_argument("--job-out", type=Path, default=None)
    ap.add_argument(
        "--sites-root",
        type=Path,
        default=None,
        help="folder holding the sites' work dirs (default: the --job-out's parent)",
    )
    a = ap.parse_args()
    floats = a.payload_floats
    if floats is None:
        from coordinator.demo import demo_config
        from feta_release.models import build_denoiser

        cfg = demo_config("cpu-eps1", 1.0, 1333, 4, 10, False)
        floats = sum(p.numel() for p in build_denoiser(cfg.model, (1, 28, 28), 10).parameters())
    with tempfile.TemporaryDirectory(prefix="feta-bench-") as tmp:
        empty = ping_rounds(a.nodes, a.rounds, 0, Path(tmp) / "empty")
        sized = ping_rounds(a.nodes, a.rounds, floats, Path(tmp) / "sized")
    print(f"Flower minimum round trip, {a.nodes} nodes on loopback (fresh flwr-clientapp per message):")
    print(
        f"  empty payload      : median {statistics.median(empty):.2f} s  (rounds: "
        f"{', '.join(f'{t:.2f}' for t in empty)})"
    )
    print(
        f"  {floats:>9,d} floats : median {statistics.median(sized):.2f} s  (rounds: "
        f"{', '.join(f'{t:.2f}' for t in sized)})"
    )
    if a.job_out is not None:
        rows = job_overheads(a.job_out, a.sites_root or a.job_out.parent)
        if not rows:
            print(f"no DP-SGD rounds with site timings in {a.job_out}")
            return
        med = statistics.median(r["overhead"] for r in rows)
        print(f"feta-release DP-SGD rounds in {a.job_out}:")
        for r in rows:
            print(
                f"  round {r['round']}: wall {r['wall']:.1f} s = on-site compute {r['site_compute_max']:.1f} "
                f"s + overhead {r['overhead']:.1f} s"
            )
        print(
            f"  median overhead {med:.1f} s vs Flower minimum {statistics.median(sized):.2f} s "
            f"(extra: imports of torch/feta in each fresh clientapp, policy + ledger checks)"
        )


if __name__ == "__main__":
    main()
