"""What the memory-budget planner measures besides a step's peak (`gact_graph.core.meter`):
per-segment tensors and recompute time, and the (de)compression time of each tensor shape at
each bit width."""

from __future__ import annotations

import array
import bisect
import contextlib
import gc
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from gact_graph.core.quantize import quantize
from gact_graph.kernels.layout import META_BYTES_PER_GROUP, group_layout

__all__ = [
    "TensorInfo",
    "CodecTimer",
    "LiveBytes",
    "PeakBytes",
    "compressed_bytes",
]


def compressed_bytes(shape: tuple[int, ...], bits: int, group_size: int) -> int:
    """Bytes a `QTensor` of ``shape`` holds at ``bits`` (codes plus group metadata)."""
    lay = group_layout(shape, group_size)
    return lay.packed_nbytes(bits) + lay.num_groups * META_BYTES_PER_GROUP


@dataclass(frozen=True)
class TensorInfo:
    """One saved tensor as the planner sees it. ``quantizable``: a float activation the
    controller quantizes at the plan's bits; otherwise it costs ``fixed_bytes`` whatever the
    plan (masks, indices, small tensors, what graph-aware paths keep lossless)."""

    name: str
    shape: tuple[int, ...]
    orig_bytes: int
    quantizable: bool
    fixed_bytes: int = 0
    uses: int = 1  # saved this many times in one forward (shared: its own unit)


class CodecTimer:
    """Seconds to quantize and dequantize a tensor of a given shape at a given width, measured
    once per (shape, bits) on a random tensor on the model's device (shapes repeat across
    the layers of a GNN, so this is a handful of measurements). ``measured`` holds them,
    ``(shape, bits) -> seconds``: the dict given (a resumed run's earlier measurements), which
    it fills."""

    def __init__(
        self,
        device: torch.device,
        group_size: int,
        repeats: int = 3,
        measured: dict[tuple[tuple[int, ...], int], float] | None = None,
    ) -> None:
        self.device = device
        self.group_size = group_size
        self.repeats = repeats
        self.measured = {} if measured is None else measured

    def seconds(self, shape: tuple[int, ...], bits: int) -> float:
        if bits >= 32 or math.prod(shape) == 0:
            return 0.0
        key = (tuple(shape), int(bits))
        hit = self.measured.get(key)
        if hit is not None:
            return hit
        x = torch.randn(shape, device=self.device)
        best = math.inf
        for i in range(self.repeats):
            self._sync()
            t0 = time.perf_counter()
            quantize(x, bits, group_size=self.group_size, seed=i).dequantize()
            self._sync()
            best = min(best, time.perf_counter() - t0)
        self.measured[key] = best
        return best

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensors created while it is active and still alive (CPU profile
    step): every op's outputs are counted once per storage until that storage is freed.

    The resident set cannot stand in for it on CPU: the first step of a process also maps
    code and thread pools, and the C allocator keeps freed memory, so RSS growth is neither
    the step's live bytes nor repeatable. Checked at every op, so it costs Python time per op:
    it runs for profile steps only.

    A *window* (`open_window` ... `close_window`, e.g. one segment's recomputation) is measured
    apart: ``outside_peak`` is the peak over the ops outside every window, `close_window`
    returns how far the window rose above the bytes live when it opened. Ops for which
    ``aside()`` is true (the sensitivity probe's own work, which only the profile step runs)
    count towards ``peak``, ``repeated_peak`` and an open window, never towards
    ``outside_peak``. Ops for which ``once()`` is true (work done once per graph: building
    its adjacency, `gact_graph.switches`) count towards ``peak`` only: ``repeated_peak`` is the
    peak over every other op (what they leave alive is counted from then on). Storages of
    ``exclude`` (what exists before the step and is counted apart: parameters, inputs) are
    never counted, even when an op returns a view of them.
    `created_after_peak` is what a later step holds beyond ``outside_peak`` because it starts
    with what this one left alive (the optimizer state a first step creates after backward).
    """

    def __init__(
        self,
        aside: Callable[[], bool] | None = None,
        exclude: Iterable[torch.Tensor] = (),
        once: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__()
        self._aside = aside
        self._once = once
        self._exclude = set()
        for t in exclude:
            with contextlib.suppress(RuntimeError, NotImplementedError):
                self._exclude.add(StorageWeakRef(t.untyped_storage()).cdata)
        #: storage address -> (weak ref, bytes, serial: order of creation, created aside)
        self._live: dict[int, tuple[StorageWeakRef, int, int, bool]] = {}
        self._serial = 0
        self.bytes = 0
        #: bytes of the live storages ops set aside created (the probe's results, held on
        #: into the rest of the step): never part of ``outside_peak``
        self.aside_bytes = 0
        self.peak = 0
        self.repeated_peak = 0
        self.outside_peak = 0
        self._window: tuple[int, int] | None = None  # (bytes at its opening, its peak)
        self._since = 0  # the most bytes live since `mark`
        # each time the outside bytes reached a new high: the serial of the newest storage
        # then and the bytes (`created_after_peak` adds what was created after each)
        self._high_serials = array.array("q")
        self._high_bytes = array.array("q")

    def mark(self) -> int:
        """Start a new `since_mark` at the bytes live now (returned)."""
        self._sweep()
        self._since = self.bytes
        return self.bytes

    def since_mark(self) -> int:
        """The most bytes live since the last `mark`."""
        return self._since

    def open_window(self) -> None:
        self._sweep()
        self._window = (self.bytes, self.bytes)

    def created_after_peak(self, skip: Iterable[int] = ()) -> int:
        """What a later step holds beyond ``outside_peak`` because it starts with what this
        step left alive: over the moments the outside bytes reached a new high, the most of
        those bytes plus the bytes alive now that did not exist yet then, less
        ``outside_peak`` (at least what is alive now and was created after that peak; cyclic
        garbage collected first: what waits for the collector is not carried; storages whose
        address is in ``skip`` are not carried either). Taken at the
        peak alone, a storage created before it but after an earlier near-peak (a first
        step's adjacency, built in the first layer) would be missed there."""
        gc.collect()
        self._sweep()
        skip = set(skip)
        alive = sorted(
            (serial, n) for key, (_, n, serial, _) in self._live.items() if key not in skip
        )
        serials = [serial for serial, _ in alive]
        after = [0] * (len(alive) + 1)  # after[i]: bytes of alive[i:]
        for i in range(len(alive) - 1, -1, -1):
            after[i] = after[i + 1] + alive[i][1]
        most = self.outside_peak
        for serial, held in zip(self._high_serials, self._high_bytes):
            most = max(most, held + after[bisect.bisect_right(serials, serial)])
        return most - self.outside_peak

    def alive(self) -> int:
        """Bytes of the storages this mode saw created that are alive now (cyclic garbage
        collected first)."""
        gc.collect()
        self._sweep()
        return self.bytes

    def close_window(self) -> int:
        """Bytes the window rose above its opening at most (0 if none was open)."""
        window, self._window = self._window, None
        return 0 if window is None else window[1] - window[0]

    def _sweep(self) -> None:
        dead = [k for k, (ref, _, _, _) in self._live.items() if ref.expired()]
        for k in dead:
            _, n, _, aside = self._live.pop(k)
            self.bytes -= n
            if aside:
                self.aside_bytes -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()
        aside = self._aside is not None and self._aside()
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type == "cpu":
                try:
                    storage = t.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue
                ref = StorageWeakRef(storage)
                if ref.cdata not in self._live and ref.cdata not in self._exclude:
                    self._serial += 1
                    self._live[ref.cdata] = (ref, storage.nbytes(), self._serial, aside)
                    self.bytes += storage.nbytes()
                    if aside:
                        self.aside_bytes += storage.nbytes()
        self.peak = max(self.peak, self.bytes)
        self._since = max(self._since, self.bytes)
        if self._once is not None and self._once():
            return out
        self.repeated_peak = max(self.repeated_peak, self.bytes)
        if self._window is None:
            if aside:
                return out
            held = self.bytes - self.aside_bytes
            if held > self.outside_peak:
                self.outside_peak = held
                self._high_serials.append(self._serial)
                self._high_bytes.append(held)
        else:
            self._window = (self._window[0], max(self._window[1], self.bytes))
        return out


class PeakBytes(TorchDispatchMode):
    """Peak bytes of the CPU tensors created while it is active and still alive, for planned
    steps (the counted meter): cheaper than `LiveBytes`, which also keeps windows and the
    order of creation. The live table is swept only when its running total, which counts
    new storages and frees nothing until a sweep, exceeds the peak: the true total can only
    exceed the peak then, so the peak is exact while most ops skip the sweep.

    An op's output that shares its storage with one of the op's inputs (a view, an in-place
    update such as the optimizer's, ``out=``) is not a new storage and is not counted: what
    existed before the step is counted apart (`BudgetPlanner` keeps a ledger of it).
    ``table`` (storage address -> (weak ref, bytes)) receives what it counts, so that what a
    step leaves alive can be carried into the next step's ledger."""

    def __init__(self, table: dict[int, tuple[StorageWeakRef, int]] | None = None) -> None:
        super().__init__()
        self.table: dict[int, tuple[StorageWeakRef, int]] = {} if table is None else table
        self._sweep()
        self.start = self.bytes
        self.peak = self.bytes

    def _sweep(self) -> None:
        dead = [k for k, (ref, _) in self.table.items() if ref.expired()]
        for k in dead:
            del self.table[k]
        self.bytes = sum(n for _, n in self.table.values())

    def alive(self) -> int:
        gc.collect()
        self._sweep()
        return self.bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = set()
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                with contextlib.suppress(RuntimeError, NotImplementedError):
                    inputs.add(StorageWeakRef(t.untyped_storage()).cdata)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type == "cpu":
                try:
                    storage = t.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue
                ref = StorageWeakRef(storage)
                if ref.cdata in inputs:
                    continue
                known = self.table.get(ref.cdata)
                if known is not None:
                    if not known[0].expired():
                        continue
                    self.bytes -= known[1]  # a freed storage's address, reused
                self.table[ref.cdata] = (ref, storage.nbytes())
                self.bytes += storage.nbytes()
        if self.bytes > self.peak:
            self._sweep()
            self.peak = max(self.peak, self.bytes)
        return out
