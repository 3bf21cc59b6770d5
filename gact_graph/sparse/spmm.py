"""Fused message passing ``out = A @ x`` on a shared `CompactAdjacency`.

Stock PyG gathers ``x_j = x[src]`` (E x F), multiplies by the edge weight and scatters, and
autograd keeps the edge index and weights of every layer for backward. `SpmmFunction` does one
sparse-dense product instead:

- forward saves nothing node-level when the edge weights need no gradient: only the shared
  adjacency (the same tensors for every layer, so the controller stores and counts them once);
- backward computes ``grad_x = A^T @ grad_out`` with the adjacency's cached transpose
  (`torch.sparse.mm` on CSR), never an E x F temporary: peak O(N x F + E);
- with learnable edge weights it saves the input ``x`` (which the controller compresses) and
  computes ``grad_w[e] = <grad_out[dst_e], x[src_e]>`` in bounded edge chunks.

``reduce="mean"`` divides by the number of entries per row, as PyG's mean aggregation (rows
without entries give 0). CUDA runs the same code (cuSPARSE CSR products); no Triton kernel is
used here.

Dtypes. The product runs in the result's dtype, except half precision on CPU, where MKL's CSR
product has no kernel: there it runs in fp32 and the result is rounded once. The result has
``x``'s dtype (the adjacency's values are cast to it), except under autocast: the stock path
this replaces, PyG's ``w * x_j`` message and scatter-sum, contains no op that autocast lowers,
so there it promotes as PyTorch does (bf16 features from an autocast ``Linear`` and fp32
normalized GCN weights give an fp32 result) and we return that dtype. Autocast itself is kept
off inside (`gact_graph.sparse.amp`): it would cast the CSR product's operands to bf16/fp16.
Gradients come back in the dtypes of ``x`` and of the learnable weights.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gact_graph.sparse.adjacency import CompactAdjacency
from gact_graph.sparse.amp import autocast_enabled, autocast_off
from gact_graph.sparse.differentiable_once import differentiable_once
from gact_graph.switches import package_work

__all__ = ["SpmmFunction", "spmm", "spmm_reference", "DEFAULT_CHUNK_BYTES"]

#: Bytes of one edge chunk's temporaries (grad of learnable weights, reference path);
#: ``compress_gnn(..., chunk_bytes=...)`` changes it.
DEFAULT_CHUNK_BYTES = 32 * 2**20
_REDUCES = ("sum", "add", "mean")


def _chunk_edges(chunk_bytes: int, width: int, element_size: int) -> int:
    return max(1, int(chunk_bytes) // max(1, 3 * width * element_size))


def spmm_reference(
    rowptr: Tensor,
    col: Tensor,
    weight: Tensor | None,
    x: Tensor,
    reduce: str = "sum",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Tensor:
    """``A @ x`` by gather / ``index_add_`` in edge chunks, accumulated in at least fp32 (the oracle
    and the fallback for dtypes the sparse library lacks)."""
    n, e = rowptr.numel() - 1, col.numel()
    x2 = _rows(x)
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    acc = torch.zeros(n, x2.size(1), dtype=acc_dtype, device=x.device)
    if e:
        dst = torch.repeat_interleave(
            torch.arange(n, device=x.device), rowptr[1:] - rowptr[:-1], output_size=e
        )
        step = _chunk_edges(chunk_bytes, x2.size(1), 4)
        for s in range(0, e, step):
            msg = x2.index_select(0, col[s : s + step].long()).to(acc_dtype)
            if weight is not None:
                msg = msg * weight[s : s + step].to(acc_dtype).unsqueeze(-1)
            acc.index_add_(0, dst[s : s + step], msg)
    if reduce == "mean":
        acc = acc / (rowptr[1:] - rowptr[:-1]).clamp(min=1).unsqueeze(-1).to(acc.dtype)
    return acc.to(x.dtype).reshape(n, *x.shape[1:])


def _rows(x: Tensor) -> Tensor:
    """``x`` as a matrix of one row per node; unlike ``reshape(n, -1)`` it also works for a graph
    of 0 nodes (stock PyG returns an empty output there)."""
    return x.reshape(x.size(0), math.prod(x.shape[1:]))


def _result_dtype(x: Tensor, values: Tensor | None) -> torch.dtype:
    """``x``'s dtype; under autocast, what PyG's ``w * x_j`` message promotes to."""
    if values is not None and autocast_enabled(x.device):
        return torch.promote_types(x.dtype, values.dtype)
    return x.dtype


def _csr_mm(adj: CompactAdjacency, values: Tensor | None, x: Tensor, dtype: torch.dtype) -> Tensor:
    """``A @ x`` with A = (adj structure, values, and its ``scale`` and ``loop``) as a
    ``dtype`` tensor: a CSR product, O(N x F + E) memory."""
    n = adj.num_nodes
    x2 = _rows(x)
    if x2.size(1) == 0 or (adj.num_edges == 0 and not adj.loop):
        return x.new_zeros((n, *x.shape[1:]), dtype=dtype)
    compute = dtype
    if x.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        compute = torch.float32  # MKL's CSR product has no half kernels on CPU
    scale = None if adj.scale is None else adj.scale.to(compute)
    if scale is not None:  # W[i, j] * scale[j]: the rows are scaled after the product
        col_scale = scale.index_select(0, adj.col)
        values = col_scale if values is None else col_scale.mul_(values)
    a = adj.to_torch_csr(values, dtype=compute)
    with autocast_off(x.device):
        if x.device.type == "cpu":
            # torch.sparse.mm is zeros + addmm on CPU: two output-sized tensors at once (the
            # backward's peak when a probe or a recomputation stacks on it); beta=0 into one
            # fresh buffer makes one, and is no slower (docs/results/spmm_cpu_buffer.md)
            out = x2.new_empty((n, x2.size(1)), dtype=compute)
            torch.addmm(out, a, x2.to(compute), beta=0, out=out)
        else:  # CUDA: the one-buffer form is not yet checked on a GPU
            out = torch.sparse.mm(a, x2.to(compute))
        del a, values
        if adj.loop or scale is not None:
            _diagonal_and_scale(out, x2, adj.loop, scale)
        out = out.to(dtype)
    if x.dim() != 2:
        # a fresh tensor, not a view: callers (GCN2Conv) modify the output in place
        out = out.reshape(n, *x.shape[1:]).clone()
    return out


def _diagonal_and_scale(out: Tensor, x: Tensor, loop: float, scale: Tensor | None) -> None:
    """``out`` (the stored entries' product, already scaled by ``scale`` on the right) becomes
    ``diag(scale) (out + loop diag(scale) x)``, in place: no N x F temporary."""
    if scale is None:
        out.add_(x.to(out.dtype), alpha=loop)
        return
    s = scale.to(out.dtype).unsqueeze(1)
    if loop:
        out.addcmul_(x.to(out.dtype), s, value=loop)
    out.mul_(s)


class SpmmFunction(torch.autograd.Function):
    """``out = reduce_j A[i, j] * x[j]`` (``reduce`` in sum/add/mean) for a `CompactAdjacency`.

    ``weight`` (optional, CSR order) replaces ``adj.weight``; when it requires grad its
    gradient is computed (chunked). The adjacency's tensors are saved through
    ``ctx.save_for_backward`` so the controller stores (by reference) and counts them once
    however many layers share them.
    """

    @staticmethod
    @package_work  # grad is off in here: the forward's pointwise mode would rewrite nothing
    def forward(ctx, x, weight, adj, reduce, chunk_bytes):
        if reduce not in _REDUCES:
            raise ValueError(f"reduce must be one of {_REDUCES}, got {reduce!r}")
        if x.size(0) != adj.num_nodes:
            raise ValueError(f"x has {x.size(0)} rows, the adjacency {adj.num_nodes} nodes")
        values = adj.weight if weight is None else weight
        if values is not None and values.numel() != adj.num_edges:
            raise ValueError("weight must hold one value per edge (CSR order)")
        out = _csr_mm(adj, values, x, _result_dtype(x, adj.scale if values is None else values))
        if reduce == "mean":
            out = out / adj.degree().clamp(min=1).to(out.dtype).view(-1, *[1] * (x.dim() - 1))

        need_x = ctx.needs_input_grad[0]
        need_w = weight is not None and ctx.needs_input_grad[1]
        ctx.adj, ctx.reduce, ctx.chunk_bytes = adj, reduce, chunk_bytes
        ctx.need_x, ctx.need_w = need_x, need_w
        ctx.has_weight = weight is not None
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        saved: list[Tensor] = []
        if need_x or need_w:
            if need_x:
                adj.transpose()  # built once per graph, then shared by every layer
            saved += adj.tensors()
            ctl = adj._ctl_ref() if adj._ctl_ref is not None else None
            if weight is not None:
                if ctl is not None:  # edge weights are part of the adjacency: never quantized
                    ctl.keep_lossless(weight, "index")
                saved.append(weight)
            if need_w:
                saved.append(x)  # the only node-level tensor: the controller compresses it
        ctx.n_adj = len(saved) - int(weight is not None) - int(need_w)
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    @differentiable_once("the fused sparse aggregation (sparse=True)")
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors  # unpacks (and version-checks) what the controller holds
        adj: CompactAdjacency = ctx.adj
        k = ctx.n_adj
        weight = saved[k] if ctx.has_weight else None
        x = saved[k + 1] if ctx.need_w else None
        g = _rows(grad_out)
        if ctx.reduce == "mean":
            g = g / adj.degree().clamp(min=1).to(g.dtype).unsqueeze(-1)

        grad_x = grad_w = None
        if ctx.need_x:
            at = adj.transpose()
            if weight is None:
                t_values = at.weight
            else:
                t_perm = adj.transpose_perm()
                t_values = weight if t_perm is None else weight[t_perm]
            grad_x = _csr_mm(at, t_values, g, g.dtype).to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.need_w:
            grad_w = _edge_dot(adj, g, _rows(x), ctx.chunk_bytes)
            grad_w = grad_w.to(weight.dtype)
        return grad_x, grad_w, None, None, None


def _edge_dot(adj: CompactAdjacency, g: Tensor, x: Tensor, chunk_bytes: int) -> Tensor:
    """``out[e] = <g[dst_e], x[src_e]>`` in CSR order, in edge chunks (never E x F)."""
    e = adj.num_edges
    out = torch.empty(e, dtype=torch.promote_types(g.dtype, x.dtype), device=g.device)
    if e == 0:
        return out
    dst = adj.dst_index()
    step = _chunk_edges(chunk_bytes, g.size(1), g.element_size())
    for s in range(0, e, step):
        gi = g.index_select(0, dst[s : s + step])
        xj = x.index_select(0, adj.col[s : s + step].long())
        out[s : s + step] = (gi * xj).sum(-1)
    return out


def spmm(
    adj: CompactAdjacency,
    x: Tensor,
    weight: Tensor | None = None,
    reduce: str = "sum",
    chunk_bytes: int | None = None,
) -> Tensor:
    """``A @ x`` (``reduce`` sum/add/mean) through `SpmmFunction`; ``weight`` in CSR order
    overrides ``adj.weight`` (e.g. learnable weights from `differentiable_edge_weight`)."""
    if chunk_bytes is None:
        ctl = adj._ctl_ref() if adj._ctl_ref is not None else None
        config = getattr(ctl, "config", None)
        chunk_bytes = DEFAULT_CHUNK_BYTES
        if config is not None:
            chunk_bytes = int(config.extra.get("chunk_bytes", DEFAULT_CHUNK_BYTES))
    return SpmmFunction.apply(x, weight, adj, reduce, chunk_bytes)
