"""Save a compressed run from divergence: the gradient norm is watched across steps.

Fixed low bits can drive some models to diverge (PyG's 64-layer ``gcn2_cora.py`` at fixed 2
bits: the gradient norm grows tenfold within a few steps, then the loss goes NaN). The watch
sees every step's gradient through ``ctl.iterate()`` and, when it sees the run diverging, does
what ``compress_gnn(..., on_divergence=...)`` says:

- ``"rescue"`` (default): raise the bits of what is compressed (fixed bits: every compressed
  tensor to 8 bits, then kept exact; adaptive: the average budget one rung, 2 -> 4 -> 8 -> 32;
  ``policy="acgc"``: ``loss_bound`` divided by 16) and say so in one warning; the watch goes on
  watching and raises again if the growth goes on. Under a ``memory_budget`` the planner decides
  every tensor's bits, so the rescue only warns.
- ``"warn"``: one warning with advice, nothing changed.
- ``"raise"``: :class:`DivergenceError` from ``ctl.iterate()``.

Diverging means: the median of ``recent`` consecutive steps' norms is more than ``growth``
times the median of the ``window`` steps before them (a median, so that a spike that recovers
the next step is no divergence) and at least half the highest such median seen before (a
converged run whose tiny gradients grow tenfold in a loss bump is not diverging either); or the
gradients were non-finite in ``nonfinite`` of the last 10 steps (a single non-finite step is
what AMP's ``GradScaler`` produces and skips on purpose). After a rescue, the median doubling
over the level it had reached means the rescue did not hold, and the next rung follows.

Cost: one fused norm over the parameters' gradients per step, kept on the device; the values
are read once every ``every`` steps (every step on CPU, where reading costs nothing; every 5
steps on CUDA, through an asynchronous copy to pinned host memory that is looked at in a later
step, once it has landed: no step waits for the device).
"""

from __future__ import annotations

import math
import statistics
import warnings
from typing import Any

import torch

from gact_graph.config import ON_DIVERGENCE

__all__ = ["DivergenceError", "GradientWatch", "attach_watch"]

#: the widths a rescue steps through (32: kept exact)
_RUNGS = (1, 2, 4, 8, 32)
#: the width a fixed-bit run is rescued to first
_FIXED_RESCUE = 8
#: how much a rescue tightens AC-GC's bound (two more bits divide S(b) by about 16)
_ACGC_TIGHTEN = 16.0


#: steps over which non-finite gradients are counted
_NONFINITE_SPAN = 10
#: growth counts only up to at least this share of the highest level (median of ``recent``
#: steps) the run had reached before
_PEAK_SHARE = 0.5
#: after a rescue, how far over the level it had reached the norm may grow before the next one
_AGAIN = 2.0


class DivergenceError(RuntimeError):
    """Raised by ``ctl.iterate()`` when the watch sees the run diverging and
    ``on_divergence="raise"``."""


def _next_rung(bits: float) -> int:
    return next((b for b in _RUNGS if b > bits), 32)


class GradientWatch:
    """Watches the gradient norm of ``ctl.model`` at each ``ctl.iterate()``.

    Args:
        every: steps between reads of the recorded norms (None: 1 on CPU, 5 on accelerators).
        window: steps of history the growth is measured against (their median).
        growth: how many times that median the median of ``recent`` steps may reach.
        recent: consecutive steps whose median is compared (a single spike is not growth).
        nonfinite: non-finite steps among the last 10 that count as divergence.
        action: ``"rescue"``, ``"warn"`` or ``"raise"`` (see the module docstring).
    """

    def __init__(
        self,
        every: int | None = None,
        window: int = 50,
        growth: float = 4.0,
        recent: int = 5,
        nonfinite: int = 3,
        action: str = "rescue",
    ) -> None:
        if action not in ON_DIVERGENCE:
            raise ValueError(f"on_divergence must be one of {ON_DIVERGENCE}, got {action!r}")
        self.every, self.window, self.growth = every, window, growth
        self.recent, self.nonfinite, self.action = recent, nonfinite, action
        self.pending: list[torch.Tensor] = []
        self.history: list[float] = []
        self.finite: list[bool] = []  # of the last _NONFINITE_SPAN steps
        self.peak = 0.0  # the highest median of ``recent`` steps seen
        #: after a rescue, for a window of steps: the level the norm had reached, which it
        #: may not exceed ``_AGAIN`` times (0: no rescue in force)
        self.floor = 0.0
        #: what the watch saw and did: ``{"step", "what", "action"}`` per event
        self.events: list[dict[str, Any]] = []
        self.done = False  # nothing more to do: warned, or nothing left to raise
        #: what the rescues raised (restored by `load_state_dict`): the fixed-bit floor, the
        #: adaptive average, the AC-GC bound
        self.bits_floor: int | None = None
        self.avg_bits: float | None = None
        self.loss_bound: float | None = None
        #: (pinned host copy, event recorded after it, step of its last norm) while in flight
        self._copy: tuple[torch.Tensor, torch.cuda.Event, int] | None = None

    # ---------------------------------------------------------------- per step
    def after_step(self, ctl) -> None:
        if self.done:
            return
        grads = [p.grad for p in ctl.model.parameters() if p.grad is not None]
        if not grads:
            return
        norms = torch._foreach_norm([g.detach() for g in grads])  # no sync: stays on device
        dev = norms[0].device
        self.pending.append(
            torch.linalg.vector_norm(torch.stack([n.float().to(dev) for n in norms]))
        )
        every = self.every if self.every is not None else (1 if dev.type == "cpu" else 5)
        if len(self.pending) >= every or self._copy is not None:
            self._check(ctl)

    def _read(self, ctl) -> tuple[list[float], int] | None:
        """The recorded norms and the step of the last one, without waiting for the device. On
        CUDA the first call starts a copy to pinned host memory and returns None; a later call
        returns the values once the copy has landed (norms recorded meanwhile wait for the
        next read)."""
        if self._copy is None:
            values = torch.stack(self.pending)
            self.pending.clear()
            if values.device.type != "cuda":
                return values.tolist(), ctl.step
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self._copy = (host, done, ctl.step)
        host, done, last_step = self._copy
        if not done.query():
            return None
        self._copy = None
        return host.tolist(), last_step

    def _check(self, ctl) -> None:
        read = self._read(ctl)
        if read is None:
            return
        values, last_step = read
        for i, v in enumerate(values):
            step = last_step - len(values) + 1 + i
            self.finite.append(math.isfinite(v))
            del self.finite[:-_NONFINITE_SPAN]
            bad = self.finite.count(False)
            if bad >= self.nonfinite:
                self._diverging(
                    ctl,
                    f"gradients were non-finite in {bad} of the last "
                    f"{len(self.finite)} steps (step {step})",
                )
                return
            if not math.isfinite(v):
                continue
            self.history.append(v)
            k = self.recent
            ref = self.history[-self.window - k : -k]
            now = statistics.median(self.history[-k:])
            if self.floor > 0 and len(self.history) >= self.window + k:
                self.floor = 0.0  # a window since the rescue: the ordinary comparison again
            if self.floor > 0 and now > _AGAIN * self.floor:
                # after a rescue: the norm went on growing over the level it had reached
                self._diverging(
                    ctl,
                    f"the gradient norm went on growing after the bits were "
                    f"raised ({now / self.floor:.1f}x by step {step})",
                )
                return
            grown = len(ref) >= self.window // 5 and len(self.history) > k
            base = statistics.median(ref) if grown else 0.0
            peak, self.peak = self.peak, max(self.peak, now)
            # growth to a level the run has been at before is no divergence: a converged run's
            # tiny norms grow tenfold in one loss bump and are still far below its first steps'
            if grown and base > 0 and now > self.growth * base and now > _PEAK_SHARE * peak:
                self._diverging(
                    ctl,
                    f"the gradient norm grew {now / base:.0f}x over the "
                    f"median of the {len(ref)} steps before step "
                    f"{step - k + 1}",
                )
                return
        del self.history[: -self.window - self.recent]

    # ---------------------------------------------------------------- actions
    def _diverging(self, ctl, what: str) -> None:
        cfg = ctl.config
        mode = f"adaptive {cfg.bits:g}-bit" if cfg.adaptive else f"fixed {cfg.bits}-bit"
        head = f"gact_graph: {what} with {mode} compression; this run may be diverging"
        event = {"step": ctl.step, "what": what, "action": self.action}
        self.events.append(event)
        if self.action == "raise":
            self.done = True
            raise DivergenceError(
                f"{head} (on_divergence='raise'). Raise bits (e.g. bits=4), use adaptive bits "
                "(the default), let the watch raise them (on_divergence='rescue', the default), "
                "or compare with bits=None to see whether the model diverges without compression"
            )
        if self.action == "rescue":
            did = self._raise_bits(ctl)
            event["did"] = did
            if did is not None:
                self._rescued(ctl, head, did)
                return
            event["action"] = "warn"
            if ctl.bits_policy is not None:
                advice = (
                    "the memory budget decides every tensor's bits, so the watch does not "
                    "raise them: give a larger memory_budget, or on_divergence='raise' to "
                    "stop such runs"
                )
            elif (ctl.bits_floor or 0) >= 32 or (self.avg_bits or 0) >= 32:
                advice = (
                    "nothing is compressed any more, so the model diverges without "
                    "compression noise: look at the learning rate and the model"
                )
            else:
                advice = (
                    "the adaptive ladder has no wider width to raise them to: add wider "
                    "widths to ladder= (e.g. 4, 8, 32) or raise bits"
                )
        else:
            advice = (
                "because of compression noise: "
                + (
                    "raise bits (e.g. bits=4)"
                    if cfg.adaptive
                    else "use adaptive bits (the default) or raise bits (e.g. bits=4)"
                )
                + (
                    ", or leave on_divergence='rescue' (the default) to let the watch raise them; "
                    "compare with bits=None to see whether the model diverges without compression"
                )
            )
        self.done = True
        # stacklevel: _diverging, _check, after_step, Controller.iterate, the caller
        warnings.warn(
            f"{head} {advice}" if self.action == "warn" else f"{head}: {advice}",
            RuntimeWarning,
            stacklevel=5,
        )

    def _rescued(self, ctl, head: str, did: str) -> None:
        # only further growth counts: the level reached is the new floor of the comparison
        recent = self.history[-self.recent :]
        if recent:
            self.floor = max(self.floor, statistics.median(recent))
        self.history = self.history[-self.recent :]  # the growth after the rescue starts here
        self.finite.clear()
        lost = any(not bool(torch.isfinite(p).all()) for p in ctl.model.parameters())
        tail = (
            "; but the parameters are already non-finite: restore them from a checkpoint"
            if lost
            else ""
        )
        warnings.warn(
            f"{head}; rescued: {did} from step {ctl.step + 1} on (on_divergence='rescue', the "
            f"default; 'warn' only warns, 'raise' stops){tail}",
            RuntimeWarning,
            stacklevel=6,  # _rescued, _diverging, _check, after_step, iterate, the caller
        )

    def _raise_bits(self, ctl) -> str | None:
        """Raise what the controller quantizes with one rung; what was done, or None when
        nothing can be raised (everything exact already, or a memory budget decides)."""
        if ctl.bits_policy is not None:
            return None
        adapter = ctl.adapter
        if adapter is not None and getattr(adapter, "loss_bound", None) is not None:  # AC-GC
            old = adapter.loss_bound
            self.loss_bound = old / _ACGC_TIGHTEN
            self._apply(ctl)
            return f"loss_bound {old:g} -> {self.loss_bound:g}"
        if adapter is not None:
            old = adapter.avg_bits
            new = _next_rung(old)
            if old >= 32 or not any(b > old for b in adapter.ladder):
                return None  # the ladder has nothing wider to give
            self.avg_bits = float(new)
            self._apply(ctl)
            return f"average bits {old:g} -> {new:g}"
        old = self.bits_floor or int(round(ctl.config.bits))
        if old >= 32:
            return None
        # straight to 8 bits, then exact: one rung (4 bits) did not hold a deep GCNII run, which
        # later blew up within a few steps, faster than a median of steps can follow
        self.bits_floor = max(_next_rung(old), _FIXED_RESCUE)
        self._apply(ctl)
        new = "kept exact (32)" if self.bits_floor >= 32 else f"{self.bits_floor}"
        return f"every compressed tensor {old} -> {new} bits"

    def _apply(self, ctl, replan: bool = True) -> None:
        """Put the raised settings into force on ``ctl``; ``replan``: the adaptive plan too
        (`load_state_dict` loads the plan that was in force instead)."""
        adapter = ctl.adapter
        if self.bits_floor is not None:
            ctl.bits_floor = self.bits_floor
        if adapter is None:
            return
        if self.loss_bound is not None and hasattr(adapter, "loss_bound"):
            adapter.loss_bound = self.loss_bound
        elif self.avg_bits is not None:
            adapter.avg_bits = self.avg_bits
            quantized = [b for b in adapter.ladder if b <= self.avg_bits and b < 32]
            adapter.default_bits = max(quantized)
        if replan and adapter.tensors:
            ctl.plan.update(adapter.make_plan())

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "bits_floor": self.bits_floor,
            "avg_bits": self.avg_bits,
            "loss_bound": self.loss_bound,
            "floor": self.floor,
            "peak": self.peak,
            "done": self.done,
            "events": [dict(e) for e in self.events],
        }

    def load_state_dict(self, state: dict[str, Any], ctl) -> None:
        """Restore what the rescues raised (``state`` checked by `check_state`)."""
        self.bits_floor = state.get("bits_floor")
        self.avg_bits = state.get("avg_bits")
        self.loss_bound = state.get("loss_bound")
        self.floor = float(state.get("floor", 0.0))
        self.peak = float(state.get("peak", 0.0))
        self.done = bool(state.get("done", False))
        self.events = [dict(e) for e in state.get("events", [])]
        self._apply(ctl, replan=False)

    @staticmethod
    def check_state(state: Any) -> None:
        """Raise a ``ValueError``/``TypeError`` naming what is wrong with a watch state."""
        if not isinstance(state, dict):
            raise TypeError(f"gact_graph state_dict: 'watch' must be a dict, got {state!r}")
        floor = state.get("bits_floor")
        if floor is not None and (isinstance(floor, bool) or floor not in _RUNGS):
            raise ValueError(
                f"gact_graph state_dict: watch bits_floor must be one of {_RUNGS} "
                f"or None, got {floor!r}"
            )
        for key in ("avg_bits", "loss_bound", "floor", "peak"):
            v = state.get(key)
            if v is not None and (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not math.isfinite(v)
                or v < 0
            ):
                raise ValueError(
                    f"gact_graph state_dict: watch {key} must be a finite number >= 0 or None, "
                    f"got {v!r}"
                )
        if not isinstance(state.get("events", []), list):
            raise TypeError("gact_graph state_dict: watch events must be a list")


def attach_watch(ctl) -> GradientWatch:
    """Give ``ctl`` a :class:`GradientWatch` (``compress_gnn`` does, whenever it quantizes),
    acting as ``ctl.config.extra["on_divergence"]`` says (default ``"rescue"``)."""
    watch = GradientWatch(action=ctl.config.extra.get("on_divergence", "rescue"))
    ctl.watch = watch
    ctl.add_step_hook(watch.after_step)
    return watch
