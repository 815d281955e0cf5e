"""Structured refusals: every one names the policy rule it enforces (``.rule``)."""

from __future__ import annotations

from ..errors import BudgetExceededError, PolicyError


class PolicyViolation(PolicyError):
    """A policy, signature or request is refused by a named rule (e.g. ``mechanisms.dpsgd.min_sigma``)."""

    def __init__(self, rule: str, message: str, *, site: str | None = None) -> None:
        self.rule = rule
        self.site = site
        where = f"site {site}: " if site else ""
        super().__init__(f"{where}policy rule {rule}: {message}")


class PolicySchemaError(PolicyError):
    """A policy or job document does not match its JSON Schema; ``.fields`` lists the offending paths."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.problems = problems
        self.fields = [p for p, _ in problems]
        lines = "; ".join(f"{path}: {msg}" for path, msg in problems)
        super().__init__(f"{source}: malformed document: {lines}")


class PolicyBudgetExceeded(BudgetExceededError):
    """A release would pass the per-job or lifetime budget of a site policy; nothing was released."""

    def __init__(self, rule: str, *, spent: float, after: float, cap: float, delta: float, accountant: str,
                 scope: str, site: str | None = None) -> None:
        self.rule = rule
        self.site = site
        self.spent, self.requested, self.after, self.cap = spent, after - spent, after, cap
        where = f"site {site}: " if site else ""
        super().__init__(
            f"{where}policy rule {rule}: {scope} has spent ε={spent:.4g}; with this release it would reach "
            f"ε={after:.4g} > cap ε={cap:.4g} (δ={delta:g}, {accountant} accountant); nothing was released"
        )


class JobDoesNotFit(PolicyViolation):
    """The coordinator's plan breaks at least one site's policy; ``.problems`` lists (site, rule, message)."""

    def __init__(self, problems: list[tuple[str, str, str]]) -> None:
        self.problems = problems
        site, rule, _ = problems[0]
        detail = "; ".join(msg for _, _, msg in problems)
        PolicyError.__init__(self, f"job refused before anything was released: {detail}")
        self.rule, self.site = rule, site
