"""A run without a declared public size draws it from a charged Gaussian count (review finding: `train` used
to round the EXACT count to 2 significant digits, a deterministic function of N: 3949 vs 3950 images gave 3900
vs 4000, epsilon infinite for that bit)."""

from __future__ import annotations

import json
import math
import sqlite3

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.accounting import epsilon, events_from_list
from feta_release.config import load_preset
from feta_release.data import ImageDataset, load_embedded
from feta_release.errors import DataError, PolicyError, PrivacyError
from feta_release.ledger import Budget, Ledger, LedgerTamperedError
from feta_release.mechanisms.count import (
    SIZE_SIGMA,
    draw_public_size,
    noisy_count,
    patients_event,
    size_event,
)
from feta_release.planning import plan as plan_run
from feta_release.signing import load_private_key
from tests.support.training import train_run


def _data(n: int = 240, seed: int = 0) -> ImageDataset:
    full = load_embedded()
    rng = np.random.default_rng(seed)
    idx = np.concatenate(
        [rng.choice(np.flatnonzero(full.labels == c), n // 10, replace=False) for c in range(10)]
    )
    return full.subset(np.sort(idx))


class Killed(BaseException):
    """The process dies (not an exception a handler catches)."""


def _ledger(out):
    """The run's site ledger, its head checked with the site's key."""
    key = load_private_key(out / "site" / "keys" / "site.key")
    return Ledger(out / "site" / "ledger.sqlite", verify_key=key.public_key())


def _ledger_rows(out):
    """(requests, events) of the run's one job in its site ledger."""
    with _ledger(out) as led:
        rows = led.requests()
        (job_id,) = {r["job_id"] for r in rows}
        return rows, led.job_events(job_id)


def _recorded_count(out, stage: str = "size") -> int:
    """The noisy count the site's ledger recorded as the answer of the run's ``stage`` request."""
    events = {"size": [size_event()], "patients": [patients_event()]}[stage]
    with _ledger(out) as led:
        (row,) = [r for r in led.requests() if r["mechanism"] == stage]
        budget = Budget(job_epsilon=math.inf, lifetime_epsilon=math.inf, delta=1e-5)
        prior = led.check(row["job_id"], row["request_id"], stage, events, budget)
    assert prior is not None and prior.response is not None
    return int(json.loads(prior.response)["count"])


def test_neighbouring_counts_at_a_rounding_boundary_give_the_same_sizes_with_close_odds():
    """3949 and 3950 images: each gives 3900 and 4000 (and neighbours) with close frequencies, not one
    each."""
    draws = {
        n: [draw_public_size(n, np.random.default_rng([n, i])) for i in range(2000)] for n in (3949, 3950)
    }
    for n, vals in draws.items():
        assert {3900, 4000} <= set(vals), n
    for v in (3900, 4000):
        a, b = draws[3949].count(v) / 2000, draws[3950].count(v) / 2000
        assert abs(a - b) < 0.06, (v, a, b)  # one image moves a probability by ~0.008 at sigma 50


@settings(max_examples=15, deadline=None)
@given(n=st.integers(0, 10**6), seed=st.integers(0, 2**32 - 1))
def test_the_count_mechanism_has_the_stated_noise_scale(n, seed):
    rng = np.random.default_rng(seed)
    vals = np.array([noisy_count(n, rng) for _ in range(4000)])
    assert abs(vals.mean() - n) < 6 * SIZE_SIGMA / np.sqrt(4000)
    assert abs(vals.std() - SIZE_SIGMA) < 6 * SIZE_SIGMA / np.sqrt(2 * 4000)


def test_the_count_mechanism_refuses_an_integer_seed():
    with pytest.raises(PrivacyError, match="numpy Generator"):
        noisy_count(100, 7)  # type: ignore[arg-type]


def test_the_plan_holds_the_size_event_first_and_its_epsilon():
    cfg = load_preset("cpu-eps1")
    declared, drawn = plan_run(cfg, 4000), plan_run(cfg, 4000, size=size_event())
    assert [e.stage for e in drawn.events] == ["size", "central", "frequency", "dpsgd"]
    assert drawn.epsilon <= cfg.privacy.epsilon + 1e-9  # DP-SGD is calibrated with the size event composed in
    assert drawn.noise_multiplier > declared.noise_multiplier
    same_sigma = epsilon([size_event(), *declared.events], declared.delta, declared.accountant)
    assert 0 < same_sigma - declared.epsilon < 0.01  # sigma 50 adds ~0.003 to cpu-eps1 at its DP-SGD sigma


def test_privacy_plan_cli_shows_the_size_event_unless_declared():
    from click.testing import CliRunner

    from feta_release.cli import cli

    job = "feta_release/presets/cpu-eps10-nodpsgd.toml"
    drawn = json.loads(CliRunner().invoke(cli, ["privacy", "plan", job, "-n", "4000", "--json"]).stdout)
    declared = json.loads(
        CliRunner().invoke(cli, ["privacy", "plan", job, "-n", "4000", "--json", "--declared-size"]).stdout
    )
    assert [s["stage"] for s in drawn["stages"]][0] == "size"
    assert "size" not in [s["stage"] for s in declared["stages"]]
    assert drawn["epsilon"] > declared["epsilon"]


# a [central] batch above any size these counts can draw: the run is refused right after the draw (a DP-SGD
# batch below the smallest size a draw gives, so that this is the refusal whatever the draw)
REFUSED_AFTER_DRAW = {"central": {"batch": 5000}, "dpsgd": {"batch": 8, "physical_batch": 8}}


def _refused_size(out, n: int = 240) -> int:
    """The public size a run drew before it was refused, as its refusal names it."""
    cfg = load_preset("tiny").replace(**REFUSED_AFTER_DRAW)
    with pytest.raises(DataError, match="fewer than \\[central\\] batch") as refused:
        train_run(cfg, _data(n), out, n_synthetic=0)
    drawn = _recorded_count(out)
    assert f"public size {drawn}," in str(refused.value)
    return drawn


def test_the_size_is_drawn_from_fresh_os_noise_charged_first_and_never_redrawn(tmp_path):
    sizes = {_refused_size(tmp_path / f"r{s}") for s in range(6)}
    assert len(sizes) > 1  # not a function of the count alone
    out = tmp_path / "r0"
    rows, events = _ledger_rows(out)
    assert [r["mechanism"] for r in rows] == ["size"] and [e["stage"] for e in events] == ["size"]
    first = _recorded_count(out)
    assert _refused_size(out) == first  # a re-run reads the recorded answer back: no second charge or draw
    assert len(_ledger_rows(out)[1]) == 1
    # the answer is the ledger's: an edited one is not replayed
    with sqlite3.connect(out / "site" / "ledger.sqlite") as db:
        db.execute(
            "UPDATE requests SET response=? WHERE mechanism='size'",
            (json.dumps({"count": 10**6, "sigma": SIZE_SIGMA}).encode(),),
        )
    with pytest.raises(LedgerTamperedError):
        train_run(load_preset("tiny"), _data(), out, n_synthetic=0)


def test_a_size_charged_and_never_recorded_is_not_drawn_again(tmp_path, monkeypatch):
    """A run killed between the size's charge and its recorded answer: a second draw would spend the size's
    budget twice, so the same run is refused and nothing is charged again."""
    import coordinator.local_run as local_run

    def killed(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        raise Killed

    out = tmp_path / "r"
    monkeypatch.setattr(local_run, "draw_public_size", killed)
    with pytest.raises(Killed):
        train_run(load_preset("tiny"), _data(), out, n_synthetic=0)
    monkeypatch.undo()
    with pytest.raises(PolicyError, match="never recorded"):
        train_run(load_preset("tiny"), _data(), out, n_synthetic=0)
    rows, events = _ledger_rows(out)
    assert [(r["mechanism"], r["status"]) for r in rows] == [("size", "charged")] and len(events) == 1


# the tiny preset's central batch is 100 and a draw has noise std 50: at 400 images a refusal at the drawn
# size takes a 6-sigma draw
DRAWN_N = 400


@pytest.fixture(scope="module")
def drawn_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("drawn") / "r"
    res = train_run(load_preset("tiny"), _data(DRAWN_N), out, n_synthetic=10)
    return out, res


def test_a_run_without_a_declared_size_charges_it_before_any_other_release(drawn_run):
    out, res = drawn_run
    rows, events = _ledger_rows(out)
    assert rows[0]["mechanism"] == "size" and [e["stage"] for e in events][0] == "size"
    plan = json.loads((out / "plan.json").read_text())["site"]
    policy = json.loads((out / "policy.signed.json").read_text())["policy"]
    assert plan["size"] == policy["dataset"]["size"] == _recorded_count(out)  # the run's one public size
    report = json.loads((out / "privacy_report.json").read_text())["sites"]["site"]
    evs = events_from_list(report["events"])
    # the planner's job at the drawn size, the size counted first: what the site charged and attested, DP-SGD
    # calibrated with it composed in
    planned = plan_run(load_preset("tiny").for_size(plan["size"]), plan["size"], size=size_event())
    assert evs[0] == size_event() and evs == planned.events == res.events
    assert report["epsilon_total"] == pytest.approx(planned.epsilon, rel=1e-12)
    assert plan["dpsgd_sigma"] == planned.noise_multiplier
    without = epsilon(evs[1:], report["delta"], "rdp")
    assert report["epsilon_total"] == pytest.approx(res.epsilon) and res.epsilon > without  # it counts
    assert "size" in report["epsilon_by_stage_alone"]


def test_a_drawn_size_run_resumes_without_recharging_and_its_release_attests_it(drawn_run):
    out, res = drawn_run
    again = train_run(load_preset("tiny"), _data(DRAWN_N), out, n_synthetic=10)
    assert again.already_complete and [e["stage"] for e in _ledger_rows(out)[1]].count("size") == 1
    man = json.loads((out / "release" / "manifest.json").read_text())
    (site,) = man["manifest"]["sites"]
    assert events_from_list(site["events"])[0] == size_event()
    assert site["attestation"]["statement"]["epsilon"] == pytest.approx(res.epsilon)
    st = site["attestation"]["statement"]  # verify recomputes the job's epsilon from the attested events
    assert epsilon(events_from_list(site["events"]), float(st["delta"]), st["accountant"]) == pytest.approx(
        st["epsilon"]
    )


def test_a_patient_level_run_without_declared_counts_draws_both_first(tmp_path):
    """`train --patient-cap K` without --public-patients used to round the EXACT patient count too."""
    from feta_release.privacy_unit import PatientIndex

    # a DP-SGD batch below the smallest count a draw gives: the run never depends on where the draw falls
    cfg = load_preset("tiny").replace(
        dpsgd={"steps": 2, "batch": 8, "physical_batch": 8},
        warmup={"spatial_iterations": 1},
        frequency={"sigma": None},
    )
    # 80 patients x 5 images; 1: a placeholder
    pats = PatientIndex(np.repeat(np.arange(80), 5), n_public=1, cap=3)
    out = tmp_path / "r"
    res = train_run(cfg, _data(DRAWN_N), out, n_synthetic=0, patients=pats, draw_patients=True)
    assert [e.stage for e in res.events] == ["size", "patients", "central", "dpsgd"]
    assert res.events[:2] == [size_event(), patients_event()] and res.events[1].unit == "patient"
    rows, _ = _ledger_rows(out)
    assert [r["mechanism"] for r in rows][:2] == ["size", "patients"]
    n_patients = _recorded_count(out, "patients")
    assert n_patients >= 10
    policy = json.loads((out / "policy.signed.json").read_text())["policy"]
    assert policy["dataset"]["size"] == _recorded_count(out)
    assert res.epsilon > epsilon(res.events[2:], res.delta, "rdp")


def test_a_cap_one_run_counts_its_patients_once_as_its_images(tmp_path):
    """`train --patient-cap 1` without --public-patients: the cap leaves one image per patient, so the noisy
    count of the images is the public patient count too. A second noisy count of the same number was charged
    (event 'patients'), and DP-SGD sampled patients at q = batch / that second draw while the job was sized,
    planned and stated at batch / the drawn size. One count is charged; DP-SGD's q is the batch over it."""
    from feta_release.privacy_unit import PatientIndex

    cfg = load_preset("tiny").replace(
        dpsgd={"steps": 2, "rate": 0.05, "physical_batch": 8},
        warmup={"spatial_iterations": 1},
        frequency={"sigma": None},
    )
    pats = PatientIndex(np.arange(DRAWN_N), n_public=1, cap=1)  # one image each; 1: a placeholder
    out = tmp_path / "r"
    res = train_run(cfg, _data(DRAWN_N), out, n_synthetic=0, patients=pats, draw_patients=True)
    assert [e.stage for e in res.events] == ["size", "central", "dpsgd"]
    drawn = _recorded_count(out)
    sgd = res.events[-1]
    assert sgd.unit == "patient" and sgd.q == pytest.approx(cfg.for_size(drawn).dpsgd.batch / drawn)
    policy = json.loads((out / "policy.signed.json").read_text())["policy"]
    assert policy["dataset"]["size"] == policy["dataset"]["patients"] == drawn


@pytest.mark.parametrize("n", [80, 90])
def test_a_run_without_a_declared_size_refuses_only_at_the_drawn_size(tmp_path, n):
    """Whether `train` refuses, and what it says, must not be a function of the exact count: the batch check
    and the plan wait for the noisy draw (charged first) and name the drawn size. The check used to plan at
    the rounded EXACT count before the draw: 80 images refused with "public size 80", uncharged, 90 with
    "90"."""
    out = tmp_path / "r"
    _refused_size(out, n)
    rows, events = _ledger_rows(out)
    assert [r["mechanism"] for r in rows] == ["size"] and [e["stage"] for e in events] == ["size"]
