"""The site's persistent privacy ledger (SQLite).

Every release a site makes is recorded here BEFORE its result leaves the site, in its own
committed transaction (WAL journal, ``synchronous=FULL``: the commit is on disk when ``charge``
returns). The spend is computed by the site's own accountant over the site's own history; a
number sent by a coordinator is never used.

Idempotency: a request id is charged at most once. A replayed or retried request gets the
recorded answer back (the released payload is stored); a request id that was charged but whose
result was never recorded (the site crashed mid-computation) is refused: re-running it would
draw fresh noise and spend the budget twice.

Tamper evidence (``feta_release.ledger_chain``): the rows form a hash chain whose head is signed by the
site key after every write; opening the ledger verifies it. Writing needs the site's private key;
reading (``node status``) verifies the signature with the site's public key when given.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from . import ledger_chain as chain
from .accounting import Accountant as AccountantName
from .accounting import (
    epsilon,
    event_to_dict,
    events_from_list,
    has_secure_aggregation,
    per_unit,
    unit_epsilon,
    unit_name,
    worst_case_epsilon_cap,
)
from .errors import PolicyBudgetExceeded, PolicyError, PolicyViolation, PrivacyError
from .ledger_chain import LedgerNotChainedError, LedgerTamperedError  # noqa: F401 - re-exported

# (events, delta, accountant) -> epsilon
Accountant = Callable[[Sequence[Any], float, str], float]

_SCHEMA = (
    """
CREATE TABLE IF NOT EXISTS requests (
    request_id   TEXT PRIMARY KEY,
    job_id       TEXT NOT NULL,
    mechanism    TEXT NOT NULL,
    events       TEXT NOT NULL,      -- JSON list of PrivacyEvent fields
    status       TEXT NOT NULL,      -- 'charged' (spent, result not yet recorded) | 'done' | 'failed'
    response     BLOB,
    response_sha256 TEXT,
    job_epsilon  REAL NOT NULL,      -- this job's epsilon after this charge (site's accountant)
    lifetime_epsilon REAL NOT NULL,
    created_at   REAL NOT NULL,
    completed_at REAL,
    seq          INTEGER,            -- position in the hash chain (1, 2, ...)
    prev_hash    TEXT,
    row_hash     TEXT
);
CREATE INDEX IF NOT EXISTS requests_job ON requests(job_id);
CREATE UNIQUE INDEX IF NOT EXISTS requests_seq ON requests(seq);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
    + chain.CHAIN_SCHEMA
)


@dataclass(frozen=True)
class Budget:
    """The site's caps, taken from its signed policy (never from a request)."""

    job_epsilon: float
    lifetime_epsilon: float
    delta: float  # the per-job delta
    accountant: AccountantName = "rdp"
    lifetime_delta: float | None = None  # None: same as ``delta``
    # per-job cap on the epsilon of secure-aggregation releases if every other site colludes (own share only);
    # None: not checked (a Budget built by hand; a SitePolicy always brings its cap, explicit or default)
    worst_case_epsilon: float | None = None
    # the patient cap of a patient-level site: every cap above is then a cap on the epsilon PER PATIENT
    # (accounting.patient_epsilon: patient-level events as they are, image-level ones by group privacy over
    # the cap); None: an image-level site, epsilon per image
    patient_cap: int | None = None
    # cap on the lifetime worst-case epsilon (every secure-aggregation release of every job, own noise share
    # only); None: not checked (a Budget built by hand; a SitePolicy always brings its cap, explicit or
    # default)
    lifetime_worst_case_epsilon: float | None = None

    @property
    def life_delta(self) -> float:
        return self.delta if self.lifetime_delta is None else self.lifetime_delta

    @property
    def per(self) -> str:
        """What one epsilon of this budget protects, in words (the refusals name it)."""
        return "" if self.patient_cap is None else f"per patient (at most {self.patient_cap} image(s) each)"

    def spent(self, events: Sequence[Any], delta: float, view: str = "assumed") -> float:
        """The epsilon this budget caps over ``events`` at ``delta``: per patient at a patient-level site,
        else per image (``accounting.unit_epsilon``)."""
        if not events:
            return 0.0
        return float(
            unit_epsilon(
                list(events), delta, self.accountant, patient_cap=self.patient_cap, view=cast(Any, view)
            )
        )

    @classmethod
    def from_policy(cls, policy: dict[str, Any]) -> Budget:
        """From a (verified) policy document: its ``budget`` and ``accountant`` fields."""
        b, sa = policy["budget"], policy.get("secure_aggregation", {})
        return cls(
            job_epsilon=float(b["per_job"]["epsilon"]),
            lifetime_epsilon=float(b["lifetime"]["epsilon"]),
            delta=float(b["per_job"]["delta"]),
            accountant=cast(AccountantName, str(policy.get("accountant", "rdp"))),
            lifetime_delta=float(b["lifetime"]["delta"]),
            worst_case_epsilon=worst_case_epsilon_cap(
                sa.get("max_worst_case_epsilon"), b["per_job"]["epsilon"]
            ),
            patient_cap=_patient_cap(policy),
            lifetime_worst_case_epsilon=worst_case_epsilon_cap(
                sa.get("max_lifetime_worst_case_epsilon"), b["lifetime"]["epsilon"]
            ),
        )


@dataclass(frozen=True)
class ChargeResult:
    request_id: str
    replay: bool  # True: this request id was already charged; nothing new was spent
    response: bytes | None  # the recorded answer of a replay (None for a fresh charge)
    job_epsilon: float
    lifetime_epsilon: float


def _patient_cap(policy: dict[str, Any]) -> int | None:
    # the same rule as SitePolicy.unit_cap
    ds = policy.get("dataset") or {}
    return int(ds["patient_cap"]) if ds.get("privacy_unit") == "patient" and ds.get("patient_cap") else None


def as_budget(policy: Budget | Any) -> Budget:
    """A ``Budget`` from itself, a verified ``SitePolicy`` or a policy document."""
    if isinstance(policy, Budget):
        return policy
    if hasattr(policy, "job_epsilon") and hasattr(policy, "lifetime_delta"):
        return Budget(
            policy.job_epsilon,
            policy.lifetime_epsilon,
            policy.job_delta,
            policy.accountant,
            policy.lifetime_delta,
            getattr(policy, "worst_case_cap", None),
            getattr(policy, "unit_cap", None),
            getattr(policy, "lifetime_worst_case_cap", None),
        )
    if isinstance(policy, dict) and "budget" in policy:
        return Budget.from_policy(policy)
    raise TypeError(f"not a budget or site policy: {type(policy).__name__}")


def _default_accountant(events: Sequence[Any], delta: float, accountant: str) -> float:
    return float(epsilon(list(events), delta, cast(AccountantName, accountant)))


def check_spend(
    budget: Budget,
    job_events: Sequence[Any],
    lifetime_events: Sequence[Any],
    new_events: Sequence[Any],
    *,
    job_scope: str = "this job",
    site: str | None = None,
    accountant: Accountant | None = None,
) -> tuple[float, float]:
    """THE budget check: (ε of the job after, ε of the site's lifetime after) with the budget's accountant, or
    :class:`PolicyBudgetExceeded` naming ``budget.per_job.epsilon``, ``budget.lifetime.epsilon`` or a
    worst-case cap.

    At a patient-level site (``budget.patient_cap``) every figure here is the epsilon PER PATIENT at the
    budget's δ (``accounting.patient_epsilon``): the per-job, lifetime and worst-case caps bound what one
    patient's records can change, never the per-image figure of a history that mixes image- and patient-level
    events.

    Every refusal on spend goes through here: a ledger's charge, the node's pre-check and the coordinator's
    plan (``feta_release.policy.enforce.check_budget``), the local driver's run.
    """
    job_ev, life_ev, new_ev = list(job_events), list(lifetime_events), list(new_events)

    def eps(events: list[Any], delta: float) -> float:
        if accountant is not None and budget.patient_cap is None:
            return float(accountant(events, delta, budget.accountant)) if events else 0.0
        return budget.spent(events, delta)

    def capped(cap_name: str, prior: list[Any], delta: float, cap: float, scope: str) -> float:
        """ε of ``prior`` and the new events at ``delta``; refused over ``cap`` (policy field cap_name)."""
        after = eps(prior + new_ev, delta)
        if after > cap + 1e-9:
            raise PolicyBudgetExceeded(
                cap_name,
                spent=eps(prior, delta),
                after=after,
                cap=cap,
                delta=delta,
                accountant=budget.accountant,
                scope=scope,
                per=per_unit(unit_name(budget.patient_cap)),
                site=site,
                patient_cap=budget.patient_cap,
            )
        return after

    job_after = capped("budget.per_job.epsilon", job_ev, budget.delta, budget.job_epsilon, job_scope)
    life_after = capped(
        "budget.lifetime.epsilon", life_ev, budget.life_delta, budget.lifetime_epsilon, "the site's lifetime"
    )
    _check_worst_case(
        budget,
        job_ev,
        new_ev,
        budget.delta,
        budget.worst_case_epsilon,
        "secure_aggregation.max_worst_case_epsilon",
        job_scope,
        site,
    )
    _check_worst_case(
        budget,
        life_ev,
        new_ev,
        budget.life_delta,
        budget.lifetime_worst_case_epsilon,
        "secure_aggregation.max_lifetime_worst_case_epsilon",
        "the site's lifetime",
        site,
    )
    return job_after, life_after


def _check_worst_case(
    budget: Budget,
    old: list[Any],
    new_ev: list[Any],
    delta: float,
    cap: float | None,
    rule: str,
    scope: str,
    site: str | None,
) -> None:
    """Secure-aggregation releases: the epsilon of ``old + new`` (one job's, or the site's lifetime history)
    if every other site colluded (own noise share only) against ``cap``:
    ``secure_aggregation.max_worst_case_epsilon`` per job (default 3 x the per-job cap),
    ``secure_aggregation.max_lifetime_worst_case_epsilon`` over the lifetime (default 3 x the lifetime cap: a
    coalition that holds for one job can hold for all of them, and the worst-case views of all charged events
    compose). Checked whenever the history (old + new) has a secure-aggregation event: a later Gaussian charge
    (DP-SGD) adds to the worst case too."""
    if cap is None or not has_secure_aggregation(old + new_ev):
        return
    after = budget.spent(old + new_ev, delta, "worst_case")
    if after > cap + 1e-9:
        raise PolicyBudgetExceeded(
            rule,
            spent=budget.spent(old, delta, "worst_case"),
            after=after,
            cap=cap,
            delta=delta,
            accountant="rdp",
            scope=f"{scope}, if every other site colluded with the coordinator,",
            per=per_unit(unit_name(budget.patient_cap)),
            site=site,
            patient_cap=budget.patient_cap,
        )


def _event_dicts(events: Sequence[Any]) -> list[dict[str, Any]]:
    """The stored form of each event (a Gaussian ``PrivacyEvent`` or a ``SkellamEvent``), validated."""
    return [event_to_dict(e) for e in events]


def _events_from_dicts(rows: list[dict[str, Any]]) -> list[Any]:
    return events_from_list(rows)


def _roll_back(db: sqlite3.Connection) -> None:
    try:
        if db.in_transaction:
            db.execute("ROLLBACK")
    except sqlite3.Error:  # the failed write may have ended the transaction itself
        pass


def _storage_failure(path: Path, exc: sqlite3.OperationalError) -> PrivacyError:
    """One line for a write the disk refused (full, read-only, I/O error). Nothing of it was committed, so
    nothing was charged and nothing may be released; the same request charges once when it is sent again."""
    return PrivacyError(
        f"{path}: the privacy ledger could not record this request ({exc}); nothing was charged or "
        "released. Fix: free disk space (or repair the volume) where the ledger lives, then send the "
        "request again (the job's re-run resumes)"
    )


class Ledger:
    """One site's ledger file. Safe to open from several processes (SQLite locking)."""

    def __init__(
        self,
        path: str | Path,
        accountant: Accountant | None = None,
        *,
        key: Any = None,
        verify_key: Any = None,
        deep: bool = False,
    ) -> None:
        """Open (or, with ``key`` and no file yet, create) a ledger and verify its chain.

        ``key``: the site's Ed25519 private key (needed to record anything; its public half checks the
        head). ``verify_key``: a public key to check the head with when reading only. ``deep``: also
        check every stored answer's bytes against its recorded hash.
        """
        self.path = Path(path)
        self._accountant = accountant or _default_accountant
        self._key = key
        self._pub = key.public_key() if key is not None else verify_key
        new = not self.path.exists()
        if new:
            if key is None:
                raise PrivacyError(
                    f"{self.path}: no ledger here (a node creates it, with its site key, on its first start)"
                )
            chain.make_private_dirs(self.path.parent)  # 0700: a folder others can write is refused
            chain.create_private_file(self.path)
        chain.check_file_mode(self.path)
        try:
            self._db = sqlite3.connect(str(self.path), timeout=60.0, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            if new:
                self._db.executescript(_SCHEMA)
                self._db.execute("BEGIN IMMEDIATE")
                chain.init(self._db, key)
                self._db.execute("COMMIT")
            elif not chain.has_requests_table(self._db):
                self._db.close()
                raise LedgerTamperedError(
                    f"{self.path}: privacy ledger tampered with: the file holds no ledger (emptied or "
                    "replaced); the node refuses to run on it. Restore the ledger from a backup (never edit "
                    "it by hand)"
                )
            elif not chain.is_chained(self._db):
                self._db.close()
                raise LedgerNotChainedError(
                    f"{self.path}: this ledger has no hash chain (written by an older feta-release); if you "
                    "trust it as it is, chain and sign it once with `feta-release node migrate-ledger "
                    f"--ledger {self.path} --site-key SITE.key`"
                )
        except sqlite3.DatabaseError as exc:
            raise PrivacyError(f"{self.path}: cannot open privacy ledger: {exc}") from None
        self.verify(deep=deep)

    @classmethod
    def migrate(cls, path: str | Path, key: Any) -> int:
        """Chain and sign a ledger written before tamper evidence (see ``LedgerNotChainedError``)."""
        p = Path(path)
        if not p.exists():
            raise PrivacyError(f"{p}: no ledger here")
        db = sqlite3.connect(str(p), timeout=60.0, isolation_level=None)
        try:
            if chain.is_chained(db):
                raise PrivacyError(f"{p}: already chained; nothing to migrate")
            if not chain.has_requests_table(db):
                raise PrivacyError(f"{p}: not a feta-release ledger (no requests table); nothing to migrate")
            db.execute("BEGIN IMMEDIATE")
            n = chain.migrate(db, key)
            db.execute("COMMIT")
        finally:
            db.close()
        os.chmod(p, 0o600)
        return n

    def verify(self, deep: bool = False) -> dict[str, Any]:
        """Check the chain and the signed head now (``LedgerTamperedError`` if anything was changed)."""
        return chain.verify(self._db, self.path, self._pub, deep=deep)

    def anchor(self) -> dict[str, Any]:
        """``{ledger_id, rows, head}`` of this ledger now (chain and head verified first): what an attestation
        carries, so that a coordinator notices the ledger deleted or restored from an older copy."""
        return chain.anchor(self.verify())

    def extends(self, anchor: Mapping[str, Any]) -> bool:
        """True when this ledger is ``anchor``'s ledger grown by appends only: the same id, at least its rows,
        and the chain through its first ``rows`` rows ending at its ``head`` (a rolled-back copy, or one that
        went on from an older copy, does not)."""
        now = self.anchor()
        if now["ledger_id"] != anchor.get("ledger_id") or now["rows"] < int(anchor.get("rows", 0)):
            return False
        return chain.hash_at(self._db, now["ledger_id"], int(anchor["rows"])) == anchor.get("head")

    @property
    def signature_checked(self) -> bool:
        return self._pub is not None

    @contextlib.contextmanager
    def _write(self) -> Iterator[None]:
        """One write transaction: take the write lock, re-verify the chain under it (a write must never
        seal someone else's edit in), run the body, then re-link and sign the head and commit."""
        if self._key is None:
            raise PrivacyError(f"{self.path}: ledger opened without the site key; nothing can be recorded")
        self._db.execute("BEGIN IMMEDIATE")
        try:
            chain.verify(self._db, self.path, self._pub)
            yield
            if self._db.in_transaction:  # the body may have rolled back (nothing to record)
                chain.seal_chain(self._db, self._key)
                self._db.execute("COMMIT")
        # disk full, I/O error: SQLite rolled the write back (or we do)
        except sqlite3.OperationalError as exc:
            _roll_back(self._db)
            raise _storage_failure(self.path, exc) from None
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- spend -----------------------------------------------------------------------------------
    def _history(self, job_id: str | None = None) -> list[dict[str, Any]]:
        if job_id is None:
            rows = self._db.execute("SELECT events FROM requests ORDER BY seq").fetchall()
        else:
            rows = self._db.execute(
                "SELECT events FROM requests WHERE job_id=? ORDER BY seq", (job_id,)
            ).fetchall()
        return [e for (blob,) in rows for e in json.loads(blob)]

    def _eps(self, event_dicts: list[dict[str, Any]], budget: Budget, lifetime: bool = False) -> float:
        if not event_dicts:
            return 0.0
        delta = budget.life_delta if lifetime else budget.delta
        if budget.patient_cap is not None:  # a patient-level site's figures are per patient (check_spend's)
            return budget.spent(_events_from_dicts(event_dicts), delta)
        return self._accountant(_events_from_dicts(event_dicts), delta, budget.accountant)

    def projected(self, job_id: str, events: Sequence[Any], budget: Budget | Any) -> tuple[float, float]:
        """(job ε, lifetime ε) if ``events`` were added now. Spends nothing."""
        budget = as_budget(budget)
        new = _event_dicts(events)
        return self._eps(self._history(job_id) + new, budget), self._eps(self._history() + new, budget, True)

    def check(
        self, job_id: str, request_id: str, mechanism: str, events: Sequence[Any], budget: Budget | Any
    ) -> ChargeResult | None:
        """Cheap pre-check before computing a release: raise if it would be refused.

        Returns the recorded answer for a replay, None when a fresh charge would fit.
        """
        prior = self._lookup(job_id, request_id, mechanism, events)
        if prior is not None:
            return prior
        self._assess(job_id, mechanism, _event_dicts(events), budget)
        return None

    def _assess(
        self, job_id: str, mechanism: str, new: list[dict[str, Any]], policy: Budget | Any
    ) -> tuple[float, float]:
        """(job ε, lifetime ε) after adding ``new``, or raise (``check_spend``: the one budget check).

        A verified ``SitePolicy`` also brings its per-job caps on rounds and steps.
        """
        if self.is_closed(job_id):  # under charge's write lock: nothing commits after the close
            raise PolicyError(
                f"job {job_id!r} was closed at this site by its final attestation; nothing more is "
                "released for it (start a new job)"
            )
        if not isinstance(policy, Budget):
            self._check_step_caps(job_id, new, policy)
        return check_spend(
            as_budget(policy),
            _events_from_dicts(self._history(job_id)),
            _events_from_dicts(self._history()),
            _events_from_dicts(new),
            site=getattr(policy, "site_id", None),
            accountant=self._accountant,
        )

    def _check_step_caps(self, job_id: str, new: list[dict[str, Any]], policy: Any) -> None:
        """The policy's per-job caps on central rounds and DP-SGD steps, over what is RECORDED now.

        Why here: ``check_request`` runs before the (slow) release is computed; two concurrent requests
        of one job both pass it against the same history. Inside ``charge`` this runs under the write
        lock, so the second one sees the first and is refused.
        """
        history = self._history(job_id)
        for m in sorted({e["stage"] for e in new}):
            rule = getattr(policy, "mechanisms", {}).get(m)
            cap = "max_rounds" if m == "central" else "max_steps"
            if rule is None or cap not in rule.caps:
                continue
            done = sum(e["steps"] for e in history if e["stage"] == m)
            asked = sum(e["steps"] for e in new if e["stage"] == m)
            if done + asked > rule.caps[cap]:
                what = "rounds" if m == "central" else "steps"
                raise PolicyViolation(
                    f"mechanisms.{m}.{cap}",
                    f"{what} for job {job_id} would be {done + asked} "
                    f"({done} recorded + {asked} requested) > cap {rule.caps[cap]:g}; nothing "
                    "released",
                    site=getattr(policy, "site_id", None),
                )

    def charge(
        self,
        job_id: str,
        request_id: str,
        mechanism: str,
        events: Sequence[Any],
        budget: Budget | Any,
        response: bytes | None = None,
    ) -> ChargeResult:
        """Record the spend of ``events`` for ``request_id`` (committed on return) or refuse.

        ``budget``: a ``Budget`` or a verified ``SitePolicy`` (its caps and accountant are used).
        ``response``: the released payload, recorded in the SAME transaction (then the request is
        complete); without it, call ``record_response`` before the result leaves the site.
        Call BEFORE the result of the release leaves the site.
        """
        policy, budget = budget, as_budget(budget)
        new = _event_dicts(events)
        # BEGIN IMMEDIATE takes the write lock first: two concurrent charges cannot both pass the check.
        with self._write():
            prior = self._lookup(job_id, request_id, mechanism, events)
            if prior is not None:
                self._db.execute("ROLLBACK")
                return prior
            job_eps, life_eps = self._assess(job_id, mechanism, new, policy)
            now = time.time()
            seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM requests").fetchone()[0]
            self._db.execute(
                "INSERT INTO requests(request_id, job_id, mechanism, events, status, response, "
                "response_sha256, job_epsilon, lifetime_epsilon, created_at, completed_at, seq) VALUES "
                "(?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    request_id,
                    job_id,
                    mechanism,
                    json.dumps(new),
                    "charged" if response is None else "done",
                    response,
                    None if response is None else hashlib.sha256(response).hexdigest(),
                    job_eps,
                    life_eps,
                    now,
                    None if response is None else now,
                    seq,
                ),
            )
        return ChargeResult(request_id, False, None, job_eps, life_eps)

    def record_response(self, request_id: str, response: bytes) -> None:
        """Store the released payload so a replay gets the same answer (never a fresh draw)."""
        digest = hashlib.sha256(response).hexdigest()
        with self._write():
            cur = self._db.execute(
                "UPDATE requests SET status='done', response=?, response_sha256=?, completed_at=? "
                "WHERE request_id=? AND status='charged'",
                (response, digest, time.time(), request_id),
            )
            if cur.rowcount != 1:
                raise PrivacyError(
                    f"{self.path}: request {request_id!r} is not a pending charge; response not recorded"
                )

    def mark_failed(self, request_id: str) -> None:
        """A charged request whose computation FAILED (an exception, whose cause may depend on the data): it
        is never run again, as a killed one may be (:meth:`interrupted`)."""
        with self._write():
            self._db.execute(
                "UPDATE requests SET status='failed' WHERE request_id=? AND status='charged'", (request_id,)
            )

    def interrupted(self, job_id: str, request_id: str, mechanism: str, events: Sequence[Any]) -> bool:
        """``request_id`` is this very request (job, mechanism, events), charged, never recorded and never
        failed: its process was killed while it computed. Nothing of it left the site, so it may be computed
        once more (from the site's own checkpoint) and its one answer recorded, without a second charge."""
        row = self._db.execute(
            "SELECT job_id, mechanism, events, status FROM requests WHERE request_id=?", (request_id,)
        ).fetchone()
        if row is None or row[3] != "charged":
            return False
        return bool((row[0], row[1], json.loads(row[2])) == (job_id, mechanism, _event_dicts(events)))

    def _lookup(
        self, job_id: str, request_id: str, mechanism: str, events: Sequence[Any]
    ) -> ChargeResult | None:
        row = self._db.execute(
            "SELECT job_id, mechanism, events, status, response, job_epsilon, lifetime_epsilon, "
            "response_sha256 FROM requests WHERE request_id=?",
            (request_id,),
        ).fetchone()
        if row is None:
            return None
        r_job, r_mech, r_events, status, response, job_eps, life_eps, r_sha = row
        if (r_job, r_mech, json.loads(r_events)) != (job_id, mechanism, _event_dicts(events)):
            raise PolicyError(
                f"request id {request_id!r} was already used for {r_mech} in job {r_job!r} with other "
                "parameters; refused (a request id names one release)"
            )
        if status == "failed":
            raise PolicyError(
                f"request {request_id!r} failed after its charge; it is not run again (its failure may "
                "depend on the data): start a new job"
            )
        if status != "done":
            raise PolicyError(
                f"request {request_id!r} was charged but its result was never recorded (interrupted); "
                "refusing to run it again: a fresh noise draw would spend the budget twice"
            )
        if hashlib.sha256(bytes(response)).hexdigest() != r_sha:
            raise LedgerTamperedError(
                f"{self.path}: privacy ledger tampered with: the stored answer of request "
                f"{request_id!r} does not match its recorded hash; not replayed"
            )
        return ChargeResult(request_id, True, bytes(response), job_eps, life_eps)

    # -- policy versions -------------------------------------------------------------------------
    def highest_policy_version(self) -> int | None:
        row = self._db.execute("SELECT value FROM meta WHERE key='policy_version'").fetchone()
        return None if row is None else int(row[0])

    def observe_policy_version(self, version: int) -> None:
        """Remember the highest policy version seen; refuse an older one (a replayed policy)."""
        if self.highest_policy_version() == version:
            return  # nothing new (every message of a node opens the site): no write, no re-signing
        with self._write():
            seen = self.highest_policy_version()
            if seen is not None and version < seen:
                raise PolicyError(
                    f"policy version {version} is older than version {seen} already used with ledger "
                    f"{self.path}; a newer policy supersedes it"
                )
            self._db.execute(
                "INSERT INTO meta(key, value) VALUES ('policy_version', ?) "
                "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                (str(max(version, seen or version)),),
            )

    # -- jobs: one signed job per id, closed by its final attestation ------------------------------
    def _job_record(self, job_id: str) -> dict[str, Any] | None:
        row = self._db.execute("SELECT value FROM meta WHERE key=?", (f"job:{job_id}",)).fetchone()
        return None if row is None else json.loads(row[0])

    def bind_job(self, job_id: str, job_sha256: str, signer_sha256: str) -> None:
        """Tie ``job_id`` to one signed job (body hash + full signer key hash) the first time it is seen.

        Why: request ids derive from the job id, so a second job document under the same id (other config,
        other coordinator) would otherwise be answered from the first job's records. Refused instead.
        """
        want = {"sha256": job_sha256, "signer": signer_sha256}
        rec = self._job_record(job_id)
        if rec is not None and {k: rec.get(k) for k in want} == want:
            return  # already bound to this job (every message of a job binds): no write, no re-signing
        # Through the signed write path: the job record lives in `meta`, which the chain head covers.
        with self._write():
            rec = self._job_record(job_id)
            if rec is None:
                self._db.execute(
                    "INSERT INTO meta(key, value) VALUES (?, ?)",
                    (f"job:{job_id}", json.dumps({**want, "closed": False}, sort_keys=True)),
                )
            elif {k: rec.get(k) for k in want} != want:
                raise PolicyError(
                    f"job id {job_id!r} is already bound at this site to another signed job (sha256 "
                    f"{str(rec.get('sha256'))[:16]}…, signer {str(rec.get('signer'))[:16]}…); a request with "
                    f"job {job_sha256[:16]}… signed by {signer_sha256[:16]}… is refused (one job id names "
                    "one job)"
                )

    def close_job(self, job_id: str, job_sha256: str, output: Mapping[str, Any] | None = None) -> None:
        """Close the job: from now on every charge for it is refused (its attestation is final).

        ``output``: what the job produced and how it is read (a local run: model sha256, delta, accountant),
        kept in the signed job record so that an export takes it from here, not from the run's unsigned files.
        Once recorded it is final: a second close with another output is refused."""
        with self._write():
            rec = self._job_record(job_id) or {"sha256": job_sha256, "signer": None}
            if rec.get("sha256") != job_sha256:
                raise PolicyError(f"job id {job_id!r} is bound to another signed job; not closed")
            if output is not None:
                if rec.get("output") not in (None, dict(output)):
                    raise PolicyError(
                        f"job {job_id!r} was closed with another output ({rec.get('output')}); "
                        "a closed job's record is final"
                    )
                rec = {**rec, "output": dict(output)}
            self._db.execute(
                "INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET "
                "value=excluded.value",
                (f"job:{job_id}", json.dumps({**rec, "closed": True}, sort_keys=True)),
            )

    # -- a local run's checkpoints: the bytes a resumed run may load ------------------------------------
    def record_checkpoint(self, job_id: str, name: str, sha256: str) -> None:
        """Bind job ``job_id``'s checkpoint ``name`` to the sha256 of the bytes about to be written (in
        ``meta``, which the signed head covers). The hash it replaces is kept as ``previous``: a kill between
        this record and the file's replacement leaves that file, still this run's own."""
        key = f"checkpoint:{job_id}:{name}"
        with self._write():
            row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
            prev = None if row is None else json.loads(row[0]).get("sha256")
            self._db.execute(
                "INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET "
                "value=excluded.value",
                (key, json.dumps({"sha256": sha256, "previous": prev}, sort_keys=True)),
            )

    def checkpoint_hashes(self, job_id: str, name: str) -> tuple[str, ...]:
        """The sha256s a resumed run may find checkpoint ``name`` at (the last recorded and the one before
        it)."""
        row = self._db.execute(
            "SELECT value FROM meta WHERE key=?", (f"checkpoint:{job_id}:{name}",)
        ).fetchone()
        rec = {} if row is None else json.loads(row[0])
        return tuple(str(rec[k]) for k in ("sha256", "previous") if rec.get(k))

    def job_record(self, job_id: str) -> dict[str, Any] | None:
        """The job's signed record (job sha256, signer, closed, output) or None when the ledger never saw
        it."""
        return self._job_record(job_id)

    def is_closed(self, job_id: str) -> bool:
        rec = self._job_record(job_id)
        return bool(rec and rec.get("closed"))

    # -- reports ---------------------------------------------------------------------------------
    def job_events(self, job_id: str) -> list[dict[str, Any]]:
        """This job's privacy events in the order they were charged."""
        return self._history(job_id)

    def requests(self, job_id: str | None = None) -> list[dict[str, Any]]:
        # the chained columns of a request, less its position in the chain and when its answer was recorded
        keys = tuple(k for k in chain.ROW_FIELDS if k not in ("seq", "completed_at"))
        q = f"SELECT {', '.join(keys)} FROM requests"
        args: tuple[Any, ...] = ()
        if job_id is not None:
            q, args = q + " WHERE job_id=?", (job_id,)
        out = []
        for row in self._db.execute(q + " ORDER BY seq", args):
            d = dict(zip(keys, row))
            d["events"] = json.loads(d["events"])
            out.append(d)
        return out

    def summary(
        self, budget: Budget | Any | None = None, delta: float = 1e-5, accountant: str = "rdp"
    ) -> dict[str, Any]:
        """Per job and per mechanism: ε spent (and left, when the budget is known).

        Per-mechanism figures are that mechanism's events alone; the job total composes all of them.
        ``unit``: what every figure is per, as the budget caps it: "patient" at a patient-level site (its
        policy's cap), "image", or None without a budget: the events composed as if each protected one
        image, which at a patient-level site is less than one patient can lose (``patient_events`` says the
        ledger holds patient-level DP-SGD).
        """
        budget = None if budget is None else as_budget(budget)
        d = budget.delta if budget else delta
        acc = budget.accountant if budget else accountant
        b = budget or Budget(float("inf"), float("inf"), d, cast(AccountantName, acc))
        jobs: dict[str, Any] = {}
        for (job_id,) in self._db.execute("SELECT DISTINCT job_id FROM requests ORDER BY seq").fetchall():
            reqs = self.requests(job_id)
            mechs: dict[str, list[dict[str, Any]]] = {}
            for r in reqs:
                mechs.setdefault(r["mechanism"], []).extend(r["events"])
            spent = self._eps([e for r in reqs for e in r["events"]], b)
            jobs[job_id] = {
                "epsilon_spent": spent,
                "epsilon_left": (max(0.0, budget.job_epsilon - spent) if budget else None),
                "requests": len(reqs),
                "mechanisms": {
                    m: {"epsilon_spent": self._eps(ev, b), "events": ev} for m, ev in mechs.items()
                },
            }
        life = self._eps(self._history(), b, True)
        return {
            "ledger": str(self.path),
            "delta": d,
            "accountant": acc,
            "lifetime_epsilon_spent": life,
            "lifetime_epsilon_left": (max(0.0, budget.lifetime_epsilon - life) if budget else None),
            "unit": None if budget is None else unit_name(budget.patient_cap),
            "patient_events": any(e.get("unit") == "patient" for e in self._history()),
            "policy_version": self.highest_policy_version(),
            "jobs": jobs,
        }
