"""Federated ``[central] cells``: each site splits its per-class sums by the single-site stage's public
slant-cell function; the coordinator combines the (class, cell) sums exactly as a pooled single-site release
would be. Secure aggregation and per-site noise alike; the event (sensitivity) is the one of cells = 1; the
cells a release uses come from the SIGNED job, capped by the site's policy when it says so."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.setup import sign_job_file
from feta_release.accounting import PrivacyEvent, events_from_list
from feta_release.config import JobConfig
from feta_release.data import load_dataset
from feta_release.errors import FetaError
from feta_release.federation.warmup import pooled_central
from feta_release.mechanisms import skellam as sk
from feta_release.mechanisms.central import CentralRelease, central_images, postprocess_central
from feta_release.policy.document import SitePolicy
from feta_release.policy.enforce import check_request, request_of
from feta_release.policy.errors import PolicyViolation
from tests.support.federation import full_job, harness, ledger_requests, make_federation, run_harness_job

CELLS = 2


class NoiselessGenerator(np.random.Generator):
    """A numpy Generator whose Gaussian draws are zero (the test's noise-off switch for per-site releases)."""

    def normal(self, loc: Any = 0.0, scale: Any = 1.0, size: Any = None) -> Any:  # type: ignore[override]
        return np.zeros(size) if size is not None else 0.0


def cells_job(secure: bool, **central: Any) -> JobConfig:
    """Central images only (q = 1: every image is in the sum), 2 slant cells, no frequency stage, no
    DP-SGD."""
    return full_job(
        central={
            "rounds": 1,
            "batch": 40,
            "sigma": 5.0,
            "clip": 2.0,
            "cells": CELLS,
            "stretch": True,
            **central,
        },
        frequency={"sigma": None},
        warmup={"spatial_iterations": 0, "frequency_epochs": 0},
        dpsgd={"steps": 0},
        federation={"secure_aggregation": secure, "rounds": 0},
    )


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    f = make_federation(tmp_path_factory.mktemp("cellsfed") / "fed")
    assert {s.size for s in f.sites} == {40}  # equal public sizes: the size-weighted mean is the pooled sum
    return f


def _union(fed: Any) -> Any:
    parts = [load_dataset(Path(s.data))[0] for s in fed.sites]
    return (
        np.concatenate([p.images for p in parts]),
        np.concatenate([p.labels for p in parts]),
        parts[0].n_classes,
    )


def _pooled(fed: Any, cfg: JobConfig) -> CentralRelease:
    """The single-site computation over the union of the sites' data, noise off, same public denominator."""
    images, labels, k = _union(fed)
    c = cfg.central
    n = sum(s.size for s in fed.sites)
    rel, _ = central_images(
        images,
        labels,
        k,
        rounds=c.rounds,
        batch=c.batch * len(fed.sites),
        sigma=c.sigma,
        clip=c.clip,
        downsample=c.downsample,
        n_public=n,
        cells=c.cells,
        rng=NoiselessGenerator(np.random.PCG64(0)),
    )
    return rel


@pytest.mark.parametrize("secure", [True, False], ids=["secure", "per-site"])
def test_noise_off_federated_cells_equal_the_pooled_single_site_release(
    fed: Any, tmp_path: Path, secure: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if secure:  # each site's Skellam share set to zero; the quantization (1 / s per value) stays
        monkeypatch.setattr(sk, "skellam_noise", lambda dim, mu, rng: np.zeros(dim, dtype=np.int64))
    else:
        from edge import protocol

        monkeypatch.setattr(protocol.ReleaseRng, "numpy", lambda self: NoiselessGenerator(np.random.PCG64()))
    cfg = cells_job(secure)
    job_id = f"job-cells-{'sec' if secure else 'site'}"
    signed, _ = sign_job_file(fed, cfg, job_id)
    run_harness_job(fed, harness(fed), signed, tmp_path / "out")
    state = tmp_path / "out" / "state"
    pooled = _pooled(fed, cfg)
    assert pooled.values.shape[0] == 10 * CELLS and np.abs(pooled.values).max() > 0.05
    if secure:
        with np.load(state / "central_secure.npz") as z:
            arrays = {k: z[k] for k in z.files}
        central = {s.site_id: arrays for s in fed.sites}
    else:
        central = {}
        for s in fed.sites:
            with np.load(state / f"central_{s.site_id}.npz") as z:
                central[s.site_id] = {k: z[k] for k in z.files}
    combined = CentralRelease.from_arrays(next(iter(central.values())))
    assert combined.cells == CELLS and np.array_equal(combined.labels, pooled.labels)
    # one decoded sum: the pooled release's values up to the randomized rounding (< 1/s per record)
    if secure:
        assert combined.denominator == pytest.approx(pooled.denominator)
        np.testing.assert_allclose(combined.values, pooled.values, atol=2e-3)
    # what the coordinator's warm-up trains on (the same post-processing as the single-site stage)
    images, labels = pooled_central(central, {s.site_id: s.size for s in fed.sites}, cfg)
    ref_images, ref_labels = postprocess_central(pooled, stretch=True)
    assert np.array_equal(labels, ref_labels)
    np.testing.assert_allclose(images, ref_images, atol=0.02 if secure else 1e-5)


def test_cells_leave_the_charged_event_and_the_plan_unchanged(fed: Any, tmp_path: Path) -> None:
    """Sensitivity: one image lands in exactly one (class, cell) sum, so the site charges (and the coordinator
    plans) the same event with 2 cells as with 1; the ledger holds the planned event."""
    for secure in (True, False):
        plans = {}
        for cells in (1, CELLS):
            job_id = f"job-ev-{int(secure)}-{cells}"
            signed, _ = sign_job_file(fed, cells_job(secure, cells=cells), job_id)
            out = tmp_path / job_id
            run_harness_job(fed, harness(fed), signed, out)
            plan = json.loads((out / "plan.json").read_text())
            for s in fed.sites:
                charged = events_from_list(
                    [e for r in ledger_requests(fed, s.site_id, job_id) for e in r["events"]]
                )
                assert [e.to_dict() for e in charged] == plan[s.site_id]["events"]
            plans[cells] = {sid: v["events"] for sid, v in plan.items()}
        assert plans[1] == plans[CELLS]


def test_a_coordinator_cannot_change_the_cells_a_site_verified(fed: Any, tmp_path: Path) -> None:
    """cells is in the SIGNED job: a coordinator editing it after signing is refused before any charge; a site
    whose policy caps cells refuses a job asking more (before any charge), at the node and in the
    coordinator's plan."""
    signed, _ = sign_job_file(fed, cells_job(True), "job-cells-tampered")
    tampered = copy.deepcopy(signed)
    tampered["job"]["config"]["central"]["cells"] = 4
    with pytest.raises(FetaError):
        run_harness_job(fed, harness(fed), tampered, tmp_path / "tampered")
    for s in fed.sites:
        assert ledger_requests(fed, s.site_id, "job-cells-tampered") == []
    policy = json.loads(fed.site("site-a").policy.read_text())["policy"]
    policy["mechanisms"]["central"]["max_cells"] = 1
    capped = SitePolicy.from_document(policy, None)
    cfg = cells_job(True)
    ev = PrivacyEvent("central", 5.0, 1.0, 1)
    with pytest.raises(PolicyViolation, match="max_cells"):
        check_request(capped, request_of(ev, cfg), require_job=False)
    check_request(capped, request_of(ev, cells_job(True, cells=1)), require_job=False)
    uncapped = SitePolicy.from_document(json.loads(fed.site("site-a").policy.read_text())["policy"], None)
    with pytest.raises(PolicyViolation, match="max_cells"):  # A default cap without max_cells
        check_request(uncapped, request_of(ev, cells_job(True, cells=10**6)), require_job=False)


@pytest.mark.parametrize("secure", [True, False], ids=["secure", "per-site"])
def test_a_federated_job_without_dpsgd_runs_end_to_end(fed: Any, tmp_path: Path, secure: bool) -> None:
    """``[dpsgd] steps = 0`` (cpu-eps1-nodpsgd) in a federated job: no DP-SGD round is planned, asked or
    charged, whatever ``[federation] rounds`` says; the model after the warm-ups is the released one."""
    from feta_release.federation import messages as fm

    cfg = full_job(
        central={"cells": CELLS}, dpsgd={"steps": 0}, federation={"secure_aggregation": secure, "rounds": 3}
    )
    assert cfg.federated_rounds == 0
    job_id = f"job-nodpsgd-{int(secure)}"
    signed, _ = sign_job_file(fed, cfg, job_id)
    grid = harness(fed)
    res = run_harness_job(fed, grid, signed, tmp_path / "out")
    assert res.rounds_done == 0 and (tmp_path / "out" / "model.pt").exists()
    assert fm.TRAIN not in [m.metadata.message_type for m in grid.sent]
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    for s in fed.sites:
        assert [r["mechanism"] for r in ledger_requests(fed, s.site_id, job_id)] == ["central", "frequency"]
        assert [e["stage"] for e in plan[s.site_id]["events"]] == ["central", "frequency"]
        assert plan[s.site_id]["dpsgd_sigma"] is None and plan[s.site_id]["planned_epsilon"] <= 1.0
