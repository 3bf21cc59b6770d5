"""The controller: compresses what autograd saves for backward during a model's forward.

It installs `torch.autograd.graph.saved_tensors_hooks` for the duration of the model's forward
(root forward pre-hook enters, forward hook with ``always_call=True`` exits, so an exception in
forward never leaves hooks behind). Every saved tensor goes through `Controller._pack`:

- parameters (recognized by storage, never by value) and the model's own inputs are kept by
  reference: they are alive anyway and cost nothing extra;
- boolean masks are packed to 1 bit, integer tensors (indices) are kept losslessly;
- float activations are quantized with the bits of the plan (fixed bits, or the adaptive plan);
- a tensor already stored in this forward (same storage, view and version) is stored once.

Autograd holds the returned `Stored` objects and releases them as backward consumes them, so
compressed storage is freed exactly when autograd would have freed the original.
"""

from __future__ import annotations

import contextlib
import copy
import operator
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.function import BackwardCFunction
from torch.multiprocessing.reductions import StorageWeakRef

from gact_graph.config import DOUBLE_BACKWARD_HELP, CompressionConfig
from gact_graph.core.chunked import RowChunked
from gact_graph.core.quantize import QTensor, exceeds_fp32_range, pack_bool_mask, quantize
from gact_graph.core.report import saved_report, saved_stats
from gact_graph.core.saved import (
    KINDS,
    PARAM_COPY_NODES,
    StorageSet,
    is_autocast_param_copy,
    is_plain_strided,
    storage_ref,
    tensors_in,
    view_bytes,
)
from gact_graph.core.state import load_state, save_state
from gact_graph.core.step_memory import StepMemory
from gact_graph.kernels.bitpack import PackedMask
from gact_graph.switches import is_reading_rows, package_work

__all__ = ["Controller", "Stored", "mix_seed"]

_MASK64 = (1 << 64) - 1

#: tensor types whose storage the pack hook inspects (`core.saved.is_plain_strided`)
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)

#: On CUDA a float tensor smaller than this is kept as it is (the ``min_bytes`` option overrides
#: it, on any device): quantizing it costs launches and Python in the pack and the unpack, a
#: fixed cost that a small graph's step pays per saved tensor, for less than a mebibyte saved
#: (see docs/design.md, "Small tensors on the GPU").
CUDA_MIN_BYTES = 1 << 20

#: module -> the live controller compressing it (weakly on both sides): a module shared by two
#: models must not be patched twice
_OWNERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()


def mix_seed(*parts: int) -> int:
    """splitmix64 over the parts: decorrelated 31-bit seeds (base, step, forward, index, salt)."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (p & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        z = h
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        h = z ^ (z >> 31)
    return h & 0x7FFFFFFF


def _builds_graph() -> bool:
    """Whether a saved tensor unpacked now may be differentiated again. The engine runs a
    ``create_graph=True`` backward in grad mode; a custom Function's backward may turn grad
    mode on itself (``torch.enable_grad()``) in a plain backward, which only the graph task
    tells apart: a create_graph backward retains its graph unless told not to. Outside any
    backward (``grad_fn._saved_*`` read from Python) grad mode decides."""
    if not torch.is_grad_enabled():
        return False
    if isinstance(torch._C._current_autograd_node(), BackwardCFunction):
        return torch._C._autograd._get_current_graph_task_keep_graph()
    return True


class Stored:
    """What autograd holds instead of a saved tensor.

    ``payload`` is the tensor itself (kept by reference), a `QTensor`, a `PackedMask`, or any
    object with ``unpack()`` and ``nbytes`` (graph-aware stores register those).
    """

    __slots__ = (
        "name",
        "kind",
        "payload",
        "bits",
        "orig_bytes",
        "stored_bytes",
        "ref_version",
        "__weakref__",
    )

    def __init__(self, name, kind, payload, bits, orig_bytes, stored_bytes, ref_version=None):
        self.name = name
        self.kind = kind
        self.payload = payload
        self.bits = bits
        self.orig_bytes = orig_bytes
        self.stored_bytes = stored_bytes
        self.ref_version = ref_version

    def unpack(self) -> torch.Tensor:
        p = self.payload
        if isinstance(p, torch.Tensor):
            # Under saved-tensor hooks autograd does not check versions; do it ourselves for
            # what we keep by reference, so an in-place change is an error, as without us.
            if self.ref_version is not None and p._version != self.ref_version:
                raise RuntimeError(
                    f"gact_graph: saved tensor '{self.name}' ({tuple(p.shape)}) was modified by "
                    f"an inplace operation after it was saved for backward (version "
                    f"{self.ref_version} -> {p._version}); gradients would be wrong"
                )
            return p
        if self.bits is not None and _builds_graph():
            raise RuntimeError(
                f"gact_graph: '{self.name}' is stored compressed and carries no graph; "
                + DOUBLE_BACKWARD_HELP
                + ". A custom autograd.Function whose backward reads ctx.saved_tensors under "
                "torch.enable_grad() with retain_graph=True looks the same: read them before "
                "enabling grad"
            )
        if isinstance(p, QTensor):
            return p.dequantize()
        return p.unpack()

    def unpack_rows(self) -> torch.Tensor:
        """`unpack`, except that a compressed 2-D activation is handed back as a `RowChunked`
        (no dequantized copy) inside a backward's `reading_rows` with grad mode off: what a
        Function that sets ``reads_rows_every_step`` reads a row range at a time."""
        p = self.payload
        if (
            isinstance(p, QTensor)
            and is_reading_rows()
            and self.kind == "activation"
            and len(p.shape) == 2
            and not torch.is_grad_enabled()
        ):
            return RowChunked(p)
        return self.unpack()


class Controller:
    """Compresses the tensors a model saves for backward. Made by `gact_graph.compress_gnn`.

    Use it for the whole training run: call `iterate()` once per training step, `stats()` to see
    bytes, `remove()` (or leave the ``with`` block) to restore the model exactly.
    """

    def __init__(self, model: nn.Module, config: CompressionConfig | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"compress_gnn expects an nn.Module, got {type(model).__name__}")
        if getattr(model, "_gact_graph_controller", None) is not None:
            raise RuntimeError(
                "this model is already compressed by a gact_graph Controller; call its remove() "
                "first"
            )
        for path, module in model.named_modules():
            owner = _OWNERS.get(module)
            if owner is not None and owner() is not None:
                raise RuntimeError(
                    f"gact_graph: module {path or '<root>'!r} ({type(module).__name__}) is part "
                    "of another compressed model; one module can be compressed by one "
                    "controller at a time (its forward is patched and its saved tensors are "
                    "named by that model). remove() the other controller first, or give each "
                    "model its own copy of the module"
                )
        self.model = model
        self.config = config if config is not None else CompressionConfig()
        self.step = 0
        #: bits per tensor name; names missing here get the config's fixed bits.
        self.plan: dict[str, int | None] = {}
        #: how each module is run ("generic", or the name of a graph-aware path).
        self.module_paths: dict[str, str] = {}
        #: per-step salt mixed into seeds (the adaptive estimator re-seeds one tensor with it).
        self.seed_salt: dict[str, int] = {}
        self.adapter = None  # set by gact_graph.policy.adaptive when adaptive=True
        #: ``fn(stored) -> Stored`` applied to every newly stored tensor (opt level L2 wraps
        #: payloads to swap them to CPU; see `gact_graph.policy.levels`).
        self.payload_wrapper: Callable[[Stored], Stored] | None = None
        #: ``fn(name) -> bits`` (None/32: lossless) that overrides ``plan`` and the adapter for
        #: every tensor (the memory-budget planner, `gact_graph.budget`, sets it).
        self.bits_policy: Callable[[str], int | None] | None = None
        #: ``fn() -> str`` whose lines `report()` appends (step memory, the memory-budget plan).
        self.report_extra: list[Callable[[], str]] = []
        #: the fewest bits a quantized tensor gets outside a memory budget (32: kept exact);
        #: the gradient watch raises it to rescue a diverging fixed-bit run
        self.bits_floor: int | None = None
        #: the gradient watch (`gact_graph.policy.watch`), set by `compress_gnn` when it quantizes
        self.watch = None
        self.budget = None  # the memory budget's planner (`gact_graph.budget`), with a budget

        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        #: (module, had an instance ``forward``, that forward) per `patch_forward`, in order
        self._forward_patches: list[tuple[nn.Module, bool, Any]] = []
        self._undo: list[Callable[[], None]] = []
        self._context_factories: list[Callable[[], contextlib.AbstractContextManager]] = []
        self._step_hooks: list[Callable[[Controller], None]] = []
        # What a forward installs is per thread, as PyTorch's saved-tensor hooks and
        # torch-function modes are: another thread's eval forward must neither see nor close it.
        self._tls = threading.local()
        self._lock = threading.Lock()
        self._compressing_threads = 0
        self._pack_counts: dict[str, int] = {}
        self._dedup: dict[Any, tuple[Any, weakref.ref]] = {}
        self._params = StorageSet()
        self._inputs = StorageSet()
        self._lossless: dict[int, tuple[Any, str]] = {}
        self._forward_id = self._step_forwards = 0  # training forwards: ever, this step's
        self._records_forward = -1
        self._records: list[dict[str, Any]] = []
        self._record_of: dict[str, dict[str, Any]] = {}
        self._live: list[weakref.ref] = []
        self._removed = False
        self._warned_range: set[str] = set()

        if self.config.opt_level != "L0":
            self._install()
        self.step_memory = StepMemory(self)  # what the last step's peak is made of (`report()`)
        for module in model.modules():
            _OWNERS[module] = weakref.ref(self)
        model._gact_graph_controller = self
        # copy.deepcopy and pickle (torch.save) look these up on the instance: a copy of a
        # compressed model comes out uncompressed (see `_detached`)
        model.__deepcopy__ = self._deepcopy_model
        model.__reduce_ex__ = self._reduce_model

    # ------------------------------------------------------------------ install / remove
    def _install(self) -> None:
        root = self.model
        self._handles.append(root.register_forward_pre_hook(self._enter_forward, with_kwargs=True))
        self._handles.append(root.register_forward_hook(self._exit_forward, always_call=True))
        for name, module in root.named_modules():
            path = name or "<root>"
            self.module_paths.setdefault(path, "generic")
            self._handles.append(module.register_forward_pre_hook(self._push_module(path)))
            self._handles.append(
                module.register_forward_hook(self._pop_module(path), always_call=True)
            )

    def add_forward_context(self, factory: Callable[[], contextlib.AbstractContextManager]) -> None:
        """Enter ``factory()`` around every forward of the model (e.g. a TorchFunctionMode)."""
        self._context_factories.append(factory)

    @package_work  # a storage look-up: the forward's pointwise mode need not see it
    def keep_lossless(self, t: torch.Tensor, kind: str = "index") -> None:
        """Store ``t`` (and any view of its storage) losslessly, as ``kind``, whenever it is
        saved: e.g. the edge weights of a shared adjacency, which must never be quantized.
        Held weakly: forgetting happens by itself when the storage is freed."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if is_plain_strided(t):
            ref = storage_ref(t)
            self._lossless[ref.cdata] = (ref, kind)

    def add_undo(self, undo: Callable[[], None]) -> None:
        """Register a function that `remove()` calls (in reverse order) to undo a patch."""
        self._undo.append(undo)

    def add_handle(self, handle: torch.utils.hooks.RemovableHandle) -> None:
        """Own a hook that a layer above registered on the model: `remove()` removes it and
        copies of the model never carry it (it may also be removed earlier by its owner)."""
        self._handles = [h for h in self._handles if h.id in (h.hooks_dict_ref() or ())]
        self._handles.append(handle)

    def patch_forward(self, module: nn.Module, forward: Callable) -> None:
        """Shadow ``module.forward`` with ``forward`` on the instance (graph-aware paths,
        checkpointing). `remove()` restores the previous state exactly, with no instance
        attribute left behind, and copies of the model never carry the patch."""
        had = "forward" in module.__dict__
        previous = module.__dict__.get("forward")

        def undo() -> None:
            if had:
                module.forward = previous
            else:
                module.__dict__.pop("forward", None)

        self._forward_patches.append((module, had, previous))
        module.forward = forward
        self.add_undo(undo)

    def guard_interrupts(self) -> None:
        """Leave the forward's hooks even when it stops on a `BaseException` (Ctrl-C,
        ``SystemExit``), which PyTorch's ``always_call`` forward hooks do not see: otherwise the
        process-wide saved-tensor hooks and torch-function modes would stay installed and
        compress every other model's autograd graph. Wraps the root's ``forward`` as it is
        now, so `compress_gnn` calls it last, after every layer has patched what it patches."""
        inner = self.model.forward

        def forward(*args, **kwargs):
            try:
                return inner(*args, **kwargs)
            except BaseException as exc:
                if not isinstance(exc, Exception):  # Exceptions: the always_call hook exits
                    self._exit_forward(self.model, args, None)
                raise

        self.patch_forward(self.model, forward)

    @contextlib.contextmanager
    def _detached(self):
        """The model as it was before `compress_gnn`, for the duration of the block: our hooks
        taken out of the hook dicts (other hooks keep their order), our forward patches and
        instance attributes set aside; everything is put back afterwards."""
        dicts: dict[int, tuple[dict, dict]] = {}
        for h in self._handles:
            refs = (h.hooks_dict_ref, *getattr(h, "extra_dict_ref", ()))
            for d in (r() for r in refs):
                if d is not None and h.id in d:
                    dicts.setdefault(id(d), (d, dict(d)))[0].pop(h.id)
        forwards: dict[int, tuple[nn.Module, bool, Any]] = {}
        for module, had, previous in self._forward_patches:  # the first patch holds the original
            if id(module) not in forwards:
                forwards[id(module)] = (module, "forward" in module.__dict__, module.forward)
                if had:
                    module.forward = previous
                else:
                    module.__dict__.pop("forward", None)
        own = ("_gact_graph_controller", "__deepcopy__", "__reduce_ex__")
        attrs = {k: self.model.__dict__.pop(k) for k in own if k in self.model.__dict__}
        try:
            yield
        finally:
            self.model.__dict__.update(attrs)
            for module, had, current in forwards.values():
                if had:
                    module.forward = current
            for d, before in dicts.values():
                d.clear()
                d.update(before)

    def _deepcopy_model(self, memo: dict[int, Any] | None = None) -> nn.Module:
        """``copy.deepcopy(model)``: an uncompressed copy (compress it with its own
        `compress_gnn` if it trains); this controller keeps compressing the original."""
        with self._detached():
            return copy.deepcopy(self.model, memo)

    def _reduce_model(self, protocol: int):
        """Pickling (``torch.save(model)``) stores the uncompressed model: the controller holds
        hooks, thread-local state and live autograd objects that have no meaning in a file.
        The state is taken from an uncompressed copy, since pickle reads the submodules only
        after this returns."""
        return self._deepcopy_model().__reduce_ex__(protocol)

    def remove(self) -> None:
        """Remove every hook and patch: the model behaves exactly as before `compress_gnn`."""
        if self._removed:
            return
        self._removed = True
        if self._active is not None:  # this thread's; other threads close theirs on exit
            self._close_forward()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self._context_factories.clear()
        self._step_hooks.clear()
        self._dedup.clear()
        self._forward_patches.clear()
        for module in self.model.modules():
            owner = _OWNERS.get(module)
            if owner is not None and owner() is self:
                del _OWNERS[module]
        if getattr(self.model, "_gact_graph_controller", None) is self:
            for k in ("_gact_graph_controller", "__deepcopy__", "__reduce_ex__"):
                self.model.__dict__.pop(k, None)

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    # ------------------------------------------------------------------ forward tracking
    @property
    def _active(self) -> contextlib.ExitStack | None:
        return getattr(self._tls, "active", None)

    @property
    def _module_stack(self) -> list[str]:
        stack = getattr(self._tls, "modules", None)
        if stack is None:
            stack = self._tls.modules = []
        return stack

    @property
    def compressing(self) -> bool:
        """True inside a forward of the model that this controller compresses, in this thread
        (graph-aware layers and levels step in only then)."""
        return self._active is not None

    def _enter_forward(self, module, args, kwargs):
        depth = getattr(self._tls, "depth", 0)
        self._tls.depth = depth + 1
        if depth:  # re-entrant call of the root inside its own forward: the outer one holds
            return None
        if not torch.is_grad_enabled():  # eval / no_grad: nothing is saved, so install nothing
            return None
        if torch.jit.is_tracing() or torch._C._functorch.maybe_current_level() is not None:
            # a trace records stock's computation; torch.func's wrapped tensors have no storage
            return None
        with self._lock:
            if self._compressing_threads:
                self._tls.depth = 0
                raise RuntimeError(
                    "gact_graph: this compressed model is already running a training forward "
                    "(grad enabled) in another thread; one controller compresses one forward at "
                    "a time (no_grad/eval forwards in other threads are fine)"
                )
            self._compressing_threads += 1
        self._forward_id, self._step_forwards = self._forward_id + 1, self._step_forwards + 1
        self._pack_counts = {}
        self._dedup.clear()
        self._params = StorageSet(list(self.model.parameters()) + list(self.model.buffers()))
        self._inputs = StorageSet(tensors_in((args, kwargs)))
        self._lossless = {k: v for k, v in self._lossless.items() if not v[0].expired()}
        stack = contextlib.ExitStack()
        try:
            # the row-reading hook unless a wrapper stands over `_unpack` (the sensitivity
            # probe's writes its noise into the dense copy it is handed)
            unpack = self._unpack if "_unpack" in self.__dict__ else self._unpack_rows
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, unpack))
            for factory in self._context_factories:
                stack.enter_context(factory())
        except BaseException:
            stack.close()
            with self._lock:
                self._compressing_threads -= 1
            self._tls.depth = 0
            raise
        self._tls.active = stack
        return None

    def _close_forward(self) -> None:
        stack, self._tls.active = self._tls.active, None
        with self._lock:
            self._compressing_threads -= 1
        stack.close()

    def _exit_forward(self, module, args, output):
        depth = getattr(self._tls, "depth", 0)
        self._tls.depth = max(depth - 1, 0)
        if depth <= 1 and self._active is not None:
            self._close_forward()
        return None

    def _push_module(self, path: str):
        def hook(module, args):
            self._module_stack.append(path)

        return hook

    def _pop_module(self, path: str):
        def hook(module, args, output):
            if self._module_stack and self._module_stack[-1] == path:
                self._module_stack.pop()

        return hook

    # ------------------------------------------------------------------ pack / unpack
    def bits_for(self, name: str) -> int | None:
        """Bits the plan gives the tensor ``name`` (None: lossless)."""
        if self.config.lossless:
            return None
        if self.bits_policy is not None:  # a policy that decides every tensor (memory budget)
            return self.bits_policy(name)
        if name in self.plan:
            bits = self.plan[name]
        elif self.adapter is not None:  # adaptive: tensors the plan does not cover yet
            bits = self.adapter.bits_for(name)
        elif self.config.adaptive and self.plan:
            bits = None
        else:
            bits = int(round(self.config.bits))
        floor = self.bits_floor
        if floor is not None and bits is not None and bits < floor:
            return None if floor >= 32 else floor
        return bits

    def _next_name(self) -> str:
        stack = getattr(self._tls, "modules", None)
        path = stack[-1] if stack else "<root>"
        k = self._pack_counts.get(path, 0)
        self._pack_counts[path] = k + 1
        return f"{path}#{k}"

    @package_work  # bookkeeping: the forward's pointwise mode need not see its torch calls
    def _pack(self, t: torch.Tensor) -> Stored:
        if self._records_forward != self._forward_id:  # first save of a new forward
            self._records_forward = self._forward_id
            self._records = []
            self._record_of = {}
            self._live = []
        name = self._next_name()
        if type(t) not in _PLAIN_TYPES or t.layout != torch.strided or t.is_meta:
            stored = Stored(name, "other", t, None, view_bytes(t), view_bytes(t))
            return self._remember(stored, t, weakref.ref(stored))
        storage = t.untyped_storage()
        # The dedup key is the view of the storage at its version (`core.saved.ViewKey`'s
        # fields, as a plain tuple). The storage's address identifies it only while the storage
        # lives: an entry whose `Stored` holds the tensor itself keeps the storage alive as long
        # as the entry can hit, so it needs no weak reference; any other entry carries one and
        # is dropped once the storage is freed (its address may then be reused). A held tensor
        # whose storage was swapped in place (``set_``) no longer holds the keyed storage: the
        # hit checks that it still does.
        key = (storage._cdata, t.storage_offset(), t.shape, t.stride(), t.dtype, t._version)
        hit = self._dedup.get(key)
        if hit is not None:
            hit_ref, hit_stored = hit[0], hit[1]()
            if hit_stored is not None and (
                not hit_ref.expired()
                if hit_ref is not None
                else hit_stored.payload.untyped_storage()._cdata == key[0]
            ):
                self._record_of[hit_stored.name]["uses"] += 1
                return hit_stored
        stored = self._store(name, t, key[0], storage)
        if self.payload_wrapper is not None:
            stored = self.payload_wrapper(stored)
        alive = weakref.ref(stored)
        ref = None if stored.payload is t else StorageWeakRef(storage)
        self._dedup[key] = (ref, alive)
        return self._remember(stored, t, alive)

    def _remember(self, stored: Stored, t: torch.Tensor, alive: weakref.ref) -> Stored:
        # shape and dtype are kept as objects here and written out by `stats()`
        rec = {
            "name": stored.name,
            "kind": stored.kind,
            "shape": t.shape,
            "dtype": t.dtype,
            "bits": stored.bits,
            "orig_bytes": stored.orig_bytes,
            "stored_bytes": stored.stored_bytes,
            "uses": 1,
        }
        self._records.append(rec)
        self._record_of[stored.name] = rec
        self._live.append(alive)
        return stored

    def _store(
        self, name: str, t: torch.Tensor, cdata: int, storage: torch.UntypedStorage | None = None
    ) -> Stored:
        """How ``t`` (a plain strided tensor whose storage is at address ``cdata``) is stored.
        ``storage`` is its untyped storage when the caller has it at hand."""
        if storage is None:
            storage = t.untyped_storage()
        nbytes = t.numel() * t.element_size()  # `core.saved.view_bytes`, inlined
        nbytes = min(nbytes, storage.nbytes())
        version = t._version
        params = self._params
        fn = t.grad_fn  # only a copy node or a view of one can be an autocast weight copy
        if cdata in params or (
            fn is not None
            and type(fn).__name__ in PARAM_COPY_NODES
            and is_autocast_param_copy(t, params)
        ):
            return Stored(name, "param", t, None, nbytes, 0, version)
        if cdata in self._inputs:
            return Stored(name, "input", t, None, nbytes, 0, version)
        lossless = self._lossless.get(cdata)
        if lossless is not None and not lossless[0].expired():
            return Stored(name, lossless[1], t, None, nbytes, nbytes, version)
        dtype = t.dtype
        small = self._below_min_bytes(t.numel() * t.element_size(), t.is_cuda)
        if dtype == torch.bool:
            if small:  # packing costs a launch (forward) and more (backward)
                return Stored(name, "mask", t, None, nbytes, nbytes, version)
            packed: PackedMask = pack_bool_mask(t)
            return Stored(name, "mask", packed, None, nbytes, packed.nbytes)
        if not dtype.is_floating_point:
            return Stored(name, "index", t, None, nbytes, nbytes, version)
        if small:  # kept whatever the plan says (no plan look-up: it has no effect)
            return Stored(name, "activation", t, None, nbytes, nbytes, version)
        bits = self.bits_for(name)
        if bits is None or bits >= 32 or t.numel() < self.config.min_numel:
            return Stored(name, "activation", t, None, nbytes, nbytes, version)
        if exceeds_fp32_range(t):  # would come back NaN: keep it, and say so once
            if name not in self._warned_range:
                self._warned_range.add(name)
                warnings.warn(
                    f"gact_graph: saved float64 tensor {name!r} holds values beyond fp32's "
                    "range; it is kept unquantized (the quantizer works in fp32)",
                    stacklevel=2,
                )
            return Stored(name, "activation", t, None, nbytes, nbytes, version)
        salt = self.seed_salt.get(name, 0)
        seed = mix_seed(self.config.seed, self.step, self._step_forwards, len(self._records), salt)
        q = quantize(t.detach(), bits, group_size=self.config.group_size, seed=seed)
        return Stored(name, "activation", q, bits, nbytes, q.nbytes)

    def _below_min_bytes(self, nbytes: int, is_cuda: bool) -> bool:
        """The rule that keeps float and bool tensors as they are: ``nbytes`` (elements times
        element size) below ``min_bytes`` (default `CUDA_MIN_BYTES` on CUDA, 0 elsewhere). A
        memory-budget policy decides every tensor itself, so it is never overridden."""
        if self.bits_policy is not None:
            return False
        limit = self.config.extra.get("min_bytes")
        if limit is None:
            limit = CUDA_MIN_BYTES if is_cuda else 0
        return nbytes < limit

    def keeps_as_is(self, t: torch.Tensor) -> bool:
        """Whether a saved tensor of ``t``'s size, dtype and device is kept as it is by the
        ``min_bytes`` rule (float and bool tensors alike). The pointwise ops ask it about
        their input: where it holds, everything PyTorch's own op would save is no larger than
        that input, so it would be kept too, and the op runs as PyTorch's."""
        return self._below_min_bytes(t.numel() * t.element_size(), t.is_cuda)

    #: the unpack hook: ``stored.unpack()``, called from C without a Python frame of its own
    _unpack = staticmethod(operator.methodcaller("unpack"))
    #: the unpack hook of a forward with no wrapper over `_unpack`: ``stored.unpack_rows()``
    _unpack_rows = staticmethod(operator.methodcaller("unpack_rows"))

    # ------------------------------------------------------------------ training loop API
    def iterate(self, step_fn: Callable[[], Any] | None = None) -> None:
        """Call once per training step, after ``optimizer.step()``.

        ``step_fn`` (GACT's API) is a closure that runs forward, ``zero_grad`` and backward; the
        adaptive planner calls it when it re-estimates sensitivities. Fixed-bit compression
        needs none.
        """
        self.step_memory.end(self._records)
        if self.adapter is not None:
            self.adapter.maybe_adapt(self, step_fn)
        for hook in self._step_hooks:
            hook(self)
        self.step, self._step_forwards = self.step + 1, 0

    def add_step_hook(self, hook: Callable[[Controller], None]) -> None:
        """Call ``hook(ctl)`` at every `iterate()` (after the optimizer step, before the step
        count advances): policies that watch training, such as `gact_graph.policy.watch`."""
        self._step_hooks.append(hook)

    def stats(self) -> dict[str, Any]:
        """Exact bytes of the last forward that saved tensors for backward.

        ``orig_bytes``: what autograd would have held (each distinct saved view once, capped at
        its storage size); ``stored_bytes``: what this controller holds instead. ``param`` and
        ``input`` tensors are kept by reference and cost nothing extra; ``total`` covers every
        other kind (activation, index, mask, other). ``live_stored_bytes`` is what is still held
        right now (zero once backward has released everything). With an adaptive planner
        that reports one (``progress()``), ``re_estimation`` says whether a re-estimation spread
        over several steps is in progress and over how many.
        """
        return saved_stats(self)

    def report(self) -> str:
        """A table: every module, the path it ran (graph-aware or generic) and its bytes."""
        return saved_report(self)

    def plot_bits(self, path: str) -> str:
        """Save a bar chart of the adaptive plan (bits and sensitivity per tensor) to ``path``
        (needs matplotlib). The adapter draws it: the core does not import the policies."""
        if self.adapter is None:
            raise RuntimeError(
                "plot_bits needs an adaptive controller (compress_gnn(adaptive=True))"
            )
        return self.adapter.plot(self.plan, path)

    def state_dict(self) -> dict[str, Any]:
        """The step, plan, config and parts' states that `load_state_dict` resumes from."""
        return save_state(self)

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Resume from `state_dict()`. Everything is checked before anything changes: a state of
        another model, a malformed plan, step or adapter state raises and leaves the controller
        as it was.

        A state saved with other compression settings (`core.state.STATE_SETTINGS`: bits,
        adaptive, policy, loss_bound, group_size, or the adaptive ladder) is refused with a
        ``ValueError`` naming each difference (its plan would replace what this controller was
        asked for). With ``strict=False`` this controller's settings hold: only the step and,
        where both are adaptive, the sensitivity estimates are loaded, the plan is made anew
        from them, and a warning says so."""
        load_state(self, state, strict)
