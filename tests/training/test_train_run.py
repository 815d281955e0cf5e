"""``train`` as a federation of one: the job directory it writes, its site's ledger, resume after a kill and a
re-run, and the refusals of a run directory, a data set or a policy it cannot run on."""

from __future__ import annotations

import json
import os
import stat
from typing import Any

import numpy as np
import pytest
import torch

from feta_release.accounting import events_from_list
from feta_release.config import JobConfig, load_preset
from feta_release.errors import ConfigError, DataError, FetaError, PolicyError
from feta_release.mechanisms.count import size_event
from feta_release.models.model_file import read_model_file
from feta_release.planning import plan as plan_run
from feta_release.planning import stage_events
from tests.support.killed_steps import Killed, count_steps
from tests.support.training import embedded_subset as _data
from tests.support.training import site_requests, train_run

# a drawn public size has noise std 50 and the tiny preset's central batch is 100: at 400 images a refusal
# of the job at the drawn size takes a 6-sigma draw
DRAWN_N = 400


def _cfg(**over: Any) -> JobConfig:
    base = load_preset("tiny")
    return base.replace(**over) if over else base


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "r"
    res = train_run(_cfg(), _data(), out, n_synthetic=30, grid_per_class=2, public_size=240)
    return out, res


def test_train_writes_the_job_directory_and_keeps_the_site_private(tiny_run):
    out, res = tiny_run
    for name in [
        "COMPLETE",
        "signed_job.json",
        "plan.json",
        "progress.jsonl",
        "model.pt",
        "job_summary.json",
        "attestations.json",
        "privacy_report.json",
        "privacy_report.txt",
        "budget.svg",
        "samples.png",
        "synthetic.npz",
        "policy.signed.json",
        "policies/site.signed.json",
        "release/manifest.json",
        "released/central.npz",
        "site/ledger.sqlite",
        "grids/01-central-images.png",
    ]:
        assert (out / name).is_file(), name
    for gone in ["run.json", "privacy.json", "privacy-budget.png", "job.json", "checkpoints"]:
        assert not (out / gone).exists(), gone
    assert sorted(p.name for p in (out / "grids").iterdir())[-1].endswith("after-dpsgd.png")
    assert stat.S_IMODE(os.stat(out / "site").st_mode) == 0o700  # the site's side: its account only
    with np.load(out / "synthetic.npz") as z:
        assert z["images"].shape == (30, 1, 28, 28) and np.bincount(z["labels"]).tolist() == [3] * 10
    assert res.dpsgd_steps_trained == 4 and not res.resumed


def test_the_sites_ledger_holds_the_planners_events_request_by_request(tiny_run):
    out, res = tiny_run
    cfg = _cfg().for_size(240)
    steps = plan_run(cfg, 240).event("dpsgd").steps  # type: ignore[union-attr]
    charged = [e for r in site_requests(out) for e in events_from_list(r["events"])]
    assert charged == stage_events(cfg, 240, rounds=[steps])
    assert res.events == plan_run(cfg, 240).events
    assert res.epsilon == pytest.approx(plan_run(cfg, 240).epsilon, rel=1e-12)
    assert all(r["status"] == "done" for r in site_requests(out))


def test_the_released_model_is_the_job_directorys_model_file(tiny_run):
    out, _ = tiny_run
    ck = read_model_file(out / "model.pt")
    assert ck["class_names"] == [str(i) for i in range(10)]
    assert all(torch.isfinite(v).all() for v in ck["state_dict"].values())


def test_rerun_of_a_complete_run_does_nothing(tiny_run):
    out, _ = tiny_run
    before = [(p, p.stat().st_mtime_ns) for p in sorted(out.rglob("*")) if p.is_file()]
    res = train_run(_cfg(), _data(), out, n_synthetic=30, public_size=240)
    assert res.already_complete
    assert [(p, p.stat().st_mtime_ns) for p in sorted(out.rglob("*")) if p.is_file()] == before


@pytest.mark.slow
def test_a_killed_train_finishes_its_charged_round_from_the_sites_checkpoint_charging_nothing_twice(
    tmp_path, monkeypatch
):
    """DP-SGD is one round of all its steps, charged once before its first step. A run killed inside it is
    finished by the same command from the site's last round checkpoint: nothing charged twice, no charged
    step lost, the drawn size and the warm-up releases not asked again."""
    cfg = _cfg(dpsgd={"steps": 6}, warmup={"spatial_iterations": 1}, frequency={"sigma": None})
    data, out = _data(DRAWN_N), tmp_path / "r"
    count_steps(monkeypatch, die_at=3)
    with pytest.raises(Killed):
        train_run(cfg, data, out, checkpoint_every=2)
    assert not (out / "COMPLETE").exists()
    first = site_requests(out)
    assert [(r["mechanism"], r["status"]) for r in first] == [
        ("size", "done"),
        ("central", "done"),
        ("dpsgd", "charged"),
    ]
    central = (out / "released" / "central.npz").read_bytes()
    taken = count_steps(monkeypatch)
    res = train_run(cfg, data, out, checkpoint_every=2)
    assert res.resumed and (out / "COMPLETE").is_file()
    assert taken == [3, 4, 5, 6]  # from the checkpoint at step 2: steps 3-6 once more, none lost
    again = site_requests(out)
    assert [r["request_id"] for r in again] == [r["request_id"] for r in first]  # nothing charged twice
    assert all(r["status"] == "done" for r in again)
    assert {e.stage: e.steps for e in res.events} == {"size": 1, "central": 1, "dpsgd": 6}
    assert (out / "released" / "central.npz").read_bytes() == central  # not asked again


@pytest.mark.slow
def test_a_drawn_public_size_is_charged_first_under_the_job_and_counted_in_its_plan(tmp_path):
    cfg = _cfg(warmup={"spatial_iterations": 1}, frequency={"sigma": None})
    res = train_run(cfg, _data(DRAWN_N), tmp_path / "r")
    reqs = site_requests(tmp_path / "r")
    assert reqs[0]["mechanism"] == "size"
    n = json.loads((tmp_path / "r" / "policy.signed.json").read_text())["policy"]["dataset"]["size"]
    sized = cfg.for_size(n)
    steps = plan_run(sized, n).event("dpsgd").steps  # type: ignore[union-attr]
    charged = [e for r in reqs for e in events_from_list(r["events"])]
    assert charged == stage_events(sized, n, rounds=[steps], size=size_event())
    assert res.epsilon <= cfg.privacy.epsilon + 1e-9
    # every ε the run shows is the total: the plan's counts the drawn size as the attestation does
    planned = json.loads((tmp_path / "r" / "plan.json").read_text())["site"]
    assert planned["events"][0]["stage"] == "size"
    assert planned["planned_epsilon"] == pytest.approx(res.epsilon, rel=1e-12)


def test_another_job_data_or_folder_is_refused(tiny_run, tmp_path):
    out, _ = tiny_run
    (out / "COMPLETE").rename(out / "COMPLETE.kept")  # as an unfinished run
    try:
        with pytest.raises(ConfigError, match="different job"):
            train_run(_cfg(dpsgd={"steps": 5}), _data(), out, public_size=240)
        with pytest.raises(PolicyError, match="commitment"):
            train_run(_cfg(), _data(seed=1), out, public_size=240)
    finally:
        (out / "COMPLETE.kept").rename(out / "COMPLETE")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "x.txt").write_text("x")
    with pytest.raises(ConfigError, match="not a feta-release run"):
        train_run(_cfg(), _data(), junk)


def test_a_site_ledger_outside_the_run_dir_needs_the_sites_policy(tmp_path):
    with pytest.raises(ConfigError, match="--policy"):
        train_run(_cfg(), _data(), tmp_path / "r", ledger=tmp_path / "site-ledger.sqlite")


def test_a_policy_without_its_data_secret_is_refused_before_any_charge(tmp_path):
    from feta_release.policy import make_policy, sign_policy, write_signed_policy
    from feta_release.signing import generate_keypair, load_private_key

    admin, admin_pub = generate_keypair(tmp_path / "k", "admin")
    coord, _ = generate_keypair(tmp_path / "k", "coordinator")
    doc = make_policy("hosp", "1" * 64, 240, [load_private_key(coord).public_key()])
    pol = write_signed_policy(tmp_path / "p.json", sign_policy(doc, load_private_key(admin)))
    with pytest.raises(ConfigError, match="--data-secret"):
        train_run(_cfg(), _data(), tmp_path / "r", policy=pol, trusted=admin_pub)
    assert not (tmp_path / "r" / "site" / "ledger.sqlite").exists()


def test_a_policy_without_a_declared_schema_is_refused_in_one_line_before_any_charge(tmp_path):
    """A site's policy that declares no classes and image shape: ``train`` refuses it as ``node start`` does
    (``edge.site.declared_schema``), naming the policy file and the fix, before its site is opened or its
    ledger charged; never a node that "did not join"."""
    from feta_release.data.commitment import dataset_commitment, ensure_secret
    from feta_release.policy import make_policy, sign_policy, write_signed_policy
    from feta_release.signing import generate_keypair, load_private_key

    data = _data()
    admin, admin_pub = generate_keypair(tmp_path / "k", "admin")
    coord, _ = generate_keypair(tmp_path / "k", "coordinator")
    secret, _ = ensure_secret(tmp_path / "k" / "data.secret")
    doc = make_policy("hosp", dataset_commitment(data, secret), 240, [load_private_key(coord).public_key()])
    pol = write_signed_policy(tmp_path / "p.json", sign_policy(doc, load_private_key(admin)))
    with pytest.raises(PolicyError, match=r"p\.json: the policy declares no public data schema.*re-sign"):
        train_run(
            _cfg(),
            data,
            tmp_path / "r",
            policy=pol,
            trusted=admin_pub,
            data_secret=tmp_path / "k" / "data.secret",
            coordinator_key=coord,
        )
    assert not (tmp_path / "r" / "site" / "ledger.sqlite").exists()


def test_budget_exhausted_by_the_warm_up_is_refused_before_any_release(tmp_path):
    cfg = _cfg(privacy={"epsilon": 0.05})
    with pytest.raises(FetaError):
        train_run(cfg, _data(), tmp_path / "r", public_size=240)
    assert not (tmp_path / "r" / "site" / "ledger.sqlite").exists() or site_requests(tmp_path / "r") == []


def test_fewer_images_than_the_batch_and_an_empty_class_are_refused(tmp_path):
    with pytest.raises(DataError, match="batch"):
        train_run(_cfg(dpsgd={"batch": 500}), _data(), tmp_path / "a", public_size=240)
    data = _data()
    keep = data.labels != 3
    with pytest.raises(DataError, match="no images"):
        train_run(_cfg(), data.subset(np.flatnonzero(keep)), tmp_path / "b", public_size=216)


def test_the_method_switch_is_part_of_the_config_every_driver_reads():
    """``[job] method`` is applied when the config is built: the planner, ``train``, the coordinator and the
    nodes (which read the signed job's config) all see the same stages."""
    cfg = _cfg()
    assert cfg.replace(job={"method": "dp-feta"}).frequency.sigma is None
    assert cfg.replace(job={"method": "dp-feta"}).central.rounds == 1
    assert cfg.replace(job={"method": "feta-pro-freq"}).central.rounds == 0
    assert cfg.replace(job={"method": "feta-pro-freq"}).frequency.sigma == 10.0
    dpdm = cfg.replace(job={"method": "dpdm"})
    assert (dpdm.central.rounds, dpdm.frequency.sigma) == (0, None)
    assert JobConfig.from_dict(dpdm.to_dict()) == dpdm  # a signed job's config carries the switch
    for federated in (False, True):
        assert {e.stage for e in stage_events(dpdm, 200, federated=federated)} == {"dpsgd"}
    assert cfg.replace(job={"method": "feta-pro"}) == cfg


@pytest.mark.slow
def test_a_patient_level_train_charges_patient_events_under_its_own_patient_policy(tmp_path):
    """With patient ids DP-SGD samples whole patients: the run's own policy is patient-level (the public
    patient count and cap), its DP-SGD event carries unit = patient in the site's ledger, and the per-patient
    total meets [privacy] epsilon (the image-level central release counted over the cap)."""
    from feta_release.accounting import patient_epsilon
    from feta_release.privacy_unit import PatientIndex

    cfg = _cfg(dpsgd={"steps": 4}, warmup={"spatial_iterations": 1}, frequency={"sigma": None})
    pats = PatientIndex(np.repeat(np.arange(80), 3), n_public=80, cap=3)  # 80 patients x 3 images
    out = tmp_path / "r"
    res = train_run(cfg, _data(), out, public_size=240, patients=pats, release=False)
    policy = json.loads((out / "policy.signed.json").read_text())["policy"]["dataset"]
    assert (policy["privacy_unit"], policy["patients"], policy["patient_cap"]) == ("patient", 80, 3)
    sgd = [e for r in site_requests(out) for e in events_from_list(r["events"]) if e.stage == "dpsgd"]
    assert [e.unit for e in sgd] == ["patient"] and sgd[0].steps == 4
    assert patient_epsilon(res.events, cfg.privacy.delta, 3) <= cfg.privacy.epsilon + 1e-9
    assert sgd[0].sigma > plan_run(cfg, 240).noise_multiplier
