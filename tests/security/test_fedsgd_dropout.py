"""FedSGD's per-site contribution drew nn.Dropout masks from torch's GLOBAL generator (left open
in edge/fedsgd.py when the DP-SGD step was fixed: DPSGDTrainer.step seeds dropout privately,
gradient_contribution does not)."""

from __future__ import annotations

import numpy as np
import torch

from tests.support.federation import full_job, make_federation
from tests.support.federation import site_and_job as _site_and_job
from tests.support.sites import perturbed_weights as _perturbed_weights


def test_fedsgd_contribution_does_not_depend_on_torchs_global_rng(tmp_path):
    import edge.fedsgd as node_fedsgd
    from edge.protocol import Request, planned

    fed = make_federation(tmp_path / "fed")
    cfg = full_job(
        federation={"secure_aggregation": True, "fedsgd": True, "rounds": 2}, model={"dropout": 0.5}
    )
    site, job, _ = _site_and_job(fed, "job-drop", cfg, "site-a")
    event, _ = planned(site, job, "dpsgd")
    w = _perturbed_weights(job.config)
    outs = []
    state = torch.get_rng_state()
    try:
        for global_seed in (1, 2):
            torch.manual_seed(global_seed)
            req = Request("r", 0, event, {}, {k: v.copy() for k, v in w.items()})
            # same private randomness both times: only torch's global RNG differs
            outs.append(
                node_fedsgd.gradient_contribution(
                    site, job, req, np.random.default_rng(0), torch.Generator().manual_seed(0)
                )
            )
    finally:
        torch.set_rng_state(state)
    assert np.array_equal(outs[0], outs[1]), (
        "the released share depends on torch's global RNG (dropout masks)"
    )
