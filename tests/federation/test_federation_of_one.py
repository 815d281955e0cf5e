"""``train`` and a federation of ONE site set up as a deployment sets one up (a site kit on disk: data file,
keys, data secret, a policy signed by its administrator; the node's handlers and the coordinator's
``JobDriver`` over the in-process Grid, as ``demo`` runs them) account the same job identically: the same
events in the ledger, the same merged privacy history and ε, and both are the planner's
(``planning.stage_events`` / ``plan``).

``train`` opens its site over the images in memory, under its own one-site policy, and signs its own job
(``coordinator.local_run.one_site_job``: the job sized for the site's public size, its DP-SGD one round of all
of its steps); the federated job here is signed by the kit's coordinator from the same rule. A change on
either side (the run's policy, its job, its site's planning) fails this test.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from feta_release.accounting import epsilon, events_from_list
from feta_release.config import load_preset
from feta_release.data import ImageDataset, load_embedded
from feta_release.ledger import Ledger
from feta_release.planning import merged, plan, stage_events
from tests.support.federation import harness, run_harness_job
from tests.support.training import site_requests, train_run


def _data(n: int = 200) -> ImageDataset:
    full = load_embedded()
    rng = np.random.default_rng(3)
    idx = np.concatenate(
        [rng.choice(np.flatnonzero(full.labels == c), n // 10, replace=False) for c in range(10)]
    )
    return full.subset(np.sort(idx), source="embedded subset")


@pytest.mark.slow  # a local run and a whole one-site federated job: about a minute on a loaded machine
def test_train_and_a_federation_of_one_charge_the_planners_events(tmp_path: Path) -> None:
    from coordinator.local_run import one_site_job
    from coordinator.setup import prepare_federation, sign_job_file

    data = _data()
    n_pub = 200
    cfg = load_preset("tiny")
    # train: DP-SGD one round of all its steps, charged once (checkpoints every 2 steps change nothing of it)
    steps = plan(cfg, n_pub).event("dpsgd").steps  # type: ignore[union-attr]
    local = train_run(cfg, data, tmp_path / "run", checkpoint_every=2, public_size=n_pub, release=False)
    local_charged = [e for r in site_requests(tmp_path / "run") for e in events_from_list(r["events"])]

    # the same job, federated over one site: node handlers + JobDriver over the in-process Grid
    eps, delta = cfg.privacy.epsilon, cfg.privacy.delta
    fed = prepare_federation(
        tmp_path / "fed",
        {"site-a": data},
        public_sizes={"site-a": n_pub},
        policy_overrides={"site-a": {"per_job": (eps, delta), "lifetime": (2 * eps, delta)}},
    )
    job = one_site_job(cfg.for_size(n_pub), n_pub)
    signed, _ = sign_job_file(fed, job, "job-one")
    res = run_harness_job(fed, harness(fed), signed, tmp_path / "out")
    att = res.attestations["site-a"]["statement"]
    with Ledger(fed.site("site-a").ledger) as led:
        fed_charged = [e for r in led.requests("job-one") for e in events_from_list(r["events"])]

    # one job: train signed the config the kit's coordinator signed
    train_job = json.loads((tmp_path / "run" / "signed_job.json").read_text("utf-8"))["job"]
    assert train_job["config"] == signed["job"]["config"] and train_job["sites"] == ["site"]
    planned = plan(cfg, n_pub)
    # the ledgers hold the same events, request by request, and they are the planner's
    assert local_charged == fed_charged == stage_events(cfg, n_pub, rounds=[steps])
    assert fed_charged == stage_events(job, n_pub, federated=True)
    # the merged histories and ε: the run's, the attestation's and the plan's
    assert local.events == merged(events_from_list(att["events"])) == planned.events
    assert att["epsilon"] == pytest.approx(local.epsilon, rel=1e-12)
    assert local.epsilon == pytest.approx(epsilon(planned.events, delta), rel=1e-12)
    assert res.rounds_done == 1
