"""The local driver's side of the site ledger: a single-site run charges the SQLite ``Ledger`` (the one the
federation's nodes use) before each release, exactly its planned events, and never more.

Request ids are deterministic (``<job>/<stage>/<first step>``), so a resumed run never charges the same
release twice; a release charged but never recorded (killed between charge and save) is refused by the
ledger rather than re-drawn. DP-SGD is one round of all its steps, charged once before its first step and
recorded after its last (``stages.dpsgd``): a killed run finishes it from its checkpoint. ``privacy.json`` in
the run directory is an unsigned copy for people; ``export`` attests from the ledger.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from ..accounting import (
    PrivacyEvent,
    epsilon,
    epsilon_breakdown,
    events_from_list,
    events_to_list,
    gaussian_only,
)
from ..errors import BudgetExceededError, PrivacyError
from ..ledger import Budget, Ledger, as_budget
from ..planning import PrivacyPlan, merged
from ..policy import check_request
from ..signing import sha256_hex
from ..training.checkpoint import atomic_write_json

PRIVACY_FORMAT = "feta-release/privacy/v1"


def run_budget(cfg: Any) -> Budget:
    """A local run's budget: the job's ``[privacy]`` per job; no lifetime cap without a signed site policy."""
    p = cfg.privacy
    return Budget(
        job_epsilon=float(p.epsilon), lifetime_epsilon=math.inf, delta=float(p.delta), accountant=p.accountant
    )


class RunAccount:
    """Charges of one run (job ``job_id``) in a site ledger, bounded by the run's plan."""

    def __init__(
        self,
        ledger: Ledger,
        job_id: str,
        plan: PrivacyPlan,
        budget: Budget,
        report: Path,
        site_policy: Any = None,
    ) -> None:
        """``site_policy``: a verified ``SitePolicy`` when the run charges a site's own ledger; every charge
        is then checked against it (lifetime and per-job caps, step caps), as a node charges, and ``budget``
        is its."""
        self.ledger, self.job_id, self.plan, self.report_path = ledger, job_id, plan, report
        self.site_policy = site_policy
        self.budget = as_budget(site_policy) if site_policy is not None else budget

    @property
    def events(self) -> list[PrivacyEvent]:
        """This run's charged events, one per stage (DP-SGD chunks summed), in plan order."""
        return merged(gaussian_only(events_from_list(self.ledger.job_events(self.job_id)), "local run"))

    def charged(self, stage: str) -> int:
        return sum(e.steps for e in self.events if e.stage == stage)

    def planned(self, stage: str) -> PrivacyEvent | None:
        return self.plan.event(stage)

    def charge(self, stage: str, steps: int) -> str:
        """Record ``steps`` more compositions of ``stage``'s planned event in the ledger (committed on
        return), or refuse: beyond the plan, or past the budget (the ledger's one check). Returns the request
        id."""
        plan = self.planned(stage)
        if plan is None:
            raise BudgetExceededError(
                f"stage {stage!r} is not in this run's privacy plan; nothing was released"
            )
        done = self.charged(stage)
        if done + steps > plan.steps:
            raise BudgetExceededError(
                f"{stage}: {done} of {plan.steps} planned compositions already charged; {steps} more would "
                f"exceed the plan (and so the budget); nothing was released"
            )
        rid = self.request_id(stage, done)
        # the site's per-mechanism rules (allowed, min σ, max q, caps), as a node
        if self.site_policy is not None:
            check_request(
                self.site_policy,
                dataclasses.replace(plan, steps=steps),
                job_events=self.events,
                require_job=False,
                require_stated=False,
            )
        limits = self.site_policy if self.site_policy is not None else self.budget
        self.ledger.charge(self.job_id, rid, stage, [dataclasses.replace(plan, steps=steps)], limits)
        self.write()
        return rid

    def request_id(self, stage: str, first: int) -> str:
        """The deterministic id of ``stage``'s request whose compositions start at ``first`` (0: its
        first)."""
        return f"{self.job_id}/{stage}/{first}"

    def record(self, request_id: str, payload: bytes) -> None:
        """The release's bytes as it was saved: the request is complete (a replay gets these, never a fresh
        draw)."""
        self.ledger.record_response(request_id, payload)

    def saved_release(self, stage: str, path: Path) -> bytes:
        """The bytes of ``stage``'s saved release as a resumed run reads them back, refused unless they hash
        to the answer the ledger recorded: the run directory is writable by local users, and a file swapped
        while the run was stopped (e.g. an un-noised embedding) would otherwise train the model and reach the
        release."""
        data = path.read_bytes()
        recorded = [
            r["response_sha256"]
            for r in self.ledger.requests(self.job_id)
            if r["mechanism"] == stage and r["status"] == "done"
        ]
        if sha256_hex(data) not in recorded:
            raise PrivacyError(
                f"{path}: not the {stage} release this run's ledger recorded (sha256 "
                f"{sha256_hex(data)[:16]}…); restore the file the run wrote, or start a new run directory"
            )
        return data

    def bind_checkpoint(self, name: str, data: bytes) -> None:
        """Record the sha256 of checkpoint ``name``'s bytes in the ledger BEFORE they are written (see
        :meth:`saved_checkpoint`)."""
        self.ledger.record_checkpoint(self.job_id, name, sha256_hex(data))

    def saved_checkpoint(self, path: Path, fix: str | None = None) -> bytes:
        """The bytes of a checkpoint as a resumed run reads them back, refused (before unpickling) unless they
        hash to what this run recorded when it wrote it (:meth:`saved_release`'s rule): a checkpoint swapped
        while the run was stopped (e.g. a denoiser trained on non-private data) would otherwise reach the
        signed release. ``fix``: the refusal's way on (default: delete the file and retrain from the stage
        before it)."""
        data = path.read_bytes()
        if sha256_hex(data) not in self.ledger.checkpoint_hashes(self.job_id, path.name):
            raise PrivacyError(
                f"{path}: not the checkpoint this run wrote (sha256 {sha256_hex(data)[:16]}…, not in the "
                "run's ledger); "
                + (
                    fix
                    or f"delete {path} to retrain from the stage before it (no "
                    "privacy cost; a charged DP-SGD round is trained again from its start, never re-charged)"
                )
            )
        return data

    def pending(self, stage: str) -> bool:
        """A release of ``stage`` was charged but never recorded (the run was killed between the two)."""
        return any(
            r["status"] != "done" for r in self.ledger.requests(self.job_id) if r["mechanism"] == stage
        )

    def close(self, job_sha256: str, model_sha256: str, aux_pool_sha256: str | None = None) -> None:
        """The run is complete: the ledger refuses any further charge for it (its statement is final). The
        signed job record keeps the released model's sha256 and the run's delta and accountant: ``export``
        checks model.pt and job.json against it and attests with its delta (run.json, job.json, model.pt are
        unsigned). ``aux_pool_sha256`` (``[sampler] start_source`` aux/mix): the aux-image pool's, so an
        export never ships a swapped file (e.g. private images) as "aux-generator images"; left out otherwise
        (records stay as before)."""
        output = {
            "model_sha256": model_sha256,
            "delta": float(self.budget.delta),
            "accountant": str(self.budget.accountant),
        }
        if aux_pool_sha256 is not None:
            output["aux_pool_sha256"] = aux_pool_sha256
        self.ledger.close_job(self.job_id, job_sha256, output)

    def summary(self, final: bool = False) -> dict[str, Any]:
        b, events = self.budget, self.events
        doc: dict[str, Any] = {
            "format": PRIVACY_FORMAT,
            "accountant": b.accountant,
            "delta": b.delta,
            "target_epsilon": b.job_epsilon,
            "dataset_size": self.plan.dataset_size,
            "unit": _unit_line(self.plan.events),
            "planned": events_to_list(self.plan.events),
            "planned_epsilon": self.plan.epsilon,
            "events": events_to_list(events),
            "ledger": str(self.ledger.path),
            "job_id": self.job_id,
            "note": "an unsigned copy for reading; the record is the ledger (export attests from it)",
        }
        if b.accountant == "rdp" or final:
            doc["epsilon"] = epsilon(events, b.delta, b.accountant)
        if final:
            doc["per_stage_epsilon"] = epsilon_breakdown(events, b.delta, b.accountant) if events else {}
        return doc

    def write(self, *, final: bool = False, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        doc = {**self.summary(final), "complete": final, **(extra or {})}
        atomic_write_json(self.report_path, doc)
        return doc


def _unit_line(events: list[PrivacyEvent]) -> str:
    """The unit of privacy of a run's events, in words (patient-level DP-SGD says so; the rest is per
    image)."""
    if any(e.unit == "patient" for e in events):
        return (
            "DP-SGD: one PATIENT of one site (patients Poisson-sampled, each patient's summed gradient "
            "clipped; no group conversion); other stages: one image of one site (add/remove)"
        )
    return "one image of one site (add/remove)"


def check_recorded_plan(state: dict[str, Any], plan: PrivacyPlan, where: Path) -> None:
    """A resumed run must have the plan it started with (same job, data and public size)."""
    recorded = (state.get("plan") or {}).get("events")
    if recorded is not None and events_from_list(recorded) != plan.events:
        raise PrivacyError(
            f"{where}: the recorded plan {recorded} differs from this job's plan "
            f"{events_to_list(plan.events)}; this run directory belongs to another job, data or public size"
        )
