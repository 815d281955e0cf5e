"""bench/pretraining.py: the table groups a route's seeds into mean ± std, reports the class a prototype
release loses (the medical set's ``finding``, else the lowest) and the synthetic set's recall, and says
which routes were refused."""

from __future__ import annotations

from types import ModuleType

from tests.support.bench_script import load_bench


def _bench() -> ModuleType:
    return load_bench("pretraining.py", "pretraining_bench")


def _row(kind: str, dpsgd: str, seed: int, acc: float, per_class: dict[str, float]) -> dict:
    return {
        "dataset": kind,
        "epsilon": 1,
        "start": "pretrain",
        "dpsgd": dpsgd,
        "seed": seed,
        "accuracy": acc,
        "per_class": per_class,
        "recall": 0.5,
        "fd": 10.0,
        "spent": 0.99,
        "seconds": 100,
    }


def test_the_table_gives_mean_and_std_over_seeds_per_route() -> None:
    bench = _bench()
    rows = [
        _row("medical", "none", 0, 0.6, {"normal": 0.9, "finding": 0.2}),
        _row("medical", "none", 1, 0.8, {"normal": 0.9, "finding": 0.4}),
        _row("medical", "lora", 0, 0.7, {"normal": 0.9, "finding": 0.6}),
    ]
    md = bench._table(rows)
    none = next(ln for ln in md.splitlines() if "no DP-SGD" in ln)
    lora = next(ln for ln in md.splitlines() if "LoRA" in ln)
    assert "0.700 ± 0.141" in none and "finding 0.300 ± 0.141" in none and none.endswith("| 2 |")
    assert "0.700 ± 0.000" in lora and "finding 0.600" in lora and lora.endswith("| 1 |")


def test_the_hardest_class_is_the_finding_where_there_is_one_else_the_lowest() -> None:
    bench = _bench()
    assert bench.hardest_class("medical", {"finding": 0.9, "normal": 0.1}) == ("finding", 0.9)
    assert bench.hardest_class("digits", {"0": 0.9, "5": 0.3, "8": 0.5}) == ("5", 0.3)


def test_a_refused_route_is_named_as_refused() -> None:
    bench = _bench()
    refused = {"dataset": "digits", "epsilon": 1, "start": "select", "dpsgd": "none", "seed": 0}
    md = bench._table([{**refused, "refused": "over the budget"}])
    assert "refused: over the budget" in md
