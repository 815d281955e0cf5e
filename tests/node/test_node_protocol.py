"""The node's release protocol (edge.protocol), written once for every releasing handler: charge before
anything is computed or released, replay without a second charge, one OS-seeded noise source per request."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.setup import sign_job_file
from feta_release.federation import messages as fm
from feta_release.ledger import Ledger
from tests.support.federation import full_job, harness, make_federation

SECRET = "image-17-is-class-3"  # stands for anything data-dependent an exception text might carry


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    return make_federation(tmp_path_factory.mktemp("proto") / "fed")


def _send(grid, signed, mtype=fm.CENTRAL, doc=None, arrays=None):
    (rep,) = grid.send_and_receive(
        [grid.create_message(fm.make_payload({"job": signed, **(doc or {})}, arrays), mtype, 100, "t")]
    )
    return rep


def _central(grid, signed) -> dict[str, np.ndarray]:
    rep = _send(grid, signed)
    assert not rep.has_error(), rep.error.reason if rep.has_error() else ""
    return fm.read_payload(rep.content)[1]


def _charged(fed, job_id):
    with Ledger(fed.sites[0].ledger) as led:
        return led.job_events(job_id), led.requests(job_id)


def test_a_compute_that_fails_after_the_charge_releases_nothing_and_is_not_charged_again(fed, monkeypatch):
    """The charge commits before the images are read; a failure afterwards answers with no arrays, no cause
    (an exception text may depend on the images), and a retry neither recomputes (fresh noise) nor charges
    again."""
    import edge.clientapp as ca

    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise ValueError(SECRET)

    monkeypatch.setattr(ca, "release_central", failing)
    signed, _ = sign_job_file(fed, full_job(), "job-fails")
    grid = harness(fed)
    rep = _send(grid, signed)
    assert rep.has_error() and not rep.has_content()
    assert "after its privacy cost was charged" in rep.error.reason and SECRET not in rep.error.reason
    events, rows = _charged(fed, "job-fails")
    assert [e["stage"] for e in events] == ["central"] and rows[0]["status"] == "failed"
    again = _send(grid, signed)
    assert again.has_error() and "it is not run again" in again.error.reason
    assert len(calls) == 1 and len(_charged(fed, "job-fails")[0]) == 1


def test_a_failure_while_building_or_recording_the_reply_names_no_cause(fed, monkeypatch):
    """After the charge, building and recording the reply are under the same catch as the computation: their
    exception text (which may carry image-dependent values) never reaches the coordinator."""

    def failing_record(*args, **kwargs):
        raise ValueError(SECRET)

    signed, _ = sign_job_file(fed, full_job(), "job-reply-fails")
    grid = harness(fed)
    msg = grid.create_message(fm.make_payload({"job": signed}), fm.CENTRAL, 100, "t")
    monkeypatch.setattr(Ledger, "record_response", failing_record)
    (rep,) = grid.send_and_receive([msg])
    assert rep.has_error() and not rep.has_content()
    assert "after its privacy cost was charged" in rep.error.reason and SECRET not in rep.error.reason


def test_a_replay_is_answered_from_the_record_and_not_charged_twice(fed, monkeypatch):
    import edge.clientapp as ca

    signed, _ = sign_job_file(fed, full_job(), "job-replay")
    grid = harness(fed)
    first = _send(grid, signed)
    monkeypatch.setattr(
        ca, "release_central", lambda *a, **k: pytest.fail("a replay computed a fresh release")
    )
    second = _send(grid, signed)
    assert fm.payload_bytes(first.content) == fm.payload_bytes(second.content)
    assert len(_charged(fed, "job-replay")[0]) == 1


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(order=st.lists(st.sampled_from([fm.CENTRAL, fm.FREQUENCY]), min_size=1, max_size=5))
def test_any_sequence_of_requests_charges_each_release_once(fed, order):
    """Property: whatever order and however often the coordinator asks, the ledger holds one charge per
    distinct release, and every answer to one request is the same recorded bytes."""
    signed, _ = sign_job_file(fed, full_job(), f"job-seq-{abs(hash(tuple(order)))}")
    grid = harness(fed)
    answers: dict[str, set[bytes]] = {}
    for mtype in order:
        rep = _send(grid, signed, mtype)
        assert not rep.has_error(), rep.error.reason
        answers.setdefault(mtype, set()).add(fm.payload_bytes(rep.content))
    events, _ = _charged(fed, signed["job"]["job_id"])
    assert sorted(e["stage"] for e in events) == sorted(m.removeprefix("query.") for m in set(order))
    assert all(len(a) == 1 for a in answers.values())


def test_two_requests_draw_independent_noise(fed):
    """Two jobs asking for the same release (same config, same data) get different noise."""
    grid = harness(fed)
    a = _central(grid, sign_job_file(fed, full_job(), "job-noise-a")[0])
    b = _central(grid, sign_job_file(fed, full_job(), "job-noise-b")[0])
    assert set(a) == set(b) and any(not np.array_equal(a[k], b[k]) for k in a if a[k].dtype.kind == "f")


def test_no_coordinator_input_reaches_a_noise_seed(fed, monkeypatch):
    """With the OS key pinned, jobs that differ in everything the coordinator controls (job id, job seed,
    request id) draw the SAME noise: the OS key is the only seed. The factory takes no argument to seed
    from."""
    import feta_release.randomness as rnd
    from edge.protocol import ReleaseRng

    assert not inspect.signature(ReleaseRng).parameters
    assert not inspect.signature(ReleaseRng.numpy).parameters.keys() - {"self"}
    assert not inspect.signature(ReleaseRng.torch).parameters.keys() - {"self"}
    monkeypatch.setattr(rnd, "os_key", lambda: b"\x07" * rnd.SEED_BYTES)
    grid = harness(fed)
    a = _central(grid, sign_job_file(fed, full_job(job={"seed": 1}), "job-pin-a")[0])
    b = _central(grid, sign_job_file(fed, full_job(job={"seed": 2}), "job-pin-b")[0])
    assert all(np.array_equal(a[k], b[k]) for k in a)
