"""Patient-level privacy: the per-patient cap, its stability, sensitivities under add/remove of a whole
patient, the group-privacy statement, and `privacy plan` for 2,000 patients x 1-20 images."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from feta_release.errors import ConfigError, PrivacyError
from feta_release.privacy_unit import PrivacyUnit, cap_per_patient, group_privacy

patient_lists = st.lists(st.integers(0, 12), min_size=1, max_size=80)


@settings(max_examples=200, deadline=None)
@given(patients=patient_lists, k=st.integers(1, 6))
def test_cap_bounds_each_patient_and_keeps_file_order(patients: list[int], k: int) -> None:
    keep = cap_per_patient(np.array(patients), k)
    kept = np.array(patients)[keep]
    assert (np.diff(keep) > 0).all()
    for p in set(patients):
        assert (kept == p).sum() == min(k, patients.count(p))
        assert keep[kept == p].tolist() == [i for i, q in enumerate(patients) if q == p][:k]


@settings(max_examples=200, deadline=None)
@given(patients=patient_lists, k=st.integers(1, 6), data=st.data())
def test_removing_a_patient_changes_at_most_k_records(patients: list[int], k: int, data) -> None:  # noqa: ANN001
    """Stability: D and D minus patient P differ, after the cap, only in P's <= k records."""
    victim = data.draw(st.sampled_from(sorted(set(patients))))
    rows = np.arange(len(patients))
    full = set(rows[cap_per_patient(np.array(patients), k)].tolist())
    rest = [i for i in rows if patients[i] != victim]
    without = {rest[j] for j in cap_per_patient(np.array([patients[i] for i in rest]), k).tolist()}
    diff = full ^ without
    assert without <= full and len(diff) <= k and all(patients[i] == victim for i in diff)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 20), min_size=2, max_size=12), k=st.integers(1, 5), seed=st.integers(0, 99)
)
def test_central_sum_sensitivity_under_whole_patient(sizes: list[int], k: int, seed: int) -> None:
    """The central mean query's L2 change when a whole patient (worst case: many images) leaves is <= k *
    clip."""
    from feta_release.mechanisms.central import central_query

    rng = np.random.default_rng(seed)
    patients = np.repeat(np.arange(len(sizes)), sizes)
    images = rng.random((len(patients), 1, 8, 8)).astype(np.float32)
    labels = rng.integers(0, 2, len(patients))
    heavy = int(np.argmax(sizes))
    keep = cap_per_patient(patients, k)
    clip = 1.5
    q_all, sens = central_query(images[keep], labels[keep], 2, clip=clip)
    rest = np.flatnonzero(patients != heavy)
    keep2 = rest[cap_per_patient(patients[rest], k)]
    q_rest, _ = central_query(images[keep2], labels[keep2], 2, clip=clip)
    assert sens == pytest.approx(clip)
    assert np.linalg.norm(q_all - q_rest) <= k * sens + 1e-6
    if k == 1:  # with the cap, a patient of 20 images moves the query no more than one image does
        assert np.linalg.norm(q_all - q_rest) <= sens + 1e-6


@settings(max_examples=100, deadline=None)
@given(eps=st.floats(0.01, 20), delta=st.floats(1e-9, 1e-3), k=st.integers(1, 50))
def test_group_privacy_statement(eps: float, delta: float, k: int) -> None:
    ge, gd = group_privacy(eps, delta, k)
    assert ge == pytest.approx(k * eps) and 0 < gd <= 1
    if k == 1:
        assert (ge, gd) == (eps, delta)
    else:
        assert gd >= min(1.0, k * delta)
        assert gd == pytest.approx(min(1.0, k * math.exp(min((k - 1) * eps, 700)) * delta))
    with pytest.raises(PrivacyError):
        group_privacy(eps, delta, 0)


def test_unit_statements() -> None:
    p1 = PrivacyUnit("patient", 1).statement(1.0, 1e-5)
    assert p1["unit"] == "patient" and p1["epsilon_per_patient"] == 1.0 and "exact" in p1["how"]
    p5 = PrivacyUnit("patient", 5).statement(1.0, 1e-5)
    assert p5["epsilon_per_patient"] == 5.0 and "5·clip" in p5["sensitivity"]
    # with the events: ε per patient at δ itself (the figure the site's caps bound), never a larger δ
    from feta_release.accounting import PrivacyEvent, patient_epsilon

    evs = [PrivacyEvent("central", 8.0, 0.5, 2), PrivacyEvent("dpsgd", 1.0, 0.05, 100, unit="patient")]
    pe = PrivacyUnit("patient", 5).statement(1.0, 1e-5, evs)
    assert pe["delta_per_patient"] == 1e-5 and pe["epsilon_per_patient"] == patient_epsilon(evs, 1e-5, 5)
    img = PrivacyUnit("image", 20).statement(1.0, 1e-5)
    assert (
        img["unit"] == "image" and img["epsilon_for_largest_group"] == 20.0 and "group privacy" in img["how"]
    )


def test_load_with_patient_cap_and_refusal_without_ids(tmp_path: Path) -> None:
    from feta_release.data import load_dataset

    lines = ["path,label,patient_id"]
    for i in range(9):
        Image.fromarray(np.full((8, 8), 20 * i, np.uint8)).save(tmp_path / f"{i}.png")
        lines.append(f"{i}.png,{'a' if i % 2 else 'b'},P{0 if i < 6 else i}")  # P0 has 6 images
    (tmp_path / "l.csv").write_text("\n".join(lines) + "\n")
    ds, rep = load_dataset(tmp_path / "l.csv", patient_cap=2)
    assert ds.n == 5 and rep.n_dropped_by_cap == 4 and rep.patients.tolist() == [0, 0, 1, 2, 3]
    assert rep.files[:2] == [str((tmp_path / "0.png").resolve()), str((tmp_path / "1.png").resolve())]
    (tmp_path / "c" / "x").mkdir(parents=True)
    (tmp_path / "c" / "y").mkdir()
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / "c" / "x" / "0.png")
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / "c" / "y" / "0.png")
    with pytest.raises(ConfigError, match="patient cap needs patient ids"):
        load_dataset(tmp_path / "c", patient_cap=1)


def _plan(args: list[str], capsys) -> dict:  # noqa: ANN001
    from feta_release.cli import main

    main(["privacy", "plan", *args, "--json"])
    return json.loads(capsys.readouterr().out)


def _eps20_job(tmp_path: Path) -> Path:
    """cpu-eps10 with a budget of 20: room, per patient of 5 images, for its warm-up and DP-SGD."""
    text = (Path(__file__).resolve().parents[2] / "feta_release" / "presets" / "cpu-eps10.toml").read_text()
    (job := tmp_path / "eps20.toml").write_text(text.replace("epsilon = 10.0", "epsilon = 20.0", 1))
    return job


def test_privacy_plan_two_thousand_patients(capsys, tmp_path: Path) -> None:  # noqa: ANN001
    """2,000 patients with 1-20 images each: the cap sets N and the statement the unit; with a cap the job's
    budget is a budget PER PATIENT (a cap of 5 cannot fit cpu-eps1's warm-up in ε 1 per patient: refused,
    naming it)."""
    from feta_release.cli import main

    preset = Path(__file__).resolve().parents[2] / "feta_release" / "presets" / "cpu-eps1.toml"
    rng = np.random.default_rng(7)
    counts = rng.integers(1, 21, 2000)
    patients = np.repeat(np.arange(2000), counts)
    n1 = len(cap_per_patient(patients, 1))
    n5 = len(cap_per_patient(patients, 5))
    assert n1 == 2000 and n5 == int(np.minimum(counts, 5).sum())
    one = _plan([str(preset), "-n", str(n1), "--patient-cap", "1"], capsys)
    u = one["privacy_unit"]
    assert u["unit"] == "patient" and u["epsilon_per_patient"] == pytest.approx(one["epsilon"])
    assert one["epsilon"] <= 1.0 + 1e-9
    with pytest.raises(SystemExit):
        main(["privacy", "plan", str(preset), "-n", str(n5), "--patient-cap", "5", "--patients", "2000"])
    assert "PER PATIENT" in capsys.readouterr().err
    five = _plan(
        [str(_eps20_job(tmp_path)), "-n", str(n5), "--patient-cap", "5", "--patients", "2000"], capsys
    )
    assert five["privacy_unit"]["epsilon_per_patient"] == pytest.approx(five["epsilon"])
    assert 19.5 < five["epsilon"] <= 20.0 + 1e-9 and five["privacy_unit"]["delta_per_patient"] == 1e-5
    img = _plan([str(preset), "-n", str(len(patients)), "--max-images-per-person", "20"], capsys)
    assert img["privacy_unit"]["unit"] == "image"
    assert img["privacy_unit"]["epsilon_for_largest_group"] == pytest.approx(20 * img["epsilon"])


def test_privacy_plan_patient_level_dpsgd(capsys, tmp_path: Path) -> None:  # noqa: ANN001
    """--patients: DP-SGD's ε is per patient directly, only the warm-up goes through group privacy, so at the
    same per-patient budget patient-level DP-SGD needs less noise than image-level DP-SGD grouped over the
    cap."""
    from feta_release.config import load_job
    from feta_release.mechanisms.count import size_event
    from feta_release.planning import patient_dpsgd
    from feta_release.planning import plan as planner

    job = str(_eps20_job(tmp_path))
    # image-level DP-SGD grouped over the cap: the planner's, as no site runs it (`privacy plan` refuses a
    # cap of 5 without --patients: `train` would draw the patient count and sample patients)
    res = planner(load_job(job), 9000, size=size_event(), **patient_dpsgd(None, 5))
    grouped = {
        **res.to_dict(),
        "privacy_unit": PrivacyUnit("patient", 5).statement(res.epsilon, res.delta, res.events),
    }
    direct = _plan([job, "-n", "9000", "--patient-cap", "5", "--patients", "2000"], capsys)
    for plan in (grouped, direct):  # both calibrated to the budget per patient
        assert plan["privacy_unit"]["epsilon_per_patient"] == pytest.approx(plan["epsilon"])
        assert 19.5 < plan["epsilon"] <= 20.0 + 1e-9
    assert direct["noise_multiplier"] < grouped["noise_multiplier"]
    assert [e.get("unit", "image") for e in direct["history"]][-1] == "patient"
    u = direct["privacy_unit"]
    assert u["epsilon_per_patient"] == pytest.approx(
        u["epsilon_warmup_per_patient"] + u["epsilon_dpsgd_per_patient"]
    )
    sgd = [e for e in direct["history"] if e["stage"] == "dpsgd"][0]
    assert u["expected_patients_per_step"] == pytest.approx(sgd["q"] * 2000)


def test_privacy_plan_of_a_job_file_samples_patients_as_the_node_and_train_do(
    capsys,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    """`privacy plan JOB --patients P --patient-cap K` planned DP-SGD at q = batch / images while `train`
    and a patient-level node sample whole patients at q = batch / P: its σ and ε were not what the ledger
    charges. The plan's DP-SGD q, σ and total must be the planner's for the same public facts."""
    from types import SimpleNamespace

    from feta_release.config import load_job
    from feta_release.mechanisms.count import size_event
    from feta_release.planning import plan, site_dpsgd

    job = _eps20_job(tmp_path)
    printed = _plan([str(job), "-n", "9000", "--patient-cap", "5", "--patients", "2000"], capsys)
    cfg = load_job(job)
    site = SimpleNamespace(privacy_unit="patient", patients=2000, patient_cap=5)
    ledger = plan(cfg, 9000, size=size_event(), **site_dpsgd(site))
    sgd = [e for e in printed["history"] if e["stage"] == "dpsgd"][0]
    assert sgd["q"] == pytest.approx(cfg.for_size(9000).dpsgd.batch / 2000)
    assert sgd["q"] == pytest.approx(ledger.event("dpsgd").q)  # type: ignore[union-attr]
    assert printed["noise_multiplier"] == pytest.approx(ledger.to_dict()["noise_multiplier"])
    assert printed["epsilon"] == pytest.approx(ledger.epsilon)


def test_the_release_text_of_an_image_level_site_states_group_privacy_with_delta() -> None:
    """The image-unit text said "(a patient-level site with patient cap k: k·ε per patient)": read as a
    patient bound an image-level site does not give, and silent on δ, which grows to k·e^((k−1)ε)·δ."""
    from feta_release.release.manifest import _figure_words

    text = _figure_words("central", "image", {"a": 1.0}, {})
    assert "patient-level site" not in text
    assert "k·e^((k−1)·ε)·δ" in text and "caps no one" in text
    assert "group privacy" not in _figure_words("central", "patient", {"a": 1.0}, {})
