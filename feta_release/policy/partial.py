"""A check that passed only in part: never a full pass, never exit status 0.

``feta-release policy check`` without ``--data`` and ``job verify --policy`` can judge a secure-aggregation
job only in its Gaussian form: the form the node charges (its Skellam events, FedSGD included) has
sensitivities that depend on the data's image shape and classes, which neither the signed policy nor the
signed job states. Such a check used to exit 0 like the node's own verdict, so a script testing ``$? -eq 0``
took it for one. Its outcome is now a :class:`PartialCheck`, which the CLI prints as one line and maps to exit
status ``PARTIAL_CHECK_EXIT`` (8): what passed, what was NOT checked, and the command that makes it a full
check (docs/secure-aggregation.md, "Exit status of the checks").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["PARTIAL_CHECK_EXIT", "PartialCheck", "gaussian_form_only", "secure_aggregation_job"]

PARTIAL_CHECK_EXIT = 8  # after 1..7 of feta_release.errors: a distinct status no error and no full pass uses

# The fix names the full check; a site administrator runs it where the data is (only its shape and classes are
# read).
FULL_CHECK = (
    "run `feta-release policy check POLICY JOB --data DATA --trusted ADMIN.pub` where the site's data is "
    "(only its image shape and classes are read) to judge the job exactly as the node does"
)


@dataclass(frozen=True)
class PartialCheck:
    """What a partial check found: ``subject`` (which job, which policy) passed what ``checked`` says;
    ``not_checked`` is what it could not see; ``fix`` how to make the check full. ``line()`` is what the CLI
    prints."""

    form: str  # e.g. "GAUSSIAN FORM": the line reads "PASSED IN THE <form> ONLY"
    subject: str
    not_checked: str
    fix: str
    checked: str
    exit_code: ClassVar[int] = PARTIAL_CHECK_EXIT

    def line(self) -> str:
        return (
            f"PASSED IN THE {self.form} ONLY (exit status {self.exit_code}: not a full check): "
            f"{self.subject}. NOT checked: {self.not_checked}. Fix: {self.fix}. Checked: {self.checked}."
        )


def gaussian_form_only(subject: str, epsilon: float | None, delta: float, accountant: str) -> PartialCheck:
    """The outcome of admitting a secure-aggregation job without the site's data (``edge.admission.admit``
    with no ``data_shape``): every rule passed in the Gaussian form, the charged (Skellam) form was not
    judged."""
    eps = "?" if epsilon is None else f"{epsilon:.4g}"
    return PartialCheck(
        form="GAUSSIAN FORM",
        subject=subject,
        not_checked=(
            "the ε the node charges (the Skellam form: its sensitivities depend on the data's image shape "
            "and classes, which no signed document states) and the worst-case cap (every other site "
            "colluding)"
        ),
        fix=FULL_CHECK,
        checked=(
            f"every request's noise against this site's own share (σ/√sites) and the budget at the "
            f"Gaussian-form ε={eps} (δ={delta:g}, {accountant})"
        ),
    )


def secure_aggregation_job(signed_job: Any) -> bool:
    """Whether a signed job (its JSON document) sums its releases by secure aggregation ([federation]
    secure_aggregation): then only a check with the data's shape is the node's verdict."""
    body = signed_job.get("job") if isinstance(signed_job, dict) else None
    fed = ((body or {}).get("config") or {}).get("federation") if isinstance(body, dict) else None
    return bool(isinstance(fed, dict) and fed.get("secure_aggregation"))
