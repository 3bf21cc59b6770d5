"""The memory budget's report: the plan per unit, what it predicts and, per step, what the
meter in use measured (`BudgetPlanner.report`, part of ``ctl.report()``)."""

from __future__ import annotations

from typing import Any

from gact_graph.config import format_bytes

__all__ = ["METERS", "budget_report"]

#: what each meter reads, as the report and the warnings name it
METERS = {
    "cuda": "CUDA max_memory_allocated",
    "rss": "anonymous resident set above the process before training",
    "bytes": "tensor bytes counted at every op (parameters, inputs and what steps left "
    "alive included)",
}


def _fmt(v: int | None) -> str:
    return "-" if v is None else format_bytes(v)


def budget_report(
    budget: int, margin: float, meter: str, state: Any, history: list[dict[str, Any]]
) -> str:
    """The plan per unit and predicted vs measured peak per step: ``state`` is the plan in
    force (a `PlanState`, None before the first profile step), ``history`` the planner's
    per-step records (the last ten are listed)."""
    lines = [
        f"memory budget {format_bytes(budget)} (margin {margin:.0%}); judged by "
        f"{METERS[meter]} ({meter})"
    ]
    if state is None:
        lines.append("no plan yet: the first training step profiles")
        return "\n".join(lines)
    plan = state.plan
    lines.append(
        f"plan ({plan.solver}, profiled at step {state.profile_step}): predicted peak "
        f"{format_bytes(state.predicted)} "
        + ("(measured, less the plan's predicted saving) " if state.relaxed == "profile"
           else "= ")
        + f"rest {format_bytes(state.rest)} + fixed "
        f"{format_bytes(state.fixed)} + plan {format_bytes(plan.memory)} + backward "
        f"{format_bytes(state.transient)}"
        + (f" + measured miss {format_bytes(state.correction)} (re-planned "
           f"{state.rectified}x)" if state.correction else "")
        + f"; added time {1e3 * plan.seconds:.2f} ms"
        + ("" if state.variance_cap is None else f"; variance {plan.variance:.3g} "
           f"<= {state.variance_cap:.3g}")
    )  # fmt: skip
    if state.relaxed == "profile":
        lines.append(
            "below the accuracy bound: admitted by the profile step's measured peak; the "
            "plan is predicted to hold no more than that step's setting (the terms are the "
            "planner's prediction of it)"
        )
    elif state.relaxed:
        lines.append("below the accuracy bound: 1 bit allowed everywhere, no variance cap")
    lines.append(
        f"smallest feasible budget {format_bytes(state.least_budget)}; profile step "
        f"measured {_fmt(state.profile_peak)}"
        + (
            f" for later steps, {format_bytes(state.profile_whole)} itself (its adjacency "
            "build, and a probe where one ran, included)"
            if state.profile_whole is not None and state.profile_whole != state.profile_peak
            else ""
        )
    )
    lines.append(f"{'unit':<40} {'kind':<8} {'choice':<16} {'orig MB':>9} {'held MB':>9}")
    for u in state.units:
        o = plan.choice[u.name]
        lines.append(
            f"{u.name:<40} {u.kind:<8} {o.label:<16} {u.orig_bytes / 2**20:>9.3f} "
            f"{(o.resident + o.transient) / 2**20:>9.3f}"
        )
    lines.append(
        f"{'step':>6} {'phase':<8} {'predicted':>12} {'measured':>12} {'meter':>6} "
        f"{'resident':>12} {'accounted':>12}"
    )
    for h in history[-10:]:
        over = h["measured"] is not None and h["measured"] > budget
        lines.append(
            f"{h['step']:>6} {h['phase']:<8} {_fmt(h['predicted']):>12} "
            f"{_fmt(h['measured']):>12} {h.get('meter', '-'):>6} "
            f"{_fmt(h.get('resident')):>12} {format_bytes(h['accounted']):>12}"
            + ("  sensitivity probe" if h.get("probe") else "")
            + ("  over budget: re-planned" if h.get("rectified")
               else "  over budget" if over and h["phase"] == "planned" else "")
        )  # fmt: skip
    return "\n".join(lines)
