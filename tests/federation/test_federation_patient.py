"""Patient-level DP-SGD in the federation: a site whose signed policy makes the PATIENT the unit of
privacy samples whole patients at q = batch / (its PUBLIC patient count), clips each patient's summed gradient
and charges events of unit "patient"; the coordinator learns the unit and the public count only from that
signed policy, and a node refuses a coordinator that plans it as image-level. A federation may mix units: each
site states its own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.setup import prepare_federation, sign_job_file
from feta_release.accounting import events_from_list
from feta_release.errors import ConfigError, PolicyError
from feta_release.federation import messages as fm
from feta_release.policy.document import make_policy, validate_policy
from feta_release.policy.errors import PolicySchemaError
from feta_release.signing import load_private_key
from tests.support.dpsgd import DotLoss, Weights
from tests.support.federation import harness, tiny_job, tiny_sites
from tests.support.federation import ledger_requests as _requests
from tests.support.federation import run_harness_job as _run
from tests.support.patients import CAP, PATIENT_SITE, write_patient_csv
from tests.support.patients import patient_federation as _federation
from tests.support.patients import patient_sizes as _patient_sizes


def test_a_patient_level_site_in_a_federation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import edge.releases as releases

    fed, p = _federation(tmp_path, public_patients=None)
    cfg = tiny_job()
    built: list[dict[str, Any]] = []
    real = releases.DPSGDTrainer

    def spy(*args: Any, **kw: Any) -> Any:
        built.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(releases, "DPSGDTrainer", spy)
    signed, _ = sign_job_file(fed, cfg, "job-pat")
    grid = harness(fed)
    seen: list[tuple[Any, Any]] = []
    deliver = grid._deliver
    grid._deliver = lambda m: seen.append((m, deliver(m))) or seen[-1][1]  # type: ignore[method-assign]
    res = _run(fed, grid, signed, tmp_path / "out")
    assert res.rounds_done == 2 and res.skipped == {}
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    q_pat, batch = cfg.dpsgd.batch / p, cfg.dpsgd.batch
    for s in fed.sites:
        events = events_from_list([e for r in _requests(fed, s.site_id, "job-pat") for e in r["events"]])
        sgd = [e for e in events if e.stage == "dpsgd"]
        planned = [e for e in plan[s.site_id]["events"] if e["stage"] == "dpsgd"]
        if s.site_id == PATIENT_SITE:
            # the ledger's rows, the plan and the q that leaves the site: patient-level, over the PUBLIC
            # patients
            assert {e.unit for e in sgd} == {"patient"} and plan[s.site_id]["privacy_unit"] == "patient"
            assert all(e.q == pytest.approx(q_pat) for e in sgd) and planned[0]["q"] == pytest.approx(q_pat)
            assert planned[0]["unit"] == "patient"
        else:
            assert {e.unit for e in sgd} == {"image"} and plan[s.site_id]["privacy_unit"] == "image"
            assert all(e.q == pytest.approx(batch / s.size) for e in sgd) and "unit" not in planned[0]
        st_ = res.attestations[s.site_id]["statement"]
        assert st_["privacy_unit"]["unit"] == ("patient" if s.site_id == PATIENT_SITE else "image")
    st_ = res.attestations[PATIENT_SITE]["statement"]["privacy_unit"]
    assert st_["public_patients"] == p and st_["images_per_patient_cap"] == CAP
    # each round's request carried the coordinator's planned event, and the reply's public q is the planned
    # one
    train = [(m, r) for m, r in seen if m.metadata.message_type == fm.TRAIN]
    assert len(train) == 6
    for m, r in train:
        site = next(s for s in fed.sites if grid.nodes[m.metadata.dst_node_id].node_config == s.node_config())
        want = q_pat if site.site_id == PATIENT_SITE else batch / site.size
        asked, _ = fm.read_payload(m.content)
        answered, _ = fm.read_payload(r.content)
        assert asked["event"]["q"] == pytest.approx(want) and answered["q"] == pytest.approx(want)
        assert answered["num_examples"] == site.size and answered["events"][0].get("unit", "image") == (
            "patient" if site.site_id == PATIENT_SITE else "image"
        )
    # the patient site's trainer sampled patients and divided by q x the PUBLIC patient count, never the exact
    # one
    pat = [kw for kw in built if "patient_rows" in kw]  # the rows grouped once at open, not the ids
    assert len(pat) == 2 and all(kw["n_public"] == p and kw["images_per_patient"] == CAP for kw in pat)
    assert all(max(int(r.numel()) for r in kw["patient_rows"]) <= CAP for kw in pat)
    assert pat[0]["patient_rows"] is pat[1]["patient_rows"]  # both rounds' trainers reuse the same grouping
    assert len([kw for kw in built if "patient_rows" not in kw]) == 4
    from feta_release.cli import main

    # the site admin's view says the unit
    main(["node", "status", "--ledger", str(fed.site(PATIENT_SITE).ledger)])
    assert "per patient" in capsys.readouterr().out


def test_public_patient_count_not_the_exact_one_leaves(tmp_path: Path) -> None:
    from feta_release.federation.driver import JobDriver

    fed, p = _federation(tmp_path, public_patients=20)
    signed, _ = sign_job_file(fed, tiny_job(), "job-pub")
    d = JobDriver(
        harness(fed),
        signed,
        tmp_path / "out",
        coordinator_key=load_private_key(fed.coordinator_key),
        wait_timeout=2,
        poll_interval=0.05,
    )
    d.wait_for_sites()
    plan = d.plan_sites()  # from the hello replies' signed policies only
    sgd = [e for e in plan[PATIENT_SITE]["events"] if e["stage"] == "dpsgd"]
    assert p == 20 and sgd[0]["q"] == pytest.approx(8 / 20)


def test_node_refuses_a_coordinator_that_plans_a_patient_site_as_image_level(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old coordinator (no unit in its plan): it asks the patient site for image-level rounds; the node
    refuses before any charge (and the coordinator's own policy check refuses such a plan first, see
    below)."""
    import feta_release.federation.driver as driver

    fed, _ = _federation(tmp_path)
    monkeypatch.setattr(driver, "site_dpsgd", lambda policy: {"dpsgd_unit": "image", "dpsgd_size": None})
    monkeypatch.setattr(driver, "check_job_fits", lambda policies, planned, **kw: {s: 0.0 for s in planned})
    signed, _ = sign_job_file(fed, tiny_job(federation={"rounds": 1}), "job-old")
    res = _run(fed, harness(fed), signed, tmp_path / "out")
    assert res.skipped == {0: [PATIENT_SITE]}
    assert _requests(fed, PATIENT_SITE, "job-old") == []  # nothing charged, nothing released
    log = (tmp_path / "out" / "progress.jsonl").read_text()
    assert "refused before any charge" in log and "'unit': 'patient'" in log


def test_coordinator_plan_refuses_an_image_level_request_to_a_patient_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import feta_release.federation.driver as driver
    from feta_release.policy.errors import JobDoesNotFit

    fed, _ = _federation(tmp_path)
    monkeypatch.setattr(driver, "site_dpsgd", lambda policy: {"dpsgd_unit": "image", "dpsgd_size": None})
    signed, _ = sign_job_file(fed, tiny_job(), "job-bad")
    with pytest.raises(JobDoesNotFit, match="dataset.privacy_unit"):
        _run(fed, harness(fed), signed, tmp_path / "out")
    assert _requests(fed, PATIENT_SITE, "job-bad") == []


def test_node_refuses_a_patient_policy_when_the_data_has_no_patient_ids(tmp_path: Path) -> None:
    from edge.site import Site

    sites = tiny_sites()
    fed = prepare_federation(tmp_path / "fed", sites, policy_overrides={"site-a": {"patient_level": (10, 2)}})
    with pytest.raises(
        ConfigError,
        match=r"policy\.signed\.json: the policy makes the PATIENT the unit of privacy "
        r".* has no patient ids; give the data a patient_id column",
    ):
        Site.open(fed.site("site-a").node_config())


def test_node_refuses_a_different_loader_cap(tmp_path: Path) -> None:
    from edge.site import CFG_PATIENT_CAP, Site

    fed, _ = _federation(tmp_path)
    cfg = {**fed.site(PATIENT_SITE).node_config(), CFG_PATIENT_CAP: str(CAP + 1)}
    with pytest.raises(ConfigError, match=rf"dataset.patient_cap = {CAP} .* set it to {CAP} or remove it"):
        Site.open(cfg)
    same = Site.open({**fed.site(PATIENT_SITE).node_config(), CFG_PATIENT_CAP: str(CAP)})
    assert same.patients is not None and same.patients.cap == CAP


@pytest.mark.parametrize(
    "dataset, field, words",
    [
        ({"privacy_unit": "patient", "patient_cap": 2}, "dataset.patients", "required with privacy_unit"),
        ({"privacy_unit": "patient", "patients": 10}, "dataset.patient_cap", "required with privacy_unit"),
        ({"patients": 10}, "dataset.patients", 'only with dataset.privacy_unit = "patient"'),
        (
            {"privacy_unit": "patient", "patients": 5000, "patient_cap": 2},
            "dataset.patients",
            "at most the public image",
        ),
        ({"privacy_unit": "person"}, "dataset.privacy_unit", "is not one of"),
        (
            {"privacy_unit": "patient", "patients": 0, "patient_cap": 2},
            "dataset.patients",
            "less than the minimum",
        ),
    ],
)
def test_policy_unit_fields_are_validated(dataset: dict[str, Any], field: str, words: str) -> None:
    doc = make_policy("site-x", "0" * 64, 100, ["a" * 64])
    doc["dataset"].update(dataset)
    with pytest.raises(PolicySchemaError) as err:
        validate_policy(doc, "policy.toml")
    msg = str(err.value)
    assert field in err.value.fields and words in msg and msg.startswith("policy.toml: ") and "\n" not in msg


@settings(max_examples=20, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=8),
    many=st.integers(2, 30),
    scale=st.floats(0.5, 50.0),
    seed=st.integers(0, 10_000),
)
def test_site_patient_index_bounds_a_many_image_patient_to_c(
    sizes: list[int], many: int, scale: float, seed: int
) -> None:
    """The node's own path (``policy_data`` -> ``PatientIndex.trainer_kwargs``, what ``dpsgd_round`` passes to
    the trainer): adding a patient with many images moves the clipped sum by at most C (q = 1, no noise)."""
    from types import SimpleNamespace

    from feta_release.config import JobConfig
    from feta_release.data.loading import LoadReport, policy_data
    from feta_release.training.dpsgd import DPSGDTrainer

    d, clip = 12, 1.0
    rng = np.random.default_rng(seed)
    cfg = JobConfig().replace(dpsgd={"batch": 1, "steps": 1, "physical_batch": 4, "clip": clip})
    ids = np.repeat(np.arange(len(sizes)), sizes)
    x = torch.from_numpy(rng.normal(size=(len(ids), d)) * scale).float()
    x2 = torch.cat([x, torch.from_numpy(np.tile(rng.normal(size=d) * 10 * scale, (many, 1))).float()])
    ids2 = np.concatenate([ids, np.full(many, len(sizes))])
    outs = []
    for ii, xx in ((ids, x), (ids2, x2)):
        cap = max(max(sizes), many)
        pol = SimpleNamespace(privacy_unit="patient", patients=1, patient_cap=cap)
        # loaded with the policy's cap already (nothing to drop)
        report = LoadReport(source="csv", kind="csv", n_images=len(ii), patients=ii, patient_cap=cap)
        _, index = policy_data(pol, None, report, data_source="d", policy_source="p")
        assert index is not None
        tr = DPSGDTrainer(
            Weights(d),
            cfg,
            1e-9,
            1.0,
            torch.Generator().manual_seed(0),
            loss=DotLoss(),
            **index.trainer_kwargs(),
        )
        outs.append(tr.noisy_gradient(xx, torch.zeros(len(ii), dtype=torch.int64))[0]["w"].double())
    assert float((outs[1] - outs[0]).norm()) <= clip * (1 + 1e-5)


def test_request_unit_must_be_the_policy_unit() -> None:
    from feta_release.accounting import PrivacyEvent
    from feta_release.policy.document import SitePolicy
    from feta_release.policy.enforce import check_request

    pat = SitePolicy.from_document(make_policy("s", "0" * 64, 100, ["a" * 64], patient_level=(40, 3)), None)
    img = SitePolicy.from_document(make_policy("s", "0" * 64, 100, ["a" * 64]), None)
    for pol, ev in (
        (pat, PrivacyEvent("dpsgd", 1.0, 0.1, 2)),
        (img, PrivacyEvent("dpsgd", 1.0, 0.1, 2, "patient")),
    ):
        with pytest.raises(PolicyError, match="dataset.privacy_unit"):
            check_request(pol, ev, require_job=False)
    check_request(pat, PrivacyEvent("dpsgd", 1.0, 0.1, 2, "patient"), require_job=False)
    check_request(pat, PrivacyEvent("central", 5.0, 0.1, 1), require_job=False)  # warm-up stays per image


def _eps20_job(tmp_path: Path) -> Path:
    """cpu-eps1 with a budget of 20: room, per patient of 5 images, for its warm-up and DP-SGD."""
    text = (Path(__file__).resolve().parents[2] / "feta_release" / "presets" / "cpu-eps1.toml").read_text()
    (job := tmp_path / "eps20.toml").write_text(text.replace("epsilon = 1.0", "epsilon = 20.0", 1))
    return job


def _plan_json(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    from feta_release.cli import main

    main(["privacy", "plan", *args, "--json"])
    return json.loads(capsys.readouterr().out)


def test_privacy_plan_for_a_federated_policy_of_two_thousand_patients(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """2,000 patients with 1-20 images each, cap 5: `privacy plan --policy` plans the site as its node
    will."""
    from feta_release.cli import main
    from feta_release.data.commitment import suggest_public_size
    from feta_release.privacy_unit import cap_per_patient

    # cap 5: the budget is per patient, and cpu-eps1's warm-up alone is 3.4 per patient
    preset = _eps20_job(tmp_path)
    counts = np.random.default_rng(7).integers(1, 21, 2000)
    n5 = len(cap_per_patient(np.repeat(np.arange(2000), counts), 5))
    size = suggest_public_size(n5)
    pols = {}
    for name, level in (("patient", (2000, 5)), ("image", None)):
        doc = make_policy(
            "site-p",
            "0" * 64,
            size,
            ["a" * 64],
            patient_level=level,
            per_job=(20.0, 1e-5),
            lifetime=(40.0, 1e-5),
        )
        (path := tmp_path / f"{name}.json").write_text(json.dumps(doc))
        pols[name] = _plan_json([str(preset), "--policy", str(path)], capsys)
    pat, img = pols["patient"], pols["image"]
    sgd = [e for e in pat["history"] if e["stage"] == "dpsgd"]
    # rate 0.0625
    assert sgd and all(e["unit"] == "patient" and e["q"] == pytest.approx(125 / 2000) for e in sgd)
    u = pat["privacy_unit"]
    assert u["unit"] == "patient" and u["public_patients"] == 2000 and u["images_per_patient_cap"] == 5
    # per patient
    assert pat["epsilon"] <= 20.0 + 1e-9 and pat["epsilon"] == pytest.approx(u["epsilon_per_patient"])
    assert u["delta_per_patient"] <= 1e-5
    assert u["epsilon_per_patient"] == pytest.approx(
        u["epsilon_warmup_per_patient"] + u["epsilon_dpsgd_per_patient"]
    )
    isgd = [e for e in img["history"] if e["stage"] == "dpsgd"]
    assert all("unit" not in e and e["q"] == pytest.approx(round(0.0625 * size) / size) for e in isgd)
    assert img["privacy_unit"]["unit"] == "image" and "group privacy" in img["privacy_unit"]["how"]
    main(["privacy", "plan", str(preset), "--policy", str(tmp_path / "patient.json")])
    out = capsys.readouterr().out
    assert "q = batch / public patients = 125 / 2000" in out and "unit of privacy: the PATIENT" in out


def _unit_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith("unit of privacy")]


def test_privacy_plan_states_the_unit_in_one_form_with_and_without_a_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The local plan (-n, --patient-cap, --patients) and the federated one (--policy) print the SAME line
    form: the unit, its figure, how, then the facts only one of them knows (public patients, sensitivity)."""
    import re

    from feta_release.cli import main

    preset = _eps20_job(tmp_path)
    lines = {}
    for name, level in (("patient", (2000, 5)), ("image", None)):
        doc = make_policy(
            "site-p",
            "0" * 64,
            9500,
            ["a" * 64],
            patient_level=level,
            per_job=(20.0, 1e-5),
            lifetime=(40.0, 1e-5),
        )
        (path := tmp_path / f"{name}.json").write_text(json.dumps(doc))
        main(["privacy", "plan", str(preset), "--policy", str(path)])
        lines[f"policy-{name}"] = _unit_lines(capsys.readouterr().out)
    main(["privacy", "plan", str(preset), "-n", "9500", "--patient-cap", "5", "--patients", "2000"])
    lines["local-patient"] = _unit_lines(capsys.readouterr().out)
    main(["privacy", "plan", str(preset), "-n", "9500"])
    lines["local-image"] = _unit_lines(capsys.readouterr().out)
    assert all(len(v) == 1 for v in lines.values()), lines
    patient = re.compile(
        r"^unit of privacy: the PATIENT \(at most 5 image\(s\) each(, 2000 public patients)?\): "
        r"ε per patient [0-9.]+ at δ [0-9.e-]+ \(.+\)"
    )
    image = re.compile(r"^unit of privacy: one IMAGE: ε [0-9.]+ at δ [0-9.e-]+ \(no patient ids.+\)$")
    assert patient.match(lines["policy-patient"][0]) and patient.match(lines["local-patient"][0]), lines
    assert "2000 public patients" in lines["policy-patient"][0]
    assert image.match(lines["policy-image"][0]) and image.match(lines["local-image"][0]), lines


def _attested_site(site_id: str, policy: Any, events: list[Any]) -> dict[str, Any]:
    """A manifest site entry as a node signs it (``build_attestation`` with the site's policy)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from feta_release.release.manifest import build_attestation, site_record

    att = build_attestation(
        site_id,
        "job-m",
        events,
        policy.job_delta,
        policy.accountant,
        policy.digest,
        Ed25519PrivateKey.generate(),
        unit_policy=policy,
    )
    return site_record(att)


def test_a_mixed_federation_states_the_unit_per_site() -> None:
    from feta_release.accounting import PrivacyEvent
    from feta_release.policy.document import SitePolicy
    from feta_release.release.certificate import epsilon_line
    from feta_release.release.report import _unit_paragraph
    from feta_release.release.synthesize import _units
    from feta_release.release.verify import describe_site, policy_violations

    pat_doc = make_policy(
        "site-p",
        "0" * 64,
        100,
        ["a" * 64],
        patient_level=(40, 3),
        per_job=(10.0, 1e-5),
        lifetime=(20.0, 1e-5),
    )
    img_doc = make_policy("site-i", "0" * 64, 100, ["a" * 64], per_job=(10.0, 1e-5), lifetime=(20.0, 1e-5))
    pat, img = (SitePolicy.from_document(d, None) for d in (pat_doc, img_doc))
    warm = PrivacyEvent("central", 5.0, 0.1, 1)
    p_site = _attested_site("site-p", pat, [warm, PrivacyEvent("dpsgd", 1.0, 0.2, 4, "patient")])
    i_site = _attested_site("site-i", img, [warm, PrivacyEvent("dpsgd", 1.0, 0.08, 4)])
    st_p = p_site["attestation"]["statement"]
    assert st_p["privacy_unit"]["unit"] == "patient" and st_p["privacy_unit"]["public_patients"] == 40
    assert policy_violations(pat_doc, st_p, events_from_list(st_p["events"])) == []
    st_i = i_site["attestation"]["statement"]
    assert policy_violations(img_doc, st_i, events_from_list(st_i["events"])) == []
    # the wrong unit for the policy is a violation either way
    assert any(
        "dataset.privacy_unit" in v
        for v in policy_violations(pat_doc, st_i | {"site_id": "site-p"}, events_from_list(st_i["events"]))
    )
    assert any(
        "privacy_unit" in v
        for v in policy_violations(img_doc, st_p | {"site_id": "site-i"}, events_from_list(st_p["events"]))
    )
    assert "Unit of privacy at this site: the PATIENT (at most 3 image(s)" in describe_site(p_site)
    assert "Unit of privacy at this site: one image" in describe_site(i_site)
    sites = [p_site, i_site]
    para = _unit_paragraph(sites)
    assert "per site" in para and "at site-p one PATIENT" in para and "at site-i one image" in para
    assert _units(sites).startswith("site site-p: one patient") and "site site-i: one image" in _units(sites)
    line = epsilon_line(sites)
    assert "site site-p" in line and "one patient of that site" in line and "site site-i" in line


def test_policy_commands_commit_to_the_capped_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`policy data-commitment --patient-cap K` prints the patient-level [dataset] fields and commits to the
    data the node will use; `policy verify --data` loads the data with the signed policy's cap."""
    from feta_release.cli import main
    from feta_release.policy.document import sign_policy, write_signed_policy
    from feta_release.signing import generate_keypair

    ds = tiny_sites()["site-a"]
    csv = write_patient_csv(ds, tmp_path / "csv", _patient_sizes(ds.n, seed=5))
    main(
        [
            "policy",
            "data-commitment",
            str(csv),
            "--secret",
            str(tmp_path / "data.secret"),
            "--patient-cap",
            "2",
        ]
    )
    out = capsys.readouterr().out
    fields = dict(
        line.split(" = ") for line in out.splitlines() if " = " in line and not line.startswith("#")
    )
    assert fields["privacy_unit"] == '"patient"' and fields["patient_cap"] == "2"
    key, pub = generate_keypair(tmp_path / "keys", "policy")
    doc = make_policy(
        "site-a",
        fields["commitment"].strip('"'),
        int(fields["size"]),
        ["a" * 64],
        patient_level=(int(fields["patients"]), 2),
    )
    signed = write_signed_policy(tmp_path / "p.signed.json", sign_policy(doc, load_private_key(key)))
    main(
        [
            "policy",
            "verify",
            str(signed),
            "--trusted",
            str(pub),
            "--data",
            str(csv),
            "--secret",
            str(tmp_path / "data.secret"),
        ]
    )
    assert "dataset commitment matches" in capsys.readouterr().out


@pytest.mark.slow  # aux-generator fit + warm-ups of the full pipeline: ~1 min on a loaded machine
def test_a_secure_aggregation_job_with_a_patient_level_site(tmp_path: Path) -> None:
    """Warm-up sums by secure aggregation (Skellam, per image with the cap), DP-SGD per patient: the
    coordinator's secure plan and the node agree on the patient-level round, and the statement composes
    both."""
    from feta_release.accounting import SkellamEvent
    from feta_release.release.verify import policy_violations
    from tests.support.federation import full_job

    fed, p = _federation(tmp_path, per_job=(5.0, 1e-5), lifetime=(10.0, 1e-5))
    cfg = full_job(federation={"secure_aggregation": True, "rounds": 1}, privacy={"epsilon": 5.0})
    signed, _ = sign_job_file(fed, cfg, "job-sp")
    res = _run(fed, harness(fed), signed, tmp_path / "out")
    assert res.rounds_done == 1 and res.skipped == {}
    events = events_from_list([e for r in _requests(fed, PATIENT_SITE, "job-sp") for e in r["events"]])
    assert [type(e).__name__ for e in events] == ["SkellamEvent", "SkellamEvent", "PrivacyEvent"]
    sgd = [e for e in events if not isinstance(e, SkellamEvent)][0]
    assert sgd.unit == "patient" and sgd.q == pytest.approx(cfg.dpsgd.batch / p)
    st_ = res.attestations[PATIENT_SITE]["statement"]
    u = st_["privacy_unit"]
    assert u["unit"] == "patient" and u["epsilon_per_patient"] == pytest.approx(
        u["epsilon_warmup_per_patient"] + u["epsilon_dpsgd_per_patient"]
    )
    # the budget holds per patient
    assert u["epsilon_per_patient"] <= 5.0 + 1e-9 and u["delta_per_patient"] <= 1e-5
    policy = json.loads(fed.site(PATIENT_SITE).policy.read_text())["policy"]
    assert policy_violations(policy, st_, events) == []
