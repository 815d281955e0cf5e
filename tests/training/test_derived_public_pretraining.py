"""The derived job with a public set: `train --data D --epsilon E --public P` derives the pretraining from the
public set's facts (size, shape, class names), with no hand-written job, and `--dpsgd on|off` picks DP-SGD."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.cli import main
from feta_release.config import JobConfig
from feta_release.data import save_npz
from feta_release.data.procedural import generate_dataset
from feta_release.errors import ConfigError
from feta_release.job_rules import (
    DPSGD_MIN_STEPS,
    PRETRAIN_MAX,
    PRETRAIN_MIN,
    PRETRAIN_SHARE,
    DataFacts,
    PublicFacts,
    derive,
    derive_job,
    estimate,
    public_facts,
    seconds_per_pass,
)
from tests.support.cli import run_cli

MEDICAL = ("normal", "finding", "effusion", "opacity")


class Stop(Exception):
    """Raised by the stand-in pipeline once it has seen what `train` would run."""


@pytest.fixture(scope="module")
def medical_sets(tmp_path_factory: Any) -> tuple[Path, Path, Any]:
    root = tmp_path_factory.mktemp("medical")
    public = generate_dataset("medical", 300, size=28, seed=7, population="B")
    save_npz(generate_dataset("medical", 200, size=28, seed=1), root / "private.npz")
    save_npz(public, root / "public.npz")
    return root / "private.npz", root / "public.npz", public


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    got: dict[str, Any] = {}

    def fake_run(cfg: JobConfig, data: Any, out_dir: Any, opts: Any) -> None:
        got.update(cfg=cfg, data=data, **vars(opts))
        raise Stop

    monkeypatch.setattr("coordinator.local_run.run_train", fake_run)
    return got


def _facts(public: PublicFacts | None = None, **kw: Any) -> DataFacts:
    return DataFacts(
        size=200,
        height=28,
        width=28,
        channels=1,
        n_classes=4,
        epsilon=10.0,
        public=public,
        class_names=MEDICAL,
        **kw,
    )


def test_train_with_a_public_set_runs_the_job_derived_from_both_sets_facts(
    medical_sets: tuple[Path, Path, Any], tmp_path: Path, capsys: Any, seen: dict[str, Any]
) -> None:
    private, public_path, public = medical_sets
    with pytest.raises(Stop):
        main(
            [
                "train",
                "--data",
                str(private),
                "--epsilon",
                "10",
                "--public-size",
                "200",
                "--public",
                str(public_path),
                "--out",
                str(tmp_path / "r"),
            ]
        )
    want = derive_job(_facts(public_facts(public)))
    assert seen["cfg"] == want
    assert want.public.pretrain_iterations > 0 and want.dpsgd.trainable == "norm_attention"
    assert seen["public"].data.fingerprint() == public.fingerprint()  # the set the job was derived from runs
    out = capsys.readouterr().out
    assert "# public: " in out and "class-conditional for 4 of 4 private classes" in out


@pytest.mark.parametrize("choice", ["on", "off"])
def test_train_dpsgd_option_switches_dp_sgd_in_the_derived_job(
    choice: str, medical_sets: tuple[Path, Path, Any], tmp_path: Path, seen: dict[str, Any]
) -> None:
    private, public_path, public = medical_sets
    with pytest.raises(Stop):
        main(
            [
                "train",
                "--data",
                str(private),
                "--epsilon",
                "10",
                "--public-size",
                "200",
                "--public",
                str(public_path),
                "--dpsgd",
                choice,
                "--time-budget",
                "1h",
                "--out",
                str(tmp_path / "r"),
            ]
        )
    cfg: JobConfig = seen["cfg"]
    assert cfg == derive_job(_facts(public_facts(public), dpsgd=choice, time_budget=3600.0))
    assert (cfg.dpsgd_steps(200) > 0) == (choice == "on")


def test_dpsgd_option_is_refused_beside_a_preset(tmp_path: Path, capsys: Any) -> None:
    code, _, err = run_cli(
        ["train", "--preset", "tiny", "--dpsgd", "on", "--out", str(tmp_path / "r")], capsys
    )
    assert code == 2 and "for the derived job" in err and "--dpsgd" in err


def test_public_pretraining_takes_nothing_from_the_privacy_budget() -> None:
    """The public set changes no release: the same central, frequency and DP-SGD noise as without it."""
    plain = derive_job(_facts())
    with_public = derive_job(_facts(PublicFacts(5000, (1, 28, 28), MEDICAL)))
    for section in ("privacy", "central", "frequency"):
        assert getattr(plain, section) == getattr(with_public, section)
    assert plain.dpsgd.trainable == "all" and not plain.public.enabled


def test_a_public_set_of_another_shape_is_refused_naming_both_shapes() -> None:
    with pytest.raises(ConfigError, match=r"public images are \[1, 64, 64\].*\[1, 28, 28\]"):
        derive(_facts(PublicFacts(500, (1, 64, 64), MEDICAL)))


def test_a_public_set_naming_no_private_class_pretrains_unconditionally() -> None:
    notes = "\n".join(derive(_facts(PublicFacts(500, (1, 28, 28), ("line", "arc")))).notes)
    assert "unconditional (no public class names a private class)" in notes


@settings(max_examples=25, deadline=None)
@given(
    public_n=st.integers(1, 200_000),
    side=st.sampled_from([28, 64, 128]),
    device=st.sampled_from(["cpu", "cuda"]),
    budget=st.one_of(st.none(), st.floats(60, 20_000)),
)
def test_pretraining_steps_grow_with_the_public_set_within_their_bounds_and_budget_share(
    public_n: int, side: int, device: str, budget: float | None
) -> None:
    f = DataFacts(
        size=4000,
        height=side,
        width=side,
        channels=1,
        n_classes=4,
        epsilon=10.0,
        device=device,  # type: ignore[arg-type]
        time_budget=budget,
        public=PublicFacts(public_n, (1, side, side), MEDICAL),
        class_names=MEDICAL,
    )
    d = derive(f)
    steps = d.cfg.public.pretrain_iterations
    assert PRETRAIN_MIN <= steps <= PRETRAIN_MAX
    per_step = seconds_per_pass(d.cfg, f) * d.cfg.public.pretrain_batch
    assert steps == PRETRAIN_MIN or steps * per_step <= PRETRAIN_SHARE * f.budget + per_step
    assert estimate(d.cfg, f).seconds["pretraining"] == round(steps * per_step, 1)
    bigger = derive(
        DataFacts(**{**f.__dict__, "public": PublicFacts(public_n * 2, (1, side, side), MEDICAL)})
    )
    assert bigger.cfg.public.pretrain_iterations >= steps  # more public images never fewer steps


@pytest.mark.parametrize("budget", [180.0, 300.0, 900.0])
def test_dpsgd_asked_for_shortens_the_warm_up_to_make_room_for_its_minimum_steps(budget: float) -> None:
    f = DataFacts(
        size=3200,
        height=64,
        width=64,
        channels=1,
        n_classes=4,
        epsilon=10.0,
        device="cuda",
        time_budget=budget,
        public=PublicFacts(4000, (1, 64, 64), MEDICAL),
        class_names=MEDICAL,
        dpsgd="on",
    )
    d = derive(f)
    assert d.cfg.dpsgd_steps(f.size) >= DPSGD_MIN_STEPS and d.cfg.dpsgd.trainable == "norm_attention"
    assert d.estimate.training <= budget * 1.01
    plain = derive(DataFacts(**{**f.__dict__, "dpsgd": "auto"}))
    assert plain.cfg.dpsgd_steps(f.size) == 0  # eps x N = 32,000: the rule alone keeps DP-SGD off
