"""What a site node is doing, told plainly: connecting / connected / refused (why) / serving job X / stopped.

The node's only window on its SuperNode is the SuperNode's output (Flower writes no machine-readable status),
so ``NodeMonitor`` reads that output line by line (ANSI colour codes stripped), writes it to the node's log as
plain text with a UTC timestamp, and turns the lines Flower 1.41 and 1.42 print into the node's state.  Each
change is announced (the console of ``node start``) and written to ``node-state.json`` in the node's work
directory, which ``feta-release node status`` reads.  Nothing here is sent anywhere: the state file and the
log stay at the site.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from feta_release.policy.document import utc_stamp

STATE_FILE = "node-state.json"
STATES = ("starting", "connecting", "connected", "refused", "serving", "stopped")

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
_LEVEL = re.compile(r"^(?:INFO|WARNING|ERROR|DEBUG|CRITICAL)\s*:\s*")
_NODE_ID = re.compile(r"SuperNode ID: (\d+)")
_RUN = re.compile(r"\[RUN (\d+), ROUND ([^\]]+)\]")
_EXIT = re.compile(r"Exit Code: (\d+)")
# The last line of a traceback raised by this project's code in a ClientApp: the site refused the job's
# request.
_OUR_ERROR = re.compile(r"^(?:edge|feta_release)[\w.]*\.(\w+): (.+)$")
# Flower exit codes of the SuperNode itself (3xx) that mean the coordinator turned this node away.
_REFUSAL_HINTS = {
    "Failed to activate SuperNod"
    "e": "the coordinator refused this node: its node-auth key is not registered there "
    "(send keys/node-auth.pub to the coordinator: `feta-release coordinator register`)",
}


def plain(line: str) -> str:
    """The line without ANSI colour/cursor codes or trailing whitespace."""
    return _ANSI.sub("", line).rstrip()


@dataclass
class NodeState:
    state: str
    detail: str
    superlink: str
    since: str = field(default_factory=utc_stamp)
    pid: int | None = None
    node_id: str | None = None
    job: str | None = None
    stage: str | None = None

    def line(self) -> str:
        return f"{self.since} node {self.state}: {self.detail}"


def ledger_jobs(ledger_path: Path | None) -> dict[str, bool]:
    """Job id -> closed, in the order this site's ledger bound them ({} if none yet, or unreadable).

    Read-only: the ClientApp binds a job at its first admitted message and closes it when it signs the final
    attestation."""
    if ledger_path is None or not Path(ledger_path).exists():
        return {}
    try:
        con = sqlite3.connect(f"file:{Path(ledger_path).resolve()}?mode=ro", uri=True, timeout=1.0)
        try:
            rows = con.execute("SELECT key, value FROM meta WHERE key LIKE 'job:%' ORDER BY rowid").fetchall()
        finally:
            con.close()
        return {k[4:]: bool(json.loads(v).get("closed")) for k, v in rows}
    except (sqlite3.Error, ValueError, AttributeError):
        return {}


def open_job(ledger_path: Path | None, before: dict[str, bool] | None = None) -> str | None:
    """The job being served: the newest one bound since ``before`` (a snapshot taken when the Flower run
    began), else the newest still-open one that was already bound (a resumed job); None when nothing names it
    yet."""
    jobs = ledger_jobs(ledger_path)
    new = [j for j in jobs if before is not None and j not in before]
    if new:
        return new[-1]
    still_open = [j for j, closed in jobs.items() if not closed]
    return still_open[-1] if still_open else None


class NodeMonitor:
    """Reads the SuperNode's output; keeps the plain log, the state file and the console in step."""

    def __init__(
        self,
        superlink: str,
        work_dir: Path,
        log_path: Path | None,
        *,
        ledger: Path | None = None,
        announce: Callable[[str], None] | None = None,
    ) -> None:
        self.superlink = superlink
        self.state_path = Path(work_dir) / STATE_FILE
        if log_path is not None:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        self.log_file = None if log_path is None else _owner_only_append(Path(log_path))
        self.ledger = ledger
        self.announce = announce
        self._lock = threading.Lock()
        self._exit: list[str] | None = None  # lines of a Flower exit report being read
        self._runs: dict[str, dict[str, bool]] = {}  # Flower run id -> the ledger's jobs when it began
        self.state = NodeState(
            "starting", f"checks passed; starting the SuperNode for {superlink}", superlink
        )
        self._publish()

    def set_pid(self, pid: int) -> None:
        self.state.pid = pid
        self._publish()

    def feed(self, raw: str) -> None:
        text = plain(raw)
        with self._lock:
            if self.log_file is not None and not self.log_file.closed:
                self.log_file.write(f"{utc_stamp()} {text}\n".encode())
                self.log_file.flush()
            self._interpret(_LEVEL.sub("", text).strip())

    def _interpret(self, msg: str) -> None:
        if self._exit is not None:
            self._read_exit_report(msg)
            return
        if "Starting Flower SuperNode" in msg:
            self._go("connecting", f"reaching the coordinator at {self.superlink}")
        elif "Connection attempt failed" in msg and self.state.state in (
            "starting",
            "connecting",
            "connected",
        ):
            self._go(
                "connecting",
                f"cannot reach the coordinator at {self.superlink} yet; retrying (check the "
                "address, the firewall and --root-certificates)",
            )
        elif m := _NODE_ID.search(msg):
            self.state.node_id = m.group(1)
            self._go("connected", f"registered at {self.superlink} as node {m.group(1)}; waiting for a job")
        elif m := _RUN.search(msg):
            self._serving(m.group(1), m.group(2))
        elif "Sent successfully" in msg and self.state.state == "serving" and self.state.stage == "attest":
            self._go(
                "connected",
                f"served job {self.state.job or '(id unknown)'} (final attestation sent); waiting for "
                "the next job",
            )
        elif m := _OUR_ERROR.match(msg):
            what = f"job {self.state.job}" if self.state.job else "a job's request"
            self._go("refused", f"this site refused {what}: {m.group(2)} ({m.group(1)})")
        elif m := _EXIT.search(msg):
            self._exit = [m.group(1)]
        elif "SuperNode terminated" in msg:
            self._go("stopped", "the SuperNode stopped")

    def _serving(self, run: str, stage: str) -> None:
        # The RUN line comes before the ClientApp binds a new job in the ledger: at a run's first round only a
        # job bound since then can name it (an older open job may be a stale one); from the next round on, a
        # resumed job (bound before this run) is named too.
        first = run not in self._runs
        if first:
            self._runs[run] = ledger_jobs(self.ledger)
        job = open_job(self.ledger, self._runs[run])
        if job is not None and first and job in self._runs[run]:
            job = None
        job = job or (self.state.job if not first and self.state.job else None)
        name = job or f"(Flower run {run}; its job id once admitted)"
        self._go("serving", f"job {name}, stage {stage}", job=job, stage=stage)

    def _read_exit_report(self, msg: str) -> None:
        assert self._exit is not None
        if msg and not msg.startswith("For more information"):
            self._exit.append(msg)
            return
        if not msg and len(self._exit) == 1:
            return
        code, lines = self._exit[0], self._exit[1:]
        self._exit = None
        # the SuperNode itself gave up: the coordinator turned it away, or unreachable
        if code.startswith("3"):
            why = next(
                (hint for key, hint in _REFUSAL_HINTS.items() if any(key in x for x in lines)),
                " ".join(lines),
            )
            self._go("refused", f"{why} (Flower exit code {code})")

    def stopped(self, code: int | None) -> None:
        with self._lock:
            if self.state.state == "refused" and code not in (None, 0):
                self._publish()  # keep the reason: it is why the node stopped
            else:
                self._go(
                    "stopped",
                    "the node shut down cleanly"
                    if code in (None, 0)
                    else f"the SuperNode exited with code {code}; see its log for why",
                )
            if self.log_file is not None:
                self.log_file.close()

    def _go(self, state: str, detail: str, **extra: Any) -> None:
        if (state, detail) == (self.state.state, self.state.detail):
            return
        self.state = NodeState(
            state,
            detail,
            self.superlink,
            pid=self.state.pid,
            node_id=self.state.node_id,
            job=extra.get("job", self.state.job),
            stage=extra.get("stage"),
        )
        self._publish()
        if self.announce is not None:
            self.announce(self.state.line())

    def _publish(self) -> None:
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_name(f".{self.state_path.name}.tmp")
        tmp.write_text(json.dumps(asdict(self.state), indent=2, sort_keys=True) + "\n", "utf-8")
        os.chmod(tmp, 0o600)  # refusal reasons may quote the site's own errors: the site's account only
        os.replace(tmp, self.state_path)


def _owner_only_append(path: Path) -> BinaryIO:
    """Open the node's log for appending, readable by the site's account only (0600, also when it existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "ab")


def read_state(work_dir: Path) -> dict[str, Any] | None:
    """The node's last published state, with ``running`` False when its process is gone (None: never
    started)."""
    path = Path(work_dir) / STATE_FILE
    try:
        state: dict[str, Any] = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError):
        return None
    pid = state.get("pid")
    running = False
    if isinstance(pid, int) and state.get("state") != "stopped":
        try:
            os.kill(pid, 0)
            running = True
        except ProcessLookupError:
            running = False
        except PermissionError:
            running = True
    state["running"] = running
    return state
