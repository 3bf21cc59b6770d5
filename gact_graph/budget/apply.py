"""`compress_gnn(model, memory_budget=...)`: profile, plan, apply and re-plan (Adacc).

**Steps.** The first training step with inputs of a new shape (a new graph, a new batch) is a
*profile* step: it runs at the setting least likely to exceed the budget, every saved tensor
at 1 bit and no segment recomputed (on every model measured, recomputing every CB1 segment at
1 bit held more than it saved: its fp32 intermediates in backward outweigh the 1-bit tensors
it spares; `docs/results/budget.md`). It measures what the plan needs: every saved tensor's
shape (from the controller's records), the step's peak (`StepMeter`), and, once per shape and
width, the (de)compression time. What work done once per graph held while it ran (building
the adjacency, `gact_graph.switches`) is counted apart (CPU) and in no figure the plan is made
from: later steps find the adjacency cached. After the step (at ``ctl.iterate()``) a plan is
chosen per unit (`gact_graph.budget.selection`, solved by `gact_graph.budget.planner`) and it
holds for every later step with inputs of that shape; plans are cached per input shape, so
alternating graphs re-profile once each (Adacc's policy rectifier re-plans on a size change
the same way).

**Recompute profile.** Only when no plan without recomputation fits (not even below the
accuracy bound, and the profile step itself measured above the budget) does the next step with
that shape profile again with every segment recomputed, measuring the tensors each segment
saves inside, its recompute time and rise (`CheckpointManager` listeners); its plan may then
recompute segments. ``budget_recompute=True`` makes the first profile step recompute (every
option measured at once), ``False`` never recomputes.

**Predicted peak.** ``rest + fixed + plan.memory + transient``: ``rest`` is what exists before
the step (CUDA: ``memory_allocated`` at its start; CPU: parameters, buffers and the model's
inputs, counted, plus what the profile step created after its peak and still held at its end,
the optimizer state of a first step); ``fixed`` the bytes no option changes (masks, indices,
small tensors);
``plan.memory`` the resident bytes of the chosen options plus the largest recompute rise
(a recomputed segment's measured rise: restored inputs, fp32 intermediates, what it saves
again); ``transient`` what the profile step held beyond its stored bytes outside the
recomputations (gradients, optimizer state, workspaces, dequantized copies in backward;
CUDA: including them), never less than twice the largest saved tensor plus three times the
parameters. The plan must fit ``budget * (1 - margin)``.

**Accuracy.** With sensitivities from the adaptive allocator (``adaptive=True``), the plan's
added gradient variance :math:`\\sum_l c_l S(b_l)` may not exceed what the allocator's own
plan at the configured average bits gives; tensors without an estimate (what segments save
inside) never go below the default width (the widest quantizer width not above ``bits``).
Without sensitivities no tensor goes below the default width.

**The probe waits for room.** The allocator's sensitivity probe (its replays and partial
backwards, the copies it keeps until its estimate) does not run in the profile step, which
therefore holds what a fixed 1-bit step holds: a budget that fixed 1 bit meets in every step
is admitted. The first plan is chosen without sensitivities; the probe then runs once, in a
later step, at its own plan (`BudgetPlanner._probe_plan`): every compressible tensor at the
default width, the least plan under the accuracy bound and the setting the allocator probes
its own first estimate at, whose sensitivities the bound's variance cap is measured against.
It holds no more than the plan in force, and a plan chosen under the bound with
sensitivities holds about as much, so the probe step is the lightest plan under the bound
plus the probe. It is armed after a step of a plan that meets the accuracy bound and
compresses a tensor, where the probe's plan and the probe's estimate fit the budget
(`BudgetPlanner._probe_estimate`: on CPU a bound from what the profile step held where the
probe would work, `gact_graph.budget.probe_cost`; elsewhere, or after a recompute profile,
from shapes); the plan in force comes back after the probe step, and every exact-shape plan
is chosen again with the sensitivities it measured. A plan below the bound is not probed (it
has no variance cap, so sensitivities change nothing in it, and the probe's plan holds more
than it). The allocator's probes are paused otherwise (`BudgetPlanner._pause_probes`).

**Below the accuracy bound.** When no plan meets both the budget and the accuracy bound, the
bound is relaxed (1 bit allowed for every unit, no variance cap) with a warning; when even that
predicts too much but the budget is at least what the profile step measured, the profile step's
own setting runs (it just ran within the budget). A budget the most compressed setting met is
never refused.

**Rectifier.** A planned step's peak is measured too (`StepMeter`); when it exceeds the
budget, the prediction missed something (on CPU the resident set holds what no tensor count
sees: Python objects of many layers' hooks and autograd nodes, the C allocator's retained
chunks), and the plan is re-solved with that miss added to the prediction (``correction``,
the largest miss seen for that input shape), then with the accuracy bound dropped, then the
least plan, with a warning each time; training goes on either way. It re-plans on the meter
in use (see Meters): the resident set only where it follows live bytes (CUDA, or CPU when the
C allocator returns freed memory, ``MALLOC_MMAP_THRESHOLD_`` set), since elsewhere it keeps
what a step freed and would make every plan the least; there counted tensor bytes judge.
With a device meter the profile step's own measurement seeds the correction: what it held
beyond its counted tensors is in the first plan's prediction, and the profile step's setting
is admitted only by what it really held.

**Errors.** A budget below both raises `BudgetError` naming the smallest feasible budget (the
lesser of a profile step's measured peak and the least relaxed plan's prediction with the
margin, over both profiles where two ran, but at least the peak of every profile step a rerun
runs before it is admitted, its adjacency build included; plus 2 % and 512 KiB,
`NAMED_SLACK` and `NAMED_SLACK_BYTES`, so that a rerun at the named figure, which measures
its own profile step, is admitted and met in every step), at the ``ctl.iterate()`` of the last
profile step. A profile step whose own peak by the meter in use (the graph's
one-time work included) exceeds the budget is refused at that ``ctl.iterate()``, with no
recompute profile after it: an admitted budget covers every step, the profile step
included. The forward's lower bound from shapes (saved bytes at 1 bit, the largest saved
tensor dequantized, the parameters' gradients) refuses nothing by itself, since a rerun at a
bound is not admitted; only on CUDA, where it exceeds the device's whole memory, does it raise
(``exact=False``, named as a bound).

**Meters.** One meter judges every step (`BudgetPlanner.meter`, named in ``report()``): CUDA
``max_memory_allocated``; on CPU the anonymous resident set where it follows live bytes
(``MALLOC_MMAP_THRESHOLD_`` set, or ``budget_rectify=True``), else tensor bytes counted at every
op of a planned step (`PeakBytes`, on top of a ledger of what earlier steps left alive). A
planned step over the budget by it is re-planned (above), or, with ``budget_rectify=False``,
reported with a warning.

**Size classes.** Inputs that differ only in their sizes (mini-batches) share a plan while its
prediction, scaled by how much the sizes exceed the profiled ones, fits; otherwise they
profile a new class (at most `BudgetPlanner.MAX_CLASSES` per structure). A class's plan is
probed like any other, in a batch where the plan and the probe's estimate, scaled to its
sizes, fit the budget; the sensitivities serve the class.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import warnings
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from gact_graph.budget.errors import NAMED_SLACK, NAMED_SLACK_BYTES, BudgetError
from gact_graph.budget.measure import forward_lower_bound, profile_figures, segment_tensors
from gact_graph.budget.planner import Unit, load_solver
from gact_graph.budget.probe_cost import BackwardReads
from gact_graph.budget.probe_step import ProbeStep, ProfileInputs
from gact_graph.budget.profile import CodecTimer, LiveBytes, PeakBytes, TensorInfo
from gact_graph.budget.rectifier import replan
from gact_graph.budget.report import METERS, budget_report
from gact_graph.budget.resume import PlannerState
from gact_graph.budget.selection import Deferred, ProfileFigures, select_plan, variance_cap
from gact_graph.budget.state import PlanState, SizeClasses
from gact_graph.budget.units import build_units
from gact_graph.config import FIXED_BITS, format_bytes
from gact_graph.core.controller import Controller
from gact_graph.core.meter import StepMeter
from gact_graph.core.saved import tensors_in
from gact_graph.policy.adaptive import Adapter
from gact_graph.policy.levels import CheckpointManager, SwapManager
from gact_graph.switches import is_lean, is_once_per_graph

__all__ = [
    "BudgetError",
    "BudgetPlanner",
    "attach_budget",
    "DEFAULT_MARGIN",
    "NAMED_SLACK",
    "NAMED_SLACK_BYTES",
]

#: Share of the budget kept free for what the prediction misses.
DEFAULT_MARGIN = 0.1


class BudgetPlanner(ProbeStep, PlannerState):
    """Keeps a model's training steps under ``budget`` bytes (see the module docstring).

    ``ctl.budget`` is this object: ``plan_state`` (the plan in force), ``history`` (per step:
    phase, predicted and measured peak, bytes accounted), ``report()``.
    """

    def __init__(
        self,
        ctl: Controller,
        budget: int,
        margin: float = DEFAULT_MARGIN,
        rectify: bool | str = "auto",
        recompute: bool | str = "auto",
    ) -> None:
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"budget_margin must be in [0, 1), got {margin}")
        if rectify not in ("auto", True, False):
            raise ValueError(f"budget_rectify must be 'auto', True or False, got {rectify!r}")
        if recompute not in ("auto", True, False):
            raise ValueError(f"budget_recompute must be 'auto', True or False, got {recompute!r}")
        self.ctl = ctl
        self.budget = int(budget)
        self.margin = float(margin)
        self.rectify = rectify
        self.recompute = recompute
        cfg = ctl.config
        self.group_size = cfg.group_size
        self.min_numel = cfg.min_numel
        self.lossless = cfg.lossless
        self.default_bits = 32 if cfg.lossless else max(b for b in FIXED_BITS if b <= cfg.bits)
        manager = getattr(ctl, "level_manager", None)
        if not isinstance(manager, CheckpointManager):
            manager = CheckpointManager(ctl, cfg.extra.get("checkpoint_segments"))
        self.ckpt = manager
        self.segments = [p for p, _ in manager.segments]
        self.swap: SwapManager | None = None
        self._swap_checked = False
        self.plans: dict[tuple, PlanState] = {}
        self.size_classes = SizeClasses()
        self._scale = 1.0
        self.plan_state: PlanState | None = None
        #: input shapes (at most `MAX_CLASSES`, `_defer`) whose first profile step (nothing
        #: recomputed) found no plan: their next step profiles with every segment recomputed.
        #: Value: the smallest budget that first profile admits (before the slack), a line on
        #: it, for the error the second may raise, and its own peak (a rerun runs that step
        #: first)
        self.compress_profiled: dict[tuple, tuple[int, str, int]] = {}
        self._recomputing = False  # whether this profile step recomputes every segment
        #: bytes of the ledger alive when this profile step started (CPU): what earlier steps
        #: left (optimizer state, a layer's own cached graph), which it does not create again
        self._ledger_start = 0
        self.history: list[dict[str, Any]] = []
        self.profiles = 0
        self._phase: str | None = None  # "profile" / "planned" during a step, else None
        self._meter: StepMeter | None = None
        self._live: LiveBytes | None = None
        self._base: int | None = None
        self._timer: CodecTimer | None = None
        self._seg_of: dict[str, str | None] = {}
        #: the counted meter's ledger: storages steps created that are still alive (what a
        #: later step starts with beyond parameters and inputs), address -> (weak ref, bytes)
        self._ledger: dict[int, tuple[Any, int]] = {}
        self._counter: PeakBytes | None = None
        self._device: torch.device | None = None
        self._warned_resident = False
        self._warned_rescaled = False  # a plan scaled from a profile relaxed the accuracy bound
        self._last_counter: PeakBytes | None = None
        #: what each exact-shape profile was planned from, for solving again once the
        #: sensitivity probe has run (`ProfileInputs`)
        self._profile_inputs: dict[tuple, ProfileInputs] = {}
        #: the adaptive allocator's probe is held back from the profile step (which then
        #: holds what a fixed 1-bit step holds) and runs in a later step, at its own plan,
        #: where that leaves room for it (`_arm_probe`); True until it has run (or cannot)
        self._probe_wanted = _defers_probe(ctl.adapter)
        self._probe_step: int | None = None  # the step the probe was armed for
        #: and the plan in force it was armed after, with what was allowed for: (that plan,
        #: bytes the probe's plan holds at the profiled sizes, the probe's estimate there)
        self._probe_for: tuple[PlanState, int, int] | None = None
        #: the plan in force a probe step set aside for the probe's plan, with its fields
        self._set_aside: tuple[PlanState, dict[str, Any]] | None = None
        #: per plan in force, the probe's plan solved for it, while that plan stands
        #: (`_probe_plan`: a solve each step otherwise, where the probe waits for room)
        self._probe_plans: dict[int, tuple[PlanState, Any, PlanState]] = {}
        #: the profile step's backward reads (CPU), for the probe's bound (`_probe_estimate`)
        self._reads: BackwardReads | None = None
        self._reads_peak: int | None = None  # the profile step's peak those were read under
        self._reset_step()
        ctl.bits_policy = self.bits_for
        manager.listeners.append(self._on_segment)
        root = ctl.model
        ctl.add_handle(root.register_forward_pre_hook(self._before_forward, with_kwargs=True))
        ctl.add_handle(root.register_forward_hook(self._after_forward, always_call=True))
        ctl.add_step_hook(self._after_step)
        ctl.report_extra.append(self.report)
        own = {k: ctl.__dict__[k] for k in ("_pack", "_unpack") if k in ctl.__dict__}
        wrappers: dict[str, Any] = {}
        if self._probe_wanted:
            self._pause_probes()  # the first step profiles: no probe there (see above)
            # the profile step's packs and backward reads, for the probe's bound (the
            # controller enters its saved-tensor hooks at each forward: set before the first)
            inner_pack, inner_unpack = ctl._pack, ctl._unpack

            def pack(t):
                stored = inner_pack(t)
                reads = self._reads
                if reads is not None and self._phase == "profile" and not is_lean():
                    reads.packed(stored)
                return stored

            def unpack(stored):
                reads = self._reads
                if reads is not None and self._phase == "profile" and not is_lean():
                    reads.read(stored)
                return inner_unpack(stored)

            wrappers = {"_pack": pack, "_unpack": unpack}
            for k, fn in wrappers.items():
                setattr(ctl, k, fn)

        def undo() -> None:
            self._end_live()
            if ctl.bits_policy == self.bits_for:
                ctl.bits_policy = None
            for k, fn in wrappers.items():
                if ctl.__dict__.get(k) is fn:
                    if k in own:
                        setattr(ctl, k, own[k])
                    else:
                        ctl.__dict__.pop(k, None)

        ctl.add_undo(undo)

    # ---------------------------------------------------------------- per tensor
    def _segment_of(self, path: str) -> str | None:
        hit = self._seg_of.get(path, "?")
        if hit == "?":
            hit = next((s for s in self.segments if path == s or path.startswith(s + ".")), None)
            self._seg_of[path] = hit
        return hit

    def _unit_of(self, name: str) -> str:
        state = self.plan_state
        if state is not None and name in state.plan.choice:  # a tensor of its own
            return name
        return self._segment_of(name.rsplit("#", 1)[0]) or name

    def bits_for(self, name: str) -> int | None:
        """The controller's ``bits_policy``: 1 bit in a profile step, the plan's bits after
        (the default width for a tensor the plan does not know)."""
        if self.lossless:
            return None
        if self._phase == "profile" or self.plan_state is None:
            return min(FIXED_BITS)
        opt = self.plan_state.plan.choice.get(self._unit_of(name))
        bits = self.default_bits if opt is None else opt.bits
        return None if bits >= 32 else bits

    def _wrap_swap(self, stored):
        state = self.plan_state
        if self.swap is not None and state is not None and self._phase == "planned":
            if stored.name in state.swap:
                return self.swap.wrap(stored)
        return stored

    # ---------------------------------------------------------------- step
    def _reset_step(self) -> None:
        self._inner: dict[str, list[TensorInfo]] = {}
        self._meta: dict[str, list[tuple]] = {}
        self._recompute_seconds: dict[str, float] = {}
        #: per segment, the most live bytes its recomputation rose by (CPU profile steps)
        self._recompute_rise: dict[str, int] = {}
        self._recomputed_peak = 0
        self._forward: dict[str, Any] | None = None
        self._lower_bound = 0
        #: CPU profile: bytes created after the step's peak and still alive at its end
        #: (optimizer state): every later step starts with them
        self._carried = 0
        #: per segment, the names of its inputs its recomputation saves again (a stored
        #: segment holds those itself)
        self._referenced: dict[str, set[str]] = {}
        #: storages of tensors segments keep by reference (the shared adjacency): counted once
        self._shared: dict[int, int] = {}

    def _before_forward(self, module, args, kwargs) -> None:
        ctl = self.ctl
        if not ctl.compressing or self._phase is not None:
            return
        inputs = tensors_in((args, kwargs))
        device = inputs[0].device if inputs else next(ctl.model.parameters()).device
        if not self._swap_checked:
            self._swap_checked = True
            if device.type == "cuda" and not self.lossless:  # swapping frees nothing on CPU
                swap = getattr(ctl, "level_manager", None)
                self.swap = swap if isinstance(swap, SwapManager) else SwapManager(ctl)
                ctl.payload_wrapper = self._wrap_swap
            elif isinstance(getattr(ctl, "level_manager", None), SwapManager):
                ctl.payload_wrapper = None
        signature = tuple((tuple(t.shape), str(t.dtype), str(t.device)) for t in inputs)
        self._reset_step()
        state, self._scale = self.plans.get(signature), 1.0
        if state is None:
            state, self._scale = self._size_class(signature)
        if self._probe_step is not None and not self._probe_fits(state, self._scale):
            # armed for a planned step of the plan with room for it; this one profiles, runs
            # another plan, or is a batch of that plan's size class too large for the probe
            # beside it: closed before it replays anything
            self._probe_step = None
            self._restore_plan()
            self._pause_probes()
        if state is None:
            self._phase = "profile"
            self._recomputing = bool(self.segments) and (
                self.recompute is True
                or (self.recompute == "auto" and signature in self.compress_profiled)
            )
            self.ckpt.enabled = None if self._recomputing else set()
        else:
            self._phase = "planned"
            self.plan_state = state
            self.ckpt.enabled = set(state.recompute)
        self._signature = signature
        self._static = self._static_bytes(inputs)
        if self._timer is None:
            self._timer = CodecTimer(device, self.group_size, measured=self._codec_seconds)
        self._meter = StepMeter(device)
        self._meter.begin()
        self._live = None
        self._device = device
        self._counter = None
        if self._phase == "planned" and self.meter == "bytes":
            # the counted meter judges this step: what it creates, on top of what earlier
            # steps left alive (the ledger)
            self._counter = PeakBytes(self._ledger)
            self._counter.__enter__()
        if self._phase == "profile" and device.type != "cuda":
            # CPU: count live tensor bytes through the profile step; the probe's partial
            # backwards (run under `lean_backward`) are kept out of the backward transient,
            # since planned steps do not probe, and once-per-graph work out of everything a
            # later step is predicted to hold, since it finds that work's result cached
            self._ledger_start = PeakBytes(self._ledger).alive()
            self._live = LiveBytes(
                aside=is_lean, exclude=self._static_tensors(inputs), once=is_once_per_graph
            )
            self._live.__enter__()
            params = list(self.ctl.model.parameters())
            self._reads = BackwardReads(params, self._live) if self._probe_wanted else None
        else:
            self._reads = None
        if self._base is None and device.type != "cuda":
            self._base = self._meter.start - self._static  # what the process held before

    def _size_class(self, signature: tuple) -> tuple[PlanState | None, float]:
        """The plan of a size class ``signature`` falls in, and its sizes' scale
        (`SizeClasses.find`); where it leaves every class, a plan solved from the nearest
        class's profile scaled to its sizes (`SizeClasses.rescaled`), kept as a class of its
        own, so a slightly larger batch does not cost a profile step at 1 bit."""
        state, scale = self.size_classes.find(signature, self.budget, self.margin)
        if state is None:
            state = self.size_classes.rescaled(signature, self.budget, self.margin)
            if state is not None:
                self.plans[signature] = state
                self._add_class(state)
                if state.relaxed == "relaxed" and not self._warned_rescaled:
                    self._warned_rescaled = True
                    warnings.warn(
                        f"gact_graph: memory_budget={format_bytes(self.budget)}: a batch "
                        f"{state.scaled_by:.2f}x the size of a profiled one fits only below "
                        "the accuracy bound (no cap on the added gradient variance); its "
                        "plan, solved from that profile, relaxes it",
                        stacklevel=2,
                    )
        return state, scale

    def _add_class(self, state: PlanState) -> None:
        """Keep ``state`` as a size class of its structure; a plan dropped to keep at most
        `MAX_CLASSES` goes with its exact-shape entry."""
        for gone in self.size_classes.add(state, self.MAX_CLASSES):
            self.plans = {k: v for k, v in self.plans.items() if v is not gone}

    @property
    def classes(self) -> dict[tuple, list[PlanState]]:
        """Per input structure, its size classes' plans (`SizeClasses`)."""
        return self.size_classes.classes

    #: plans kept per input structure (mini-batches whose sizes leave every class re-profile)
    MAX_CLASSES = 8

    def _defer(self, signature: tuple, deferred: Deferred) -> None:
        """Keep ``deferred`` for ``signature``'s next profile step (every segment recomputed),
        for at most `MAX_CLASSES` input shapes, the oldest dropped: a dropped shape's next
        profile runs without recomputation first again."""
        self.compress_profiled.pop(signature, None)
        self.compress_profiled[signature] = deferred
        while len(self.compress_profiled) > self.MAX_CLASSES:
            del self.compress_profiled[next(iter(self.compress_profiled))]

    def _static_tensors(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """What exists before a step and is counted in ``rest``: parameters, buffers, inputs."""
        return [*self.ctl.model.parameters(), *self.ctl.model.buffers(), *inputs]

    def _static_bytes(self, inputs: list[torch.Tensor]) -> int:
        seen, total = set(), 0
        for t in self._static_tensors(inputs):
            try:
                key = t.untyped_storage().data_ptr()
                size = t.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):
                key, size = id(t), t.numel() * t.element_size()
            if key not in seen:
                seen.add(key)
                total += size
        return total

    def _on_segment(self, event: str, segment, store, seconds: float) -> None:
        if self._phase is None or is_lean():
            # the sensitivity probe's partial backwards recompute segments too: their tensors,
            # times and rises are not the step's
            return
        if event == "forward":
            self._meta.setdefault(segment.path, []).extend(segment.meta)
            return
        if event == "recompute_start":
            if self._live is not None:
                self._live.open_window()
            return
        if self._live is not None:
            rise = self._live.close_window()
            self._recompute_rise[segment.path] = max(
                self._recompute_rise.get(segment.path, 0), rise
            )
        referenced = self._referenced.setdefault(segment.path, set())
        infos, held = segment_tensors(segment, store, referenced, self._shared)
        self._inner.setdefault(segment.path, []).extend(infos)
        self._recompute_seconds[segment.path] = (
            self._recompute_seconds.get(segment.path, 0.0) + seconds
        )
        self._recomputed_peak = max(self._recomputed_peak, held)

    def _end_live(self) -> LiveBytes | None:
        """Take the profile step's `LiveBytes` mode (and a planned step's `PeakBytes`) off the
        dispatch stack (pushed when the step's forward starts and normally popped by
        ``iterate``): left on, it would slow every later op of the process."""
        counter, self._counter = self._counter, None
        live, self._live = self._live, None
        if counter is not None and live is None:
            counter.__exit__(None, None, None)
        elif live is not None and counter is None:
            live.__exit__(None, None, None)
        elif live is not None:  # both (never pushed together): pop in reverse order
            live.__exit__(None, None, None)
            counter.__exit__(None, None, None)
        self._last_counter = counter
        return live

    @property
    def meter(self) -> str:
        """Which meter judges a step against the budget: ``"cuda"`` (``max_memory_allocated``),
        ``"rss"`` (CPU: the anonymous resident set, where it follows live bytes: glibc returns
        freed memory with ``MALLOC_MMAP_THRESHOLD_`` set, or ``budget_rectify=True`` says to
        trust it) or ``"bytes"`` (CPU otherwise: tensor bytes counted at every op of a planned
        step, what the plan is made in; the resident set keeps what glibc does not return)."""
        device = self._device
        if device is not None and device.type == "cuda":
            return "cuda"
        if self.rectify is True or "MALLOC_MMAP_THRESHOLD_" in os.environ:
            return "rss"
        return "bytes"

    METERS = METERS

    def _after_forward(self, module, args, output) -> None:
        if self._phase is None or is_lean():
            return
        if output is None:  # the forward raised (``always_call``): no step to measure
            phase, self._phase = self._phase, None
            self._end_live()
            if phase == "profile":
                self._explain_out_of_memory(sys.exc_info()[1])
            return
        if self._forward is not None:
            return
        stats = self.ctl.stats()
        self._forward = {"tensors": stats["tensors"], "stored": stats["total"]["stored_bytes"]}
        if self._phase == "profile" and output is not None:
            self._check_lower_bound()

    def _explain_out_of_memory(self, exc: BaseException | None) -> None:
        """A profile step's forward that runs out of device memory never reaches the lower
        bound's check: the out-of-memory error (which a forward hook cannot replace) gets a
        note that names the budget and what the step held when it failed."""
        if not isinstance(exc, torch.OutOfMemoryError) or not hasattr(exc, "add_note"):
            return
        held = self._meter.peak() if self._meter is not None else None
        at = "" if held is None else f" with {format_bytes(held)} allocated"
        exc.add_note(
            f"gact_graph: memory_budget={format_bytes(self.budget)}: the profile step (the "
            f"first with this input shape: every saved tensor at 1 bit, {self._what()}) ran "
            f"out of device memory in its forward{at}, before any plan could be chosen. "
            + (
                ""
                if self._recomputing or not self.segments
                else "budget_recompute=True profiles with every segment recomputed, which "
                "holds less in forward; or "
            )
            + "give it more memory, or a smaller model or graph (mini-batches)"
        )

    def _records(self) -> list[TensorInfo]:
        out = []
        for r in self._forward["tensors"] if self._forward else []:
            if r["kind"] in ("param", "input"):
                continue
            q = r["kind"] == "activation" and r["bits"] is not None
            fixed = 0 if q else r["stored_bytes"]
            info = TensorInfo(r["name"], tuple(r["shape"]), r["orig_bytes"], q, fixed, r["uses"])
            out.append(info)
        return out

    def _transient_floor(self, tensors: list[TensorInfo]) -> int:
        """The least backward transient a plan assumes: the largest saved tensor dequantized
        and its gradient, and gradients plus two optimizer states per parameter."""
        largest = max((t.orig_bytes for t in tensors), default=0)
        params = sum(p.numel() * p.element_size() for p in self.ctl.model.parameters())
        return 2 * largest + 3 * params

    def _check_lower_bound(self) -> None:
        """End of a profile step's forward: a lower bound on what any plan holds. Only shapes
        are known here (what segments save inside: their holders' shapes): every tensor at 1
        bit, every segment recomputed. Where a recompute profile may still follow, what
        segments save is left out (recomputed, a segment may hold only its inputs), but the
        largest saved tensor, wherever it is saved, is dequantized (or recomputed) in fp32 in
        backward either way.

        The bound refuses nothing by itself: a refusal names a budget at which a rerun is
        admitted, and only the finished profile step measures that. The step runs to its end
        at the least setting and the refusal comes at ``ctl.iterate()`` with the measured
        figure. On CUDA, where the bound exceeds the device's whole memory
        (the profile step cannot run), it raises here, naming the bound as a bound."""
        every = self._records()
        tensors = every
        if self._may_recompute_next():
            tensors = [t for t in every if not self._in_segment(t)]
        params = self.ctl.model.parameters()
        bound = forward_lower_bound(
            tensors, every, [m for metas in self._meta.values() for m in metas],
            rest=self._rest(),
            trainable_bytes=sum(p.numel() * p.element_size() for p in params if p.requires_grad),
            min_numel=self.min_numel, lossless=self.lossless, group_size=self.group_size,
        )  # fmt: skip
        need = bound.need
        self._lower_bound = need
        device = self._device
        if need > self.budget and device is not None and device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            if need > total:
                self._phase = None
                self._end_live()
                raise BudgetError(
                    f"gact_graph: memory_budget={format_bytes(self.budget)} cannot be met: even "
                    f"every saved tensor at {bound.bits} bit(s) and every segment recomputed "
                    f"needs at least {format_bytes(need)} (rest {format_bytes(bound.rest)}, "
                    f"saved {format_bytes(bound.saved)}, backward at least "
                    f"{format_bytes(bound.backward)}), "
                    f"more than the device's {format_bytes(total)}: the smallest feasible "
                    f"budget is at least {format_bytes(need)}, a lower bound from the "
                    "forward's shapes (the profile step that would measure the admissible "
                    "figure cannot run on this device)",
                    need,
                    exact=False,
                )

    def _may_recompute_next(self) -> bool:
        """Whether this profile step recomputes nothing but a recompute profile may follow."""
        return self.recompute == "auto" and bool(self.segments) and not self._recomputing

    def _in_segment(self, t: TensorInfo) -> bool:
        """Whether ``t`` is saved by (for) one segment alone: that segment's unit holds it."""
        return t.uses == 1 and self._segment_of(t.name.rsplit("#", 1)[0]) is not None

    def _rest(self) -> int:
        return self._meter.start if self._device.type == "cuda" else self._static

    def _after_step(self, ctl: Controller) -> None:
        phase, self._phase = self._phase, None
        live = self._end_live()
        if phase is None or self._forward is None:
            return
        peak = self._meter.peak()
        if peak is None:
            measured = None
        elif self._device.type == "cuda":
            measured = peak
        else:
            measured = peak - self._base
        resident = None if self._device.type == "cuda" else measured
        counted = None
        counter = self._last_counter
        if counter is not None:  # the counted meter (a planned step)
            counted = self._static + counter.peak
        stored = self._forward["stored"]
        accounted = self._rest() + stored + self._recomputed_peak
        if phase == "profile":
            if self._reads is not None:
                self._reads.close()
                self._reads_peak = live.repeated_peak if live is not None else None
            fig = profile_figures(
                live, self._meter, peak, measured, cuda=self._device.type == "cuda",
                rest=self._rest(), base=self._base, static=self._static,
                ledger_start=self._ledger_start, ledger=self._ledger,
                trusted=self._rectifies(), carried=self._carried, dropped=self._grad_storages(),
            )  # fmt: skip
            self._carried = fig.carried
            growth, outside, profile_peak = fig.growth, fig.outside, fig.profile_peak
            correction, whole = fig.correction, fig.whole
            if self.meter == "bytes":
                counted = whole
            state = self._plan_from_profile(growth, outside, profile_peak, correction, whole)
            if state is not None:
                self._pause_probes()
                self.plans[self._signature] = state
                self.plan_state = state
                self._add_class(state)
            predicted = None
        else:
            state = self.plan_state
            predicted = state.rest + math.ceil((state.predicted - state.rest) * self._scale)
        meter = self.meter
        judged = counted if meter == "bytes" else measured
        over = phase == "planned" and judged is not None and judged > self.budget
        rectified = over and self.rectify is not False
        self.history.append(
            {
                "step": ctl.step,
                "phase": phase,
                "predicted": predicted,
                "measured": judged,
                "meter": meter,
                "resident": resident,
                "counted": counted,
                "accounted": accounted,
                "rectified": rectified,
                "probe": self._probe_step == ctl.step,
            }
        )
        del self.history[:-256]
        if rectified:
            self._rectify(self.plan_state, judged)
        elif over:  # budget_rectify=False: said, not re-planned
            warnings.warn(
                f"gact_graph: memory_budget={format_bytes(self.budget)}: step {ctl.step} "
                f"measured {format_bytes(judged)} ({self.METERS[meter]}) against a predicted "
                f"{format_bytes(predicted)}; not re-planned (budget_rectify=False)",
                stacklevel=2,
            )
        if (
            phase == "planned"
            and meter == "bytes"
            and resident is not None
            and resident > self.budget
            and not over
            and not self._warned_resident
        ):
            self._warned_resident = True
            warnings.warn(
                f"gact_graph: memory_budget={format_bytes(self.budget)}: step {ctl.step} held "
                f"{format_bytes(counted)} of tensors, within the budget, but the process's "
                f"anonymous resident set rose {format_bytes(resident)} above where training "
                "started: glibc keeps memory the steps freed. The budget is judged in counted "
                "tensor bytes here; with MALLOC_MMAP_THRESHOLD_=65536 in the environment "
                "(set before Python starts) glibc returns it and the resident set judges "
                "(budget_rectify=True trusts it without)",
                stacklevel=2,
            )
        if self._probe_wanted and self._sensitivities():  # known (a probe ran, a loaded state)
            self._probe_wanted = False
        if self._probe_step != ctl.step:  # only the plans kept (size classes drop some)
            if not self._probe_wanted:
                self._profile_inputs.clear()
            else:
                self._profile_inputs = {
                    k: v for k, v in self._profile_inputs.items() if k in self.plans
                }
        if self._probe_step == ctl.step:
            self._after_probe()
        elif self._probe_wanted and state is not None:
            self._arm_probe(state, judged if phase == "planned" else None)

    def _grad_storages(self) -> list[int]:
        """Addresses of the parameters' gradients' storages: a later step's
        ``zero_grad()`` (``set_to_none=True``, PyTorch's default) frees them before its
        forward, so a profile step's figure for later steps does not carry them (where they
        are kept, the meter judging the planned steps sees them)."""
        out = []
        for p in self.ctl.model.parameters():
            if p.grad is not None and p.grad.layout == torch.strided:
                with contextlib.suppress(RuntimeError, NotImplementedError):
                    out.append(StorageWeakRef(p.grad.untyped_storage()).cdata)
        return out

    def _rectifies(self) -> bool:
        """Whether the device's own meter (CUDA's allocator, the CPU resident set) is trusted
        to seed the profile's correction with what it saw beyond the counted tensors: CUDA's
        allocator counts live bytes; on CPU the resident set does only when glibc returns
        freed memory, which ``MALLOC_MMAP_THRESHOLD_`` (read at process start) makes it do for
        every tensor above that size. ``budget_rectify=False`` trusts nothing."""
        if self.rectify is False:
            return False
        return self.meter in ("cuda", "rss")

    def _rectify(self, state: PlanState, measured: int) -> None:
        """A planned step measured ``measured`` bytes, above the budget: re-plan
        (`gact_graph.budget.rectifier.replan`); the plan takes effect at the next step."""
        replan(state, measured, self.budget, self.margin, self.ctl.step)

    # ---------------------------------------------------------------- planning
    def _plan_from_profile(
        self,
        growth: int | None,
        outside: int | None,
        profile_peak: int | None,
        correction: int = 0,
        whole: int | None = None,
    ) -> PlanState | None:
        """The plan for the profile step just finished (`select_plan`, which the figures are
        gathered for here); None: no plan without recomputation, the next step with these
        inputs profiles with every segment recomputed (kept in ``compress_profiled``)."""
        self.profiles += 1
        tensors = self._records()
        all_inner = [t for ts in self._inner.values() for t in ts]
        fig = ProfileFigures(
            signature=self._signature,
            step=self.ctl.step,
            rest=self._rest() + self._carried,  # later steps start with what this one carried
            stored=self._forward["stored"],
            recomputed_peak=self._recomputed_peak,
            transient_floor=self._transient_floor(tensors + all_inner),
            growth=growth,
            outside=outside,
            profile_peak=profile_peak,
            correction=correction,
            whole=whole,
            lower_bound=self._lower_bound,
        )
        units, fixed = self._units(tensors, relaxed=False)
        cap_var = self._variance_cap(tensors)
        loose = self._units(tensors, relaxed=True)[0]
        chosen = select_plan(
            fig, units, fixed, loose, cap_var, budget=self.budget, margin=self.margin,
            meter=self.meter, default_bits=self.default_bits,
            earlier=self.compress_profiled.get(self._signature),
            may_recompute_next=self._may_recompute_next(), what=self._what(),
        )  # fmt: skip
        if isinstance(chosen, Deferred):
            self._defer(self._signature, chosen)
            return None
        if self._probe_wanted:  # kept for choosing again once the probe has run
            self._profile_inputs[self._signature] = ProfileInputs(
                fig, tensors, dict(self._inner), {k: set(v) for k, v in self._referenced.items()},
                dict(self._recompute_seconds), dict(self._recompute_rise), dict(self._shared),
                self._probe_estimate(tensors + all_inner),
            )  # fmt: skip
        return chosen

    def _what(self) -> str:
        return "every segment recomputed" if self._recomputing else "nothing recomputed"

    def _sensitivities(self) -> dict[str, float]:
        adapter = self.ctl.adapter
        c = getattr(adapter, "c", None)
        return dict(c) if isinstance(c, dict) else {}

    def _variance_cap(self, tensors: list[TensorInfo]) -> float | None:
        """The accuracy bound's variance cap over ``tensors`` (`variance_cap`, at the
        allocator's configured average bits)."""
        avg = float(getattr(self.ctl.adapter, "avg_bits", self.default_bits))
        return variance_cap(tensors, self._sensitivities(), self.group_size, avg, self.lossless)

    def _units(
        self, tensors: list[TensorInfo], relaxed: bool, src: ProfileInputs | None = None
    ) -> tuple[list[Unit], int]:
        """The units and the bytes no option changes (`build_units`); ``relaxed``: every unit
        may go down to 1 bit (what the accuracy bound forbids for tensors without an
        estimate); ``src``: a finished profile's records (default: this step's)."""
        if src is None:
            src = ProfileInputs(
                None, tensors, self._inner, self._referenced, self._recompute_seconds,
                self._recompute_rise, self._shared, 0,
            )  # fmt: skip
        return build_units(
            tensors, relaxed, c=self._sensitivities(), timer=self._timer, swap=self.swap,
            segments=self.segments, segment_of=self._segment_of, in_segment=self._in_segment,
            inner_of=src.inner, referenced=src.referenced,
            recompute_seconds=src.recompute_seconds, recompute_rise=src.recompute_rise,
            shared=src.shared, lossless=self.lossless, default_bits=self.default_bits,
            group_size=self.group_size,
        )  # fmt: skip

    # ---------------------------------------------------------------- report
    def report(self) -> str:
        """The plan per unit and predicted vs measured peak per step (`budget_report`)."""
        return budget_report(self.budget, self.margin, self.meter, self.plan_state, self.history)


def _defers_probe(adapter: Any) -> bool:
    """Whether ``adapter`` is the adaptive allocator estimating by its probe, which the
    planner holds back from profile steps and runs in a later step with room for it."""
    return isinstance(adapter, Adapter) and adapter.estimator == "probe"


def attach_budget(ctl: Controller) -> BudgetPlanner:
    """Give ``ctl`` a `BudgetPlanner` for ``ctl.config.memory_budget`` (`compress_gnn` does
    this when a budget is set); kept as ``ctl.budget``."""
    budget = ctl.config.memory_budget_bytes
    if budget is None:
        raise ValueError("attach_budget needs config.memory_budget")
    margin = float(ctl.config.extra.get("budget_margin", DEFAULT_MARGIN))
    rectify = ctl.config.extra.get("budget_rectify", "auto")
    recompute = ctl.config.extra.get("budget_recompute", "auto")
    load_solver()  # outside every measured step (see there)
    planner = BudgetPlanner(ctl, budget, margin, rectify, recompute)
    ctl.budget = planner
    return planner
