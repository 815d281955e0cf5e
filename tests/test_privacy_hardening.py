"""Issue 12 §1: nothing un-noised leaves a site. Each test is an attack that worked on the code before the fix."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.setup import sign_job_file
from feta_release.federation import messages as fm

from .federation_fixtures import full_job, harness, make_federation, tiny_job

# What a site may put beside its released arrays: public values fixed by the signed job and policy, ids, and the
# privacy events (σ, q, steps: public too). Anything else is a new channel that must be reviewed first.
PUBLIC_REPLY_FIELDS = {
    fm.TRAIN: {"round", "num_examples", "sigma", "q", "site_id", "request_id", "events"},
    fm.CENTRAL: {"site_id", "request_id", "events"},
    fm.FREQUENCY: {"site_id", "request_id", "events"},
}


@pytest.fixture()
def fed(tmp_path):
    return make_federation(tmp_path / "fed")


def _weights(cfg):
    from feta_release.models import build_denoiser

    return {k: v.numpy() for k, v in build_denoiser(cfg.model, (1, 28, 28), 10).state_dict().items()}


def _ask(grid, signed, mtype, doc=None, arrays=None, node=100):
    msg = grid.create_message(fm.make_payload({"job": signed, **(doc or {})}, arrays), mtype, node, "t")
    (rep,) = grid.send_and_receive([msg])
    assert not rep.has_error(), rep.error.reason if rep.has_error() else ""
    return fm.read_payload(rep.content)


def test_train_reply_carries_no_loss_no_seconds_only_public_fields(fed):
    """Attack: a coordinator that picks the weights reads the un-noised mean loss of the private Poisson batch
    (a counting query) and the on-site seconds (the realised batch size) from every DP-SGD reply."""
    cfg = tiny_job()
    signed, _ = sign_job_file(fed, cfg, "job-reply")
    doc, arrays = _ask(harness(fed), signed, fm.TRAIN, {"round": 0}, _weights(cfg))
    assert "loss" not in doc and "seconds" not in doc
    assert set(doc) <= PUBLIC_REPLY_FIELDS[fm.TRAIN], set(doc) - PUBLIC_REPLY_FIELDS[fm.TRAIN]
    assert set(arrays) == set(_weights(cfg))  # the weights, and no extra array


def test_central_and_frequency_replies_carry_no_timing(fed):
    cfg = full_job()
    signed, _ = sign_job_file(fed, cfg, "job-stats")
    grid = harness(fed)
    for mtype in (fm.CENTRAL, fm.FREQUENCY):
        doc, _ = _ask(grid, signed, mtype)
        assert "seconds" not in doc
        assert set(doc) <= PUBLIC_REPLY_FIELDS[mtype], (mtype, set(doc) - PUBLIC_REPLY_FIELDS[mtype])
