"""Faults: a coordinator killed while it writes. Its progress log may end in a torn line; what it writes next
and what ``coordinator run`` reads back from it stay whole."""

from __future__ import annotations

import json

from coordinator.runner import _last_error
from feta_release.federation.driver import append_event


def test_an_event_after_a_torn_progress_line_is_a_line_of_its_own_and_the_last_error_is_read(tmp_path):
    log = tmp_path / "progress.jsonl"
    append_event(log, {"phase": "warmup", "message": "spatial warm-up on 10 central images"})
    with open(log, "ab") as fh:
        fh.write(b'{"phase": "warmup", "mess')  # the line being written when the coordinator was killed
    append_event(log, {"phase": "error", "message": "SiteUnavailable: round 1: only 1 site(s) answered"})
    lines = log.read_text("utf-8").splitlines()
    assert len(lines) == 3
    assert json.loads(lines[2])["phase"] == "error"
    assert _last_error(tmp_path) == "SiteUnavailable: round 1: only 1 site(s) answered"
