"""Plan selection: from what a finished profile step measured to the plan in force for its
input shape (`select_plan`), or a refusal (`BudgetError`), or the word that a recompute
profile comes next (`Deferred`). It reads no planner state: `BudgetPlanner` gathers the
figures (`ProfileFigures`) and the units, and keeps what this returns."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import NamedTuple

from gact_graph.budget.errors import BudgetError, named_budget
from gact_graph.budget.planner import Option, Plan, Unit, smallest_memory, solve_plan
from gact_graph.budget.profile import TensorInfo
from gact_graph.budget.report import METERS
from gact_graph.budget.state import PlanState
from gact_graph.config import PLAN_BITS, format_bytes
from gact_graph.policy.adaptive import allocate_bits, budget_bits, tensor_costs
from gact_graph.policy.sensitivity import S

__all__ = ["Deferred", "ProfileFigures", "profile_option", "select_plan", "variance_cap"]


class Deferred(NamedTuple):
    """A profile step that recomputed nothing found no plan, and a recompute profile may
    follow: the smallest budget it admits (before the slack), a line on it for the error the
    recompute profile may raise, and its own peak (a rerun runs that step first)."""

    least: int
    detail: str
    whole: int


@dataclass(frozen=True)
class ProfileFigures:
    """What a finished profile step measured, as plan selection needs it.

    ``rest``: what a later step starts with (what existed before this one, plus what it
    carried past its end); ``stored``: the forward's stored bytes; ``recomputed_peak``: the
    most a recomputed segment stored again; ``transient_floor``: the least backward transient
    a plan assumes; ``growth``: the most the step held beyond what existed before it;
    ``outside``: the same outside the segments' recomputations and the probe's work (CPU;
    None: not measured apart); ``profile_peak``: what a later step at the profile step's
    setting holds, measured (None: not measurable); ``correction``: what a trusted meter saw
    beyond the tensors; ``whole``: the profile step's own peak, its adjacency build (and a
    probe where one ran) included; ``lower_bound``: the bound its forward checked."""

    signature: tuple
    step: int
    rest: int
    stored: int
    recomputed_peak: int
    transient_floor: int
    growth: int | None
    outside: int | None
    profile_peak: int | None
    correction: int = 0
    whole: int | None = None
    lower_bound: int = 0


def profile_option(unit: Unit) -> Option:
    """The option the profile step ran ``unit`` at: recomputed where it can be (a recompute
    profile measured it), at the fewest bits."""
    redo = [o for o in unit.options if o.mode == "recompute"]
    pool = redo or [o for o in unit.options if o.mode in ("compress", "keep")]
    return min(pool, key=lambda o: o.bits)


def variance_cap(
    tensors: list[TensorInfo],
    c: dict[str, float],
    group_size: int,
    avg_bits: float,
    lossless: bool,
) -> float | None:
    """The added variance of the adaptive allocator's own plan at ``avg_bits`` on average
    over the tensors with an estimate in ``c`` (None: no estimates, or lossless)."""
    known = [t for t in tensors if t.quantizable and t.name in c]
    if not known or lossless:
        return None
    costs = [tensor_costs(t.shape, group_size) for t in known]
    D, meta = [d for d, _ in costs], [m for _, m in costs]
    bits = allocate_bits(
        [c[t.name] for t in known], D, budget_bits(avg_bits, D, meta), PLAN_BITS, meta
    )
    return sum(c[t.name] * S(b) for t, b in zip(known, bits))


def select_plan(
    fig: ProfileFigures,
    units: list[Unit],
    fixed: int,
    loose: list[Unit],
    cap_var: float | None,
    *,
    budget: int,
    margin: float,
    meter: str,
    default_bits: int,
    earlier: tuple[int, str, int] | None,
    may_recompute_next: bool,
    what: str,
) -> PlanState | Deferred:
    """The plan for the profile step ``fig`` describes; ``units`` and ``fixed`` are its units
    under the accuracy bound and the bytes no option changes, ``loose`` its units with the
    bound relaxed (1 bit allowed everywhere), ``cap_var`` the bound's variance cap,
    ``earlier`` what a first profile of these inputs that recomputed nothing deferred
    (`Deferred`, else None), ``may_recompute_next`` whether a recompute profile may follow
    this one, ``what`` how it ran ("nothing recomputed" / "every segment recomputed"),
    ``meter`` the meter judging steps (named in a refusal).

    The backward transient is what the step held beyond its stored bytes and the largest
    recomputed segment's; where recomputations were measured apart (``outside``), it
    excludes them: a plan that recomputes a segment pays that segment's own measured rise
    instead (its ``recompute`` option's transient), and one that recomputes nothing does
    not pay it at all.

    In order: the fastest plan that meets the accuracy bound under ``budget * (1 -
    margin)``; else the fastest with the bound relaxed, with a warning; else, when the budget
    is at least what a later step at the profile step's setting holds (measured, less a
    probe's tensors where one ran), that setting (refusing it would refuse a budget just
    met). Otherwise, where a recompute profile may follow, `Deferred`; else `BudgetError`,
    naming the smallest budget one of these admits and a rerun meets in every step: a rerun
    at it runs this profile step again (and the one before it, where this is a recompute
    profile), so it is at least their own peaks. A warning points at the caller's caller
    (the step hook)."""
    rest = fig.rest
    profile_peak, correction, whole = fig.profile_peak, fig.correction, fig.whole
    transient = fig.transient_floor
    held = fig.outside if fig.outside is not None else fig.growth
    if held is not None:
        transient = max(fig.transient_floor, held - fig.stored - fig.recomputed_peak)
    profile_memory = 0
    usable = budget * (1 - margin)
    free = usable - rest - fixed - transient - correction
    plan = solve_plan(units, free, cap_var) if free >= 0 else None
    relaxed = ""
    least_loose, _ = smallest_memory(loose, None)
    need_loose = (rest + fixed + transient + correction + least_loose) / (1 - margin)
    least = math.ceil(need_loose)
    if profile_peak is not None:
        least = min(least, profile_peak)
    runs_again = max(whole or 0, earlier[2] if earlier is not None else 0)
    least = max(least, runs_again)
    if earlier is not None:
        least = min(least, earlier[0])
    least_budget = named_budget(least)  # what a rerun, measuring again, admits
    if whole is not None and whole > budget:
        # the profile step itself held more than the budget by the meter in use (its
        # adjacency build, a probe where the allocator ran one): admitting would leave a
        # step of this run over it, and a rerun's profile step holds as much again
        raise BudgetError(
            f"gact_graph: memory_budget={format_bytes(budget)} cannot be met: the "
            f"profile step (every saved tensor at 1 bit, {what}, the graph's one-time "
            f"work included) held {format_bytes(whole)} "
            f"({METERS[meter]}); the smallest feasible budget is "
            f"{format_bytes(least_budget)}"
            + (
                "; budget_recompute=True profiles with every segment recomputed from the "
                "first step, which may hold less"
                if may_recompute_next
                else ""
            ),
            least_budget,
        )
    if plan is None:
        least_bound, _ = smallest_memory(units, cap_var)
        need_bound = (rest + fixed + transient + correction + least_bound) / (1 - margin)
        if free >= 0:
            plan = solve_plan(loose, free, None)
        if plan is not None:
            relaxed, units = "relaxed", loose
        elif profile_peak is not None and profile_peak <= budget:
            # the profile step's setting just ran within the budget; a plan predicted to hold
            # no more than it (same terms, no margin: only the plans' difference is
            # predicted) is as safe, and may be much faster: on small graphs recomputing
            # every segment holds more than it saves
            relaxed, units = "profile", loose
            ran = Plan({u.name: profile_option(u) for u in loose}, "profile")
            profile_memory = ran.memory
            plan = solve_plan(loose, profile_memory, None) or ran
        else:
            detail = (
                f"(the profile step, every saved tensor at 1 bit and {what}, measured "
                f"{'-' if profile_peak is None else format_bytes(profile_peak)}; the least "
                f"plan predicts {format_bytes(need_loose)} with margin {margin:.0%}: "
                f"rest {format_bytes(rest)}, fixed saved bytes {format_bytes(fixed)}, "
                f"least plan {format_bytes(least_loose)}, backward transient "
                f"{format_bytes(transient)}"
                + (
                    f", measured beyond the tensors {format_bytes(correction)}"
                    if correction
                    else ""
                )
                + f"; {format_bytes(need_bound)} keeps the accuracy bound)"
            )
            if may_recompute_next:  # recomputing segments may still fit it
                return Deferred(least, detail, whole or 0)
            if earlier is not None:
                detail += f"; without recomputation {earlier[1]}"
            raise BudgetError(
                f"gact_graph: memory_budget={format_bytes(budget)} cannot be met; the "
                f"smallest feasible budget is {format_bytes(least_budget)} {detail}",
                least_budget,
            )
        if relaxed == "profile":
            how = (
                "admitted by the profile step's measured peak "
                f"({format_bytes(profile_peak)}; 1 bit, {what}), the fastest plan "
                "predicted to hold no more than that setting runs"
            )
        else:
            how = "the bound is relaxed (1 bit allowed everywhere)"
        warnings.warn(
            f"gact_graph: memory_budget={format_bytes(budget)} is below "
            f"{format_bytes(need_bound)}, the least budget at which the plan keeps the "
            f"accuracy bound (no tensor without a sensitivity estimate below "
            f"{default_bits} bits, added gradient variance at most the adaptive "
            f"allocator's): {how}",
            stacklevel=3,
        )
        cap_var = None
    recompute = {n for n, o in plan.choice.items() if o.mode == "recompute"}
    swap = {n for n, o in plan.choice.items() if o.mode == "swap"}
    return PlanState(
        fig.signature, plan, units, rest, fixed, transient, cap_var, fig.step,
        recompute, swap, profile_peak, least_budget, relaxed, fig.lower_bound,
        correction, profile_memory=profile_memory, profile_whole=whole,
    )  # fmt: skip
