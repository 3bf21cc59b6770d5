"""What the last training step's peak memory is made of, for `Controller.report()`: the graph
(the root forward's index and sparse inputs, and the adjacencies cached for it), the features
(its floating-point inputs), parameters with their gradients and optimizer state, what the
controller stored for backward, and the working set (the rest of the measured peak).

Per step it reads the inputs' storages and starts a `StepMeter` at the root forward's start,
and reads the meter at `Controller.iterate()`; the rest is counted when the report is made.
The optimizer is found through torch's global step hook: those whose parameter groups hold
the model's parameters, kept weakly. The meter's reset is process-wide: a peak read outside
across several steps covers the last one only (docs/design.md, "Step memory in report()")."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from gact_graph.core.meter import StepMeter

__all__ = ["StepMemory"]

#: the slots PyG's cached convolutions keep their normalized graph in
_CACHE_SLOTS = ("_cached_edge_index", "_cached_adj_t")
#: the report's names of `StepMemory.figures`' keys, where a key's own words are not enough
_NAMES = {"parameters": "parameters and optimizer", "saved": "saved tensors"}
_CSR, _CSC = ("crow_indices", "col_indices", "values"), ("ccol_indices", "row_indices", "values")
#: per sparse layout, the methods that return the tensors holding it
_SPARSE = {torch.sparse_coo: ("_indices", "_values")}
_SPARSE |= dict.fromkeys((torch.sparse_csr, torch.sparse_bsr), _CSR)
_SPARSE |= dict.fromkeys((torch.sparse_csc, torch.sparse_bsc), _CSC)


def _leaves(obj: Any) -> list[Any]:
    """Tensors and `torch_sparse.SparseTensor`s in nested containers and PyG-like objects
    (as `core.saved.tensors_in` walks them)."""
    out, stack = [], [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor) or type(o).__name__ == "SparseTensor":
            out.append(o)
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif callable(getattr(o, "to_dict", None)) and not isinstance(o, torch.nn.Module):
            stack.extend(o.to_dict().values())
    return out


def _parts(o: Any) -> list[torch.Tensor]:
    """The strided tensors holding ``o``: itself, a sparse tensor's indices and values, or
    every tensor a `SparseTensor`'s storage holds (its cached transposes included)."""
    if isinstance(o, torch.Tensor):
        names = _SPARSE.get(o.layout)
        return [o] if names is None else [getattr(o, n)() for n in names]
    return _leaves(list(vars(o.storage).values()))


def _storages(tensors: Iterable[torch.Tensor]) -> dict[tuple, int]:
    """``{(device, address): bytes}`` of the storages behind ``tensors`` (each once)."""
    out = {}
    for t in tensors:
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage to read (a wrapper subclass)
            continue
        if s.data_ptr():
            out[(s.device, s.data_ptr())] = s.nbytes()
    return out


def _count(seen: dict[tuple, int], storages: dict[tuple, int]) -> int:
    """Bytes of ``storages`` not in ``seen`` yet, adding them there."""
    new = {k: n for k, n in storages.items() if k not in seen}
    seen.update(new)
    return sum(new.values())


class StepMemory:
    """Attached to a controller: ``graph_sources`` holds ``fn() -> tensors`` of the graph
    structures the layers above cache (`gact_graph.sparse`'s adjacency cache adds itself)."""

    def __init__(self, ctl) -> None:
        self.ctl = ctl
        self.graph_sources: list[Callable[[], Iterable[torch.Tensor]]] = []
        self.peak: int | None = None  # the last step's, read at `iterate()`
        self.saved = 0
        self._meter: StepMeter | None = None
        self._began = False  # the meter runs: a training forward began since `iterate()`
        self._inputs: tuple[dict[tuple, int], dict[tuple, int]] = ({}, {})  # graph, features
        self._optimizers, self._others = weakref.WeakSet(), weakref.WeakSet()
        me = weakref.ref(self)  # torch's hook table must not keep the controller alive

        def stepped(optimizer, args, kwargs) -> None:
            if (memory := me()) is not None:
                memory._saw(optimizer)

        hook = register_optimizer_step_post_hook(stepped)
        ctl.add_undo(hook.remove)
        weakref.finalize(self, hook.remove)  # a controller dropped without `remove()`
        ctl.add_handle(ctl.model.register_forward_pre_hook(self._begin, with_kwargs=True))
        ctl.report_extra.append(self.report)

    def _saw(self, optimizer) -> None:
        if optimizer in self._optimizers or optimizer in self._others:
            return
        ours = {id(p) for p in self.ctl.model.parameters()}
        holds = any(id(p) in ours for g in optimizer.param_groups for p in g["params"])
        (self._optimizers if holds else self._others).add(optimizer)

    def _begin(self, module, args, kwargs) -> None:
        """The root forward's pre-hook: the step's first training forward starts the meter."""
        if not self.ctl.compressing or self._began:
            return
        graph, features = [], []
        for o in _leaves((args, kwargs)):
            if isinstance(o, torch.Tensor) and o.layout == torch.strided:
                if o.is_floating_point():
                    features.append(o)
                elif o.dim() == 2 and len(o) == 2 and o.dtype != torch.bool:  # edge_index
                    graph.append(o)
            else:  # a sparse adjacency
                graph += _parts(o)
        self._inputs = (_storages(graph), _storages(features))
        cuda = [t.device for t in graph + features if t.is_cuda]
        device = cuda[0] if cuda else torch.device("cpu")
        if self._meter is None or self._meter.device != device:
            self._meter = StepMeter(device, sync=False)
        self._meter.begin(start=False)
        self._began = True

    def end(self, records: list[dict[str, Any]]) -> None:
        """At `iterate()`: the step's peak, and what the controller stored (as `stats()`)."""
        if self._began:
            self._began, self.peak = False, self._meter.peak()
            kept = ("param", "input")
            self.saved = sum(r["stored_bytes"] for r in records if r["kind"] not in kept)

    def figures(self) -> dict[str, Any]:
        """Bytes of each part of the last step's peak (``working_set`` and ``peak`` None where
        the peak could not be read); the graph's caches, parameters and optimizer state as
        they are now. ``optimizer``: whether an optimizer of these parameters has stepped."""
        seen: dict[tuple, int] = {}
        graph = _count(seen, self._inputs[0])
        cached = [t for source in self.graph_sources for t in source()]
        cached += [getattr(m, s, None) for m in self.ctl.model.modules() for s in _CACHE_SLOTS]
        graph += _count(seen, _storages(t for o in _leaves(cached) for t in _parts(o)))
        features = _count(seen, self._inputs[1])
        params = list(self.ctl.model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        state = [opt.state.get(p, {}) for opt in self._optimizers for p in params]
        weights = _count(seen, _storages(params + grads + _leaves(state)))
        out = {"graph": graph, "features": features, "parameters": weights, "saved": self.saved}
        out["working_set"] = None if self.peak is None else self.peak - sum(out.values())
        return {**out, "peak": self.peak, "optimizer": bool(self._optimizers)}

    def report(self) -> str:
        if self._meter is None:
            return "step memory: no training step yet"
        f = self.figures()
        cuda = self._meter.device.type == "cuda"
        what = "CUDA max_memory_allocated" if cuda else "the anonymous resident set"
        rows = [f"step memory (the last step's peak: {what})"]
        for key in ("graph", "features", "parameters", "saved", "working_set", "peak"):
            name = _NAMES.get(key, key.replace("_", " "))
            value = "n/a" if f[key] is None else f"{f[key] / 2**20:.3f}"
            unseen = key == "parameters" and not f["optimizer"]
            rows.append(f"  {name:<26} {value:>10} MB" + ("  (optimizer: not seen)" * unseen))
        if not cuda and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
            rows.append("  (MALLOC_MMAP_THRESHOLD_ unset: glibc may keep memory freed earlier)")
        return "\n".join(rows)
