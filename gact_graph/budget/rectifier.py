"""The rectifier: a planned step measured above the budget, so the prediction missed
something; the miss is added to the plan's prediction and the plan is re-solved (Adacc's
policy rectifier). Which meter judges is the planner's (`BudgetPlanner.meter`)."""

from __future__ import annotations

import warnings
from typing import Any

from gact_graph.budget.planner import smallest_memory, solve_plan
from gact_graph.config import format_bytes

__all__ = ["replan"]


def replan(state: Any, measured: int, budget: int, margin: float, step: int) -> None:
    """A planned step measured ``measured`` bytes, above ``budget``: add the miss to the
    prediction of ``state`` (a `PlanState`, changed in place: ``correction``, the largest miss
    seen for its input shape) and re-solve under ``budget * (1 - margin)``: under the
    accuracy bound, else without it, else the least plan, with a warning saying which. The
    plan takes effect at the next step."""
    before = state.predicted
    miss = measured - (before - state.correction)
    state.correction = max(state.correction, miss)
    state.rectified += 1
    usable = budget * (1 - margin)
    free = usable - state.rest - state.fixed - state.transient - state.correction
    plan, how = None, "re-planned"
    if free >= 0:
        plan = solve_plan(state.units, free, state.variance_cap)
        if plan is None and state.variance_cap is not None:
            plan = solve_plan(state.units, free, None)
            how = "re-planned below the accuracy bound"
    if plan is None:
        least, _ = smallest_memory(state.units, None)
        plan, how = solve_plan(state.units, least, None), "took the least plan"
    state.plan = plan
    if state.relaxed == "profile":  # its figure was the profile step's; now a prediction
        state.relaxed = "relaxed"
    state.recompute = {n for n, o in plan.choice.items() if o.mode == "recompute"}
    state.swap = {n for n, o in plan.choice.items() if o.mode == "swap"}
    over = state.predicted > usable
    warnings.warn(
        f"gact_graph: memory_budget={format_bytes(budget)}: step {step} "
        f"measured {format_bytes(measured)} against a predicted {format_bytes(before)}; "
        f"{how} with the miss ({format_bytes(state.correction)}) added, now predicting "
        f"{format_bytes(state.predicted)}"
        + (": still above the budget less its margin" if over else ""),
        stacklevel=3,
    )
