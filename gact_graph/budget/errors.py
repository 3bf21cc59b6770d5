"""A refusal of the memory budget: `BudgetError` and the figure it names."""

from __future__ import annotations

import math

__all__ = ["BudgetError", "NAMED_SLACK", "NAMED_SLACK_BYTES", "named_budget"]

#: A refusal names the least budget its profile admits plus this share and
#: `NAMED_SLACK_BYTES`: a rerun measures its own profile step, and what identical processes
#: measure varies (the CPU resident set by a few hundred KiB; `docs/design.md`, budget)
NAMED_SLACK = 0.02
NAMED_SLACK_BYTES = 1 << 19


def named_budget(least: float) -> int:
    """The budget a refusal names for a least admitted budget of ``least`` bytes."""
    return math.ceil(least * (1 + NAMED_SLACK)) + NAMED_SLACK_BYTES


class BudgetError(ValueError):
    """The memory budget cannot be met by any plan. ``least_budget``: the smallest feasible
    budget in bytes that the message names; ``exact``: whether the planner admits it (False:
    a lower bound, where the message says "at least", from the forward's shapes alone)."""

    def __init__(self, message: str, least_budget: int | None = None, exact: bool = True) -> None:
        super().__init__(message)
        self.least_budget = least_budget
        self.exact = exact
