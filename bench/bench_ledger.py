"""Cost of the tamper-evident ledger: opening (full chain check) and one charge (re-check + re-sign) vs rows.

    python bench/bench_ledger.py                 # rows 10, 100, 1000; 64 KiB answers
    python bench/bench_ledger.py --rows 100 --answer-kib 1024

Every message a real node handles opens the ledger (chain check without the answers' bytes) and a
releasing one charges it (re-check under the write lock, re-link, sign the head). ``deep`` also hashes
every stored answer (node start, ``node status``). A trivial accountant is used so only the ledger's
own cost is measured. Timings on a shared 2-core machine are approximate.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from feta_release.accounting import PrivacyEvent  # noqa: E402
from feta_release.ledger import Budget, Ledger  # noqa: E402


def _acc(events, delta, accountant):  # noqa: ANN001, ANN202 - only the ledger's own cost is measured
    return 0.0


def measure(rows: int, answer: bytes, key: Ed25519PrivateKey) -> dict[str, float]:
    ev = [PrivacyEvent("dpsgd", 1.0, 0.01, 1)]
    budget = Budget(1e9, 1e9, 1e-5)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "l.db"
        with Ledger(path, _acc, key=key) as led:
            for i in range(rows):
                led.charge("job", f"r{i}", "dpsgd", ev, budget, response=answer)
        t0 = time.perf_counter()
        led = Ledger(path, _acc, key=key)
        t_open = time.perf_counter() - t0
        t0 = time.perf_counter()
        led.charge("job", "new", "dpsgd", ev, budget, response=answer)
        t_charge = time.perf_counter() - t0
        led.close()
        t0 = time.perf_counter()
        Ledger(path, _acc, key=key, deep=True).close()
        t_deep = time.perf_counter() - t0
    return {"rows": rows, "open_ms": 1e3 * t_open, "charge_ms": 1e3 * t_charge, "open_deep_ms": 1e3 * t_deep}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--answer-kib", type=int, default=64)
    a = ap.parse_args()
    key = Ed25519PrivateKey.generate()
    answer = b"\x01" * (a.answer_kib * 1024)
    for n in a.rows:
        print(json.dumps({k: round(v, 2) for k, v in measure(n, answer, key).items()}), flush=True)


if __name__ == "__main__":
    main()
