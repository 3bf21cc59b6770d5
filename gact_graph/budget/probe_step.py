"""The memory budget's sensitivity-probe step: when the adaptive allocator's probe runs under a
budget, at which plan, and what is chosen again with the sensitivities it measures.

`ProbeStep` is one part of `gact_graph.budget.apply.BudgetPlanner` (a base class of it: the
planner's state and its `_units`, `_variance_cap`, `_sensitivities` are used here); the
module docstring there says why the probe waits for room ("The probe waits for room"). The
profile step holds the probe back (`_pause_probes`); after a planned step with room for the
probe's plan and the probe's estimate (`_probe_estimate`), `_arm_probe` puts the probe's plan
(`_probe_plan`) in place of the plan in force for one step; `_after_probe` puts the plan in force
back and chooses every exact-shape plan again with the sensitivities (`_solve_again`).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from typing import NamedTuple

from gact_graph.budget.errors import BudgetError
from gact_graph.budget.planner import least_plan
from gact_graph.budget.probe_cost import probe_need
from gact_graph.budget.profile import TensorInfo
from gact_graph.budget.selection import ProfileFigures, select_plan
from gact_graph.budget.state import PlanState

__all__ = ["ProbeStep", "ProfileInputs"]


class ProfileInputs(NamedTuple):
    """What a finished profile step's plan was chosen from (`BudgetPlanner._units`), kept to
    choose it again once the probe has run (`ProbeStep._solve_again`): its figures, saved
    tensors and per-segment records; ``probe_need`` the sensitivity probe's estimated cost
    (`ProbeStep._probe_estimate`)."""

    fig: ProfileFigures | None
    tensors: list[TensorInfo]
    inner: dict[str, list[TensorInfo]]
    referenced: dict[str, set[str]]
    recompute_seconds: dict[str, float]
    recompute_rise: dict[str, int]
    shared: dict[int, int]
    probe_need: int

    def to_plain(self) -> tuple:
        """These inputs in plain types, sharing nothing with them (`from_plain` reads them)."""
        return (
            None if self.fig is None else dataclasses.astuple(self.fig),
            [dataclasses.astuple(t) for t in self.tensors],
            {k: [dataclasses.astuple(t) for t in ts] for k, ts in self.inner.items()},
            {k: sorted(v) for k, v in self.referenced.items()},
            dict(self.recompute_seconds),
            dict(self.recompute_rise),
            dict(self.shared),
            self.probe_need,
        )

    @classmethod
    def from_plain(cls, plain: tuple) -> ProfileInputs:
        """The inputs `to_plain` wrote (raises on anything else)."""
        fig, tensors, inner, referenced, seconds, rise, shared, need = plain
        return cls(
            None if fig is None else ProfileFigures(*fig),
            [TensorInfo(*t) for t in tensors],
            {k: [TensorInfo(*t) for t in ts] for k, ts in inner.items()},
            {k: set(v) for k, v in referenced.items()},
            dict(seconds),
            dict(rise),
            dict(shared),
            int(need),
        )


class ProbeStep:
    """The deferred sensitivity probe of `BudgetPlanner` (see the module docstring)."""

    def _pause_probes(self) -> None:
        """Stop the adaptive allocator's sensitivity probes: the profile step and planned
        steps do not probe (the plan decides every tensor's bits, and a probe step holds more
        than a planned one and runs several times longer); `_arm_probe` lets one run in a
        planned step with room for it."""
        adapter = self.ctl.adapter
        if adapter is not None and hasattr(adapter, "next_estimate"):
            adapter.next_estimate = sys.maxsize
            adapter.detach()  # a probe armed for the next step

    def _probe_estimate(self, tensors: list[TensorInfo]) -> int:
        """What the sensitivity probe adds to a step's peak (it is not run to measure it). CPU:
        bounded from what the profile step's backward read and held (`probe_need`: per node
        that reads a compressed tensor, its replay or closed form on top of what that node's
        backward held, against the step's peak). Elsewhere (no counted profile, or a
        recompute profile), from shapes: its replays, the partial backwards that carry their
        noise to the parameters, and the dequantized copies and per-row counts it keeps
        until its estimate, allowed for as `PROBE_ACTIVATIONS` fp32 copies of the largest
        saved tensor, plus a copy of the parameters' gradients."""
        largest = max((t.orig_bytes for t in tensors), default=0)
        params = sum(p.numel() * p.element_size() for p in self.ctl.model.parameters())
        reads, peak = self._reads, self._reads_peak
        if reads is None or peak is None or self._recomputing:
            # a profile that recomputed every segment read the tensors segments save in
            # recomputations, not where the probe step, which recomputes what its plan
            # says, reads them: its reads bound no such step
            return self.PROBE_ACTIVATIONS * largest + params
        kept = 0
        for t in tensors:
            if not t.quantizable:
                continue
            kept += 64  # the two rounding factors' tensor
            if len(t.shape) == 2:  # per-row (and per-group) non-zero counts
                kept += 4 * t.shape[0] * max(1, -(-t.shape[1] // self.group_size))
        return probe_need(reads, step_peak=peak, kept=kept, param_bytes=params)

    #: copies of the largest saved tensor the probe's estimate allows for (`_probe_estimate`;
    #: the measured ratios are in ``docs/design.md``)
    PROBE_ACTIVATIONS = 6

    def _arm_probe(self, state: PlanState, judged: int | None) -> None:
        """After a step of a plan for exactly these inputs that compresses a tensor, under the
        accuracy bound: arm the adaptive allocator's sensitivity probe for the next step,
        which runs the probe's own plan (`_probe_plan`: every tensor at the default width,
        the least plan under the bound), where that plan and the probe's estimate fit the
        budget. The plan in force is set aside for that step and comes back after it
        (`_restore_plan`). What the plan in force measured above its prediction in this step
        is added to the probe plan's prediction. A plan shared by a size class
        (mini-batches) is armed for at its profiled sizes; the next batch runs the probe only
        where the probe's plan and the probe, scaled to its sizes, fit (`_probe_fits`).

        A plan below the accuracy bound (relaxed, or admitted by the profile step's
        measurement) is not probed: it has no variance cap, so sensitivities change nothing
        in it, and the default-width plan would hold more than its steps."""
        src = self._profile_inputs.get(state.signature)
        if src is None and state.scaled_from is not None:
            # a plan solved from another batch's profile, scaled: the probe's estimate too
            src = self._profile_inputs.get(state.scaled_from)
            if src is not None:
                src = src._replace(probe_need=math.ceil(src.probe_need * state.scaled_by))
        if src is None or self.plans.get(state.signature) is not state or state.relaxed:
            return
        if not any(o.mode == "compress" for o in state.plan.choice.values()):
            return  # a plan that keeps every tensor: no sensitivity would change it yet
        probe_plan = self._probe_plan(state)
        if not any(o.mode == "compress" for o in probe_plan.plan.choice.values()):
            return  # the probe estimates compressed tensors only: none to learn of
        held = probe_plan.predicted
        if judged is not None:  # what this step measured beyond its prediction, if more
            at = state.rest + math.ceil((judged - state.rest) / self._scale)
            held += max(0, at - state.predicted)
        if held + src.probe_need > self.budget:
            return
        if probe_plan.plan.choice != state.plan.choice:
            self._set_aside = (state, {n: getattr(state, n) for n in self._PLAN_FIELDS})
            self._adopt(state, probe_plan)
        adapter = self.ctl.adapter
        adapter.next_estimate = self.ctl.step  # `attach` arms it for the coming step
        adapter.attach(self.ctl)
        adapter.next_estimate = self.ctl.step + 1
        self._probe_step = self.ctl.step + 1
        self._probe_for = (state, held, src.probe_need)

    def _probe_plan(self, state: PlanState) -> PlanState:
        """The plan the probe step runs for ``state``'s inputs: the plan in force with every
        unit it compresses or keeps at the width of least memory at or above the default
        width (a segment it recomputes, a tensor it swaps, stay so: a recompute profile's
        figures predict the other options of such a unit less well). Under the accuracy
        bound with no sensitivities known that is every compressible tensor at the default
        width, the setting the adaptive allocator probes its own first estimate at, whose
        sensitivities its variance cap (the accuracy bound) is measured against: a probe at
        1 bit (the least plan) or at the widths of the plan in force measures other values
        on attention models (``docs/results/budget.md``). It holds no more than the plan in
        force, and a plan under the bound chosen with sensitivities holds about as much (the
        variance cap is that of the allocator's plan, which spends the default width's
        bytes). Solved once per plan in force while that plan stands."""
        hit = self._probe_plans.get(id(state))
        if hit is not None and hit[0] is state and hit[1] is state.plan:
            return hit[2]
        units = []
        for u in state.units:
            now = state.plan.choice.get(u.name)
            if now is not None and now.mode not in ("compress", "keep"):
                options = [now]  # recomputed or swapped as the plan in force does
            else:
                options = [
                    o
                    for o in u.options
                    if o.mode in ("compress", "keep") and o.bits >= self.default_bits
                ] or [o for o in (now,) if o is not None]
            units.append(dataclasses.replace(u, options=options or u.options))
        plan = least_plan(units)
        probe = dataclasses.replace(
            state,
            plan=plan,
            recompute={n for n, o in plan.choice.items() if o.mode == "recompute"},
            swap={n for n, o in plan.choice.items() if o.mode == "swap"},
        )
        self._probe_plans[id(state)] = (state, state.plan, probe)
        return probe

    def _probe_fits(self, state: PlanState | None, scale: float) -> bool:
        """Whether the probe armed for the coming step may run on inputs whose plan is
        ``state`` at ``scale`` times the profiled sizes: the plan it was armed for, and what
        the probe's plan holds plus the probe's estimate, both scaled by the sizes
        (per-tensor bytes, what the backward holds and the probe's copies grow with the node
        and edge counts), within the budget."""
        armed = self._probe_for
        if armed is None or state is None or state is not armed[0]:
            return False
        plan, held, need = armed
        return plan.rest + math.ceil((held - plan.rest + need) * scale) <= self.budget

    def _after_probe(self) -> None:
        """The probed step ended (its estimate taken by the allocator at this
        ``ctl.iterate()``): pause the probes again and solve every exact-shape plan again
        with the sensitivities (the accuracy bound's variance cap now known)."""
        self._probe_step = None
        self._probe_wanted = False
        self._restore_plan()
        self._pause_probes()
        kept, self._profile_inputs = self._profile_inputs, {}  # needed no more
        self._probe_plans.clear()
        if not self._sensitivities():
            return
        # plans scaled from a profile are solved again from it, scaled, when a batch of their
        # sizes next comes (`_size_class`), with the sensitivities
        scaled = [st for st in self.plans.values() if st.scaled_from is not None]
        for state in scaled:
            self.plans = {k: v for k, v in self.plans.items() if v is not state}
            for classes in self.size_classes.classes.values():
                if state in classes:
                    classes.remove(state)
        for signature, src in kept.items():
            state = self.plans.get(signature)
            if state is not None and state.signature == signature:
                self._solve_again(state, src)

    def _restore_plan(self) -> None:
        """Put back the plan in force a probe step set aside for the probe's plan
        (`_arm_probe`); what the rectifier added to its correction meanwhile stays."""
        if self._set_aside is not None:
            state, fields = self._set_aside
            self._set_aside = None
            for name, value in fields.items():
                setattr(state, name, value)

    def _solve_again(self, state: PlanState, src: ProfileInputs) -> None:
        """Choose ``state``'s plan again from its profile's figures and the sensitivities
        now known (what the rectifier added stays); changed in place, so size classes that
        share it follow. A plan not found keeps the one in force."""
        chosen = self._choose(state, src, self.budget)
        if chosen is None:
            return
        if chosen.predicted > max(state.predicted, self.budget * (1 - self.margin)):
            return  # never a plan predicted to hold more than the one in force, over the margin
        self._adopt(state, chosen)

    def _choose(self, state: PlanState, src: ProfileInputs, budget: int) -> PlanState | None:
        """A plan for ``state``'s inputs from its profile's figures under ``budget``, with
        the sensitivities known now; None where none is found."""
        signature = state.signature
        fig = dataclasses.replace(src.fig, correction=max(src.fig.correction, state.correction))
        units, fixed = self._units(src.tensors, relaxed=False, src=src)
        loose = self._units(src.tensors, relaxed=True, src=src)[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # said at the first plan where it applies
            try:
                chosen = select_plan(
                    fig, units, fixed, loose, self._variance_cap(src.tensors),
                    budget=budget, margin=self.margin, meter=self.meter,
                    default_bits=self.default_bits,
                    earlier=self.compress_profiled.get(signature),
                    may_recompute_next=False, what="nothing recomputed",
                )  # fmt: skip
            except BudgetError:
                return None
        if not isinstance(chosen, PlanState) or signature != chosen.signature:
            return None
        return chosen

    #: what a plan decides, copied from a chosen `PlanState` into the one in force
    _PLAN_FIELDS = (
        "plan", "units", "variance_cap", "relaxed", "profile_memory", "recompute", "swap",
    )  # fmt: skip

    def _adopt(self, state: PlanState, chosen: PlanState) -> None:
        """Make ``chosen``'s plan ``state``'s, in place (size classes that share ``state``
        follow)."""
        for name in self._PLAN_FIELDS:
            setattr(state, name, getattr(chosen, name))
