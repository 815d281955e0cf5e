"""Semantic selection: the node's request + the coordinator's step, in `train` and in a federation. The
charge is committed before any private image is read, the ledgers hold the planner's events, and a site
receives the public groups' centroids, never a public image."""

from __future__ import annotations

import json

import numpy as np
import pytest

from feta_release.config import load_preset
from feta_release.data import ImageDataset, load_embedded
from feta_release.data.procedural import generate_dataset
from feta_release.errors import PrivacyError
from feta_release.ledger import Ledger
from feta_release.mechanisms import selection as sel
from feta_release.planning import stage_events
from feta_release.stages import PublicInputs
from feta_release.stages.pretrain import with_public
from tests.support.training import site_requests, train_run

pytestmark = pytest.mark.slow  # a tiny run and a tiny federation


def _data(n: int = 240) -> ImageDataset:
    full = load_embedded()
    rng = np.random.default_rng(0)
    idx = np.concatenate(
        [rng.choice(np.flatnonzero(full.labels == c), n // 10, replace=False) for c in range(10)]
    )
    return full.subset(np.sort(idx))


def _order_recorder(monkeypatch) -> list[str]:
    """Every ledger charge and every private vote count, in the order they happen."""
    order: list[str] = []
    charge, votes = Ledger.charge, sel.vote_counts

    def charged(self, job_id, rid, mechanism, events, limits):
        out = charge(self, job_id, rid, mechanism, events, limits)
        order.append(f"charge:{mechanism}")
        return out

    def counted(images, centroids):
        if len(images) and np.asarray(images).any():  # the padding's blank rows are not the site's images
            order.append("votes")
        return votes(images, centroids)

    monkeypatch.setattr(Ledger, "charge", charged)
    monkeypatch.setattr(sel, "vote_counts", counted)
    return order


def test_train_charges_the_selection_before_it_reads_an_image_and_pretrains_on_the_kept_part(
    tmp_path, monkeypatch
):
    public = generate_dataset("strokes", 64, size=28, seed=4)
    cfg = load_preset("tiny").replace(
        public={
            "pretrain_iterations": 3,
            "pretrain_batch": 16,
            "selection": True,
            "selection_groups": 4,
            "selection_keep": 0.3,
        }
    )
    order = _order_recorder(monkeypatch)
    out = tmp_path / "r"
    train_run(cfg, _data(), out, public_size=240, public=PublicInputs(public, "pen strokes"), release=False)
    assert order[:2] == ["charge:selection", "votes"]  # fails when the votes are counted before the charge
    rows = site_requests(out)
    assert [r["mechanism"] for r in rows] == ["selection", "central", "frequency", "dpsgd"]
    signed = with_public(cfg, PublicInputs(public, "pen strokes"), (1, 28, 28))
    assert [e["stage"] for r in rows for e in r["events"]] == [e.stage for e in stage_events(signed, 240)]
    kept = json.loads((out / "selection.json").read_text())["kept"]
    assert 0.3 * 64 <= kept < 64
    assert not (out / "pretrained.pt").exists()  # a charged selection's weights are not offered as public


def test_a_federated_selection_sends_centroids_only_and_each_site_charges_it_first(tmp_path, monkeypatch):
    from flwr.common.serde import message_to_proto

    from coordinator.setup import sign_job_file
    from feta_release.federation import harness as h
    from feta_release.federation import messages as fm
    from tests.support.federation import harness, ledger_requests, make_federation, run_harness_job, tiny_job

    fed = make_federation(tmp_path / "fed")
    public = generate_dataset("strokes", 48, size=28, seed=9)
    pub = PublicInputs(public, "pen strokes")
    cfg = with_public(
        tiny_job(
            public={"pretrain_iterations": 2, "pretrain_batch": 8, "selection": True, "selection_groups": 3}
        ),
        pub,
        (1, 28, 28),
    )
    signed, _ = sign_job_file(fed, cfg, "job-sel")
    sent, selection_arrays = [], []
    wire = h._wire

    def record(msg):
        sent.append(message_to_proto(msg).SerializeToString())
        if msg.metadata.message_type == fm.SELECTION and msg.metadata.reply_to_message_id == "":
            selection_arrays.append(fm.read_payload(msg.content)[1])
        return wire(msg)

    monkeypatch.setattr(h, "_wire", record)
    order = _order_recorder(monkeypatch)
    res = run_harness_job(fed, harness(fed), signed, tmp_path / "out", public=pub)
    assert res.rounds_done == 2
    assert len(selection_arrays) == len(fed.sites)
    for arrays in selection_arrays:  # the request carries the centroids alone: groups x thumbnail features
        assert set(arrays) == {"centroids"} and arrays["centroids"].shape == (3, sel.feature_dim((1, 28, 28)))
    images = [np.ascontiguousarray(public.images[i], "<f4").tobytes() for i in range(public.n)]
    pixels = [np.rint(public.images[i] * 255).astype(np.uint8).tobytes() for i in range(public.n)]
    assert not any(img in m for m in sent for img in images + pixels)
    for i in range(len(fed.sites)):  # each site: its charge, then its votes (the harness asks sites in turn)
        assert order[2 * i : 2 * i + 2] == ["charge:selection", "votes"]
    for s in fed.sites:
        rows = ledger_requests(fed, s.site_id, "job-sel")
        assert rows[0]["mechanism"] == "selection"
        assert rows[0]["events"] == [sel.selection_event(20.0).to_dict()]
    doc = json.loads((tmp_path / "out" / "selection.json").read_text())
    assert len(doc["histogram"]) == 3 and 0.5 * 48 <= doc["kept"] <= 48


def test_a_selection_below_the_sites_min_sigma_is_refused_before_any_charge_or_vote(tmp_path, monkeypatch):
    from coordinator.setup import sign_job_file
    from feta_release.policy.errors import JobDoesNotFit
    from tests.support.federation import harness, make_federation, run_harness_job, tiny_job

    fed = make_federation(
        tmp_path / "fed",
        policy_overrides={
            s: {"per_job": (10.0, 1e-5), "lifetime": (20.0, 1e-5)} for s in ("site-a", "site-b", "site-c")
        },
    )
    public = generate_dataset("strokes", 48, size=28, seed=9)
    pub = PublicInputs(public)
    job = tiny_job(
        privacy={"epsilon": 10.0},
        public={"pretrain_iterations": 2, "selection": True, "selection_groups": 3, "selection_sigma": 3.0},
    )
    cfg = with_public(job, pub, (1, 28, 28))
    signed, _ = sign_job_file(fed, cfg, "job-sel-over")
    order = _order_recorder(monkeypatch)
    with pytest.raises(JobDoesNotFit, match="mechanisms.selection.min_sigma"):  # the research policy's 5.0
        run_harness_job(fed, harness(fed), signed, tmp_path / "out", public=pub)
    assert order == []
    over, _ = sign_job_file(fed, cfg.replace(privacy={"epsilon": 1.0}), "job-sel-budget")  # sigma 3: eps > 1
    with pytest.raises(PrivacyError, match=r"shrink \[public\] selection_sigma"):
        run_harness_job(fed, harness(fed), over, tmp_path / "out2", public=pub)
    assert order == []
