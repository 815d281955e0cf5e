"""The derived job with a public set: `train --data D --epsilon E --public P` derives the pretraining from the
public set's facts (size, shape, class names), with no hand-written job, and `--dpsgd on|off` picks DP-SGD."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.cli import main
from feta_release.config import JobConfig
from feta_release.data import ImageDataset, save_npz
from feta_release.data.procedural import generate_dataset
from feta_release.errors import ConfigError
from feta_release.job_rules import (
    DPSGD_MIN_STEPS,
    PRETRAIN_BATCH,
    PRETRAIN_EPOCHS,
    PRETRAIN_MAX,
    PRETRAIN_MIN,
    PRETRAIN_SHARE,
    DataFacts,
    PublicFacts,
    derive,
    derive_job,
    estimate,
    every_class_public,
    plan_of,
    public_facts,
    seconds_per_pass,
)
from feta_release.planning import plan
from feta_release.stages import PublicInputs
from feta_release.stages.pretrain import mapped_labels
from tests.support.cli import run_cli
from tests.support.training import site_requests, train_run

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
    want = derive_job(_facts(public_facts(public), threads=torch.get_num_threads()))  # train's default
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
    here = torch.get_num_threads()  # what train times the job at without --threads
    assert cfg == derive_job(_facts(public_facts(public), dpsgd=choice, time_budget=3600.0, threads=here))
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
    # every private class is named alike: the share plus the central warm-up's time (_freed_seconds)
    share = PRETRAIN_SHARE * f.budget + _freed_seconds(derive(_unconditional(f)))
    assert steps == PRETRAIN_MIN or steps * per_step <= share + per_step
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


# -- the pretrained denoiser kept away from the released central images ------------------------------------

NO_CENTRAL = {"spatial_iterations": 0, "polish_iterations": 0, "frequency_mix_central": False}
NAMES = ("normal", "finding", "effusion", "opacity", "nodule", "fracture")
UNRELATED = ("line", "arc", "loop", "curve")


def _central_warmup(cfg: JobConfig) -> dict[str, Any]:
    w = cfg.warmup
    return {
        "spatial_iterations": w.spatial_iterations,
        "polish_iterations": w.polish_iterations,
        "frequency_mix_central": w.frequency_mix_central,
    }


def _unconditional(f: DataFacts) -> DataFacts:
    """``f`` with no public class naming a private one: the same facts, the job without the rule."""
    assert f.public is not None
    renamed = tuple(f"public-{n}" for n in f.public.class_names)
    return replace(f, public=replace(f.public, class_names=renamed))


def _only_the_rule_differs(got: JobConfig, without: JobConfig) -> None:
    """``got`` is ``without`` but for the three warm-up keys of the rule and the pretraining steps."""
    undone = got.replace(
        warmup=_central_warmup(without), public={"pretrain_iterations": without.public.pretrain_iterations}
    )
    assert undone == without


def _freed_seconds(without: Any) -> float:
    """The estimated seconds of the central warm-up in the derivation ``without`` the rule: spatial warm-up,
    polish and the central half of a mixed frequency warm-up."""
    s, mixed = without.estimate.seconds, without.cfg.warmup.frequency_mix_central
    return s["spatial warm-up"] + s["polish"] + (s.get("frequency warm-up", 0.0) / 2 if mixed else 0.0)


def _pretraining_reaches_every_class(private: tuple[str, ...], public: tuple[str, ...]) -> bool:
    """Whether the pretraining's own labels (``stages.pretrain.mapped_labels``) reach every private class."""
    images = np.zeros((len(public), 1, 2, 2), np.float32)
    ds = ImageDataset(images, np.arange(len(public), dtype=np.int64), public)
    return set(mapped_labels(ds, private, ()).tolist()) >= set(range(len(private)))


@functools.cache
def _derived_without_the_rule(k: int) -> JobConfig:
    return derive_job(
        DataFacts(
            2000, 28, 28, 1, k, 10.0, public=PublicFacts(3000, (1, 28, 28), UNRELATED), class_names=NAMES[:k]
        )
    )


@settings(max_examples=20, deadline=None)
@given(
    private=st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True),
    public=st.lists(st.sampled_from(NAMES + UNRELATED), min_size=1, max_size=6, unique=True),
)
def test_the_central_warm_up_is_dropped_exactly_when_the_pretraining_labels_reach_every_private_class(
    private: list[str], public: list[str]
) -> None:
    f = DataFacts(
        2000,
        28,
        28,
        1,
        len(private),
        10.0,
        public=PublicFacts(3000, (1, 28, 28), tuple(public)),
        class_names=tuple(private),
    )
    reach = _pretraining_reaches_every_class(tuple(private), tuple(public))
    assert every_class_public(f) == reach
    got, without = derive(f), _derived_without_the_rule(len(private))
    if reach:
        assert _central_warmup(got.cfg) == NO_CENTRAL
        _only_the_rule_differs(got.cfg, without)
        assert any(n.startswith("warm-up on the central images: off (") for n in got.notes)
    else:
        assert got.cfg == without
        assert any(n.startswith("warm-up on the central images: kept (") for n in got.notes)


def test_without_the_private_class_names_or_a_public_set_the_central_warm_up_stays() -> None:
    named = _facts(PublicFacts(3000, (1, 28, 28), MEDICAL))
    assert every_class_public(named)
    assert not every_class_public(replace(named, class_names=()))  # names unknown: no claim of coverage
    assert not every_class_public(replace(named, public=None))
    plain = derive(_facts())
    assert plain.cfg.warmup.spatial_iterations > 0 and plain.cfg.warmup.frequency_mix_central
    assert not any(n.startswith("warm-up on the central images") for n in plain.notes)


def test_digits_with_an_unconditional_public_set_get_the_job_without_the_rule() -> None:
    digits = tuple(str(i) for i in range(10))
    f = DataFacts(
        4000, 28, 28, 1, 10, 10.0, public=PublicFacts(10_000, (1, 28, 28), UNRELATED), class_names=digits
    )
    d = derive(f)
    w = d.cfg.warmup
    assert w.spatial_iterations > 0 and w.polish_iterations > 0 and w.frequency_mix_central
    assert (
        d.cfg.public.pretrain_iterations == derive_job(replace(f, class_names=())).public.pretrain_iterations
    )
    assert "warm-up on the central images: kept (the pretraining is unconditional" in "\n".join(d.notes)


def test_public_classes_naming_some_private_classes_keep_the_central_warm_up() -> None:
    f = _facts(PublicFacts(3000, (1, 28, 28), MEDICAL[:3]))
    d = derive(f)
    assert d.cfg == derive_job(_unconditional(f))
    assert (
        "warm-up on the central images: kept (public classes name only 3 of 4 private classes"
        in "\n".join(d.notes)
    )


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(1000, 50_000),
    side=st.sampled_from([28, 32, 64]),
    k=st.integers(2, 6),
    eps=st.floats(1.0, 20.0),
    device=st.sampled_from(["cpu", "cuda"]),
    dpsgd=st.sampled_from(["auto", "on", "off"]),
    budget=st.one_of(st.none(), st.floats(120.0, 3600.0)),
    n_public=st.integers(200, 20_000),
)
def test_the_rule_changes_no_release_no_dpsgd_step_and_no_epsilon_and_gives_the_freed_time_to_pretraining(
    n: int,
    side: int,
    k: int,
    eps: float,
    device: Literal["cpu", "cuda"],
    dpsgd: Literal["auto", "on", "off"],
    budget: float | None,
    n_public: int,
) -> None:
    f = DataFacts(
        n,
        side,
        side,
        1,
        k,
        eps,
        device=device,
        time_budget=budget,
        dpsgd=dpsgd,
        public=PublicFacts(n_public, (1, side, side), NAMES[:k]),
        class_names=NAMES[:k],
    )
    try:
        without = derive(_unconditional(f))
    except ConfigError:  # below the floor: refused alike, the rule never reached
        with pytest.raises(ConfigError):
            derive(f)
        return
    got = derive(f)
    assert _central_warmup(got.cfg) == NO_CENTRAL
    _only_the_rule_differs(got.cfg, without.cfg)
    planned, planned_without = plan_of(f, got.cfg), plan_of(f, without.cfg)
    assert planned.history == planned_without.history and planned.epsilon == planned_without.epsilon
    # the freed warm-up time went to pretraining, within its caps, and the job takes no longer
    cap = min(PRETRAIN_MAX, max(PRETRAIN_MIN, math.ceil(PRETRAIN_EPOCHS * n_public / PRETRAIN_BATCH)))
    steps, before = got.cfg.public.pretrain_iterations, without.cfg.public.pretrain_iterations
    assert before <= steps <= cap
    assert got.estimate.training <= without.estimate.training + 0.5
    freed = _freed_seconds(without)
    per_step = seconds_per_pass(got.cfg, f) * PRETRAIN_BATCH
    if steps < cap:
        assert steps * per_step >= PRETRAIN_SHARE * f.budget + freed - per_step - 0.5


def _toy(cfg: JobConfig) -> JobConfig:
    """``cfg`` with its compute cut to a toy's (model width, aux fit, warm-up images, pretraining and sampler
    steps): no release, rate or noise changes."""
    return cfg.replace(
        model={"channels": 8},
        auxgen={
            "epochs": 1,
            "iterations_per_epoch": 2,
            "restarts": 1,
            "keep": 1,
            "width": 8,
            "z_dim": 8,
            "batch": 20,
        },
        warmup={"frequency_images": 40, "frequency_epochs": 1, "frequency_batch": 20},
        public={"pretrain_iterations": 4, "pretrain_batch": 16},
        sampler={"solver": "euler", "steps": 3},
    )


@pytest.mark.slow
@pytest.mark.usefixtures("torch_one_thread")
def test_the_job_keeping_the_pretrained_denoiser_trains_end_to_end_spending_the_plain_jobs_epsilon(
    medical_sets: tuple[Path, Path, Any], tmp_path: Path
) -> None:
    _, _, public = medical_sets
    f = _facts(public_facts(public))
    job = _toy(derive_job(f))
    without = _toy(derive_job(_unconditional(f)))
    assert _central_warmup(job) == NO_CENTRAL and _central_warmup(without) != NO_CENTRAL
    out = tmp_path / "r"
    res = train_run(
        job,
        generate_dataset("medical", 200, size=28, seed=1),
        out,
        public_size=200,
        public=PublicInputs(public, "medical-like population B"),
        n_synthetic=8,
    )
    said = [json.loads(line)["message"] for line in (out / "progress.jsonl").read_text().splitlines()]
    assert "public pretraining: 4 steps" in said
    assert any(m.startswith("frequency warm-up done") for m in said)
    assert not [m for m in said if "spatial" in m or "polish" in m]  # never trained on the central images
    assert (out / "COMPLETE").exists() and (out / "released" / "central.npz").exists()  # still released
    assert sorted(r["mechanism"] for r in site_requests(out)) == ["central", "frequency"]
    planned = plan(without, 200, image_shape=(1, 28, 28), n_classes=4)
    assert sorted(res.events, key=str) == sorted(planned.events, key=str)  # charged as the plain job plans
    assert res.epsilon == pytest.approx(planned.epsilon, rel=1e-12)
