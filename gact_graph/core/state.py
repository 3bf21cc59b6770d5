"""A controller's resumable state: what `Controller.state_dict()` writes and how
`Controller.load_state_dict()` checks and loads it.

A state is checked whole before anything changes, so a state of another model, a malformed
plan or step, or one saved with other compression settings raises with the controller left as
it was: a resumed run either runs the plan it was asked for or stops before training. The
parts a state carries beside the plan (the adaptive estimates, the gradient watch, the memory
budget) check and load their own pieces; this module calls them in that order.
"""

from __future__ import annotations

import warnings
from typing import Any

from gact_graph.config import PLAN_BITS

__all__ = ["STATE_SETTINGS", "load_state", "save_state"]

#: settings a state's plan and estimates are made for: loading a state saved with other
#: values would run its plan instead of what this controller was asked for
STATE_SETTINGS = ("bits", "adaptive", "policy", "loss_bound", "group_size")


def save_state(ctl) -> dict[str, Any]:
    """`Controller.state_dict()`: the step, the plan, the config and the parts' states."""
    state = {
        "step": ctl.step,
        "plan": dict(ctl.plan),
        "config": ctl.config.to_dict(),
        # which model the plan's tensor names belong to (checked by load_state)
        "model": type(ctl.model).__qualname__,
        "modules": sorted(ctl.module_paths),
    }
    parts = {"adapter": ctl.adapter, "watch": ctl.watch, "budget": ctl.budget}
    state.update({k: p.state_dict() for k, p in parts.items() if p is not None})
    return state


def load_state(ctl, state: dict[str, Any], strict: bool) -> None:
    """`Controller.load_state_dict()`: checks everything, then loads ``state`` into ``ctl``."""
    if not isinstance(state, dict):
        raise TypeError(f"gact_graph state_dict must be a dict, got {type(state).__name__}")
    missing = {"step", "plan", "config"} - set(state)
    if missing:
        raise KeyError(f"gact_graph state_dict lacks {sorted(missing)}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be True or False, got {strict!r}")
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"gact_graph state_dict: step must be an int >= 0, got {step!r}")
    model = type(ctl.model).__qualname__
    if state.get("model", model) != model:
        raise ValueError(
            f"gact_graph state_dict was saved for a {state['model']}, not this {model}"
        )
    saved_cfg = state["config"]
    if not isinstance(saved_cfg, dict):
        raise TypeError(
            "gact_graph state_dict: config must be the dict of the saved CompressionConfig "
            f"(CompressionConfig.to_dict()), got {saved_cfg!r}"
        )
    paths = _paths(ctl)
    plan = state["plan"]
    if not isinstance(plan, dict):
        raise TypeError(f"gact_graph state_dict: plan must be a dict, got {plan!r}")
    for name, bits in plan.items():
        if bits is not None and (isinstance(bits, bool) or bits not in PLAN_BITS):
            raise ValueError(
                f"gact_graph state_dict: plan gives tensor {name!r} {bits!r} bits; "
                f"a plan holds {PLAN_BITS} or None (lossless)"
            )
        _check_tensor_name(ctl, name, paths, "plan")
    conflicts = _conflicts(ctl, state)
    adapter_state = state.get("adapter")
    load_adapter = ctl.adapter is not None and adapter_state is not None
    if load_adapter:
        ctl.adapter.check_state(adapter_state)  # raises, naming what is wrong
        for name in adapter_state["tensors"]:
            _check_tensor_name(ctl, name, paths, "adapter state")
    others = {"watch": ctl.watch, "budget": ctl.budget}  # loaded as `watch` is
    others = [(p, state[k]) for k, p in others.items() if p is not None and k in state]
    for part, saved in others:
        part.check_state(saved)
    if conflicts and strict:
        said = ", ".join(f"{k}={saved!r} (this controller: {now!r})" for k, saved, now in conflicts)
        raise ValueError(
            f"gact_graph state_dict was saved with other compression settings: {said}; its "
            "plan would replace what this controller was asked for. Build the controller "
            "with the saved settings to resume that run, or call "
            "load_state_dict(state, strict=False) to keep this controller's settings (the "
            "step and any sensitivity estimates are loaded, the plan is made anew)"
        )
    ctl.step, ctl._step_forwards = step, 0
    if conflicts:  # strict=False: this controller's settings hold
        ctl.plan = {}
        if load_adapter:
            ctl.adapter.load_state_dict(adapter_state)
            if ctl.adapter.tensors:
                ctl.plan.update(ctl.adapter.make_plan())
        now = ", ".join(f"{k}={n!r}" for k, _, n in conflicts)
        saved = ", ".join(f"{k}={s!r}" for k, s, _ in conflicts)
        warnings.warn(
            f"gact_graph: state saved with {saved}; this controller's settings hold "
            f"({now}): loaded the step"
            + (
                " and the sensitivity estimates, the plan is made from them"
                if load_adapter
                else ", not the saved plan"
            ),
            stacklevel=3,
        )
        return
    ctl.plan = dict(plan)
    if load_adapter:
        ctl.adapter.load_state_dict(adapter_state)
    for part, saved in others:
        part.load_state_dict(saved, ctl)


def _paths(ctl) -> set[str]:
    """Every module path a tensor name may start with (also where nothing is installed, opt
    level L0)."""
    return set(ctl.module_paths) | {n or "<root>" for n, _ in ctl.model.named_modules()}


def _check_tensor_name(ctl, name: Any, paths: set[str], where: str) -> None:
    if not isinstance(name, str) or "#" not in name:
        raise ValueError(
            f"gact_graph state_dict: {where} names a tensor {name!r}; names are "
            "'<module path>#<index>' strings"
        )
    path = name.rpartition("#")[0]
    if path not in paths:
        raise ValueError(
            f"gact_graph state_dict: {where} names tensor {name!r} of module {path!r}, "
            f"which this {type(ctl.model).__qualname__} does not have (a state of another "
            "model?)"
        )


def _conflicts(ctl, state: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(setting, saved, this controller's)`` for each setting the state differs in."""
    saved_cfg = state["config"]
    out = [
        (key, saved_cfg[key], getattr(ctl.config, key))
        for key in STATE_SETTINGS
        if key in saved_cfg and saved_cfg[key] != getattr(ctl.config, key)
    ]
    # the bits of the saved plan must be ones this controller's adapter may use
    adapter_state = state.get("adapter")
    if ctl.adapter is not None and isinstance(adapter_state, dict):
        ladder = adapter_state.get("ladder")
        if ladder is not None and list(ladder) != list(ctl.adapter.ladder):
            out.append(("ladder", list(ladder), list(ctl.adapter.ladder)))
    return out
