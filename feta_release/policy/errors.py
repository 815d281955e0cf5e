"""Structured refusals: every one names the policy rule it enforces (``.rule``)."""

from __future__ import annotations

from ..errors import PolicyBudgetExceeded, PolicyError, PolicyViolation

__all__ = ["JobDoesNotFit", "PolicyBudgetExceeded", "PolicySchemaError", "PolicyViolation"]


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
