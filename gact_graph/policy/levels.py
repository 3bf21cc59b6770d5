r"""Optimization levels of `compress_gnn` (GACT Sec. 5.4-5.5; ActNN's L0-L5).

======  ===================================================================================
level   what runs
======  ===================================================================================
``L0``  nothing: no hook, no patch; the model runs stock PyTorch.
``L1``  compression (default): every tensor autograd saves goes through the `Controller`.
``L2``  L1 + swap (`SwapManager`): every compressed activation payload is copied to pinned
        CPU memory on a side CUDA stream as soon as it is made (its device copy is freed),
        and copied back on that stream one GNN layer ahead of the backward pass. Lossless
        tensors are not swapped (``bits=None``: L2 is L1). On CPU there is nothing to swap
        to: L2 runs exactly as L1, with one warning.
``CB1`` L1 + checkpointing (`CheckpointManager`): each GNN block is a checkpoint segment.
        Inside a segment nothing is saved; its inputs are saved through the controller
        (compressed like any activation); in backward the segment is recomputed and what the
        recomputation saves is compressed again before the backward pass reads it.
======  ===================================================================================

**Segments (CB1).** `checkpoint_segments` picks, by default, the outermost modules that are
a message-passing layer (a PyG ``MessagePassing``) or a block of a ``ModuleList`` /
``Sequential`` that holds one (e.g. PyG's ``DeepGCNLayer``: conv + norm + activation). The
reference models of `gact_graph.models` write norm, activation and dropout inline in their
``forward``, so their segments are the convolutions ``convs.0``, ``convs.1``, ...: what a
GCNConv saves is its input anyway (no gain there), what a GCN2Conv or GATConv saves inside is
more than its inputs (the gain). ``compress_gnn(..., opt_level="CB1",
checkpoint_segments=[...])`` takes module paths (or ``fn(path, module) -> bool``) instead.

**Why our own checkpoint.** CB1 uses a non-reentrant checkpoint built on saved-tensor hooks
(`_Segment`, the algorithm of ``torch.utils.checkpoint(use_reentrant=False)``: holders in
forward, recomputation on the first unpack, early stop, RNG state restored, a check that the
recomputation saves what the forward did). Torch's own version keeps the recomputed tensors
uncompressed until backward reads them and gives no way to change that, and its recomputation
would run outside the controller's forward contexts (the pointwise mode), so it would save
different tensors than the forward did. Torch's checkpoint inside a model compressed with
``pointwise=False`` composes with the controller (its inputs are saved through our hooks;
tested); with the pointwise mode on, its recomputation saves different tensors than its
forward (a known limitation, kept as a strict xfail in ``tests/test_levels.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from gact_graph.core.controller import Controller, Stored, mix_seed
from gact_graph.core.quantize import QTensor
from gact_graph.core.saved import is_plain_strided, storage_ref, view_bytes, view_key

__all__ = [
    "LEVELS",
    "install_level",
    "checkpoint_segments",
    "SwapManager",
    "SwappedPayload",
    "CheckpointManager",
]

#: level -> one line of what it does (the table above).
LEVELS = {
    "L0": "off: no hooks at all",
    "L1": "compress every saved tensor (default)",
    "L2": "L1 + swap compressed payloads to pinned CPU memory, prefetch one layer ahead (CUDA)",
    "CB1": "L1 + checkpoint each GNN block; inputs and recomputed tensors compressed",
}

#: stored payloads below this many bytes stay where they are under L2 (copies cost more).
DEFAULT_SWAP_MIN_BYTES = 1 << 16


def install_level(ctl: Controller) -> SwapManager | CheckpointManager | None:
    """Install what ``ctl.config.opt_level`` adds to L1; called by `compress_gnn`.

    ``config.extra`` keys: ``swap_min_bytes`` (L2), ``swap_simulate`` (L2: run the swap
    bookkeeping with plain CPU copies; for tests on machines without CUDA),
    ``checkpoint_segments`` (CB1, see `checkpoint_segments`). The manager is kept as
    ``ctl.level_manager``; ``ctl.remove()`` undoes it.
    """
    level = ctl.config.opt_level
    extra = ctl.config.extra
    if level == "L2":
        manager: SwapManager | CheckpointManager = SwapManager(
            ctl,
            min_bytes=int(extra.get("swap_min_bytes", DEFAULT_SWAP_MIN_BYTES)),
            simulate=bool(extra.get("swap_simulate", False)),
        )
    elif level == "CB1":
        manager = CheckpointManager(ctl, extra.get("checkpoint_segments"))
    else:
        return None
    ctl.level_manager = manager
    return manager


# ------------------------------------------------------------------------------ segments
def _message_passing_type() -> type | None:
    try:
        from torch_geometric.nn import MessagePassing
    except ImportError:  # pragma: no cover - PyG is a dependency
        return None
    return MessagePassing


def checkpoint_segments(
    model: nn.Module,
    spec: Iterable[str] | Callable[[str, nn.Module], bool] | None = None,
) -> list[tuple[str, nn.Module]]:
    """The ``(path, module)`` segments CB1 checkpoints, in model order.

    Args:
        model: the root model (never a segment itself).
        spec: ``None``: the outermost modules that are a ``MessagePassing`` layer or an element
            of a ``ModuleList``/``Sequential`` holding one (a "block"); a list of module paths;
            or ``fn(path, module) -> bool`` (outermost matches only).
    """
    named = [(n, m) for n, m in model.named_modules() if n]
    if spec is not None and not callable(spec):
        wanted = list(spec)
        found = dict(named)
        missing = [p for p in wanted if p not in found]
        if missing:
            raise ValueError(f"checkpoint_segments: no module at {missing}")
        chosen = set(wanted)
        return _outermost([(n, m) for n, m in named if n in chosen])
    if callable(spec):
        return _outermost([(n, m) for n, m in named if spec(n, m)])
    mp = _message_passing_type()
    if mp is None:
        return []
    containers = (nn.ModuleList, nn.Sequential, nn.ModuleDict)

    def holds_mp(m: nn.Module) -> bool:
        return any(isinstance(s, mp) for s in m.modules())

    parents = {n: m for n, m in [("", model), *named]}
    picked = []
    for name, module in named:
        parent = parents[name.rpartition(".")[0]]
        if isinstance(module, mp):
            picked.append((name, module))
        elif (
            isinstance(parent, containers)
            and not isinstance(module, containers)
            and holds_mp(module)
        ):
            picked.append((name, module))
    return _outermost(picked)


def _outermost(items: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    out: list[tuple[str, nn.Module]] = []
    for name, module in items:  # named_modules order: parents come before children
        if any(name.startswith(p + ".") for p, _ in out):
            continue
        out.append((name, module))
    return out


# ------------------------------------------------------------------------------ L2: swap
def _map_value(value: QTensor, fn: Callable[[Tensor], Tensor]) -> QTensor:
    return replace(value, packed=fn(value.packed), meta=fn(value.meta))


class SwappedPayload:
    """A compressed activation (a `QTensor`) whose bytes live in (pinned) CPU memory between
    forward and backward; `unpack` brings them back and dequantizes."""

    __slots__ = (
        "manager",
        "layers",
        "layer",
        "cpu",
        "dev",
        "event",
        "device",
        "nbytes",
        "name",
        "__weakref__",
    )

    def __init__(self, manager, layers, layer, device, nbytes, name):
        self.manager = manager
        self.layers = layers  # the layer lists of the forward that made it
        self.layer = layer
        self.device = device
        self.nbytes = nbytes
        self.name = name
        self.cpu: QTensor | None = None
        self.dev: QTensor | None = None
        self.event = None

    def unpack(self) -> Tensor:
        return self.manager.fetch(self).dequantize()


class SwapManager:
    """L2: swaps compressed activations to CPU memory and prefetches them in backward.

    **Forward.** Each `QTensor` the controller stores (of at least ``min_bytes``) is copied
    into pinned CPU memory on a side CUDA stream that first waits for the compute stream (the
    quantize kernels must be done); ``record_stream`` keeps the allocator from reusing the
    device buffers before the copy ends, and the device copy is dropped right away. Tensors
    kept losslessly (``bits=None``, below ``min_numel``, indices, masks) stay where they are:
    the caller could still modify them in place while an asynchronous copy reads them, and
    stock autograd's in-place check could not see it. In lossless mode L2 is therefore L1.

    **Backward.** Payloads are grouped by GNN layer in pack order (a new layer starts with the
    first payload of the next block of `checkpoint_segments`, i.e. each conv; what runs between
    convs - norm, activation, dropout - belongs to the conv before). When backward unpacks a
    payload of layer ``k`` it waits (on the compute stream, not the host) for that payload,
    and starts the copies of every payload of layer ``k - 1`` on the side stream: one layer of
    look-ahead, so the transfers overlap the backward compute of layer ``k``. A payload that
    was not prefetched is fetched on demand.

    ``simulate=True`` runs the same bookkeeping with plain CPU copies (no streams): the tests
    use it to check that swapping is bit-exact on machines without CUDA. Otherwise, payloads
    not on CUDA are left alone and the first one raises one warning: L2 is L1 there.
    """

    def __init__(
        self, ctl: Controller, min_bytes: int = DEFAULT_SWAP_MIN_BYTES, simulate: bool = False
    ) -> None:
        self._ctl = weakref.ref(ctl)
        self.min_bytes = int(min_bytes)
        self.simulate = bool(simulate)
        self.warned = False
        self.counters = {
            "offloaded": 0,
            "offloaded_bytes": 0,
            "fetched": 0,
            "prefetched": 0,
            "prefetch_hits": 0,
        }
        self._streams: dict[torch.device, Any] = {}
        self._forward_id = -1
        self._layers: list[list[weakref.ref]] = []
        self._layer_key: Any = None
        self._key_of_path: dict[str, str | None] = {}
        self._blocks = [p for p, _ in checkpoint_segments(ctl.model)]
        ctl.payload_wrapper = self.wrap

        def undo() -> None:
            if ctl.payload_wrapper == self.wrap:
                ctl.payload_wrapper = None

        ctl.add_undo(undo)

    # ---------------------------------------------------------------- forward
    def _block_of(self, name: str) -> str | None:
        path = name.rsplit("#", 1)[0]
        key = self._key_of_path.get(path, "?")
        if key == "?":
            key = next((b for b in self._blocks if path == b or path.startswith(b + ".")), None)
            self._key_of_path[path] = key
        return key

    def wrap(self, stored: Stored) -> Stored:
        """The controller's ``payload_wrapper``: swap ``stored`` if it is worth it."""
        if stored.kind != "activation":
            return stored
        value = stored.payload
        if not isinstance(value, (QTensor, Tensor)):
            return stored
        device = value.device
        if device.type != "cuda" and not self.simulate:
            if not self.warned:
                self.warned = True
                warnings.warn(
                    f"gact_graph: opt_level='L2' swaps compressed activations to pinned CPU "
                    f"memory on a side CUDA stream, but this model's activations are on "
                    f"{device.type}; L2 runs exactly as L1 here (compression only)",
                    stacklevel=2,
                )
            return stored
        if not isinstance(value, QTensor) or stored.stored_bytes < self.min_bytes:
            return stored
        ctl = self._ctl()
        fid = ctl._forward_id if ctl is not None else 0
        if fid != self._forward_id:  # first payload of a new forward
            self._forward_id = fid
            self._layers = []
            self._layer_key = None
        key = self._block_of(stored.name)
        if not self._layers or (key is not None and key != self._layer_key):
            self._layers.append([])
            if key is not None:
                self._layer_key = key
        payload = SwappedPayload(
            self, self._layers, len(self._layers) - 1, device, stored.stored_bytes, stored.name
        )
        self._offload(payload, value)
        self._layers[-1].append(weakref.ref(payload))
        stored.payload = payload
        self.counters["offloaded"] += 1
        self.counters["offloaded_bytes"] += stored.stored_bytes
        return stored

    def _stream(self, device: torch.device):
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
        return s

    @torch.no_grad()
    def _offload(self, payload: SwappedPayload, value: QTensor) -> None:
        if self.simulate and payload.device.type != "cuda":
            payload.cpu = _map_value(value, lambda t: t.detach().clone())
            return
        side = self._stream(payload.device)
        side.wait_stream(torch.cuda.current_stream(payload.device))
        with torch.cuda.stream(side):

            def d2h(t: Tensor) -> Tensor:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                buf.copy_(t.detach(), non_blocking=True)
                t.record_stream(side)  # its memory is not reused before the copy ends
                return buf

            payload.cpu = _map_value(value, d2h)
            payload.event = torch.cuda.Event()
            payload.event.record(side)

    # ---------------------------------------------------------------- backward
    @torch.no_grad()
    def _start_fetch(self, payload: SwappedPayload) -> None:
        if payload.dev is not None or payload.cpu is None:
            return
        if self.simulate and payload.device.type != "cuda":
            payload.dev = _map_value(payload.cpu, lambda t: t.clone())
            return
        side = self._stream(payload.device)
        with torch.cuda.stream(side):  # after the D2H copy: same stream
            payload.dev = _map_value(payload.cpu, lambda t: t.to(payload.device, non_blocking=True))
            payload.event = torch.cuda.Event()
            payload.event.record(side)

    def fetch(self, payload: SwappedPayload) -> QTensor:
        """The payload's value on its device (waits for its copy), and prefetch of the layer
        before it."""
        if payload.dev is None:
            self._start_fetch(payload)
        else:
            self.counters["prefetch_hits"] += 1
        value, payload.dev = payload.dev, None  # a second unpack (shared tensor) fetches again
        self.counters["fetched"] += 1
        if payload.device.type == "cuda":
            current = torch.cuda.current_stream(payload.device)
            current.wait_event(payload.event)
            for t in (value.packed, value.meta):
                t.record_stream(current)  # made on the side stream, used and freed here
        self._prefetch_layer(payload.layers, payload.layer - 1)
        return value

    def _prefetch_layer(self, layers: list[list[weakref.ref]], k: int) -> None:
        if k < 0 or k >= len(layers):
            return
        for ref in layers[k]:
            p = ref()
            if p is not None and p.dev is None:
                self._start_fetch(p)
                self.counters["prefetched"] += 1
        layers[k] = []  # prefetched once; a later unpack of one of them fetches on demand

    def stats(self) -> dict[str, int]:
        return dict(self.counters)


# ------------------------------------------------------------------------------ CB1: checkpoint
class _StopRecompute(BaseException):
    """Raised from the recomputation's pack hook once everything needed is recomputed.
    A BaseException so that ``except Exception`` fallbacks inside a forward never catch it."""


class _Holder:
    """What autograd holds for a tensor saved inside a segment: nothing but its index."""

    __slots__ = ("segment", "index", "__weakref__")

    def __init__(self, segment: _Segment, index: int) -> None:
        self.segment = segment
        self.index = index


def _unreachable(_obj):  # the recomputation's own graph is never backpropagated
    raise RuntimeError("gact_graph: internal error: recomputed graph was backpropagated")


@contextlib.contextmanager
def _keep_running_stats(module: nn.Module):
    """Recomputing a segment must not update BatchNorm running statistics a second time."""
    norms = [
        m
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats
    ]
    saved = [[b.clone() for b in m.buffers(recurse=False)] for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, bufs in zip(norms, saved):
                for b, v in zip(m.buffers(recurse=False), bufs):
                    b.copy_(v)


class _Segment:
    """One call of a checkpointed module (torch's non-reentrant algorithm, compressing)."""

    def __init__(self, manager: CheckpointManager, ctl: Controller, path: str, module, fn):
        self.manager = manager
        self.ctl = ctl
        self.path = path
        self.module = module
        self.fn = fn
        self.serial = manager.next_serial(ctl.step)
        self.holders: list[weakref.ref] = []
        self.meta: list[tuple[torch.Size, torch.dtype, torch.device]] = []
        self.recomputed: dict[Any, dict[int, Stored]] = {}

    # ---------------------------------------------------------------- forward
    def run(self, args: tuple, kwargs: dict) -> Any:
        # The inputs are what the segment keeps: through the controller, like any saved tensor.
        self.args = [self._save_input(a) for a in args]
        self.kwargs = {k: self._save_input(v) for k, v in kwargs.items()}
        self.cpu_rng = torch.get_rng_state()
        tensors = [a for a in itertools.chain(args, kwargs.values()) if isinstance(a, Tensor)]
        self.cuda_devices = sorted({t.device.index for t in tensors if t.is_cuda})
        self.cuda_rng = []
        if self.cuda_devices and torch.cuda.is_initialized():
            self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.cuda_devices]
        self.autocast = {
            dt: (torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt))
            for dt in ("cpu", "cuda")
        }
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.manager.counters["segments_run"] += 1
        self.manager._depth += 1
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack_forward, self._unpack):
                return self.fn(*args, **kwargs)
        finally:
            self.manager._depth -= 1
            for listener in self.manager.listeners:  # e.g. the memory-budget profiler
                listener("forward", self, None, 0.0)

    def _save_input(self, a: Any) -> tuple:
        if isinstance(a, Tensor):
            return ("t", self.ctl._pack(a), a.requires_grad)
        return ("v", a, False)

    def _pack_forward(self, t: Tensor) -> _Holder:
        holder = _Holder(self, len(self.holders))
        self.holders.append(weakref.ref(holder))
        self.meta.append((t.shape, t.dtype, t.device))
        return holder

    # ---------------------------------------------------------------- backward
    def _unpack(self, holder: _Holder) -> Tensor:
        gid: Any = torch._C._current_graph_task_id()
        if gid == -1:  # unpacked outside a backward (e.g. ctx.saved_tensors by hand)
            gid = object()
        store = self.recomputed.get(gid)
        if store is None:
            store = self.recomputed[gid] = self._recompute()
        stored = store.pop(holder.index, None)
        if stored is None:
            raise RuntimeError(
                f"gact_graph: checkpointed tensor {holder.index} of segment '{self.path}' was "
                "unpacked twice in one backward pass (CB1 recomputes each segment once per "
                "backward)"
            )
        return stored.unpack()

    def _restore(self, spec: tuple) -> Any:
        kind, value, requires_grad = spec
        if kind == "v":
            return value
        t = value.unpack()
        if t.requires_grad != requires_grad:
            t = t.detach().requires_grad_(requires_grad)
        return t

    def _recompute(self) -> dict[int, Stored]:
        ctl = self.ctl
        for listener in self.manager.listeners:  # the budget profiler measures from here
            listener("recompute_start", self, None, 0.0)
        args = [self._restore(s) for s in self.args]
        kwargs = {k: self._restore(s) for k, s in self.kwargs.items()}
        # A saved tensor that IS a (restored) input is stored as that input's own Stored.
        by_view: dict[Any, Stored] = {}
        for spec, value in itertools.chain(
            zip(self.args, args), zip(self.kwargs.values(), kwargs.values())
        ):
            if spec[0] == "t" and is_plain_strided(value):
                by_view[view_key(value, storage_ref(value))] = spec[1]
        store: dict[int, Stored] = {}
        count = 0
        seg_bytes = 0
        started = time.perf_counter()
        n = len(self.holders)
        counters = self.manager.counters

        def pack(t: Tensor) -> None:
            nonlocal count, seg_bytes
            i = count
            count += 1
            if i >= n:
                raise RuntimeError(
                    f"gact_graph: checkpoint segment '{self.path}' saved more tensors when "
                    f"recomputed than in its forward ({n}); its forward must be deterministic"
                )
            shape, dtype, device = self.meta[i]
            if t.shape != shape or t.dtype != dtype or t.device != device:
                raise RuntimeError(
                    f"gact_graph: checkpoint segment '{self.path}': saved tensor {i} was "
                    f"{tuple(shape)} {dtype} on {device} in forward but "
                    f"{tuple(t.shape)} {t.dtype} on {t.device} when recomputed"
                )
            if self.holders[i]() is not None:  # still needed by the graph
                stored, new = self._compress(t, i, by_view)
                store[i] = stored
                if new and stored.kind in ("activation", "mask"):  # not refs to the graph
                    counters["recomputed_tensors"] += 1
                    counters["recomputed_orig_bytes"] += stored.orig_bytes
                    counters["recomputed_stored_bytes"] += stored.stored_bytes
                    seg_bytes += stored.stored_bytes
            if count == n:
                raise _StopRecompute
            return None

        with contextlib.ExitStack() as stack:
            stack.enter_context(
                torch.random.fork_rng(devices=self.cuda_devices, device_type="cuda")
            )
            torch.set_rng_state(self.cpu_rng)
            for d, state in zip(self.cuda_devices, self.cuda_rng):
                torch.cuda.set_rng_state(state, d)
            stack.enter_context(torch.enable_grad())
            for dt, (enabled, dtype) in self.autocast.items():
                if enabled:
                    stack.enter_context(
                        torch.autocast(dt, dtype=dtype, cache_enabled=self.autocast_cache)
                    )
            for factory in list(ctl._context_factories):  # the forward's modes (pointwise ops)
                stack.enter_context(factory())
            stack.enter_context(_keep_running_stats(self.module))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, _unreachable))
            try:
                self.fn(*args, **kwargs)
            except _StopRecompute:
                pass
        if count != n:
            raise RuntimeError(
                f"gact_graph: checkpoint segment '{self.path}' saved {count} tensors when "
                f"recomputed but {n} in its forward; its forward must be deterministic"
            )
        counters["recomputes"] += 1
        counters["max_segment_stored_bytes"] = max(counters["max_segment_stored_bytes"], seg_bytes)
        self.manager._label(ctl, self.path)
        seconds = time.perf_counter() - started
        for listener in self.manager.listeners:
            listener("recompute", self, store, seconds)
        return store

    def _compress(self, t: Tensor, i: int, by_view: dict[Any, Stored]) -> tuple[Stored, bool]:
        """Store a recomputed tensor with the controller's own classifier (parameters and
        inputs by reference, masks in 1 bit, floats quantized with the configured bits).
        Returns ``(stored, new)``; ``new`` is False when it is a segment input's own Stored."""
        ctl = self.ctl
        name = f"{self.path}#ckpt{i}"
        if not is_plain_strided(t):
            return Stored(name, "other", t, None, view_bytes(t), view_bytes(t)), True
        ref = storage_ref(t)
        hit = by_view.get(view_key(t, ref))
        if hit is not None:
            return hit, False
        # The controller seeds from (seed, step, forward, #records, salt[name]); in backward
        # #records is fixed, so a salt per (segment call, index) keeps the rounding noise
        # independent.
        ctl.seed_salt[name] = mix_seed(self.serial, i)
        try:
            return ctl._store(name, t.detach(), ref.cdata), True
        finally:
            del ctl.seed_salt[name]


class CheckpointManager:
    """CB1: checkpoints the segments of `checkpoint_segments` with compressed storage.

    A segment runs checkpointed only inside a forward the controller compresses (grad
    enabled, hooks active) and not nested in another segment; otherwise its forward runs as
    is. ``counters`` count segment calls, recomputations and the bytes the recomputations
    stored (``recomputed_orig_bytes`` what they would have held uncompressed);
    ``max_segment_stored_bytes`` is the most one recomputation held at once, what backward
    holds on top of the forward's stored bytes.

    ``enabled`` (``None``: every segment) is the set of segment paths that run checkpointed;
    the others run their forward as is, so a policy (the memory-budget planner) decides per
    segment. ``listeners`` are called as ``fn(event, segment, store, seconds)`` after each
    checkpointed forward (``"forward"``), before each recomputation (``"recompute_start"``,
    before its inputs are restored) and after it (``"recompute"``, with the recomputed `Stored`
    by index and the seconds it took).
    """

    def __init__(self, ctl: Controller, spec=None) -> None:
        self._ctl = weakref.ref(ctl)
        self._depth = 0
        self.segments = checkpoint_segments(ctl.model, spec)
        self.enabled: set[str] | None = None
        self.listeners: list[Callable[[str, _Segment, dict | None, float], None]] = []
        self.counters = {
            "segments_run": 0,
            "recomputes": 0,
            "recomputed_tensors": 0,
            "recomputed_orig_bytes": 0,
            "recomputed_stored_bytes": 0,
            "max_segment_stored_bytes": 0,
        }
        self._serial_step, self._serial = -1, 0
        for path, module in self.segments:
            self._wrap(ctl, path, module)

    def next_serial(self, step: int) -> int:
        """Rounding-seed salt of a segment call: (step, call within the step). It depends on
        nothing else, so the same run twice in one process, or resumed from ``state_dict()``,
        rounds its recomputed tensors exactly alike."""
        if step != self._serial_step:
            self._serial_step, self._serial = step, 0
        self._serial += 1
        return mix_seed(step, self._serial)

    def _wrap(self, ctl: Controller, path: str, module: nn.Module) -> None:
        inner = module.forward  # a graph-aware patch if one is installed, else the class's

        def forward(*args, **kwargs):
            c = self._ctl()
            if (
                c is None
                or not c.compressing
                or self._depth
                or not torch.is_grad_enabled()
                or (self.enabled is not None and path not in self.enabled)
            ):
                return inner(*args, **kwargs)
            try:
                return _Segment(self, c, path, module, inner).run(args, kwargs)
            finally:
                self._label(c, path)

        ctl.patch_forward(module, forward)
        ctl.module_paths[path] = f"{ctl.module_paths.get(path, 'generic')}+ckpt"

    @staticmethod
    def _label(ctl: Controller, path: str) -> None:
        # graph-aware paths relabel their module on every call (recomputation included)
        label = ctl.module_paths.get(path, "generic")
        if not label.endswith("+ckpt"):
            ctl.module_paths[path] = f"{label}+ckpt"

    def stats(self) -> dict[str, int]:
        return dict(self.counters)
