"""Attack: two unmask requests for ONE sum, delivered to a node at the same time with conflicting views
of who dropped, must not both be answered. Without a lock edge.secure._unmask did load_state -> unmask ->
save_state unguarded, both processes read the state before either saved, and the victim revealed the shares of
BOTH other sites for the same sum; with the others' honest answers the coordinator could unmask the victim's
vector alone (its own noise share only). load_state is slowed by 2 s to make the window deterministic; the two
requests run in two forked processes, as two flwr-clientapp processes would."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Message

import edge.secure as node_secure
import edge.site as node_site
from coordinator.setup import sign_job_file
from feta_release.federation import messages as fm
from tests.support.federation import fedsgd_job, harness, make_federation
from tests.support.federation import run_harness_job as _run


class Stop(Exception):
    pass


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_federation(tmp_path_factory.mktemp("race") / "fed")


def test_two_racing_unmask_views_are_not_both_answered(
    fed: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    signed, _ = sign_job_file(fed, fedsgd_job(secagg_threshold=2), "job-race")
    grid = harness(fed)
    deliver = grid._deliver
    real_load = node_secure.load_state
    answers: list[Any] = []

    def slow_load(*a: Any, **k: Any) -> Any:
        loaded = real_load(*a, **k)
        time.sleep(2.0)  # both processes hold the state they read before either answers
        return loaded

    def hook(msg: Any) -> Any:
        if msg.metadata.message_type == fm.SECAGG:
            doc, arrays = fm.read_payload(msg.content)
            if doc.get("phase") == "dpsgd" and doc.get("stage") == "unmask" and doc.get("round") == 0:
                victim = msg.metadata.dst_node_id
                others = sorted(n for n in grid.nodes if n != victim)
                views = [([victim, others[0]], [others[1]]), ([victim, others[1]], [others[0]])]
                monkeypatch.setattr(node_secure, "load_state", slow_load)
                files = [tmp_path / f"view{i}.json" for i in range(2)]
                pids = []
                for i in range(2):  # two flwr-clientapp processes handling the two messages at once
                    pid = os.fork()
                    if pid == 0:
                        try:
                            node_site._cached.cache_clear()  # each process opens the site itself
                            d = {**doc, "active": views[i][0], "dead": views[i][1]}
                            m = Message(
                                fm.make_payload(d, arrays), dst_node_id=victim, message_type=fm.SECAGG
                            )
                            rep = deliver(m)
                            res = (
                                {"error": rep.error.reason[:300]}
                                if rep.has_error()
                                else {"shares": sorted(fm.read_payload(rep.content)[0].get("shares", {}))}
                            )
                        except BaseException as exc:  # noqa: BLE001 - the child must always write its answer
                            res = {"error": repr(exc)[:300]}
                        files[i].write_text(json.dumps(res))
                        os._exit(0)
                    pids.append(pid)
                for pid in pids:
                    os.waitpid(pid, 0)
                monkeypatch.setattr(node_secure, "load_state", real_load)
                for f in files:
                    res = json.loads(f.read_text())
                    print("view reply:", res)
                    answers.append(res if "shares" in res else None)
                raise Stop()
        return deliver(msg)

    grid._deliver = hook
    with pytest.raises(Stop):
        _run(fed, grid, signed, tmp_path / "out")
    assert len(answers) == 2
    revealed = [a for a in answers if a is not None and a.get("shares")]
    print("answered views:", [sorted(a["shares"]) for a in revealed])
    assert len(revealed) <= 1, "the victim answered BOTH conflicting unmask views of one sum"
