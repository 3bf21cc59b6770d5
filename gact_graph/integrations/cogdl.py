"""Activation compression for CogDL (0.6) models, in ``cogdl.experiment`` or CogDL's Trainer.

::

    from cogdl import experiment
    from cogdl.datasets.planetoid_data import CoraDataset
    from cogdl.models.nn.gcn import GCN
    from gact_graph.integrations.cogdl import GactModel

    model = GactModel(GCN(1433, 64, 7, num_layers=2, dropout=0.5), bits=2)
    experiment(dataset=CoraDataset(data_path="data"), model=model, epochs=200, cpu=True)
    print(model.ctl.report())

`GactModel` wraps a CogDL model (CogDL's trainer cannot be given callbacks, and its model
wrapper calls ``model(graph)``), so nothing of CogDL is forked:

- ``compress_gnn`` compresses the wrapped model's forward (saved-tensor hooks, pointwise ops,
  bits plan), as for any model;
- CogDL's ``spmm(graph, x)`` over constant edge weights is routed, during a compressed
  forward only, through `gact_graph.sparse.spmm` on a `CompactAdjacency` made from the
  graph's CSR (``row_indptr``, ``col_indices``, raw weights, with CogDL's
  ``out_norm``/``in_norm`` scaling as its fused kernel applies them). CogDL's own CUDA SpMM
  keeps ``rowptr``, ``colind`` (int32 copies made per call) and the weights as ``ctx``
  attributes that saved-tensor hooks never see; its CPU training path gathers through
  ``index_select``/``scatter_add`` and saves the edge indices of every layer. Ours saves the
  shared adjacency once (lossless, counted once) and nothing node-level;
- ``ctl.iterate()`` runs at the start of every training forward after the first (CogDL's
  trainer has no per-step hook; the optimizer step happened in between);
- ``copy.deepcopy`` (CogDL's trainer snapshots the best model) returns a plain copy of the
  wrapped model without hooks, and keeps compressing the original.

What stays CogDL's (``tests/integrations/test_integrations_cogdl.py``): ``spmm`` calls whose
edge weights require grad (GAT's edge softmax and per-head SpMM, which set the learnable
attention as ``graph.edge_weight``); on CPU they are autograd ops the hooks see and compress
generically. On CUDA CogDL's edge softmax, multi-head SpMM and fused GAT kernels never call
``spmm`` and keep their inputs as ``ctx`` attributes, uncompressed.
"""

from __future__ import annotations

import collections
import collections.abc
import copy
import sys
import weakref
from typing import Any

# CogDL 0.6 still spells collections.Iterable (gone since Python 3.10) in its dataset code;
# without this alias none of its datasets loads on a current Python.
if not hasattr(collections, "Iterable"):
    collections.Iterable = collections.abc.Iterable

try:
    import cogdl  # noqa: F401
    from cogdl.utils import spmm_utils as _spmm_utils
except ImportError as e:  # pragma: no cover - CI does not install CogDL
    raise ImportError(
        "gact_graph.integrations.cogdl needs CogDL: pip install gact_graph[cogdl]"
    ) from e

import torch
from cogdl.data.data import Adjacency as _Adjacency
from cogdl.data.data import Graph as _Graph
from torch import nn

from gact_graph.api import compress_gnn
from gact_graph.core.controller import Controller
from gact_graph.sparse.adjacency import CompactAdjacency
from gact_graph.sparse.spmm import spmm as gact_spmm

__all__ = ["GactModel", "compress_cogdl", "patch_cogdl_spmm"]

_ORIGINAL_SPMM = _spmm_utils.spmm

# CogDL 0.6 saves its processed datasets as pickled Graph objects and reads them back with
# torch.load, whose default became weights_only=True in torch 2.6: allow its two classes.
torch.serialization.add_safe_globals([_Graph, _Adjacency])


class _SpmmRouter:
    """Replaces CogDL's module-level ``spmm`` while at least one controller uses it."""

    def __init__(self) -> None:
        self.controllers: list[weakref.ref] = []
        self.patched: list[tuple[Any, str]] = []

    def attach(self, ctl: Controller) -> None:
        if not self.controllers:
            self._patch()
        ref = weakref.ref(ctl)
        self.controllers.append(ref)

        def undo() -> None:
            if ref in self.controllers:
                self.controllers.remove(ref)
            if not self.controllers:
                self._unpatch()

        ctl.add_undo(undo)

    def _patch(self) -> None:
        for name, mod in list(sys.modules.items()):
            if (name == "cogdl" or name.startswith("cogdl.")) and mod is not None:
                if getattr(mod, "spmm", None) is _ORIGINAL_SPMM:
                    mod.spmm = routed_spmm
                    self.patched.append((mod, "spmm"))

    def _unpatch(self) -> None:
        for mod, attr in self.patched:
            if getattr(mod, attr, None) is routed_spmm:
                setattr(mod, attr, _ORIGINAL_SPMM)
        self.patched.clear()

    def active(self) -> Controller | None:
        """The controller whose compressed forward is running now, if any."""
        for ref in self.controllers:
            ctl = ref()
            if ctl is not None and ctl.compressing:
                return ctl
        return None


_ROUTER = _SpmmRouter()


def _adjacency(ctl: Controller, graph) -> CompactAdjacency:
    """A `CompactAdjacency` sharing the graph's CSR tensors, cached per controller while the
    graph's CSR tensors stay the same objects and versions."""
    rowptr, col = graph.row_indptr, graph.col_indices
    weight = graph.raw_edge_weight
    key = tuple((id(t), t._version) for t in (rowptr, col, weight))
    cache: dict = ctl.__dict__.setdefault("_gg_cogdl_adjacency", {})
    hit = cache.get(key)
    if hit is not None and all(r() is t for r, t in zip(hit[0], (rowptr, col, weight))):
        return hit[1]
    if rowptr.dtype != torch.int64:
        rowptr = rowptr.long()
    n = rowptr.numel() - 1
    if col.dtype not in (torch.int32, torch.int64):
        col = col.long()
    if n < 2**31 - 1 and col.dtype == torch.int64:
        col = col.int()  # 4 bytes per edge, as gact_graph's own adjacency
    adj = CompactAdjacency(n, rowptr, col, weight.float() if weight is not None else None)
    adj._ctl_ref = weakref.ref(ctl)
    for t in adj.tensors(with_transpose=False):
        ctl.keep_lossless(t, "index")
    cache.clear()  # one graph at a time (full-batch training)
    refs = tuple(weakref.ref(t) for t in (graph.row_indptr, graph.col_indices, weight))
    cache[key] = (refs, adj)
    return adj


def routed_spmm(graph, x, *args, **kwargs):
    """CogDL's ``spmm(graph, x)``: through `gact_graph.sparse.spmm` during a compressed forward
    (grad enabled) over constant edge weights, CogDL's own otherwise. Learnable weights (GAT's
    attention) stay CogDL's so that values and gradients are its own: on CPU CogDL computes
    the edge softmax's denominator with a compiled kernel that passes it no gradient, and it
    reorders a graph's edges into CSR order only on some of its paths, where the attention
    it computed follows the order before."""
    ctl = _ROUTER.active()
    if ctl is None or not torch.is_grad_enabled() or getattr(graph, "grb_adj", None) is not None:
        return _ORIGINAL_SPMM(graph, x, *args, **kwargs)
    if graph.raw_edge_weight.requires_grad:
        ctl.module_paths["cogdl.spmm (learnable edge weights)"] = "generic (CogDL's own)"
        return _ORIGINAL_SPMM(graph, x, *args, **kwargs)
    adj = _adjacency(ctl, graph)
    out_norm, in_norm = graph.out_norm, graph.in_norm
    if out_norm is not None:
        ctl.keep_lossless(out_norm, "index")
        x = out_norm * x
    out = gact_spmm(adj, x)
    if in_norm is not None:
        ctl.keep_lossless(in_norm, "index")
        out = in_norm * out
    ctl.module_paths.setdefault("cogdl.spmm", "sparse-spmm")
    return out


def _mark_graph_inputs(ctl: Controller, graph) -> None:
    """The tensors of a CogDL ``Graph`` are the model's inputs (alive anyway): keep them by
    reference as kind ``input``, as the controller does for tensor arguments (it cannot look
    inside a CogDL ``Graph``)."""
    tensors = [graph[k] for k in graph.keys]
    adj = getattr(graph, "_adj", None)
    if adj is not None:
        tensors += [getattr(adj, k, None) for k in ("row", "col", "row_ptr", "weight")]
    for t in tensors:
        if isinstance(t, torch.Tensor):
            ctl.keep_lossless(t, "input")


def patch_cogdl_spmm(ctl: Controller) -> None:
    """Route CogDL's ``spmm`` through gact_graph during ``ctl``'s forwards (undone by
    ``ctl.remove()``)."""
    _ROUTER.attach(ctl)


def compress_cogdl(model: nn.Module, bits: float | None = 2, **kwargs: Any) -> Controller:
    """`compress_gnn` for a CogDL model, with CogDL's SpMM routed through gact_graph."""
    ctl = compress_gnn(model, bits=bits, **kwargs)
    if ctl.config.opt_level != "L0" and ctl.config.sparse:
        patch_cogdl_spmm(ctl)
    return ctl


class GactModel(nn.Module):
    """A CogDL model whose training forwards are compressed; use it wherever CogDL takes a
    model (``cogdl.experiment(model=...)``, a model wrapper).

    ``cogdl.experiment`` trains a deep copy of the model it is given (and its trainer
    snapshots the best model with ``copy.deepcopy``): a copy is a new `GactModel` around a
    copy of the wrapped model, compressed by its own controller, and every copy shares one
    record of which controller ran the last training step: `controller` / `stats`.

    Args:
        model: a CogDL model (``cogdl.models.BaseModel``) or any ``nn.Module``.
        bits: as `compress_gnn`.
        **kwargs: any other `compress_gnn` argument.

    Attributes:
        ctl: this instance's `Controller`.
        model_name: the wrapped model's, which CogDL uses to pick its wrappers.
    """

    def __init__(self, model: nn.Module, bits: float | None = 2, **kwargs: Any) -> None:
        super().__init__()
        self.model = model
        self.model_name = getattr(model, "model_name", type(model).__name__)
        self._bits = bits
        self._kwargs = kwargs
        self._trained_once = False
        self._shared: dict[str, Any] = {"controller": None}
        self.ctl = compress_cogdl(model, bits=bits, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and self.training:
            if self._trained_once:
                self.ctl.iterate()  # the previous training step has finished
            self._trained_once = True
            self._shared["controller"] = self.ctl
            for a in (*args, *kwargs.values()):
                if isinstance(a, _Graph):
                    _mark_graph_inputs(self.ctl, a)
        return self.model(*args, **kwargs)

    def controller(self) -> Controller:
        """The controller that ran the last training step of this model or of a copy of it
        (this instance's own before any training)."""
        return self._shared["controller"] or self.ctl

    def stats(self) -> dict[str, Any]:
        """`Controller.stats()` of the last training step (see `controller`)."""
        return self.controller().stats()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self._modules.get("model")
            if inner is None:
                raise
            return getattr(inner, name)  # CogDL asks models for setup_optimizer, predict, ...

    def remove(self) -> nn.Module:
        """Stop compressing; returns the wrapped model, exactly as before."""
        self.ctl.remove()
        return self.model

    def __deepcopy__(self, memo: dict) -> GactModel:
        # Hooks, patches and the controller's weak references to storages must not be copied:
        # copy the plain model, then compress the copy with a controller of its own.
        state = self.ctl.state_dict()
        self.ctl.remove()
        try:
            inner = copy.deepcopy(self.model, memo)
        finally:
            self.ctl = compress_cogdl(self.model, bits=self._bits, **self._kwargs)
            self.ctl.load_state_dict(state)
        clone = GactModel(inner, self._bits, **self._kwargs)
        clone.ctl.load_state_dict(state)
        clone._trained_once = self._trained_once
        clone._shared = self._shared
        clone.train(self.training)
        return clone
