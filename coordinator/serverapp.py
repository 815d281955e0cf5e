"""The coordinator's Flower ServerApp: runs the signed job over the SuperLink's Grid.

Run configuration (set by ``feta-release coordinator run`` with ``flwr run --run-config``):
  job-file         the SIGNED job (JSON envelope written by ``coordinator run``)
  out-dir          where state, checkpoints and outputs go (a rerun with the same dir resumes)
  coordinator-key  the coordinator's private key (signs nothing here; used to verify the job is ours)
Where it computes (``coordinator run --device``) comes in ``out-dir``
(``feta_release.federation.job.DEVICE_FILE``): a run-config key of its own would change the FAB and so its
hash in every site's signed policy. Its public inputs (``coordinator run --public/--pretrained``) likewise
(``feta_release.federation.job.PUBLIC_FILE``), checked against the signed job's [public] hashes before any
site is asked for a release.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from flwr.app import Context, Message
from flwr.serverapp import Grid, ServerApp

from feta_release.allocator import keep_freed_pages
from feta_release.federation.anchors import anchors_path
from feta_release.federation.job import run_job
from feta_release.signing import load_private_key

app = ServerApp()
log = logging.getLogger("feta.coordinator")

# flwr 1.42's Grid.send_and_receive pulls the replies every 3 s. A job's exchanges run one after another (a
# secure sum alone is four), so that poll added up to 3 s to each, beside the SuperNodes' own poll; pulling
# every half second costs the SuperLink two small requests a second while a job waits.
REPLY_POLL = 0.5


class PromptGrid:
    """The SuperLink's Grid, with ``send_and_receive`` pulling the replies every ``poll`` s: otherwise
    Flower's loop (push, then pull until every reply came or the timeout passed; ``None``: no timeout)."""

    def __init__(self, grid: Grid, poll: float = REPLY_POLL) -> None:
        self._grid, self._poll = grid, poll

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        pending = set(self._grid.push_messages(messages))
        end = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while end is None or time.monotonic() < end:
            got = list(self._grid.pull_messages(pending))
            replies += got
            pending -= {m.metadata.reply_to_message_id for m in got}
            if not pending:
                break
            time.sleep(self._poll)
        return replies


@app.main()
def main(grid: Grid, context: Context) -> None:
    # this process (Flower's flwr-serverapp) runs the warm-ups and FedSGD steps: each reuses the last one's
    # pages (feta_release.allocator)
    keep_freed_pages()
    rc = context.run_config
    job_file, out_dir = str(rc.get("job-file", "")), str(rc.get("out-dir", ""))
    if not job_file or not out_dir:
        raise RuntimeError("run config needs job-file and out-dir (use `feta-release coordinator run`)")
    key = load_private_key(str(rc["coordinator-key"])) if rc.get("coordinator-key") else None
    signed = json.loads(Path(job_file).read_text("utf-8"))

    def progress(ev: dict) -> None:
        # flwr run --stream shows the ServerApp's output: one line per event.
        print(f"[feta] {ev['phase']}: {ev['message']}", flush=True)

    # the sites' ledger positions live beside the coordinator key: every job of this coordinator checks the
    # same record
    anchors = anchors_path(str(rc["coordinator-key"])) if rc.get("coordinator-key") else None
    # device: in out_dir
    run_job(PromptGrid(grid), signed, out_dir, coordinator_key=key, progress=progress, anchors=anchors)
