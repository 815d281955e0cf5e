"""Error types. Every user-facing failure is one of these, with a message that says what and where."""

from __future__ import annotations


class FetaError(Exception):
    """Base class: the CLI prints the message (no traceback) and exits with ``exit_code``."""

    exit_code = 1


class ConfigError(FetaError):
    """A job file or option is malformed, unknown or impossible."""

    exit_code = 2


class DataError(FetaError):
    """Input images or arrays cannot be used as given."""

    exit_code = 3


class PrivacyError(FetaError):
    """A privacy plan is infeasible or a mechanism parameter is invalid."""

    exit_code = 4


class BudgetExceededError(PrivacyError):
    """A release would take a ledger past its budget; nothing was released."""

    exit_code = 5


class PolicyError(FetaError):
    """A policy or signature is missing, invalid, untrusted, expired, or forbids the request."""

    exit_code = 6


class ReleaseError(FetaError):
    """A release directory is incomplete, tampered with, or inconsistent."""

    exit_code = 7
