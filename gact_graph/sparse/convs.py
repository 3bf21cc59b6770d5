"""SpMM paths for PyG's linear message-passing convolutions.

Each patched ``forward`` is the stock PyG 2.8 ``forward`` line for line (same linear layers,
bias, root weight and in-place ops, in the same order) with ``propagate`` replaced by
`SpmmFunction` on the shared `CompactAdjacency`: GCNConv, GCN2Conv, SAGEConv (mean/sum),
GraphConv (add/sum/mean), GINConv (add/sum/mean) and APPNP (its K propagations).

A call the fused path cannot reproduce exactly (bipartite inputs, message-passing hooks,
explain mode, CSC matrices, learnable sparse values, ...) runs PyG's own ``forward``, and
``ctl.module_paths[path]`` says which path the last call took and why.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch_geometric.nn import APPNP, GCN2Conv, GCNConv, GINConv, GraphConv, SAGEConv
from torch_geometric.nn.aggr import MeanAggregation, SumAggregation

from gact_graph.sparse.adjacency import is_sparse_tensor, is_torch_sparse
from gact_graph.sparse.adjacency_build import (
    differentiable_edge_weight,
    get_adjacency,
    pyg_edge_list,
)
from gact_graph.sparse.amp import add_into
from gact_graph.sparse.patching import install_forward, message_passing_reason, register_patcher
from gact_graph.sparse.spmm import spmm
from gact_graph.switches import package_work

__all__ = [
    "patch_gcn_conv",
    "patch_gcn2_conv",
    "patch_sage_conv",
    "patch_graph_conv",
    "patch_gin_conv",
    "patch_appnp",
    "LABEL",
]

#: What ``ctl.module_paths`` shows for a module that ran the fused SpMM path.
LABEL = "sparse-spmm"


# ---------------------------------------------------------------------------- checks
def _graph_reason(edge_index: Any, edge_weight: Tensor | None = None) -> str | None:
    """Why this adjacency input must take PyG's path (None: supported). An ``edge_weight`` of
    another length than the edges, which stock PyG refuses (a size mismatch), is refused here
    before anything runs; a single value, which PyG broadcasts where it does not normalize,
    takes PyG's path."""
    if is_torch_sparse(edge_index):
        if edge_index.layout == torch.sparse_csc:
            return "sparse CSC"
        if edge_index.requires_grad:
            return "learnable sparse values"
        return None
    if is_sparse_tensor(edge_index):
        value = edge_index.storage.value()
        return "learnable sparse values" if value is not None and value.requires_grad else None
    if not isinstance(edge_index, Tensor):
        name = type(edge_index).__name__
        return "torch_sparse not installed" if name == "SparseTensor" else f"adjacency {name}"
    if edge_index.layout != torch.strided or edge_index.dim() != 2 or edge_index.size(0) != 2:
        return "edge_index shape"
    if edge_index.is_floating_point() or edge_index.dtype == torch.bool:
        return "edge_index dtype"
    if edge_weight is None:
        return None
    if edge_weight.dim() != 1 or not edge_weight.is_floating_point():
        return "edge_weight shape"
    num_edges = edge_index.size(1)
    if edge_weight.numel() != num_edges:
        if edge_weight.numel() == 1:
            return "one edge_weight for all edges"  # stock broadcasts it, or refuses it
        raise ValueError(
            f"edge_weight holds {edge_weight.numel()} values for {num_edges} edges "
            f"(edge_index.size(1)): pass one weight per edge"
        )
    return None


def _nodes(x: Any, size: Any = None) -> tuple[int | None, str | None]:
    """(N, None) for one node set (a tensor, or a pair of equal-size tensors), else a reason."""
    if isinstance(x, Tensor):
        n = x.size(0) if x.dim() == 2 else None
    elif isinstance(x, (tuple, list)) and len(x) == 2 and isinstance(x[0], Tensor):
        if not isinstance(x[1], Tensor):
            return None, "no destination features"
        if x[0].dim() != 2 or x[1].size(0) != x[0].size(0):
            return None, "bipartite"
        n = x[0].size(0)
    else:
        return None, "x type"
    if n is None:
        return None, "x shape"
    if size is not None and tuple(size) != (n, n):
        return None, "size"
    return n, None


def _aggr_reason(module) -> str | None:
    aggr = module.aggr
    if not isinstance(aggr, str) or aggr not in ("add", "sum", "mean"):
        return f"aggr={aggr}"
    if type(module.aggr_module) not in (MeanAggregation, SumAggregation):
        return f"aggr module {type(module.aggr_module).__name__}"
    return None


def _reduce(module) -> str:
    return "mean" if module.aggr == "mean" else "sum"


def _patch(ctl, path: str, module, fused, reason_of) -> None:
    """Install ``forward`` = fused path when ``reason_of(args) is None``, else PyG's own."""
    original = module.forward

    @package_work  # checks of shapes and types: the forward's pointwise mode need not see them
    def reason(args, kwargs) -> str | None:
        return message_passing_reason(module) or reason_of(*args, **kwargs)

    def forward(*args, **kwargs):
        if _stays_generic(ctl, path, reason(args, kwargs)):
            stock_cache(module)  # PyG's forward reads its cache slot as stock left it
            return original(*args, **kwargs)
        ctl.module_paths[path] = LABEL
        return fused(*args, **kwargs)

    install_forward(ctl, path, module, forward, LABEL)


def _static_reason(module) -> str | None:
    return message_passing_reason(module)


def _stays_generic(ctl, path: str, reason: str | None) -> bool:
    """True when ``reason`` says why the module at ``path`` runs PyG's own forward (recorded
    for the report); False when there is none."""
    if reason is None:
        return False
    ctl.module_paths[path] = f"generic ({reason})"
    return True


# ---------------------------------------------------------------------------- GCN family
def _plain_graph_adjacency(ctl, edge_index, edge_weight, n: int, use_values: bool):
    """The adjacency as given (no self-loops, no normalization); returns (adjacency,
    learnable CSR weights or None)."""
    adj = get_adjacency(
        ctl, edge_index, n, add_self_loops=False, normalize=False, edge_weight=edge_weight,
        use_values=use_values,
    )  # fmt: skip
    w = None
    if adj.weight_is_external:
        w = differentiable_edge_weight(
            adj, edge_index, edge_weight, n, add_self_loops=False, normalize=False
        )
    return adj, w


class SharedNormalizedGraph:
    """What a ``cached=True`` GCN-family conv holds in its own cache slot while compressed: the
    controller's shared adjacency of the graph it first saw, instead of the conv's own normalized
    copy of the edge list (one per layer in stock PyG). PyG's forward never reads it: the
    fused path does; `stock_cache` turns it into stock's cache entry where PyG's own forward
    runs on a compressed model (a call the fused path leaves to PyG). ``ctl.remove()`` empties
    the slot again, as it was before `compress_gnn`, and so does a copy of the model
    (``copy.deepcopy``, pickle): stock fills it again on its first call."""

    def __init__(self, adj, graph_kind: str) -> None:
        self.adj = adj
        self.graph_kind = graph_kind  # "edge_index", "torch_sparse" or "sparse_tensor"

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return (_none, ())


def _none() -> None:
    return None


def _cache_slot(edge_index) -> str:
    """The slot stock PyG caches this graph's normalization in."""
    plain = isinstance(edge_index, Tensor) and edge_index.layout == torch.strided
    return "_cached_edge_index" if plain else "_cached_adj_t"


def stock_cache(module) -> None:
    """Replace a `SharedNormalizedGraph` in ``module``'s cache slots by the entry stock PyG's
    ``gcn_norm`` would have left there (same edges and weights, in CSR order)."""
    for slot in ("_cached_edge_index", "_cached_adj_t"):
        held = getattr(module, slot, None)
        if isinstance(held, SharedNormalizedGraph):
            setattr(module, slot, held.adj.stock_form(held.graph_kind))


def _empty_cache(module, slot: str) -> None:
    if isinstance(getattr(module, slot, None), SharedNormalizedGraph):
        setattr(module, slot, None)


def _gcn_adjacency(ctl, module, edge_index, edge_weight, n: int, dtype, improved: bool):
    """The adjacency GCNConv / GCN2Conv / APPNP propagate over, with their normalization
    and ``cached`` semantics; returns (adjacency, learnable CSR weights or None)."""
    if not module.normalize:
        return _plain_graph_adjacency(ctl, edge_index, edge_weight, n, use_values=True)
    slot = _cache_slot(edge_index)
    held = getattr(module, slot, None) if module.cached else None
    if isinstance(held, SharedNormalizedGraph):  # stock semantics: the first graph, forever
        return held.adj, None
    if held is not None:  # filled by stock PyG before compress_gnn: that graph, as PyG would
        graph, weight = (held, None) if slot == "_cached_adj_t" else held
        adj = get_adjacency(
            ctl, graph, n, add_self_loops=False, normalize=False, edge_weight=weight
        )
        return adj, None
    adj = get_adjacency(
        ctl, edge_index, n, add_self_loops=module.add_self_loops, normalize=True,
        improved=improved, edge_weight=edge_weight, dtype=dtype,
    )  # fmt: skip
    w = None
    if adj.weight_is_external:
        w = differentiable_edge_weight(
            adj, edge_index, edge_weight, n, add_self_loops=module.add_self_loops,
            normalize=True, improved=improved, dtype=dtype,
        )  # fmt: skip
    elif module.cached:
        kind = "edge_index" if slot == "_cached_edge_index" else "torch_sparse"
        kind = "sparse_tensor" if is_sparse_tensor(edge_index) else kind
        setattr(module, slot, SharedNormalizedGraph(adj, kind))
        ctl.add_undo(lambda: _empty_cache(module, slot))
    return adj, w


def _gcn_graph_reason(module, edge_index, edge_weight) -> str | None:
    cached = module.normalize and module.cached
    # once stock has cached its normalized graph it never reads the weights again
    reused = cached and module._cached_edge_index is not None
    reason = _graph_reason(edge_index, None if reused else edge_weight)
    if reason is not None:
        return reason
    learnable = edge_weight is not None and edge_weight.requires_grad and torch.is_grad_enabled()
    if learnable and cached:
        return "cached with learnable edge_weight"
    if (
        module.normalize
        and is_torch_sparse(edge_index)
        and edge_index.size(0) != edge_index.size(1)
    ):
        return "non-square sparse adjacency"
    return None


@register_patcher(GCNConv)
def patch_gcn_conv(ctl, path: str, module: GCNConv) -> None:
    """GCNConv: ``lin`` -> SpMM with the normalized shared adjacency -> ``bias``.
    Supports ``normalize``/``add_self_loops``/``improved``/``cached`` and learnable
    ``edge_weight`` (its gradient flows through PyG's own `gcn_norm`)."""
    if _stays_generic(ctl, path, _static_reason(module)):
        return

    def reason_of(x, edge_index, edge_weight=None):
        if isinstance(x, (tuple, list)):
            return "bipartite"
        n, why = _nodes(x)
        return why or _gcn_graph_reason(module, edge_index, edge_weight)

    def fused(x, edge_index, edge_weight=None):
        n = x.size(0)
        improved = module.improved
        adj, w = _gcn_adjacency(ctl, module, edge_index, edge_weight, n, x.dtype, improved)
        out = spmm(adj, module.lin(x), w)  # the projection is freed once aggregated
        if module.bias is not None:
            out = add_into(out, module.bias)  # the product is fresh: no second N x C tensor
        return out

    _patch(ctl, path, module, fused, reason_of)


@register_patcher(GCN2Conv)
def patch_gcn2_conv(ctl, path: str, module: GCN2Conv) -> None:
    """GCN2Conv (GCNII): SpMM with the GCN-normalized shared adjacency, then PyG's exact
    initial-residual / identity-mapping arithmetic (including its in-place ops)."""
    if _stays_generic(ctl, path, _static_reason(module)):
        return

    def reason_of(x, x_0, edge_index, edge_weight=None):
        n, why = _nodes(x)
        if why is None and (not isinstance(x_0, Tensor) or x_0.dim() != 2):
            why = "x_0 shape"
        return why or _gcn_graph_reason(module, edge_index, edge_weight)

    def fused(x, x_0, edge_index, edge_weight=None):
        n = x.size(0)
        adj, w = _gcn_adjacency(ctl, module, edge_index, edge_weight, n, x.dtype, False)
        x = spmm(adj, x, w)
        x.mul_(1 - module.alpha)
        if module.weight2 is None:
            # alpha * x_0 summed in place: no N x C temporary for the scaled residual
            out = x.add_(x_0[: x.size(0)], alpha=module.alpha)
            out = torch.addmm(out, out, module.weight1, beta=1.0 - module.beta, alpha=module.beta)
        else:
            x_0 = module.alpha * x_0[: x.size(0)]
            out = torch.addmm(x, x, module.weight1, beta=1.0 - module.beta, alpha=module.beta)
            out = out + torch.addmm(
                x_0, x_0, module.weight2, beta=1.0 - module.beta, alpha=module.beta
            )
        return out

    _patch(ctl, path, module, fused, reason_of)


@register_patcher(APPNP)
def patch_appnp(ctl, path: str, module: APPNP) -> None:
    """APPNP: K SpMMs over one shared adjacency. Edge dropout in training draws the same
    random masks as PyG (over the edge weights in PyG's edge order)."""
    if _stays_generic(ctl, path, _static_reason(module)):
        return

    def dropping() -> bool:
        return module.dropout > 0 and module.training and module.K > 0

    def reason_of(x, edge_index, edge_weight=None):
        n, why = _nodes(x)
        if why is None and dropping():
            if not isinstance(edge_index, Tensor) or edge_index.layout != torch.strided:
                why = "edge dropout on a sparse matrix"
            elif not module.normalize and edge_weight is None:
                why = "edge dropout without edge weights"
            elif module.cached:
                why = "edge dropout with cached=True"
        return why or _gcn_graph_reason(module, edge_index, edge_weight)

    def fused(x, edge_index, edge_weight=None):
        n = x.size(0)
        if dropping():
            return _appnp_dropout(ctl, module, x, edge_index, edge_weight, n)
        adj, w = _gcn_adjacency(ctl, module, edge_index, edge_weight, n, x.dtype, False)
        h = x
        for _ in range(module.K):
            x = spmm(adj, x, w)
            x = x * (1 - module.alpha)
            x = x + module.alpha * h
        return x

    _patch(ctl, path, module, fused, reason_of)


def _appnp_dropout(ctl, module: APPNP, x, edge_index, edge_weight, n: int) -> Tensor:
    opts = dict(
        add_self_loops=module.add_self_loops and module.normalize, normalize=module.normalize
    )
    adj = get_adjacency(
        ctl, edge_index, n, edge_weight=edge_weight, dtype=x.dtype, keep_perm=True, **opts
    )
    if adj.weight_is_external:  # PyG's edge order, differentiable
        _, w_edges = pyg_edge_list(
            edge_index, edge_weight, n, opts["add_self_loops"], opts["normalize"], False, 1.0,
            "remaining", x.dtype,
        )  # fmt: skip
    else:
        w_edges = adj.to_edge_order(adj.weight)
    h = x
    for _ in range(module.K):
        # As PyG: each step drops from the previous step's (already dropped) weights.
        w_edges = F.dropout(w_edges, p=module.dropout)
        x = spmm(adj, x, adj.to_csr_order(w_edges))
        x = x * (1 - module.alpha)
        x = x + module.alpha * h
    return x


# ---------------------------------------------------------------------------- SAGE / Graph / GIN
@register_patcher(SAGEConv)
def patch_sage_conv(ctl, path: str, module: SAGEConv) -> None:
    """SAGEConv with ``aggr`` mean or sum: (``project``) -> SpMM (mean divides by the
    in-degree) -> ``lin_l`` (+ ``lin_r`` root) (-> L2 normalize)."""
    if _stays_generic(ctl, path, _static_reason(module) or _aggr_reason(module)):
        return

    def reason_of(x, edge_index, size=None):
        n, why = _nodes(x, size)
        return why or _graph_reason(edge_index)

    def fused(x, edge_index, size=None):
        if isinstance(x, Tensor):
            x = (x, x)
        if module.project and hasattr(module, "lin"):
            x = (module.lin(x[0]).relu(), x[1])
        n = x[0].size(0)
        adj, _ = _plain_graph_adjacency(
            ctl, edge_index, None, n, use_values=not is_sparse_tensor(edge_index)
        )
        out = spmm(adj, x[0], None, _reduce(module))
        out = module.lin_l(out)
        x_r = x[1]
        if module.root_weight and x_r is not None:
            out = out + module.lin_r(x_r)
        if module.normalize:
            out = F.normalize(out, p=2.0, dim=-1)
        return out

    _patch(ctl, path, module, fused, reason_of)


@register_patcher(GraphConv)
def patch_graph_conv(ctl, path: str, module: GraphConv) -> None:
    """GraphConv (add/sum/mean): SpMM with optional (learnable) edge weights -> ``lin_rel``
    + ``lin_root``. A sparse matrix's own values weight the edges, as in PyG."""
    if _stays_generic(ctl, path, _static_reason(module) or _aggr_reason(module)):
        return

    def reason_of(x, edge_index, edge_weight=None, size=None):
        n, why = _nodes(x, size)
        return why or _graph_reason(edge_index, edge_weight)

    def fused(x, edge_index, edge_weight=None, size=None):
        if isinstance(x, Tensor):
            x = (x, x)
        n = x[0].size(0)
        adj, w = _plain_graph_adjacency(ctl, edge_index, edge_weight, n, use_values=True)
        out = spmm(adj, x[0], w, _reduce(module))
        out = module.lin_rel(out)
        x_r = x[1]
        if x_r is not None:
            out = out + module.lin_root(x_r)
        return out

    _patch(ctl, path, module, fused, reason_of)


@register_patcher(GINConv)
def patch_gin_conv(ctl, path: str, module: GINConv) -> None:
    """GINConv (add/sum/mean): SpMM -> ``+ (1 + eps) * x`` -> ``nn``."""
    if _stays_generic(ctl, path, _static_reason(module) or _aggr_reason(module)):
        return

    def reason_of(x, edge_index, size=None):
        n, why = _nodes(x, size)
        return why or _graph_reason(edge_index)

    def fused(x, edge_index, size=None):
        if isinstance(x, Tensor):
            x = (x, x)
        n = x[0].size(0)
        adj, _ = _plain_graph_adjacency(
            ctl, edge_index, None, n, use_values=not is_sparse_tensor(edge_index)
        )
        out = spmm(adj, x[0], None, _reduce(module))
        x_r = x[1]
        if x_r is not None:
            out = out + (1 + module.eps) * x_r
        return module.nn(out)

    _patch(ctl, path, module, fused, reason_of)
