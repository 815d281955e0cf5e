"""``train`` and a federation of ONE site (the node's handlers and the coordinator's ``JobDriver`` over the
in-process Grid, as ``demo`` runs them) account the same job identically: the same events in the ledger, the
same merged privacy history and ε, and both are the planner's (``planning.stage_events`` / ``plan``).

The federated job is the local one as the local driver would sign it: the job sized for the site's public
size, one site, and its DP-SGD as one round of all of its steps (``[federation] rounds = 1``, ``local_steps``
= the job's DP-SGD steps), the schedule of every ``train`` run (``--checkpoint-every`` only spaces its
checkpoints).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from feta_release.accounting import epsilon, events_from_list
from feta_release.config import JobConfig, load_preset
from feta_release.data import ImageDataset, load_embedded
from feta_release.ledger import Ledger
from feta_release.planning import merged, plan, stage_events
from feta_release.training.pipeline import run_pipeline
from tests.support.federation import harness, run_harness_job


def _data(n: int = 200) -> ImageDataset:
    full = load_embedded()
    rng = np.random.default_rng(3)
    idx = np.concatenate(
        [rng.choice(np.flatnonzero(full.labels == c), n // 10, replace=False) for c in range(10)]
    )
    return full.subset(np.sort(idx), source="embedded subset")


def _one_site_job(cfg: JobConfig, n_public: int) -> JobConfig:
    """The local job as a one-site federated job: sized for the site, DP-SGD as one round of all its steps."""
    sized = cfg.for_size(n_public)
    return sized.replace(federation={"min_sites": 1, "rounds": 1, "local_steps": sized.dpsgd_steps(n_public)})


@pytest.mark.slow  # a local run and a whole one-site federated job: about a minute on a loaded machine
def test_train_and_a_federation_of_one_charge_the_planners_events(tmp_path: Path) -> None:
    from coordinator.setup import prepare_federation, sign_job_file

    data = _data()
    n_pub = 200
    cfg = load_preset("tiny")
    # train: DP-SGD one round of all its steps, charged once (checkpoints every 2 steps change nothing of it)
    steps = plan(cfg, n_pub).event("dpsgd").steps  # type: ignore[union-attr]
    local = run_pipeline(
        cfg, data, tmp_path / "run", n_synthetic=0, grid_per_class=1, checkpoint_every=2, public_size=n_pub
    )
    run = json.loads((tmp_path / "run" / "run.json").read_text("utf-8"))
    with Ledger(tmp_path / "run" / run["ledger"]["path"]) as led:
        local_charged = [
            e for r in led.requests(run["ledger"]["job_id"]) for e in events_from_list(r["events"])
        ]

    # the same job, federated over one site: node handlers + JobDriver over the in-process Grid
    eps, delta = cfg.privacy.epsilon, cfg.privacy.delta
    fed = prepare_federation(
        tmp_path / "fed",
        {"site-a": data},
        public_sizes={"site-a": n_pub},
        policy_overrides={"site-a": {"per_job": (eps, delta), "lifetime": (2 * eps, delta)}},
    )
    job = _one_site_job(cfg, n_pub)
    signed, _ = sign_job_file(fed, job, "job-one")
    res = run_harness_job(fed, harness(fed), signed, tmp_path / "out")
    att = res.attestations["site-a"]["statement"]
    with Ledger(fed.site("site-a").ledger) as led:
        fed_charged = [e for r in led.requests("job-one") for e in events_from_list(r["events"])]

    planned = plan(cfg, n_pub)
    # the ledgers hold the same events, request by request, and they are the planner's
    assert local_charged == fed_charged == stage_events(cfg, n_pub, rounds=[steps])
    assert fed_charged == stage_events(job, n_pub, federated=True)
    # the merged histories and ε: the run's, the attestation's and the plan's
    assert local.events == merged(events_from_list(att["events"])) == planned.events
    assert att["epsilon"] == pytest.approx(local.epsilon, rel=1e-12)
    assert local.epsilon == pytest.approx(epsilon(planned.events, delta), rel=1e-12)
    assert res.rounds_done == 1
