"""A node's DP-SGD round whose process is KILLED after its charge is finished when the same request comes
again, from the round's own checkpoint, and answered once: nothing charged twice, no charged step lost
(docs/architecture.md, "resume inside a charged round"). Before, such a request was refused for ever ("charged
but its result was never recorded"), so a killed ``train`` could not go on over the node. A round that FAILED
(an exception, whose cause may depend on the data) stays refused, and a checkpoint swapped into the work
directory is never loaded."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from coordinator.setup import sign_job_file
from feta_release.federation import messages as fm
from feta_release.ledger import Ledger
from tests.support.federation import make_federation, tiny_job
from tests.support.killed_steps import Killed, count_steps


@pytest.fixture
def fed(tmp_path):
    return make_federation(tmp_path / "fed")


def _grid(fed: Any, every: int) -> Any:
    from edge.clientapp import app
    from edge.site import CFG_ROUND_CHECKPOINT, forget_sites
    from feta_release.federation.harness import HarnessNode, InProcessGrid

    forget_sites()  # a fresh open of the site, as a restarted node
    s = fed.sites[0]
    return InProcessGrid({100: HarnessNode(app, {**s.node_config(), CFG_ROUND_CHECKPOINT: str(every)})})


def _ask(grid: Any, signed: dict[str, Any], weights: dict[str, np.ndarray]) -> Any:
    msg = grid.create_message(fm.make_payload({"job": signed, "round": 0}, weights), fm.TRAIN, 100, "round-0")
    (rep,) = grid.send_and_receive([msg])
    return rep


def _setup(fed: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    from feta_release.models import build_denoiser

    cfg = tiny_job(federation={"min_sites": 1, "rounds": 1, "local_steps": 5})
    signed, _ = sign_job_file(fed, cfg, "job-kill", sites=["site-a"])
    weights = {k: v.numpy() for k, v in build_denoiser(cfg.model, (1, 28, 28), 10).state_dict().items()}
    return signed, weights


def _requests(fed: Any) -> list[dict[str, Any]]:
    with Ledger(fed.site("site-a").ledger) as led:
        return led.requests("job-kill")


def test_a_killed_round_is_finished_from_its_checkpoint_and_charged_once(fed, monkeypatch):
    signed, weights = _setup(fed)
    count_steps(monkeypatch, die_at=3)
    with pytest.raises(Killed):
        _ask(_grid(fed, 2), signed, weights)
    (req,) = _requests(fed)
    assert req["status"] == "charged"  # spent, nothing recorded, nothing left the site
    taken = count_steps(monkeypatch)
    rep = _ask(_grid(fed, 2), signed, weights)
    assert not rep.has_error(), rep.error.reason if rep.has_error() else ""
    assert taken == [3, 4, 5]  # from the checkpoint at step 2: no charged step lost, none taken twice here
    (req,) = _requests(fed)
    assert req["status"] == "done" and req["events"][0]["steps"] == 5  # one charge, its one answer recorded
    # not kept past the round
    assert not list((fed.site("site-a").ledger.parent / "work" / "rounds").glob("*.pt"))
    again = _ask(_grid(fed, 2), signed, weights)  # a replay now gets the record
    assert fm.payload_bytes(again.content) == fm.payload_bytes(rep.content)


def test_a_killed_round_without_a_checkpoint_is_computed_again_from_its_start(fed, monkeypatch):
    signed, weights = _setup(fed)
    count_steps(monkeypatch, die_at=3)
    with pytest.raises(Killed):
        _ask(_grid(fed, 0), signed, weights)
    taken = count_steps(monkeypatch)
    assert not _ask(_grid(fed, 0), signed, weights).has_error()
    assert taken == [1, 2, 3, 4, 5] and len(_requests(fed)) == 1


def test_a_round_that_failed_after_its_charge_is_not_run_again(fed, monkeypatch):
    signed, weights = _setup(fed)
    count_steps(monkeypatch, die_at=3, error=True)
    rep = _ask(_grid(fed, 2), signed, weights)
    assert rep.has_error() and "nothing was released" in rep.error.reason
    assert _requests(fed)[0]["status"] == "failed"
    taken = count_steps(monkeypatch)
    rep = _ask(_grid(fed, 2), signed, weights)
    assert rep.has_error() and "failed after its charge" in rep.error.reason and taken == []


def test_a_checkpoint_swapped_into_the_work_directory_is_not_loaded(fed, monkeypatch):
    """Attack (the work directory is writable by the site's account): a round checkpoint replaced while the
    node was down, e.g. weights trained on anything or a known noise stream, would reach the released
    weights."""
    from feta_release.training.checkpoint import load_torch, save_torch

    signed, weights = _setup(fed)
    count_steps(monkeypatch, die_at=3)
    with pytest.raises(Killed):
        _ask(_grid(fed, 2), signed, weights)
    (path,) = (fed.site("site-a").ledger.parent / "work" / "rounds").glob("*.pt")
    state = load_torch(path)
    state["steps_done"] = 4
    save_torch(path, state)
    taken = count_steps(monkeypatch)
    rep = _ask(_grid(fed, 2), signed, weights)
    assert rep.has_error() and taken == []
    assert _requests(fed)[0]["status"] == "failed"


def test_a_killed_central_release_is_still_refused(fed, monkeypatch):
    """Only DP-SGD rounds are finished after a kill; a warm-up release charged and never recorded stays
    refused."""
    import edge.clientapp as ca

    cfg = tiny_job(central={"rounds": 1, "batch": 10, "sigma": 5.0}, federation={"min_sites": 1})
    signed, _ = sign_job_file(fed, cfg, "job-kill", sites=["site-a"])

    def die(*a: Any, **k: Any) -> Any:
        raise Killed

    monkeypatch.setattr(ca, "release_central", die)
    grid = _grid(fed, 2)
    msg = grid.create_message(fm.make_payload({"job": signed}), fm.CENTRAL, 100, "central")
    with pytest.raises(Killed):
        grid.send_and_receive([msg])
    monkeypatch.undo()
    grid = _grid(fed, 2)
    (rep,) = grid.send_and_receive(
        [grid.create_message(fm.make_payload({"job": signed}), fm.CENTRAL, 100, "c")]
    )
    assert rep.has_error() and "never recorded" in rep.error.reason
