"""The plan in force for one input shape (`PlanState`) and the size classes that let inputs
of other sizes share it (`SizeClasses`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from gact_graph.budget.planner import Option, Plan, Unit, solve_plan

__all__ = ["PlanState", "SizeClasses"]


@dataclass
class PlanState:
    """The plan in force for one input shape, and what it predicts."""

    signature: tuple
    plan: Plan
    units: list[Unit]
    rest: int
    fixed: int
    transient: int
    variance_cap: float | None
    profile_step: int
    recompute: set[str] = field(default_factory=set)
    swap: set[str] = field(default_factory=set)
    #: what the profile step measured (CUDA: max allocated; CPU: ``rest`` + peak live bytes)
    profile_peak: int | None = None
    #: the smallest budget this profile admits (what `BudgetError` would name)
    least_budget: int = 0
    #: "" (the plan meets the accuracy bound), "relaxed" (below it: no variance cap, and in
    #: a profile's plan 1 bit allowed everywhere), "profile" (admitted by the profile step's
    #: measurement: its own setting, or a plan predicted to hold no more than it)
    relaxed: str = ""
    #: the bound the profile step's forward checked (at most ``profile_peak``)
    lower_bound: int = 0
    #: bytes planned steps measured beyond the prediction (the rectifier's term; 0 until a
    #: planned step exceeded the budget)
    correction: int = 0
    #: how often the rectifier re-planned
    rectified: int = 0
    #: ``plan.memory`` of the profile step's own setting (``relaxed == "profile"``)
    profile_memory: int = 0
    #: the profile step's own peak, its adjacency build (and a probe where one ran)
    #: included (what a rerun's profile step holds again; CUDA: ``profile_peak``; CPU: the
    #: larger of the counted peak and, where trusted, the resident set's)
    profile_whole: int | None = None
    #: a plan solved from another shape's profile (`SizeClasses.rescaled`): that profile's
    #: signature and the factor its sizes were scaled by
    scaled_from: tuple | None = None
    scaled_by: float = 1.0

    @property
    def predicted(self) -> int:
        if self.relaxed == "profile" and self.profile_peak is not None:
            # measured, less what the plan is predicted to hold below the setting that ran
            return self.profile_peak - (self.profile_memory - self.plan.memory)
        return self.rest + self.fixed + self.plan.memory + self.transient + self.correction

    def to_dict(self) -> dict[str, Any]:
        """This state in plain types, sharing nothing with it (what ``torch.load`` reads back
        with ``weights_only``): a resumed run's planner takes it back (`from_dict`)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["plan"] = (
            {n: dataclasses.astuple(o) for n, o in self.plan.choice.items()},
            self.plan.solver,
        )
        out["units"] = [
            (u.name, u.kind, [dataclasses.astuple(o) for o in u.options], u.orig_bytes)
            for u in self.units
        ]
        out["recompute"], out["swap"] = sorted(self.recompute), sorted(self.swap)
        return out

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> PlanState:
        """The state `to_dict` wrote (raises on anything else)."""
        state = dict(state)
        choice, solver = state["plan"]
        state["plan"] = Plan({n: Option(*o) for n, o in choice.items()}, solver)
        state["units"] = [
            Unit(name, kind, [Option(*o) for o in options], orig)
            for name, kind, options, orig in state["units"]
        ]
        state["recompute"], state["swap"] = set(state["recompute"]), set(state["swap"])
        return cls(**state)


class SizeClasses:
    """Plans shared by inputs that differ only in their sizes (mini-batches): per input
    structure (shapes less their sizes), at most ``limit`` plans, the least recently used
    dropped first."""

    def __init__(self) -> None:
        #: per input structure, its size classes' plans, the most recently used last
        self.classes: dict[tuple, list[PlanState]] = {}

    @staticmethod
    def structure(signature: tuple) -> tuple:
        """A signature less its sizes (node, edge, batch counts): inputs that differ only
        there (mini-batches) share a structure."""
        return tuple((len(shape), dtype, dev) for shape, dtype, dev in signature)

    @staticmethod
    def sizes(signature: tuple) -> tuple[int, ...]:
        return tuple(n for shape, _, _ in signature for n in shape)

    def find(self, signature: tuple, budget: int, margin: float) -> tuple[PlanState | None, float]:
        """The plan of a size class this input shape falls in, and by how much its sizes
        exceed the profiled ones (1.0: not at all): what saved tensors, the transient and
        the adjacency hold scales with the node and edge counts, so a plan profiled on a
        batch holds at most that ratio more on another of its structure. A class admits a
        shape whose scaled prediction still fits the budget (with the margin, or, for a
        plan admitted by the profile step's measurement, within the budget); otherwise the
        shape leaves every class and profiles a new one. The plan least predicted to hold
        is taken; (None, 1.0) where none admits it."""
        classes = self.classes.get(self.structure(signature), [])
        sizes = self.sizes(signature)
        best = None
        for state in classes:
            ref = self.sizes(state.signature)
            scale = max(
                [1.0] + [s / r for s, r in zip(sizes, ref) if r > 0 and s > r]
            )  # fmt: skip
            if any(r == 0 and s > 0 for s, r in zip(sizes, ref)):
                continue
            held = state.rest + (state.predicted - state.rest) * scale
            usable = budget if state.relaxed == "profile" else budget * (1 - margin)
            if scale > 1.0 and held > usable:
                continue
            if best is None or held < best[0]:
                best = (held, state, scale)
        if best is None:
            return None, 1.0
        classes.remove(best[1])  # most recently used last
        classes.append(best[1])
        return best[1], best[2]

    #: the most a shape's sizes may exceed a profiled one's for `rescaled` to plan it from
    #: that profile: mini-batches of one loader differ by a few percent, where bytes that
    #: scale with the counts dominate; a graph several times larger is profiled again, since
    #: what does not scale linearly (its one-time work, the backward transient's shape) may
    #: then exceed the margin
    MAX_RESCALE = 1.25

    def rescaled(self, signature: tuple, budget: int, margin: float) -> PlanState | None:
        """A plan for a shape that no class admits, solved from a class's profile with its
        per-tensor bytes, transient and measured excess scaled by the shape's sizes over the
        profiled ones (what a profile step of this shape would measure, without running one
        at 1 bit); where no plan meets the class's accuracy bound, the fastest that fits
        without it (``relaxed="relaxed"``, as `select_plan` relaxes a profile's). The
        nearest class first, then the farther ones within `MAX_RESCALE`: a class itself
        scaled from a profile by its largest ratio (edges, say) may leave no room where the
        profile, scaled by this shape's own ratios, does. None where no class's profile is
        within `MAX_RESCALE` and scalable (a plan admitted by the profile step's own
        measurement is not) or no plan fits."""
        sizes = self.sizes(signature)
        near = []
        for state in self.classes.get(self.structure(signature), []):
            if state.relaxed == "profile":
                continue
            ref = self.sizes(state.signature)
            if any(r == 0 and s > 0 for s, r in zip(sizes, ref)):
                continue
            scale = max([1.0] + [s / r for s, r in zip(sizes, ref) if r > 0 and s > r])
            if scale <= self.MAX_RESCALE:
                near.append((scale, len(near), state))
        for scale, _, state in sorted(near):
            chosen = self._scaled(state, scale, signature, budget, margin)
            if chosen is not None:
                return chosen
        return None

    @staticmethod
    def _scaled(
        state: PlanState, scale: float, signature: tuple, budget: int, margin: float
    ) -> PlanState | None:
        """``state``'s profile scaled by ``scale`` for ``signature`` and solved (`rescaled`)."""

        def grow(n: int) -> int:
            return math.ceil(round(n * scale, 6))  # not one byte up for a float's last bit

        units = [
            dataclasses.replace(
                u,
                options=[
                    dataclasses.replace(o, resident=grow(o.resident), transient=grow(o.transient))
                    for o in u.options
                ],
            )
            for u in state.units
        ]
        fixed, transient, correction = (
            grow(state.fixed),
            grow(state.transient),
            grow(state.correction),
        )
        free = budget * (1 - margin) - state.rest - fixed - transient - correction
        if free < 0:
            return None
        cap, relaxed = (None, state.relaxed) if state.relaxed else (state.variance_cap, "")
        plan = solve_plan(units, free, cap)
        if plan is None and cap is not None:
            # where no plan meets the accuracy bound, it is relaxed, as for a profile's plan
            # (`select_plan`), rather than sending a batch a few percent larger to a 1-bit
            # profile step
            cap, relaxed = None, "relaxed"
            plan = solve_plan(units, free, None)
        if plan is None:
            return None
        return dataclasses.replace(
            state,
            signature=signature,
            plan=plan,
            units=units,
            fixed=fixed,
            transient=transient,
            correction=correction,
            variance_cap=cap,
            relaxed=relaxed,
            recompute={n for n, o in plan.choice.items() if o.mode == "recompute"},
            swap={n for n, o in plan.choice.items() if o.mode == "swap"},
            scaled_from=state.scaled_from or state.signature,
            scaled_by=state.scaled_by * scale,
        )

    def add(self, state: PlanState, limit: int) -> list[PlanState]:
        """Keep ``state`` as a size class of its structure; returns the plans dropped to keep
        at most ``limit`` per structure (the least recently used)."""
        classes = self.classes.setdefault(self.structure(state.signature), [])
        classes.append(state)
        gone = []
        while len(classes) > limit:
            gone.append(classes.pop(0))
        return gone
