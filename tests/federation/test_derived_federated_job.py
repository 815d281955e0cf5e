"""The coordinator derives a federated job from the sites' public declarations: it fits every site's plan and
policy, and sites that disagree on their schema are refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from coordinator.derive import derive_federated
from feta_release.accounting import epsilon
from feta_release.cli import main
from feta_release.config import load_job
from feta_release.data.declared import DataDeclaration
from feta_release.errors import ConfigError
from feta_release.job_rules import DPSGD_MAX_NOISE
from feta_release.mechanisms.secure_sums import secagg_warmup_events
from feta_release.planning import stage_events
from feta_release.policy import make_policy, open_signed_policy, sign_job, sign_policy

DIGITS = DataDeclaration(tuple(str(c) for c in range(10)), (1, 28, 28))


def _pem(key: Ed25519PrivateKey) -> str:
    from cryptography.hazmat.primitives import serialization

    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    return key.public_key().public_bytes(serialization.Encoding.PEM, spki).decode()


def _policies(
    tmp_path: Path,
    sizes: dict[str, int],
    coord: Ed25519PrivateKey,
    declared: dict[str, DataDeclaration] | None = None,
    per_job: tuple[float, float] = (1.0, 1e-5),
    patient_level: dict[str, tuple[int, int]] | None = None,
    mechanisms: dict[str, dict[str, Any]] | None = None,
    pin_peers: bool = False,
    resources: dict[str, dict[str, int]] | None = None,
    max_colluders: int = 0,
) -> tuple[list[Path], dict[str, Any]]:
    """The sites' signed policy files and opened policies; ``pin_peers``: each site pins the others' keys
    (secure aggregation then counts their noise shares too, but for ``max_colluders`` of them)."""
    files, opened = [], {}
    keys = {sid: Ed25519PrivateKey.generate() for sid in sizes}
    for sid, n in sizes.items():
        site = keys[sid]
        peers = {o: _pem(k) for o, k in keys.items() if o != sid}
        doc = make_policy(
            sid,
            "ab" * 32,
            n,
            [coord.public_key()],
            app_bundles=["cd" * 32],
            declared=(declared or {}).get(sid, DIGITS),
            lifetime=(max(4.0, 2 * per_job[0]), 1e-5),
            per_job=per_job,
            patient_level=(patient_level or {}).get(sid),
            mechanisms=(mechanisms or {}).get(sid),
            site_key=_pem(site) if pin_peers else None,
            secure_aggregation={"peers": peers, "max_colluders": max_colluders} if pin_peers else None,
            resources=(resources or {}).get(sid),
        )
        signed = sign_policy(doc, site)
        path = tmp_path / f"{sid}.signed.json"
        path.write_text(json.dumps(signed), "utf-8")
        files.append(path)
        opened[sid] = open_signed_policy(signed, [site.public_key()])
    return files, opened


def _two_sites(tmp_path: Path, coord: Ed25519PrivateKey, **kw: Any) -> tuple[list[Path], dict[str, Any]]:
    """:func:`_policies` of two sites of 20,000 images each, a per-job epsilon of 10 (``kw``: the rest)."""
    return _policies(tmp_path, {"st-mary": 20_000, "st-luke": 20_000}, coord, per_job=(10.0, 1e-5), **kw)


def test_derived_federated_job_fits_every_sites_plan_and_policy(tmp_path: Path) -> None:
    from edge.admission import admit

    coord = Ed25519PrivateKey.generate()
    sizes = {"st-mary": 1500, "st-luke": 1300, "st-john": 1700}
    files, pols = _policies(tmp_path, sizes, coord)
    d, ids = derive_federated(files, epsilon=1.0)
    cfg = d.cfg
    assert ids == list(sizes) and d.facts.size == 3 * 1300 and d.facts.federated
    assert cfg.central.batch == 1300 and cfg.central.rate is None and cfg.central.cells == 1
    signed = sign_job(cfg.with_secure_default(3), coord, "j", ids)
    for sid, n in sizes.items():
        assert epsilon(stage_events(cfg, n, federated=True), cfg.privacy.delta) <= 1.0
        secure = secagg_warmup_events(cfg.with_secure_default(3), n, (1, 28, 28), 10, 3, 0)
        assert epsilon(secure, cfg.privacy.delta) <= 1.0  # type: ignore[arg-type]
        res = admit(pols[sid], signed, data_shape=((1, 28, 28), 10))  # the form the node judges
        assert res.accepted, (sid, res.failures)


def test_sites_that_declare_different_schemas_are_refused(tmp_path: Path) -> None:
    coord = Ed25519PrivateKey.generate()
    other = DataDeclaration(("a", "b"), (3, 64, 64))
    files, _ = _policies(tmp_path, {"a": 1000, "b": 1000}, coord, {"b": other})
    with pytest.raises(ConfigError, match="different classes or image shapes"):
        derive_federated(files, epsilon=1.0)


def test_coordinator_derive_job_writes_a_job_that_loads(tmp_path: Path, capsys: Any) -> None:
    coord = Ed25519PrivateKey.generate()
    files, _ = _policies(tmp_path, {"a": 2000, "b": 2000}, coord)
    out = tmp_path / "job.toml"
    argv = ["coordinator", "derive-job", "--epsilon", "1", "--for-threads", "1", "--out", str(out)]
    for f in files:
        argv += ["--policy", str(f)]
    main(argv)
    assert "sites a, b" in capsys.readouterr().out
    assert load_job(out) == derive_federated(files, epsilon=1.0, threads=1)[0].cfg
    text = out.read_text("utf-8")
    assert "# federation: 2 site(s)" in text and "cpu, 1 thread (CPU stages estimated 1.80x" in text


def test_coordinator_run_without_a_job_file_derives_it_into_the_output(tmp_path: Path, capsys: Any) -> None:
    from click import UsageError

    from coordinator.cli import _job_and_sites

    coord = Ed25519PrivateKey.generate()
    files, _ = _policies(tmp_path, {"a": 2000, "b": 2000}, coord)
    path, sites = _job_and_sites(None, None, tuple(files), 1.0, None, None, "cpu", tmp_path / "out")
    assert path == tmp_path / "out" / "derived-job.toml" and sites == "a,b"
    here = torch.get_num_threads()  # the coordinator's own threads time the job it runs
    assert load_job(path) == derive_federated(files, epsilon=1.0, threads=here)[0].cfg
    with pytest.raises(UsageError, match="differs"):
        _job_and_sites(None, "a,c", tuple(files), 1.0, None, None, "cpu", tmp_path / "out")
    with pytest.raises(UsageError, match="JOB_FILE"):
        _job_and_sites(path, "a,b", tuple(files), 1.0, None, None, "cpu", tmp_path / "out")


def test_a_derived_federated_step_is_charged_the_slowest_sites_padded_rows(tmp_path: Path) -> None:
    """Each site samples the one signed DP-SGD batch over its OWN declared size and pads every step to its
    own public bound (``site_step_rows``, as its node does); the sites step in parallel. The time rules
    charge a step the most padded rows of any site: charged as one site of the summed size (3 sites' batch
    at once), the derived job bought a third of the steps its time budget holds."""
    from feta_release.job_rules import dpsgd_step_rows, dpsgd_step_seconds
    from feta_release.planning import stage_sampling_rate
    from feta_release.training.step_rows import site_step_rows

    coord = Ed25519PrivateKey.generate()
    sizes = {"st-mary": 20_000, "st-luke": 30_000, "st-john": 50_000}
    files, _ = _policies(tmp_path, sizes, coord, per_job=(10.0, 1e-5))
    d, _ = derive_federated(files, epsilon=10.0, time_budget=1200.0)
    cfg, chunk = d.cfg, d.cfg.dpsgd.physical_batch
    padded = {
        sid: site_step_rows(n, n, stage_sampling_rate(cfg.dpsgd.batch, n, "dpsgd"), chunk)
        for sid, n in sizes.items()
    }
    assert dpsgd_step_rows(cfg, d.facts) == max(padded.values()) < cfg.dpsgd.batch * len(sizes)
    steps = cfg.dpsgd_steps(d.facts.size)
    assert steps >= 20 and steps % 5 == 0
    assert d.estimate.seconds["dpsgd"] == pytest.approx(steps * dpsgd_step_seconds(cfg, d.facts), abs=0.05)
    assert d.estimate.training <= 1200.0


def test_a_patient_level_site_is_charged_the_whole_patients_its_node_pads_to(tmp_path: Path) -> None:
    """A patient-level site (its policy: 8,000 public patients, at most 4 images each) samples whole patients
    at q = batch / patients and pads each step to the images of q·P patients + 5 sd (variance bound q·cap·N),
    in whole chunks covering its cap: ``site_step_rows`` with the ``PatientIndex`` its node builds from the
    policy. The signed batch is the rules' batch for its 8,000 patients (2,000, what its drafted policy's
    max_batch admits). Charged as an image-level site of its 20,000 images (q = batch / images), its step
    cost 2,240 rows against the 5,632 its node runs."""
    import numpy as np

    from feta_release.job_rules import dpsgd_step_rows, dpsgd_step_seconds
    from feta_release.planning import stage_sampling_rate
    from feta_release.privacy_unit import PatientIndex
    from feta_release.training.step_rows import site_step_rows

    coord = Ed25519PrivateKey.generate()
    files, pols = _two_sites(tmp_path, coord, patient_level={"st-luke": (8000, 4)})
    d, _ = derive_federated(files, epsilon=10.0, time_budget=1200.0)
    cfg, chunk, batch = d.cfg, d.cfg.dpsgd.physical_batch, d.cfg.dpsgd.batch
    luke = pols["st-luke"]
    node_index = PatientIndex(np.zeros(1, dtype=np.int64), int(luke.patients), int(luke.patient_cap))
    as_images = site_step_rows(20_000, 20_000, stage_sampling_rate(batch, 20_000, "dpsgd"), chunk)
    q_patients = stage_sampling_rate(batch, node_index.n_public, "dpsgd")
    as_patients = site_step_rows(20_000, 20_000, q_patients, chunk, node_index)
    assert (batch, chunk, as_images, as_patients) == (2000, 64, 2240, 5632)
    assert dpsgd_step_rows(cfg, d.facts) == as_patients  # the slowest site: the patient-level one
    steps = cfg.dpsgd_steps(d.facts.size)
    assert steps >= 20 and steps == 5 * cfg.federation.rounds
    assert d.estimate.seconds["dpsgd"] == pytest.approx(steps * dpsgd_step_seconds(cfg, d.facts), abs=0.05)
    assert d.estimate.training <= 1200.0


def _dpsgd_rule(max_batch: int) -> dict[str, Any]:
    return {"allowed": True, "min_sigma": 0.5, "max_steps": 100_000, "max_batch": max_batch}


def _patient_federation(tmp_path: Path, patients: int, cap: int, pin_peers: bool) -> Any:
    coord = Ed25519PrivateKey.generate()
    files, pols = _two_sites(
        tmp_path,
        coord,
        patient_level={"st-luke": (patients, cap)},
        mechanisms={"st-luke": {"dpsgd": _dpsgd_rule(patients // 4)}},
        pin_peers=pin_peers,
    )
    return coord, files, pols


@pytest.mark.parametrize(("patients", "cap"), [(8000, 4), (1500, 2)])
def test_a_patient_level_site_admits_the_derived_federated_job(
    tmp_path: Path, patients: int, cap: int
) -> None:
    """A federation with a patient-level site (P public patients, at most ``cap`` images each; its DP-SGD
    max_batch drafted at a quarter of its patients; each site pins the other's key): the shared warm-up is
    fitted to the budget PER PATIENT over the largest cap and the one signed DP-SGD batch to what every
    policy admits, so each site's node admits the secure job (judged with its data's shape, as the node
    does) and spends at most its budget. A split per image would spend 63.8 per patient on the warm-up alone
    at cap 4, and with 1,500 patients the rules' batch (2,048) would be above them."""
    from edge.admission import admit

    coord, files, pols = _patient_federation(tmp_path, patients, cap, pin_peers=True)
    d, ids = derive_federated(files, epsilon=10.0, time_budget=1200.0)
    assert d.cfg.dpsgd.batch <= patients // 4
    signed = sign_job(d.cfg, coord, "j", ids)
    assert signed["job"]["config"]["federation"]["secure_aggregation"] is True
    for sid in ids:
        res = admit(pols[sid], signed, data_shape=((1, 28, 28), 10))
        assert res.accepted, (sid, res.failures)
        assert res.job_epsilon is not None and res.job_epsilon <= 10.0
    luke = admit(pols["st-luke"], signed, data_shape=((1, 28, 28), 10)).job_epsilon
    assert luke is not None and luke >= 9.0  # the budget per patient is spent, not left idle


def test_sites_pinning_no_peers_get_a_job_with_per_site_noise_their_nodes_admit(tmp_path: Path) -> None:
    """Signed for 2 sites a job sums by secure aggregation, and a site that pins no peer counts only its own
    noise share: its node (judging the secure form with its data's shape) refuses the warm-up fitted to the
    whole noise (11.7 per patient over a budget of 10). The derivation plans the form the node judges, so the
    job is signed with each site adding the whole noise (secure_aggregation = false, named in the header),
    which every node admits."""
    from edge.admission import admit

    coord, files, pols = _patient_federation(tmp_path, 8000, 4, pin_peers=False)
    d, ids = derive_federated(files, epsilon=10.0, time_budget=1200.0)
    assert d.cfg.federation.secure_aggregation is False
    assert any(n.startswith("federation: secure_aggregation = false") for n in d.notes), d.notes
    signed = sign_job(d.cfg, coord, "j", ids)
    for sid in ids:
        res = admit(pols[sid], signed, data_shape=((1, 28, 28), 10))
        assert res.accepted, (sid, res.failures)
        assert res.job_epsilon is not None and res.job_epsilon <= 10.0


def test_the_signed_batch_is_cut_to_every_sites_policy_and_the_header_says_so(tmp_path: Path) -> None:
    """An image-level site whose policy caps DP-SGD's batch below the rules' batch: the one signed batch is
    cut to that cap (every site samples it), and the job's header names the cut and states the q the sites
    are charged for the cut batch (700 over 20,000 images), not the rules' rate before it."""
    from edge.admission import admit

    coord = Ed25519PrivateKey.generate()
    files, pols = _two_sites(tmp_path, coord, mechanisms={"st-mary": {"dpsgd": _dpsgd_rule(700)}})
    d, ids = derive_federated(files, epsilon=10.0, time_budget=1200.0)
    assert d.cfg.dpsgd.batch == 700
    assert any("DP-SGD 700 (cut from" in n for n in d.notes)
    said = next(n for n in d.notes if n.startswith("dpsgd:"))
    assert " at q = 0.035 (batch 700 over the smallest site's 20000 images) " in said, said
    signed = sign_job(d.cfg, coord, "j", ids)
    for sid in ids:  # (the policies' default min_sigma of 1 is their own matter at epsilon 10)
        assert not [r for r, _ in admit(pols[sid], signed).failures if r.startswith("mechanisms.dpsgd")]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_physical_batch_is_cut_to_every_sites_resource_caps(tmp_path: Path, device: str) -> None:
    """One signed physical batch runs at every site: a site whose policy caps ``resources.max_pass_rows`` at
    16 (below the CPU rule's 64 at 28 px and the GPU's ~232) gets a job within it, costed at that physical
    batch, and no site's node refuses the job's work (``check_resources`` inside ``admit``). Without the cut
    the job carried the rules' physical batch and that site refused it."""
    from edge.admission import admit
    from feta_release.job_rules import dpsgd_step_seconds

    coord = Ed25519PrivateKey.generate()
    caps = {"st-mary": {"max_physical_batch": 200}, "st-luke": {"max_pass_rows": 16}}
    files, pols = _two_sites(tmp_path, coord, resources=caps)
    d, ids = derive_federated(files, epsilon=10.0, time_budget=1200.0, device=device)
    assert d.facts.max_physical_batch == 200 and d.facts.max_pass_rows == 16
    assert 1 <= d.cfg.dpsgd.physical_batch <= 16
    steps = d.cfg.dpsgd_steps(d.facts.size)
    assert steps > 0
    assert d.estimate.seconds["dpsgd"] == pytest.approx(steps * dpsgd_step_seconds(d.cfg, d.facts), abs=0.05)
    signed = sign_job(d.cfg.with_secure_default(2), coord, "j", ids)
    for sid in ids:
        res = admit(pols[sid], signed, data_shape=((1, 28, 28), 10))
        assert res.job_id == "j" and not [r for r, _ in res.failures if r.startswith("resources.")], sid
    (tmp_path / "defaults").mkdir()
    files, _ = _two_sites(tmp_path / "defaults", coord)
    uncapped, _ = derive_federated(files, epsilon=10.0, time_budget=1200.0, device=device)
    assert uncapped.cfg.dpsgd.physical_batch > 16


def _signed_and_admitted(d: Any, coord: Ed25519PrivateKey, ids: list[str], pols: dict[str, Any]) -> None:
    """Every site's node (``admit``, judging the signed job with its declared data's shape) serves the job."""
    from edge.admission import admit

    signed = sign_job(d.cfg, coord, "j", ids)
    for sid in ids:
        res = admit(pols[sid], signed, data_shape=((1, 28, 28), 10))
        assert res.accepted, (sid, res.failures)


# the warm-up's sigma floors both sites accept, so that the whole budget may go to the warm-up releases
_LOW_FLOORS: dict[str, Any] = {"central": {"min_sigma": 0.5}, "frequency": {"min_sigma": 0.5}}


def test_a_site_allowing_no_dpsgd_gets_a_job_without_it_that_every_node_admits(tmp_path: Path) -> None:
    """St Luke's policy allows no DP-SGD (``mechanisms.dpsgd.allowed = false``): the rules' job trains 180
    DP-SGD steps, which its node refuses after St Mary's may have spent budget on the warm-up. The derived job
    has DP-SGD off, its budget split planned again without it, the header says which site's rule, and every
    node admits it."""
    coord = Ed25519PrivateKey.generate()
    mechs: dict[str, dict[str, Any]] = {
        "st-mary": _LOW_FLOORS,
        "st-luke": {**_LOW_FLOORS, "dpsgd": {"allowed": False}},
    }
    files, pols = _two_sites(tmp_path, coord, mechanisms=mechs)
    d, ids = derive_federated(files, epsilon=10.0, time_budget=1200.0)
    assert d.cfg.federated_rounds == 0
    assert "dpsgd: off (site st-luke's policy allows no DP-SGD: mechanisms.dpsgd.allowed)" in d.notes
    _signed_and_admitted(d, coord, ids, pols)


@pytest.mark.parametrize(
    ("max_steps", "steps"), [(150, 150), (100, 100), (40, 0), (30, 0), (25, 0), (20, 0), (12, 0)]
)
def test_the_dpsgd_steps_are_cut_to_every_sites_step_cap(tmp_path: Path, max_steps: int, steps: int) -> None:
    """St Luke caps DP-SGD at ``max_steps`` per job, under the 180 steps the time budget buys: the job is cut
    to the whole rounds within the cap (100: 20 rounds of 5), or has DP-SGD off where fewer than the rules'
    20 steps would remain (12) or where the fewer steps' noise-to-signal over the job (sigma calibrated to the
    same budget) is above the rules' line (20 to 40 steps); the header states the cut job (its steps and
    estimate, not the derived ones) and every node admits it."""
    from feta_release.job_rules import dpsgd_step_seconds

    coord = Ed25519PrivateKey.generate()
    mechs: dict[str, dict[str, Any]] = {
        "st-mary": _LOW_FLOORS,
        "st-luke": {**_LOW_FLOORS, "dpsgd": {"max_steps": max_steps}},
    }
    files, pols = _two_sites(tmp_path, coord, mechanisms=mechs)
    d, ids = derive_federated(files, epsilon=10.0, time_budget=1200.0)
    assert d.cfg.dpsgd_steps(d.facts.size) * (d.cfg.federated_rounds > 0) == steps
    said = f"site st-luke's mechanisms.dpsgd.max_steps = {max_steps}"
    assert any(n.startswith("dpsgd:") and said in n for n in d.notes), d.notes
    if steps:
        assert d.estimate.seconds["dpsgd"] == pytest.approx(
            steps * dpsgd_step_seconds(d.cfg, d.facts), abs=0.05
        )
        said = next(n for n in d.notes if n.startswith("dpsgd:"))
        assert said.startswith(f"dpsgd: {steps} steps at q = ") and "q = None" not in said, said
        assert said.count("cut from") == 1, said
        assert noise(d) <= DPSGD_MAX_NOISE
    else:
        assert max_steps < 20 or f"above {DPSGD_MAX_NOISE:.4f}" in next(n for n in d.notes if "dpsgd:" in n)
    est = [n for n in d.notes if n.startswith("estimated ")]
    assert len(est) == 1 and est[0].startswith(f"estimated {d.estimate.training / 60:.1f} min"), est
    _signed_and_admitted(d, coord, ids, pols)


def noise(d: Any) -> float:
    """The job's DP-SGD noise-to-signal over the job as the rules judge it (the planner's sigma)."""
    from feta_release.job_rules import job_dpsgd_noise

    return job_dpsgd_noise(d.facts, d.cfg.to_dict())


@pytest.mark.parametrize("dpsgd", [{"min_sigma": 3.0}, {"max_steps": 100, "min_sigma": 1.45}])
def test_a_site_whose_dpsgd_sigma_floor_refuses_gets_a_job_without_dpsgd(
    tmp_path: Path, dpsgd: dict[str, Any]
) -> None:
    """St Luke's DP-SGD sigma floor is above the sigma the planner calibrates: 3 over the 180 steps' 1.49, or
    1.45 once its step cap cuts the job to 100 steps (fewer steps for the same budget: less sigma). The job
    without DP-SGD is admitted, so it is derived, the header naming the rule, rather than refused."""
    coord = Ed25519PrivateKey.generate()
    mechs = {"st-mary": _LOW_FLOORS, "st-luke": {**_LOW_FLOORS, "dpsgd": dpsgd}}
    files, pols = _two_sites(tmp_path, coord, mechanisms=mechs)
    d, ids = derive_federated(files, epsilon=10.0, time_budget=1200.0)
    assert d.cfg.federated_rounds == 0
    said = "dpsgd: off (site st-luke's policy refuses its DP-SGD: mechanisms.dpsgd.min_sigma)"
    assert said in d.notes, d.notes
    _signed_and_admitted(d, coord, ids, pols)


def test_sites_pinning_each_others_keys_get_a_job_their_nodes_admit(tmp_path: Path) -> None:
    """Sites pinning each other's keys plan the securely summed job, but each node judges a warm-up's sigma
    floor on its own noise share (sigma / sqrt(2)), under the default floors: the job is derived with each
    site adding the whole noise (secure_aggregation = false, named in the header), which every node admits."""
    coord = Ed25519PrivateKey.generate()
    files, pols = _two_sites(tmp_path, coord, pin_peers=True)
    d, ids = derive_federated(files, epsilon=10.0, time_budget=1200.0)
    assert d.cfg.federation.secure_aggregation is False
    assert any(n.startswith("federation: secure_aggregation = false") for n in d.notes), d.notes
    _signed_and_admitted(d, coord, ids, pols)


def test_a_dpsgd_floor_the_per_site_form_breaks_turns_dpsgd_off_rather_than_refusing_the_job(
    tmp_path: Path,
) -> None:
    """Three sites pinning each other's keys, each counting one of the two others as a colluder: a site sees
    two of the three noise shares of a secure sum, so its warm-up costs it more and its DP-SGD is calibrated
    to sigma 2.33, while with each site adding the whole noise DP-SGD gets sigma 1.27. The warm-up floors
    (0.65) refuse the secure form on a site's own share (central 1.04 / sqrt(3)), so the job must be signed
    per site, where St Luke's DP-SGD floor (1.8) refuses DP-SGD. The per-site form was tried after the
    DP-SGD remedy, and the job was refused naming mechanisms.dpsgd.min_sigma although the job without DP-SGD
    is admitted: it is derived, DP-SGD off and each site adding the whole noise."""
    coord = Ed25519PrivateKey.generate()
    ids = ["st-mary", "st-luke", "st-john"]
    floors: dict[str, Any] = {"central": {"min_sigma": 0.65}, "frequency": {"min_sigma": 0.65}}
    mechs = {sid: {**floors, **({"dpsgd": {"min_sigma": 1.8}} if sid == "st-luke" else {})} for sid in ids}
    files, pols = _policies(
        tmp_path,
        dict.fromkeys(ids, 20_000),
        coord,
        per_job=(10.0, 1e-5),
        mechanisms=mechs,
        pin_peers=True,
        max_colluders=1,
    )
    d, got = derive_federated(files, epsilon=10.0, time_budget=1200.0)
    assert d.cfg.federated_rounds == 0 and d.cfg.federation.secure_aggregation is False
    assert "dpsgd: off (site st-luke's policy refuses its DP-SGD: mechanisms.dpsgd.min_sigma)" in d.notes
    assert any(n.startswith("federation: secure_aggregation = false") for n in d.notes), d.notes
    _signed_and_admitted(d, coord, got, pols)


def test_a_dpsgd_refusal_of_the_secure_form_alone_keeps_dpsgd_with_per_site_noise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a site's node refuses DP-SGD only in the secure form (its own-share view of the warm-up leaves
    DP-SGD a sigma under its floor) and admits the job with each site adding the whole noise, the job keeps
    DP-SGD as derived and is signed per site: the DP-SGD remedy (steps cut, DP-SGD off) ran first and turned
    DP-SGD off. The node's verdict is stood in for (with per-site DP-SGD rounds a secure form's DP-SGD sigma
    was never measured below the per-site one); the order of the remedies is what is pinned."""
    import coordinator.derive as derive

    coord = Ed25519PrivateKey.generate()
    lows = dict.fromkeys(["st-mary", "st-luke"], _LOW_FLOORS)
    files, _ = _two_sites(tmp_path, coord, mechanisms=lows, pin_peers=True)  # the secure form planned
    said = "site st-luke: policy rule mechanisms.dpsgd.min_sigma: requested σ=1.2 < minimum 1.4"

    def refusals(cfg: Any, policies: Any) -> list[tuple[str, str, str]]:
        secure = cfg.federation.secure_aggregation is not False
        return [("st-luke", "mechanisms.dpsgd.min_sigma", said)] if secure and cfg.federated_rounds else []

    monkeypatch.setattr(derive, "site_refusals", refusals)
    d, _ = derive_federated(files, epsilon=10.0, time_budget=1200.0)
    assert d.cfg.federated_rounds > 0 and d.cfg.federation.secure_aggregation is False
    assert not any("cut from" in n or n.startswith("dpsgd: off") for n in d.notes), d.notes
    why = "site st-luke's node refuses it on its own share: mechanisms.dpsgd.min_sigma"
    assert any(n.startswith("federation: secure_aggregation = false") and why in n for n in d.notes), d.notes


@pytest.mark.parametrize("rule", ["job", "plan"])
def test_a_node_planner_refusal_of_the_derived_job_reads_as_the_plan_path_says_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rule: str
) -> None:
    """Where a site's node refuses the job by its planner (admission's rule ``job`` or ``plan``: no policy
    rule the site could change), the refusal is the plan path's one line, not a fix naming a POLICY rule."""
    import coordinator.derive as derive

    coord = Ed25519PrivateKey.generate()
    files, _ = _two_sites(tmp_path, coord)
    said = "site st-luke: job needs epsilon 11.2 > budget 10 at delta 1e-06"
    monkeypatch.setattr(derive, "site_refusals", lambda cfg, policies: [("st-luke", rule, said)])
    with pytest.raises(ConfigError) as exc:
        derive_federated(files, epsilon=10.0, time_budget=1200.0)
    head = "derived federated job: site st-luke's plan refuses it: "
    assert str(exc.value) == head + "job needs epsilon 11.2 > budget 10 at delta 1e-06"


def test_a_refusal_after_dpsgd_is_turned_off_names_the_remedy_in_short(tmp_path: Path) -> None:
    """St Luke allows no DP-SGD and floors the frequency sigma at 50: the job without DP-SGD is still refused,
    in one line whose parentheses name only what was changed and by which site's rule."""
    from feta_release.errors import PolicyViolation

    coord = Ed25519PrivateKey.generate()
    mechs = {"st-luke": {"dpsgd": {"allowed": False}, "frequency": {"min_sigma": 50.0}}}
    files, _ = _two_sites(tmp_path, coord, mechanisms=mechs)
    with pytest.raises(PolicyViolation) as exc:
        derive_federated(files, epsilon=10.0, time_budget=1200.0)
    msg = str(exc.value)
    assert "the derived federated job (DP-SGD off: site st-luke's policy allows no DP-SGD) would be" in msg
    assert "dpsgd: off (" not in msg


@pytest.mark.parametrize("mechanism", ["frequency", "central"])
def test_a_site_whose_sigma_floor_is_above_the_fitted_sigma_refuses_in_one_line(
    tmp_path: Path, mechanism: str
) -> None:
    """St Luke's floor on the frequency (or central) release's sigma is 50, far above the sigma the rules fit
    to a budget of 10: its node would refuse the job, so it is not derived. One line names the site, the rule
    and the fix."""
    from feta_release.errors import PolicyViolation

    coord = Ed25519PrivateKey.generate()
    files, _ = _two_sites(
        tmp_path,
        coord,
        mechanisms={"st-luke": {mechanism: {"min_sigma": 50.0}}},
    )
    with pytest.raises(PolicyViolation) as exc:
        derive_federated(files, epsilon=10.0, time_budget=1200.0)
    rule = f"mechanisms.{mechanism}.min_sigma"
    assert exc.value.rule == rule and exc.value.site == "st-luke"
    msg = str(exc.value)
    assert msg.startswith(f"site st-luke: policy rule {rule}:") and "\n" not in msg
    assert "< minimum 50" in msg and f"fix: the site changes {rule} in its POLICY" in msg


def test_coordinator_derive_job_refuses_a_job_a_site_would_refuse(tmp_path: Path, capsys: Any) -> None:
    """The CLI: the refusal is one line naming the site and rule, with the exit code of a policy refusal; no
    job file is written."""
    from feta_release.errors import PolicyViolation

    coord = Ed25519PrivateKey.generate()
    files, _ = _two_sites(
        tmp_path,
        coord,
        mechanisms={"st-luke": {"frequency": {"min_sigma": 50.0}}},
    )
    out = tmp_path / "job.toml"
    argv = ["coordinator", "derive-job", "--epsilon", "10", "--time-budget", "20m", "--out", str(out)]
    for f in files:
        argv += ["--policy", str(f)]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == PolicyViolation.exit_code
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith("error: site st-luke: policy rule mechanisms.frequency.min_sigma:"), line
    assert not out.exists()


_SITE_RULES = st.fixed_dictionaries(
    {
        "dpsgd": st.fixed_dictionaries(
            {
                "allowed": st.sampled_from([True, True, True, False]),
                "max_steps": st.integers(5, 400),
                "min_sigma": st.floats(0.3, 1.2),
            }
        ),
        "central": st.fixed_dictionaries({"min_sigma": st.floats(0.3, 1.2), "max_rounds": st.integers(1, 3)}),
        "frequency": st.fixed_dictionaries({"min_sigma": st.floats(0.3, 1.2)}),
    }
)
_SITE_RESOURCES = st.fixed_dictionaries(
    {
        "max_model_parameters": st.sampled_from([20_000_000, 20_000_000, 1_000_000, 100_000]),
        "max_physical_batch": st.integers(4, 256),
        "max_pass_rows": st.integers(8, 4096),
    }
)


_DEFAULT_RESOURCES = {"max_model_parameters": 20_000_000, "max_physical_batch": 256, "max_pass_rows": 4096}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rules=st.lists(_SITE_RULES, min_size=3, max_size=3),
    resources=st.lists(_SITE_RESOURCES, min_size=3, max_size=3),
    eps=st.sampled_from([10.0, 4.0, 1.0]),
    pin=st.booleans(),
    n_sites=st.sampled_from([2, 2, 3]),
    colluders=st.integers(0, 1),
)
@example(
    rules=[{"dpsgd": {"allowed": True, "max_steps": 400, "min_sigma": 0.3}}] * 3,
    resources=[_DEFAULT_RESOURCES] * 3,
    eps=10.0,
    pin=True,
    n_sites=2,
    colluders=0,
)
def test_whatever_derive_job_returns_every_sites_node_admits(
    rules: list[dict[str, Any]],
    resources: list[dict[str, int]],
    eps: float,
    pin: bool,
    n_sites: int,
    colluders: int,
) -> None:
    """Over random policies (DP-SGD allowed or not, step and round caps, sigma floors, resource caps, peers
    pinned or not, a pinned peer counted as a colluder or not, 2 or 3 sites): the derived job is admitted by
    every site's node, or it is refused in one line naming a site and its rule; never on a DP-SGD rule while
    the job without DP-SGD would be admitted, in either form of its noise."""
    import tempfile

    from feta_release.errors import PolicyViolation

    coord = Ed25519PrivateKey.generate()
    ids = ["st-mary", "st-luke", "st-john"][:n_sites]
    with tempfile.TemporaryDirectory() as tmp:
        files, pols = _policies(
            Path(tmp),
            dict.fromkeys(ids, 20_000),
            coord,
            per_job=(eps, 1e-5),
            mechanisms=dict(zip(ids, rules)),
            resources=dict(zip(ids, resources)),
            pin_peers=pin,
            max_colluders=colluders,
        )
        try:
            d, _ = derive_federated(files, epsilon=eps, time_budget=1200.0)
        except PolicyViolation as exc:
            assert exc.site in ids and str(exc).startswith(f"site {exc.site}: policy rule {exc.rule}:")
            assert exc.rule.startswith(("mechanisms.", "resources.", "budget.")) and "\n" not in str(exc)
            # no refusal where a remedy exists: DP-SGD off, or each site adding the whole noise
            if exc.rule.startswith("mechanisms.dpsgd."):
                assert _refused_in_every_form(files, eps, "off"), exc
            if "own noise share under secure aggregation" in str(exc):
                assert _refused_in_every_form(files, eps, "auto"), exc
            event(f"refused: {exc.rule}")
            return
        except ConfigError as exc:  # the sites' plans (budget, public sizes) refuse every form of the job
            assert str(exc).startswith("derived federated job") and "\n" not in str(exc), exc
            event("refused by a site's plan")
            return
        _signed_and_admitted(d, coord, ids, pols)
        event(f"admitted, {d.cfg.dpsgd_steps(d.facts.size) * (d.cfg.federated_rounds > 0)} DP-SGD steps")


def _refused_in_every_form(files: list[Path], eps: float, dpsgd: Literal["auto", "off"]) -> bool:
    """Whether some site's node refuses the job the rules derive (DP-SGD ``dpsgd``) summed securely and some
    site's node refuses it with each site adding the whole noise (a site's plan refusing it counts too)."""
    from dataclasses import replace

    from coordinator.derive import (
        dpsgd_batch_cap,
        facts_from_policies,
        federated_job,
        read_site_policy,
        site_refusals,
    )

    policies = [read_site_policy(f) for f in files]
    facts = replace(facts_from_policies(policies, eps, time_budget=1200.0), dpsgd=dpsgd)
    try:
        d = federated_job(facts, min(int(p.dataset_size) for p in policies), dpsgd_batch_cap(policies))
    except ConfigError:
        return True
    per_site = d.cfg.replace(federation={"secure_aggregation": False})  # the form derive-job falls back to
    return bool(site_refusals(d.cfg, policies)) and bool(site_refusals(per_site, policies))
