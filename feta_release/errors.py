"""Error types. Every user-facing failure is one of these, with a message that says what and where."""

from __future__ import annotations

__all__ = [
    "BudgetExceededError",
    "ConfigError",
    "DataError",
    "FetaError",
    "PolicyBudgetExceeded",
    "PolicyError",
    "PolicyViolation",
    "PrivacyError",
    "PrivateImagesInPublicSet",
    "ReleaseError",
]


class FetaError(Exception):
    """Base class: the CLI prints the message (no traceback) and exits with ``exit_code``."""

    exit_code = 1


class ConfigError(FetaError):
    """A job file or option is malformed, unknown or impossible."""

    exit_code = 2


class DataError(FetaError):
    """Input images or arrays cannot be used as given."""

    exit_code = 3


class PrivateImagesInPublicSet(DataError):
    """A public pretraining set holds copies of the private images, which would be released unprotected.

    Pretraining costs no epsilon; ``data.public.refuse_private_copies`` refuses such a set where one process
    reads both."""


class PrivacyError(FetaError):
    """A privacy plan is infeasible or a mechanism parameter is invalid."""

    exit_code = 4


class BudgetExceededError(PrivacyError):
    """A release would take a ledger past its budget; nothing was released."""

    exit_code = 5


class PolicyError(FetaError):
    """A policy or signature is missing, invalid, untrusted, expired, or forbids the request."""

    exit_code = 6


class PolicyViolation(PolicyError):
    """A policy, signature or request is refused by a named rule (e.g. ``mechanisms.dpsgd.min_sigma``).

    Defined here (re-exported by ``feta_release.policy.errors``) because the ledger enforces the per-job caps
    under its write lock and sits below the policy package.
    """

    def __init__(self, rule: str, message: str, *, site: str | None = None) -> None:
        self.rule = rule
        self.site = site
        where = f"site {site}: " if site else ""
        super().__init__(f"{where}policy rule {rule}: {message}")


class PolicyBudgetExceeded(BudgetExceededError):
    """A release would pass a site's per-job or lifetime budget (``.rule`` names which); nothing was released.

    Defined here, below every other module, because the ledger (``feta_release.ledger``) raises it and the
    policy package builds on the ledger; ``feta_release.policy.errors`` re-exports it.
    """

    def __init__(
        self,
        rule: str,
        *,
        spent: float,
        after: float,
        cap: float,
        delta: float,
        accountant: str,
        scope: str,
        per: str,
        site: str | None = None,
        patient_cap: int | None = None,
    ) -> None:
        """``per``: the words after each ε that name the site's unit, "per image" or "per patient"
        (``accounting.per_unit``, as every other line that states a site's ε: "ε=0.998 per image"; passed in
        because this module sits below accounting). ``patient_cap``: a patient-level site's signed cap (None
        at an image-level site)."""
        self.rule = rule
        self.site = site
        self.spent, self.requested, self.after, self.cap = spent, after - spent, after, cap
        where = f"site {site}: " if site else ""
        super().__init__(
            f"{where}policy rule {rule}: {scope} has spent ε={spent:.4g} {per}; with this release it would "
            f"reach ε={after:.4g} {per} > cap ε={cap:.4g} {per} (δ={delta:g}, {accountant} accountant"
            + ("" if patient_cap is None else f"; at most {patient_cap} image(s) per patient")
            + "); nothing was released"
        )


class ReleaseError(FetaError):
    """A release directory is incomplete, tampered with, or inconsistent."""

    exit_code = 7
