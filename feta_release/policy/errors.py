"""Structured refusals: every one names the policy rule it enforces (``.rule``)."""

from __future__ import annotations

from ..errors import PolicyBudgetExceeded, PolicyError, PolicyViolation

__all__ = ["JobDoesNotFit", "JobRefused", "PolicyBudgetExceeded", "PolicySchemaError", "PolicyViolation"]


class PolicySchemaError(PolicyError):
    """A policy or job document does not match its JSON Schema; ``.fields`` lists the offending paths."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.problems = problems
        self.fields = [p for p, _ in problems]
        lines = "; ".join(f"{path}: {msg}" for path, msg in problems)
        super().__init__(f"{source}: malformed document: {lines}")


class JobDoesNotFit(PolicyViolation):
    """The coordinator's plan breaks at least one site's policy; ``.problems`` lists (site, rule, message)."""

    def __init__(self, problems: list[tuple[str, str, str]]) -> None:
        self.problems = problems
        site, rule, _ = problems[0]
        detail = "; ".join(msg for _, _, msg in problems)
        PolicyError.__init__(self, f"job refused before anything was released: {detail}")
        self.rule, self.site = rule, site


class JobRefused(PolicyViolation):
    """A site's policy refuses a job (``policy check``, ``job verify --policy``): every failing rule, one line
    each, ``.failures`` the (rule, message) pairs; ``.rule`` the first."""

    def __init__(self, header: str, failures: list[tuple[str, str]], site: str | None = None) -> None:
        self.failures = failures
        prefix = f"site {site}: " if site else ""
        lines = "\n".join(f"  {rule}: {_bare(msg, prefix, rule)}" for rule, msg in failures)
        PolicyError.__init__(self, f"{header} ({len(failures)} rule(s)):\n{lines}")
        self.rule, self.site = failures[0][0], site


def _bare(message: str, prefix: str, rule: str) -> str:
    """A violation's message without the "site X: policy rule R: " its line already says."""
    for head in (f"{prefix}policy rule {rule}: ", prefix):
        if message.startswith(head):
            return message[len(head) :]
    return message
