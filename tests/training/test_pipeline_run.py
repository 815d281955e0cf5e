"""Single-site pipeline: a whole tiny run, resume after a kill, method switches, bad input."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from feta_release.accounting import epsilon, events_from_list
from feta_release.config import JobConfig, load_job, load_preset
from feta_release.errors import BudgetExceededError, ConfigError, DataError, PrivacyError
from feta_release.ledger import Budget, Ledger
from feta_release.models.model_file import read_model_file
from feta_release.planning import plan as plan_run
from feta_release.signing import generate_keypair, load_private_key
from feta_release.stages import RunAccount, run_budget
from feta_release.training.pipeline import (
    SimulatedKill,
    run_pipeline,
)
from tests.support.training import embedded_subset as _data

# Tests whose run DRAWS its public size (no public_size, no fixed noise seed): the draw has noise std 50
# (mechanisms.count.SIZE_SIGMA) and the tiny preset's central batch is 100, so at 240 images a 3-sigma-low
# draw (0.2 % of runs; seen once) refuses the job, correctly. At 400 that takes a 6-sigma draw.
DRAWN_N = 400


def _cfg(**over) -> JobConfig:
    base = load_preset("tiny")
    return base.replace(**over) if over else base


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "r"
    # a declared public size (the site policy's in test_a_trained_run_exports...); a drawn one:
    # test_public_size_draw
    res = run_pipeline(_cfg(), _data(), out, n_synthetic=30, grid_per_class=2, noise_seed=1, public_size=240)
    return out, res


def test_tiny_run_writes_a_complete_run_dir(tiny_run):
    out, res = tiny_run
    for name in [
        "COMPLETE",
        "run.json",
        "job.json",
        "privacy.json",
        "privacy-budget.png",
        "synthetic.npz",
        "model.pt",
        "released/central.npz",
        "released/frequency.npz",
        "checkpoints/dpsgd.pt",
    ]:
        assert (out / name).is_file(), name
    grids = sorted(p.name for p in (out / "grids").glob("*.png"))
    assert grids[:4] == [
        "01-central-images.png",
        "02-after-spatial.png",
        "03-after-frequency.png",
        "04-after-dpsgd.png",
    ]
    assert json.loads((out / "run.json").read_text())["status"] == "complete"
    z = np.load(out / "synthetic.npz")
    assert z["images"].shape == (30, 1, 28, 28) and z["images"].dtype == np.float32
    assert 0.0 <= z["images"].min() and z["images"].max() <= 1.0
    assert np.bincount(z["labels"], minlength=10).tolist() == [3] * 10  # balanced


def test_privacy_json_holds_the_full_history_and_total(tiny_run):
    out, res = tiny_run
    doc = json.loads((out / "privacy.json").read_text())
    events = events_from_list(doc["events"])
    assert [e.stage for e in events] == ["central", "frequency", "dpsgd"]
    assert events == events_from_list(doc["planned"])  # everything planned was charged, nothing more
    assert doc["complete"] is True
    total = epsilon(events, doc["delta"], "rdp")
    assert doc["epsilon"] == pytest.approx(total) and total <= doc["target_epsilon"]
    assert set(doc["per_stage_epsilon"]) == {"central", "frequency", "dpsgd", "total"}
    assert res.dpsgd_steps_trained == events[-1].steps == 4


def test_model_pt_rebuilds_the_ema_denoiser(tiny_run):
    import torch

    from feta_release.models.edm import denoiser_from_spec

    out, _ = tiny_run
    blob = torch.load(out / "model.pt", weights_only=False)
    model = denoiser_from_spec(blob["spec"])
    model.load_state_dict(blob["state_dict"])
    assert blob["class_names"] == [str(i) for i in range(10)]


def test_rerun_of_complete_run_does_nothing(tiny_run):
    out, _ = tiny_run
    before = (out / "privacy.json").read_bytes()
    res = run_pipeline(_cfg(), _data(), out, n_synthetic=30, public_size=240)
    assert res.already_complete and (out / "privacy.json").read_bytes() == before


@pytest.mark.slow
def test_a_killed_run_finishes_its_charged_dpsgd_round_from_the_checkpoint_charging_nothing_twice(tmp_path):
    """DP-SGD is one round of all its steps, charged once before its first step. A run killed inside it
    resumes from its last checkpoint with the same generator state: the steps after it are the same
    computation done again (the model is the uninterrupted run's), nothing is charged twice and no charged
    step is lost."""
    cfg = _cfg(dpsgd={"steps": 6}, warmup={"spatial_iterations": 1}, frequency={"sigma": None})
    data = _data()
    out = tmp_path / "r"
    with pytest.raises(SimulatedKill):
        run_pipeline(
            cfg,
            data,
            out,
            n_synthetic=10,
            grid_per_class=1,
            checkpoint_every=2,
            kill_after_steps=3,
            noise_seed=5,
        )
    assert not (out / "COMPLETE").exists()
    assert json.loads((out / "run.json").read_text())["status"] == "running"
    doc = json.loads((out / "privacy.json").read_text())
    assert doc["complete"] is False
    charged = {e.stage: e.steps for e in events_from_list(doc["events"])}
    # the whole round charged before its first step
    # size: the drawn public size, charged once, first
    assert charged == {"size": 1, "central": 1, "dpsgd": 6}
    central_bytes = (out / "released" / "central.npz").read_bytes()

    res = run_pipeline(cfg, data, out, n_synthetic=10, grid_per_class=1, checkpoint_every=2)
    assert res.resumed and (out / "COMPLETE").exists()
    doc = json.loads((out / "privacy.json").read_text())
    assert events_from_list(doc["events"]) == events_from_list(doc["planned"])  # == plan, no double count
    # size not re-drawn
    assert {e.stage: e.steps for e in res.events} == {"size": 1, "central": 1, "dpsgd": 6}
    assert res.dpsgd_steps_trained == 6  # steps 3-6 trained from the checkpoint at step 2: none lost
    assert (out / "released" / "central.npz").read_bytes() == central_bytes  # not re-queried
    whole = run_pipeline(
        cfg, data, tmp_path / "whole", n_synthetic=10, grid_per_class=1, checkpoint_every=2, noise_seed=5
    )
    resumed, uninterrupted = (read_model_file(d / "model.pt")["state_dict"] for d in (out, whole.run_dir))
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)


@pytest.mark.slow
def test_release_charged_but_not_saved_refuses_to_requery(tmp_path):
    cfg = _cfg(dpsgd={"steps": 2}, frequency={"sigma": None}, warmup={"spatial_iterations": 1})
    data = _data(DRAWN_N)
    out = tmp_path / "r"
    with pytest.raises(SimulatedKill):
        run_pipeline(cfg, data, out, n_synthetic=0, grid_per_class=1, kill_after_steps=1)
    (out / "released" / "central.npz").unlink()
    with pytest.raises(PrivacyError, match="already charged"):
        run_pipeline(cfg, data, out, n_synthetic=0, grid_per_class=1)


@pytest.mark.slow
def test_dpdm_method_runs_dpsgd_only(tmp_path):
    cfg = _cfg(job={"method": "dpdm"}, dpsgd={"steps": 2})
    res = run_pipeline(cfg, _data(DRAWN_N), tmp_path / "r", n_synthetic=10, grid_per_class=1)
    assert [e.stage for e in res.events] == ["size", "dpsgd"]  # the drawn public size, then DP-SGD only
    assert sorted(p.name for p in (tmp_path / "r" / "released").iterdir()) == ["size.json"]
    assert res.epsilon <= cfg.privacy.epsilon


def test_the_method_switch_is_part_of_the_config_every_driver_reads():
    """``[job] method`` is applied when the config is built: the planner, ``train``, the coordinator and the
    nodes (which read the signed job's config) all see the same stages. Before, only ``train`` applied it: a
    federated ``dpdm`` job still planned and released central images and frequency statistics."""
    from feta_release.planning import stage_events

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


def test_other_job_into_existing_run_dir_is_refused(tiny_run, tmp_path):
    out, _ = tiny_run
    with pytest.raises(ConfigError, match="different job config"):
        run_pipeline(_cfg(dpsgd={"steps": 5}), _data(), out, public_size=240)
    with pytest.raises(DataError, match="different data"):
        run_pipeline(_cfg(), _data(seed=1), out, public_size=240)
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match="not a feta-release run"):
        run_pipeline(_cfg(), _data(), junk)


def test_budget_exhausted_by_warmup_leaves_nothing(tmp_path):
    """With a declared public size the plan is checked before anything is written (a run that draws its size
    is refused only after the draw: tests/mechanisms/test_public_size_draw.py)."""
    cfg = _cfg(central={"sigma": 0.3, "rounds": 5})
    with pytest.raises(PrivacyError, match="warm-up"):
        run_pipeline(cfg, _data(), tmp_path / "r", public_size=240)
    assert not (tmp_path / "r").exists()


def test_fewer_examples_than_the_batch_is_refused(tmp_path):
    cfg = _cfg(dpsgd={"batch": 500})
    with pytest.raises(DataError, match="fewer than the DP-SGD batch"):
        run_pipeline(cfg, _data(), tmp_path / "r", public_size=240)
    assert not (tmp_path / "r").exists()


def test_class_without_images_is_refused(tmp_path):
    d = _data()
    keep = np.flatnonzero(d.labels != 3)
    data = d.subset(keep)
    assert data.n_classes == 10 and data.class_counts()[3] == 0
    with pytest.raises(DataError, match="'3'"):
        run_pipeline(_cfg(), data, tmp_path / "r")


def test_unknown_and_impossible_config_values(tmp_path):
    p = tmp_path / "job.toml"
    p.write_text("[dpsgd]\nsteps = 3\nclipp = 1.0\n")
    with pytest.raises(ConfigError, match="unknown key"):
        load_job(p)
    p.write_text("[dpsgd]\nsteps = 3\nclip = -1.0\n")
    with pytest.raises(ConfigError, match="clip"):
        load_job(p)
    with pytest.raises(ConfigError, match="checkpoint_every"):
        run_pipeline(_cfg(), _data(), tmp_path / "r", checkpoint_every=0)


def _account(tmp_path, cfg, budget=None) -> RunAccount:
    key = (
        load_private_key(generate_keypair(tmp_path / "keys", "site")[0])
        if not (tmp_path / "keys").exists()
        else load_private_key(tmp_path / "keys" / "site.key")
    )
    plan = plan_run(cfg, 240)
    return RunAccount(
        Ledger(tmp_path / "ledger.sqlite", key=key),
        "local-test",
        plan,
        budget or run_budget(cfg),
        tmp_path / "privacy.json",
    )


def test_ledger_refuses_beyond_plan_and_keeps_file(tmp_path):
    cfg = _cfg()
    acc = _account(tmp_path, cfg)
    steps = acc.plan.event("dpsgd").steps
    acc.charge("central", 1)
    acc.charge("dpsgd", steps)
    before = (tmp_path / "ledger.sqlite").read_bytes()
    with pytest.raises(BudgetExceededError, match="exceed"):
        acc.charge("dpsgd", 1)
    with pytest.raises(BudgetExceededError):
        acc.charge("central", 1)
    assert (tmp_path / "ledger.sqlite").read_bytes() == before
    # a reopened ledger sees the charges on disk
    again = _account(tmp_path, cfg)
    assert again.charged("dpsgd") == steps and again.charged("central") == 1


def test_ledger_checks_the_real_epsilon_before_each_chunk(tmp_path):
    # A budget lower than what the plan spends: the charge that would cross it is refused, naming the rule.
    cfg = _cfg()
    plan = plan_run(cfg, 240)
    tight = Budget(job_epsilon=plan.epsilon * 0.5, lifetime_epsilon=100.0, delta=1e-5)
    acc = _account(tmp_path, cfg, tight)
    acc.charge("central", 1)
    charged = 0
    with pytest.raises(BudgetExceededError, match=r"budget\.per_job\.epsilon"):
        for _ in range(plan.event("dpsgd").steps):
            acc.charge("dpsgd", 1)
            charged += 1
    assert acc.charged("dpsgd") == charged < plan.event("dpsgd").steps
    assert epsilon(acc.events, 1e-5) <= plan.epsilon * 0.5


def test_run_charges_the_site_ledger_and_privacy_json_is_only_a_copy(tiny_run):
    out, res = tiny_run
    run = json.loads((out / "run.json").read_text())
    key = load_private_key(out / "checkpoints" / "site.key")
    with Ledger(out / run["ledger"]["path"], verify_key=key.public_key()) as led:
        rows = led.requests(run["ledger"]["job_id"])
        assert led.is_closed(run["ledger"]["job_id"])  # complete: nothing more can be charged for it
    assert all(r["status"] == "done" for r in rows)
    assert [r["mechanism"] for r in rows][:2] == ["central", "frequency"]
    doc = json.loads((out / "privacy.json").read_text())
    assert events_from_list(doc["events"]) == res.events


def test_a_trained_run_exports_to_a_release_that_verifies(tiny_run, tmp_path):
    """The local driver's ledger is the real site ledger: a run trained with no key of its own exports (with
    the key `train` created) to a release `verify` passes, its statement's events the ledger's, history
    site-ledger."""
    from click.testing import CliRunner

    from feta_release.cli import cli
    from feta_release.policy import make_policy, sign_policy
    from feta_release.release.export_run import export_run

    out, res = tiny_run
    site = load_private_key(out / "checkpoints" / "site.key")
    coord = load_private_key(generate_keypair(tmp_path, "coordinator")[0])
    admin_key, admin_pub = generate_keypair(tmp_path, "admin")
    policy = sign_policy(
        make_policy(
            "site-a",
            "1" * 64,
            240,
            [coord.public_key()],
            per_job=(10.0, 1e-5),
            lifetime=(20.0, 1e-5),
            site_key=site.public_key(),
            mechanisms={"dpsgd": {"min_sigma": 0.1}},
        ),
        load_private_key(admin_key),
    )
    rel = export_run(out, tmp_path / "release", coordinator_key=coord, site_key=site, signed_policy=policy)
    (entry,) = json.loads((rel / "manifest.json").read_text())["manifest"]["sites"]
    assert events_from_list(entry["events"]) == res.events
    assert entry["attestation"]["statement"]["history"] == "site-ledger"
    r = CliRunner().invoke(cli, ["verify", str(rel), "--json", "--trusted", f"site-a={admin_pub}"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["ok"] is True


def _signed_site_policy(tmp_path, lifetime_eps: float, per_job_eps: float, mechanisms=None):
    """A site policy signed by an administrator key and verified as `train --policy --trusted` verifies it."""
    from feta_release.policy import load_site_policy, make_policy, sign_policy

    admin, admin_pub = generate_keypair(tmp_path / "admin", "admin")
    coord = load_private_key(generate_keypair(tmp_path / "coord", "coordinator")[0]).public_key()
    doc = make_policy(
        "hosp-a",
        "1" * 64,
        240,
        [coord],
        per_job=(per_job_eps, 1e-5),
        lifetime=(lifetime_eps, 1e-5),
        mechanisms=mechanisms,
    )
    path = tmp_path / "site.signed.json"
    path.write_text(json.dumps(sign_policy(doc, load_private_key(admin))))
    return load_site_policy(path, [admin_pub]), path, admin_pub


def test_local_run_on_a_site_ledger_is_held_to_the_signed_lifetime_cap(tmp_path):
    """Attack: `train --ledger SITE` charged with the job's own budget (no lifetime cap), so local runs
    could push a site's shared ledger past its signed lifetime budget. With the site policy: refused, naming
    the rule."""
    from feta_release.policy import PolicyBudgetExceeded

    cfg = _cfg()
    plan = plan_run(cfg, 240)
    central = plan.event("central")
    one, two = (epsilon([replace(central, steps=k)], 1e-5) for k in (1, 2))
    cap = (one + two) / 2  # one central release fits the job and the site; a second one at the site does not
    pol, _, _ = _signed_site_policy(tmp_path, lifetime_eps=cap, per_job_eps=cap)
    key = load_private_key(generate_keypair(tmp_path / "keys", "site")[0])
    led = Ledger(tmp_path / "site-ledger.sqlite", key=key)
    unbounded = RunAccount(led, "local-a", plan, run_budget(cfg), tmp_path / "a.json")
    unbounded.charge("central", 1)  # earlier spend at this site
    acc = RunAccount(led, "local-b", plan, run_budget(cfg), tmp_path / "b.json", site_policy=pol)
    assert acc.budget.lifetime_epsilon == pytest.approx(cap)
    with pytest.raises(PolicyBudgetExceeded) as exc:
        acc.charge("central", 1)
    assert exc.value.rule == "budget.lifetime.epsilon"
    assert led.job_events("local-b") == []


def test_site_ledger_outside_the_run_dir_needs_the_site_policy(tmp_path):
    with pytest.raises(ConfigError, match=r"--policy SITE.signed.json --trusted ADMIN.pub"):
        run_pipeline(_cfg(), _data(), tmp_path / "r", ledger=tmp_path / "site-ledger.sqlite")
    assert not (tmp_path / "site-ledger.sqlite").exists()


def test_local_run_on_a_site_ledger_is_held_to_the_policys_min_sigma(tmp_path):
    from feta_release.policy import PolicyViolation

    cfg = _cfg()
    plan = plan_run(cfg, 240)
    sigma = plan.event("central").sigma
    mech = {"central": {"allowed": True, "min_sigma": sigma * 2, "max_rounds": 50, "max_batch": 60000}}
    pol, _, _ = _signed_site_policy(tmp_path, lifetime_eps=100.0, per_job_eps=100.0, mechanisms=mech)
    key = load_private_key(generate_keypair(tmp_path / "keys", "site")[0])
    led = Ledger(tmp_path / "site-ledger.sqlite", key=key)
    acc = RunAccount(led, "local-b", plan, run_budget(cfg), tmp_path / "b.json", site_policy=pol)
    with pytest.raises(PolicyViolation) as exc:
        acc.charge("central", 1)
    assert exc.value.rule == "mechanisms.central.min_sigma" and led.job_events("local-b") == []


def test_patient_level_run_charges_patient_events_and_resumes(tmp_path):
    """With patient ids the DP-SGD events carry unit = patient in the ledger, privacy.json and run.json; a
    killed run resumes onto the same patient-level plan, and an image-level plan into the same directory is
    refused."""
    from feta_release.privacy_unit import PatientIndex

    cfg = _cfg(dpsgd={"steps": 4}, warmup={"spatial_iterations": 1}, frequency={"sigma": None})
    data = _data()
    pats = PatientIndex(np.repeat(np.arange(80), 3), n_public=80, cap=3)  # 80 patients x 3 images
    out = tmp_path / "r"
    with pytest.raises(SimulatedKill):
        run_pipeline(
            cfg,
            data,
            out,
            n_synthetic=0,
            grid_per_class=1,
            checkpoint_every=2,
            kill_after_steps=1,
            noise_seed=3,
            patients=pats,
            public_size=240,
        )
    with pytest.raises(PrivacyError, match="differs from this job's plan"):
        run_pipeline(
            cfg,
            data,
            out,
            n_synthetic=0,
            grid_per_class=1,
            checkpoint_every=2,  # image-level now
            public_size=240,
        )
    res = run_pipeline(
        cfg, data, out, n_synthetic=0, grid_per_class=1, checkpoint_every=2, patients=pats, public_size=240
    )
    sgd = [e for e in res.events if e.stage == "dpsgd"]
    assert [e.unit for e in sgd] == ["patient"] and sgd[0].steps == 4
    assert all(e.unit == "image" for e in res.events if e.stage != "dpsgd")
    doc = json.loads((out / "privacy.json").read_text())
    assert "PATIENT" in doc["unit"] and events_from_list(doc["events"]) == res.events
    ledger_rows = Ledger(
        out / "ledger.sqlite", verify_key=load_private_key(out / "checkpoints" / "site.key").public_key()
    ).job_events(json.loads((out / "run.json").read_text())["ledger"]["job_id"])
    assert {r.get("unit", "image") for r in ledger_rows if r["stage"] == "dpsgd"} == {"patient"}
    # the budget is per patient: the image-level central release counts 3x (group privacy over the cap), so
    # DP-SGD gets less of it than in the image-level plan, and the per-patient total meets [privacy] epsilon
    from feta_release.accounting import patient_epsilon

    image_level = plan_run(cfg, 240)
    assert patient_epsilon(res.events, cfg.privacy.delta, 3) <= cfg.privacy.epsilon + 1e-9
    assert sgd[0].sigma > image_level.noise_multiplier


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["central", "frequency"])
def test_a_release_file_swapped_while_the_run_was_stopped_is_refused_on_resume(tmp_path, stage):
    """Review (aux pool, medium, resume path): a resumed run read released/<stage>.npz back unchecked, so a
    local user could replace it (e.g. with an un-noised embedding or private images) and the model, the aux
    generator and the release were then fitted to it. Now the file must hash to the answer the ledger
    recorded."""
    cfg = _cfg(dpsgd={"steps": 2}, warmup={"spatial_iterations": 1})
    data, out = _data(DRAWN_N), tmp_path / "r"
    with pytest.raises(SimulatedKill):
        run_pipeline(cfg, data, out, n_synthetic=0, grid_per_class=1, kill_after_steps=1)
    path = out / "released" / f"{stage}.npz"
    with np.load(path) as z:
        arrays = dict(z)
    key = "images" if stage == "central" else "embedding"
    np.savez(path, **{**arrays, key: arrays[key] * 0 + 0.5})  # stands in for un-noised / private values
    with pytest.raises(PrivacyError, match=f"not the {stage} release this run's ledger recorded"):
        run_pipeline(cfg, data, out, n_synthetic=0, grid_per_class=1)


def _perturb_first_float(obj) -> bool:  # noqa: ANN001
    """Change the first floating tensor found in a checkpoint (in place): stands in for swapped weights."""
    import torch

    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for v in items:
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel():
            v.add_(1.0)
            return True
        if isinstance(v, (dict, list, tuple)) and _perturb_first_float(v):
            return True
    return False


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["untouched", "after-spatial.pt", "auxgen.pt", "after-frequency.pt", "dpsgd.pt"]
)
def test_a_checkpoint_swapped_while_the_run_was_stopped_is_refused_on_resume(tmp_path, name):
    """Review (aux pool, low): checkpoints/*.pt were loaded back on resume unchecked (and unpickled), so a
    local user could swap in a denoiser or aux generator trained on anything and it reached the signed
    release. Now each one's sha256 is recorded in the run's signed ledger when it is written, and a resume
    refuses other bytes."""
    from feta_release.training.checkpoint import load_torch, save_torch

    # start_source mix: the resumed run's synthesis loads auxgen.pt too (the frequency stage loads its own
    # checkpoint)
    cfg = _cfg(
        dpsgd={"steps": 2},
        warmup={"spatial_iterations": 1},
        sampler={"start_sigma": 0.5, "start_source": "mix"},
    )
    data, out = _data(DRAWN_N), tmp_path / "r"
    with pytest.raises(SimulatedKill):
        run_pipeline(cfg, data, out, n_synthetic=0, grid_per_class=1, checkpoint_every=1, kill_after_steps=1)
    names = ("after-spatial.pt", "auxgen.pt", "after-frequency.pt", "dpsgd.pt")
    assert all((out / "checkpoints" / n).is_file() for n in names)
    if name == "untouched":
        res = run_pipeline(cfg, data, out, n_synthetic=0, grid_per_class=1, checkpoint_every=1)
        assert res.resumed and (out / "COMPLETE").exists()
        return
    path = out / "checkpoints" / name
    obj = load_torch(path)
    assert _perturb_first_float(obj)
    save_torch(path, obj)
    with pytest.raises(PrivacyError, match=f"checkpoints/{name}: not the checkpoint this run wrote") as exc:
        run_pipeline(cfg, data, out, n_synthetic=0, grid_per_class=1, checkpoint_every=1)
    assert "\n" not in str(exc.value) and f"delete {path}" in str(exc.value)
    assert not (out / "COMPLETE").exists()


@pytest.mark.slow
def test_a_noise_secret_swapped_while_the_run_was_stopped_is_refused_on_resume(tmp_path):
    """A local user who replaces checkpoints/noise_seed.txt while a run is stopped chooses the noise of every
    later release (and so can subtract it): the secret is bound in the run's signed ledger like a checkpoint,
    and a resume refuses another one, saying how to go on with a fresh secret."""
    cfg = _cfg(dpsgd={"steps": 2}, warmup={"spatial_iterations": 1})
    data, out = _data(DRAWN_N), tmp_path / "r"
    with pytest.raises(SimulatedKill):
        run_pipeline(cfg, data, out, n_synthetic=0, grid_per_class=1, checkpoint_every=1, kill_after_steps=1)
    seed_file = out / "checkpoints" / "noise_seed.txt"
    seed_file.write_text("12345\n")  # a secret the attacker knows
    with pytest.raises(PrivacyError, match="noise_seed.txt: not the checkpoint this run wrote") as exc:
        run_pipeline(cfg, data, out, n_synthetic=0, grid_per_class=1, checkpoint_every=1)
    assert "\n" not in str(exc.value) and "fresh secret" in str(exc.value)
    assert not (out / "COMPLETE").exists()
    seed_file.unlink()  # the fix the message gives
    res = run_pipeline(cfg, data, out, n_synthetic=0, grid_per_class=1, checkpoint_every=1)
    assert res.resumed and (out / "COMPLETE").exists()
