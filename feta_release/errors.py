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
        site: str | None = None,
        per: str = "",
    ) -> None:
        """``per``: what one ε protects when it is not one image, e.g. "per patient (at most 5 image(s)
        each)"."""
        self.rule = rule
        self.site = site
        self.spent, self.requested, self.after, self.cap = spent, after - spent, after, cap
        where = f"site {site}: " if site else ""
        e = f"ε {per.split(' (')[0]}" if per else "ε"
        super().__init__(
            f"{where}policy rule {rule}: {scope} has spent {e}={spent:.4g}; with this release it would reach "
            f"{e}={after:.4g} > cap ε={cap:.4g} (δ={delta:g}, {accountant} accountant"
            + (f"; {per}" if per else "")
            + "); nothing was released"
        )


class ReleaseError(FetaError):
    """A release directory is incomplete, tampered with, or inconsistent."""

    exit_code = 7
