"""What the process's peak memory in training is made of, for `Controller.report()`: the graph
(the root forward's index and sparse inputs, and the adjacencies cached for it), the features
(its floating-point inputs), parameters with their gradients and optimizer state, what the
controller stored for backward, and the working set (the rest of the peak).

The peak is read, never reset (a reset is process-wide: it would cut short every other
reading of the peak, the example's and the benchmarks'): at the root forward's start and at
`Controller.iterate()`. A step whose end reads more than its start raised the process's peak:
its inputs and stored bytes are kept as the peak step's. The rest is counted when the report
is made. The optimizer is found through torch's global step hook: those whose parameter
groups hold the model's parameters, kept weakly."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from gact_graph.core.meter import StepMeter
from gact_graph.switches import package_work

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
        #: the process's peak as last read, and the step that raised it to that (None: no
        #: step rose above what the process held before training)
        self.peak: int | None = None
        self.peak_step: int | None = None
        self.saved = 0  # what the peak step stored
        self._meter: StepMeter | None = None
        self._before: int | None = None  # the peak at this step's start; None: no step runs
        self._step_inputs: tuple[dict[tuple, int], dict[tuple, int]] = ({}, {})
        self._inputs: tuple[dict[tuple, int], dict[tuple, int]] = ({}, {})  # graph, features
        self._optimizers, self._others = weakref.WeakSet(), weakref.WeakSet()
        if ctl.config.opt_level == "L0":  # L0 installs nothing: stock's forward, untouched
            return
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

    @package_work  # its storage reads are the package's, not the user's calls
    def _begin(self, module, args, kwargs) -> None:
        """The root forward's pre-hook: the step's first training forward reads the peak."""
        if not self.ctl.compressing or self._before is not None:
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
        self._step_inputs = (_storages(graph), _storages(features))
        cuda = [t.device for t in graph + features if t.is_cuda]
        device = cuda[0] if cuda else torch.device("cpu")
        if self._meter is None or self._meter.device != device:
            self._meter = StepMeter(device, sync=False)
        self._before = self._meter.peak() or 0
        if self.peak is not None and self._before > self.peak:  # raised outside training
            self.peak_step = None

    def end(self, records: list[dict[str, Any]]) -> None:
        """At `iterate()`: the peak now; if the step raised it, its inputs and what the
        controller stored (as `stats()`) are the peak step's."""
        before, self._before = self._before, None
        if before is None or (now := self._meter.peak()) is None:
            return
        self.peak = now
        if now > before:
            self.peak_step = self.ctl.step
        if now > before or self.peak_step is None:  # else the peak step's figures stay
            self._inputs = self._step_inputs
            kept = ("param", "input")
            self.saved = sum(r["stored_bytes"] for r in records if r["kind"] not in kept)

    def figures(self) -> dict[str, Any]:
        """Bytes of each part of the process's peak (``working_set`` and ``peak`` None where
        the peak could not be read); the peak step's inputs and stored bytes, the graph's
        caches, parameters and optimizer state as they are now. ``optimizer``: whether an
        optimizer of these parameters has stepped; ``step``: the peak step (None: the peak
        was set before training)."""
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
        return {
            **out,
            "peak": self.peak,
            "step": self.peak_step,
            "optimizer": bool(self._optimizers),
        }

    def report(self) -> str:
        if self._meter is None:
            return "step memory: no training step yet"
        f = self.figures()
        cuda = self._meter.device.type == "cuda"
        what = "CUDA max_memory_allocated" if cuda else "the anonymous resident set"
        when = "before training" if f["step"] is None else f"in step {f['step']}"
        rows = [f"step memory (the process's peak, {what}, set {when})"]
        for key in ("graph", "features", "parameters", "saved", "working_set", "peak"):
            name = _NAMES.get(key, key.replace("_", " "))
            value = "n/a" if f[key] is None else f"{f[key] / 2**20:.3f}"
            unseen = key == "parameters" and not f["optimizer"]
            rows.append(f"  {name:<26} {value:>10} MB" + ("  (optimizer: not seen)" * unseen))
        if not cuda and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
            rows.append("  (MALLOC_MMAP_THRESHOLD_ unset: glibc may keep memory freed earlier)")
        return "\n".join(rows)
