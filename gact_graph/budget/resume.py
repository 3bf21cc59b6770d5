"""The memory budget's part of ``ctl.state_dict()``: `PlannerState`, a base class of
`gact_graph.budget.apply.BudgetPlanner` (its attributes are used here), saves and loads the
plans per input shape and their size classes, the deferred recompute profiles, the probe's
schedule and the profile records the plans are chosen again from, and the codec timings, in
plain types (what ``torch.load`` reads back with ``weights_only``). A resumed run then plans,
probes and rounds as the uninterrupted one; what a step measures is the resumed process's own.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from gact_graph.budget.probe_step import ProfileInputs
from gact_graph.budget.selection import Deferred
from gact_graph.budget.state import PlanState

__all__ = ["PlannerState"]


class PlannerState:
    """`BudgetPlanner.state_dict` and its loading (see the module docstring)."""

    #: what the codec timer measured, ``(shape, bits) -> seconds``, as loaded before the timer
    #: is made (the timer takes it over: a plan solved after a resume uses the same figures)
    _codec_seconds: dict[tuple[tuple[int, ...], int], float] | None = None

    def settings(self) -> dict[str, Any]:
        """What the plans are made for."""
        return {
            "memory_budget": self.budget,
            "budget_margin": self.margin,
            "budget_rectify": self.rectify,
            "budget_recompute": self.recompute,
        }

    def state_dict(self) -> dict[str, Any]:
        states: list[dict[str, Any]] = []
        index: dict[int, int] = {}

        def ref(state: PlanState | None) -> int | None:
            if state is None:
                return None
            if id(state) not in index:
                index[id(state)] = len(states)
                states.append(state.to_dict())
            return index[id(state)]

        probe_for, set_aside = self._probe_for, self._set_aside
        timer = self._timer
        out = {
            "settings": self.settings(),
            "plans": {sig: ref(st) for sig, st in self.plans.items()},
            "classes": {k: [ref(st) for st in v] for k, v in self.size_classes.classes.items()},
            "plan_state": ref(self.plan_state),
            "compress_profiled": {sig: tuple(d) for sig, d in self.compress_profiled.items()},
            "profiles": self.profiles,
            "history": [dict(h) for h in self.history],
            "codec_seconds": dict(timer.measured if timer else self._codec_seconds or {}),
            "probe_wanted": self._probe_wanted,
            "probe_step": self._probe_step,
            "probe_for": None if probe_for is None else (ref(probe_for[0]), *probe_for[1:]),
            "set_aside": None
            if set_aside is None
            else (ref(set_aside[0]), dataclasses.replace(set_aside[0], **set_aside[1]).to_dict()),
            "profile_inputs": {sig: p.to_plain() for sig, p in self._profile_inputs.items()},
        }
        out["states"] = states
        return out

    def _read_state(self, state: Any) -> dict[str, Any]:
        """``state`` (`state_dict`) as the planner's objects, by attribute name (``classes``:
        the size classes'); a ``ValueError`` naming the problem where it is not such a
        state."""
        try:
            states = [PlanState.from_dict(d) for d in state["states"]]

            def at(i: int | None) -> PlanState | None:
                return None if i is None else states[i]

            probe_for, set_aside, step = state["probe_for"], state["set_aside"], state["probe_step"]
            return {
                "settings": dict(state["settings"]),
                "plans": {tuple(sig): at(i) for sig, i in state["plans"].items()},
                "classes": {tuple(k): [at(i) for i in v] for k, v in state["classes"].items()},
                "plan_state": at(state["plan_state"]),
                "compress_profiled": {
                    tuple(sig): Deferred(*d) for sig, d in state["compress_profiled"].items()
                },
                "profiles": int(state["profiles"]),
                "history": [dict(h) for h in state["history"]],
                "_codec_seconds": {
                    (tuple(shape), int(bits)): float(v)
                    for (shape, bits), v in state["codec_seconds"].items()
                },
                "_probe_wanted": bool(state["probe_wanted"]),
                "_probe_step": None if step is None else int(step),
                "_probe_for": None
                if probe_for is None
                else (at(probe_for[0]), int(probe_for[1]), int(probe_for[2])),
                "_set_aside": None
                if set_aside is None
                else (
                    at(set_aside[0]),
                    {n: getattr(PlanState.from_dict(set_aside[1]), n) for n in self._PLAN_FIELDS},
                ),
                "_profile_inputs": {
                    tuple(sig): ProfileInputs.from_plain(p)
                    for sig, p in state["profile_inputs"].items()
                },
            }
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ValueError(
                "gact_graph state_dict: the memory budget's state is not one "
                f"BudgetPlanner.state_dict() wrote ({type(exc).__name__}: {exc})"
            ) from exc

    def check_state(self, state: Any) -> None:
        """Raise a ``ValueError`` naming what is wrong with ``state`` (`Controller.
        load_state_dict` calls it before it changes anything)."""
        self._read_state(state)

    def load_state_dict(self, state: dict[str, Any], ctl: Any) -> None:
        """Take back `state_dict`'s plans and schedule, after ``ctl``'s step and its adaptive
        allocator's state: a probe armed for the coming step is armed again. Plans made for
        other settings (`settings`) are not: this planner profiles anew, and says so."""
        read = self._read_state(state)
        saved, now = read.pop("settings"), self.settings()
        other = [f"{k}={saved.get(k)!r} (here: {v!r})" for k, v in now.items() if saved.get(k) != v]
        if other:
            warnings.warn(
                f"gact_graph: the state's memory-budget plans were made for {', '.join(other)}: "
                "not loaded; the first step with each input shape profiles anew",
                stacklevel=3,
            )
            return
        self.size_classes.classes = read.pop("classes")
        for name, value in read.items():
            setattr(self, name, value)
        if self._timer is not None:
            self._timer.measured = self._codec_seconds
        self._probe_plans.clear()
        if self._probe_step == ctl.step:
            ctl.adapter.attach(ctl)  # armed for the coming step, as it was saved
        else:
            self._pause_probes()
