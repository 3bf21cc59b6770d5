"""`GATConv` and `GATv2Conv` through the edge stages that save only node-level tensors:
the patchers (`patch_gat_conv`, `patch_gatv2_conv`) route every call that the edge stage
computes exactly to it (the fused kernels where `fused_kernel_applies`, else the chunked
stage), and every other call (edge features, attention weights requested, sparse adjacency
types, bipartite graphs of two sizes, explain mode, message hooks) to PyG's own forward,
recording which ran in ``ctl.module_paths``. A `GATConv`'s node logits come from the layer's
input, ``h @ (W^T att)`` (`_node_logits`; why: `gact_graph.sparse.gat`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.parameter import is_lazy
from torch_geometric.nn import GATConv, GATv2Conv
from torch_geometric.nn.dense.linear import Linear as PygLinear

from gact_graph.sparse.adjacency_build import get_adjacency
from gact_graph.sparse.amp import add_into, autocast_off
from gact_graph.sparse.edge_chunks import DEFAULT_CHUNK_BYTES
from gact_graph.sparse.gat import gat_attention
from gact_graph.sparse.gat_fused import (
    adjacency_transpose,
    fused_kernel_applies,
    gat_attention_fused,
    gatv2_attention_fused,
)
from gact_graph.sparse.gatv2 import gatv2_attention
from gact_graph.sparse.patching import install_forward, message_passing_reason, register_patcher
from gact_graph.switches import package_work

__all__ = ["patch_gat_conv", "patch_gatv2_conv"]


def _chunk_bytes(ctl) -> int:
    return int(ctl.config.extra.get("chunk_bytes", DEFAULT_CHUNK_BYTES))


def _message_passing_reason(module, edge_index) -> str | None:
    """Why a MessagePassing call must take PyG's own path (None: the fused path is exact). A
    torch.sparse CSR ``adj_t`` (`compact_adj_t`'s) is an edge list in CSR order to it."""
    if not isinstance(edge_index, Tensor) or edge_index.layout not in (
        torch.strided,
        torch.sparse_csr,
    ):
        return "sparse adj"
    if edge_index.layout == torch.sparse_csr:
        if edge_index.requires_grad:
            return "learnable sparse values"
    elif edge_index.dim() != 2 or edge_index.size(0) != 2:
        return "edge_index shape"
    if getattr(module, "aggr", "add") not in ("add", "sum"):
        return f"aggr={module.aggr}"
    return message_passing_reason(module)


def _square_nodes(x) -> tuple[int | None, str | None]:
    """(number of nodes, None) when source and destination node sets are one and the same
    size; (None, reason) otherwise."""
    if isinstance(x, Tensor):
        return (x.size(0), None) if x.dim() == 2 else (None, "x shape")
    if isinstance(x, (tuple, list)) and len(x) == 2:
        x_s, x_d = x
        if not isinstance(x_s, Tensor) or not isinstance(x_d, Tensor) or x_s.dim() != 2:
            return None, "bipartite"
        if x_s.size(0) != x_d.size(0):
            return None, "bipartite"
        return x_s.size(0), None
    return None, "x type"


def _projections(module) -> tuple:
    """(source, destination) projection modules of a `GATConv`."""
    if module.lin is not None:
        return module.lin, module.lin
    return module.lin_src, module.lin_dst


def _foldable(lin) -> bool:
    """A projection whose output is ``h @ W^T`` and nothing else (the logits fold into it)."""
    return type(lin) in (PygLinear, torch.nn.Linear) and lin.bias is None


def _attention_reason(module, edge_index, edge_attr, return_attention_weights) -> str | None:
    """Why a `GATConv` / `GATv2Conv` call must take PyG's path, as far as the two share it."""
    if return_attention_weights:
        return "return_attention_weights"
    if edge_attr is not None:  # used (edge_dim), refused (GATv2Conv) or ignored (GATConv)
        return "edge_attr"
    return _message_passing_reason(module, edge_index)


@package_work  # checks of types and shapes: nothing the forward's pointwise mode rewrites
def _gat_reason(module, x, edge_index, edge_attr, size, return_attention_weights) -> str | None:
    reason = _attention_reason(module, edge_index, edge_attr, return_attention_weights)
    if reason is not None:
        return reason
    num_nodes, reason = _square_nodes(x)
    if reason is not None:
        return reason
    if size is not None and tuple(size) != (num_nodes, num_nodes):
        return "size"
    if not all(_foldable(lin) for lin in _projections(module)):
        return "projection is not a bias-free Linear"
    return _dropout_reason(module, x)


def _dropout_reason(module, x) -> str | None:
    x_s = x if isinstance(x, Tensor) else x[0]
    if module.training and module.dropout > 0 and x_s.device.type not in ("cpu", "cuda"):
        return f"attention dropout on {x_s.device.type}"
    return None


@package_work  # products, sums and a matmul: nothing the forward's pointwise mode rewrites
def _node_logits(ctl, h: Tensor, pairs, dtype: torch.dtype) -> list[Tensor]:
    """``<lin(h)_i, att>`` per head (N x H, in ``dtype``) for each ``(lin, att)`` of ``pairs``,
    computed as ``h @ (W^T att)``: from the projection's input, never from its (quantized)
    output; see the module docstring. One matmul for all of them: backward then reads ``h``
    (dequantized, N x F_in) once and forms one N x F_in gradient, rather than one
    dequantization, matmul and gradient per pair, summed."""
    blocks = []
    for lin, _ in pairs:
        if is_lazy(lin.weight):  # stock's call of this projection would initialize it
            with torch.no_grad():
                lin(h)
    with autocast_off(h.device):  # stock's logits are an elementwise product: no autocast
        compute = torch.promote_types(h.dtype, dtype)
        for lin, att in pairs:
            heads, channels = att.shape[-2:]
            blocks.append(
                (lin.weight.view(heads, channels, -1) * att.view(heads, channels, 1)).sum(1)
            )
        w_att = (blocks[0] if len(blocks) == 1 else torch.cat(blocks)).to(compute)
        if torch.is_grad_enabled():  # (sum of H) x F_in, small; rounding it would only add noise
            ctl.keep_lossless(w_att, "activation")
        logits = F.linear(h.to(compute), w_att).to(dtype)
    if len(blocks) == 1:
        return [logits]
    # separate tensors, as when computed apart (small: N x H each)
    return [part.contiguous() for part in logits.split([b.shape[0] for b in blocks], dim=1)]


@package_work  # sums, a mean and a view: nothing the forward's pointwise mode rewrites
def _finish(module, out: Tensor, res: Tensor | None) -> Tensor:
    """Stock's end of a GAT layer: heads concatenated (or averaged), plus the residual, plus
    the bias, summed into the edge stage's output (`add_into`) while it is still N x H x C,
    not a view: no N x H x C sum beside its terms."""
    heads, channels = out.shape[1:]
    if module.concat:
        terms = [None if res is None else res.reshape(-1, heads, channels),
                 None if module.bias is None else module.bias.view(heads, channels)]  # fmt: skip
    else:
        out = out.mean(dim=1)
        terms = [res, module.bias]
    for t in terms:
        if t is not None:
            out = add_into(out, t)
    return out.view(-1, heads * channels) if module.concat else out


def _gat_fused_forward(ctl, module, x, edge_index) -> Tensor:
    """`GATConv.forward` (PyG 2.8.1) with the edge stage replaced by `GatAttentionFunction`
    and the node logits computed by `_node_logits`."""
    heads, channels = module.heads, module.out_channels
    x_s, x_d = (x, x) if isinstance(x, Tensor) else x
    res = module.res(x_d) if module.res is not None else None
    lin_src, lin_dst = _projections(module)
    x_src = lin_src(x_s).view(-1, heads, channels)
    # Stock's destination projection feeds only its logits: not computed here.
    dtype = torch.promote_types(x_src.dtype, module.att_src.dtype)  # stock's logits' dtype
    if x_s is x_d:
        a_src, a_dst = _node_logits(
            ctl, x_s, [(lin_src, module.att_src), (lin_dst, module.att_dst)], dtype
        )
    else:
        (a_src,) = _node_logits(ctl, x_s, [(lin_src, module.att_src)], dtype)
        (a_dst,) = _node_logits(ctl, x_d, [(lin_dst, module.att_dst)], dtype)
    # The softmax of quantized logits would be far off and they are small (N x H): lossless.
    if torch.is_grad_enabled():  # (nothing is saved otherwise)
        ctl.keep_lossless(a_src, "activation")
        ctl.keep_lossless(a_dst, "activation")

    p = float(module.dropout) if module.training else 0.0
    adj = _get_adjacency(
        ctl, edge_index, x_src.size(0), module.add_self_loops,
        _stock_draw(ctl, module, x_src, a_src),
    )  # fmt: skip
    if fused_kernel_applies(x_src, a_src, p, lossless=ctl.config.lossless):
        keep = (lambda t: ctl.keep_lossless(t, "activation")) if torch.is_grad_enabled() else None
        out = gat_attention_fused(
            x_src, a_src, a_dst, adj.rowptr, adj.col, module.negative_slope, p,
            transpose=adjacency_transpose(adj, p), keep_lossless=keep,
        )  # fmt: skip
    else:
        out = gat_attention(
            x_src, a_src, a_dst, adj.rowptr, adj.col, module.negative_slope, p, adj.perm,
            chunk_bytes=_chunk_bytes(ctl),
        )  # fmt: skip
    # The projection is saved (compressed) by now: its fp32 copy goes before the sums below.
    # The residual's projection stays before the edge stage, as in stock: made after it, it
    # would hold one tensor less in forward but run first in backward, where the default
    # mode's probed steps then peak higher (docs/design.md).
    del x_src, a_src, a_dst
    return _finish(module, out, res)


@package_work  # checks of types and shapes: nothing the forward's pointwise mode rewrites
def _gatv2_reason(module, x, edge_index, edge_attr, return_attention_weights) -> str | None:
    reason = _attention_reason(module, edge_index, edge_attr, return_attention_weights)
    if reason is not None:
        return reason
    _, reason = _square_nodes(x)
    return reason or _dropout_reason(module, x)


def _gatv2_fused_forward(ctl, module, x, edge_index) -> Tensor:
    """`GATv2Conv.forward` (PyG 2.8.1) with the edge stage replaced by
    `GatV2AttentionFunction`."""
    heads, channels = module.heads, module.out_channels
    x_s, x_d = (x, x) if isinstance(x, Tensor) else x
    res = module.res(x_d) if module.res is not None else None
    x_l = module.lin_l(x_s).view(-1, heads, channels)
    if x_s is x_d and module.share_weights:
        x_r = x_l
    else:
        x_r = module.lin_r(x_d).view(-1, heads, channels)

    same_dtype = x_r.dtype == x_l.dtype
    adj = _get_adjacency(
        ctl, edge_index, x_l.size(0), module.add_self_loops,
        module.dropout > 0 and (not same_dtype or _stock_draw(ctl, module, x_l, module.att)),
    )  # fmt: skip
    p = float(module.dropout) if module.training else 0.0
    lossless = ctl.config.lossless
    if same_dtype and fused_kernel_applies(x_l, module.att, p, lossless):
        out = gatv2_attention_fused(
            x_l, x_r, module.att, adj.rowptr, adj.col, module.negative_slope, p,
            transpose=adjacency_transpose(adj, p),
            recompute_stats=torch.is_grad_enabled() and not lossless,
        )  # fmt: skip
    else:
        out = gatv2_attention(
            x_l, x_r, module.att, adj.rowptr, adj.col, module.negative_slope, p, adj.perm,
            chunk_bytes=_chunk_bytes(ctl),
        )  # fmt: skip
    del x_l, x_r  # saved by now (see GATConv's)
    return _finish(module, out, res)


@register_patcher(GATConv)
def patch_gat_conv(ctl, path: str, module) -> None:
    """Run ``module`` (a `GATConv`) through `GatAttentionFunction` whenever that is exact;
    other calls (edge features, attention weights requested, sparse adjacency types, bipartite
    graphs of two sizes, explain mode, message hooks) take PyG's own forward, and
    ``ctl.module_paths[path]`` says which ran last."""
    original = module.forward

    def forward(x, edge_index, edge_attr=None, size=None, return_attention_weights=None):
        args = (x, edge_index, edge_attr, size, return_attention_weights)
        return _route(ctl, path, _gat_reason(module, *args), lambda: original(*args),
                      lambda: _gat_fused_forward(ctl, module, x, edge_index))  # fmt: skip

    install_forward(ctl, path, module, forward)


@register_patcher(GATv2Conv)
def patch_gatv2_conv(ctl, path: str, module) -> None:
    """`patch_gat_conv` for `GATv2Conv` (`GatV2AttentionFunction`)."""
    original = module.forward

    def forward(x, edge_index, edge_attr=None, return_attention_weights=None):
        args = (x, edge_index, edge_attr, return_attention_weights)
        return _route(ctl, path, _gatv2_reason(module, *args), lambda: original(*args),
                      lambda: _gatv2_fused_forward(ctl, module, x, edge_index))  # fmt: skip

    install_forward(ctl, path, module, forward)


def _route(ctl, path: str, reason: str | None, stock, fused):
    """Run ``fused()`` (and record ``"sparse-fused"`` as the path of ``path``), or, given a
    ``reason``, ``stock()`` (recorded as generic, with the reason)."""
    if reason is not None:
        ctl.module_paths[path] = f"generic ({reason})"
        return stock()
    ctl.module_paths[path] = "sparse-fused"
    return fused()


def _get_adjacency(ctl, edge_index, num_nodes: int, add_self_loops: bool, stock_draw: bool):
    # GATConv / GATv2Conv: remove_self_loops, then add_self_loops (every node one loop). Where
    # the chunked stage draws attention dropout stock's way (``stock_draw``), ``perm`` puts the
    # mask in PyG's edge order; asked for in eval mode too, so that train and eval share one
    # cached adjacency. The fused kernels draw in CSR order and need no ``perm`` (4 bytes per
    # edge).
    return get_adjacency(
        ctl, edge_index, num_nodes, add_self_loops=add_self_loops, normalize=False,
        loop_mode="replace", keep_perm=stock_draw, use_values=False,
    )  # fmt: skip


def _stock_draw(ctl, module, x: Tensor, logits: Tensor) -> bool:
    """Whether ``module``'s attention dropout, in training, is drawn stock's way (on the
    chunked stage: `fused_kernel_applies` says no)."""
    p = float(module.dropout)
    return p > 0 and not fused_kernel_applies(x, logits, p, lossless=ctl.config.lossless)
