"""GAT's and GATv2's edge stages on the fused Triton kernels of `gact_graph.kernels.gat_edge`
and `gact_graph.kernels.gatv2_edge`.

`GatAttentionFunction` (`gact_graph.sparse.gat`) and `GatV2AttentionFunction`
(`gact_graph.sparse.gatv2`) are plain PyTorch, edge chunk by edge chunk: the CPU path and the
reference. `GatFusedFunction` and `GatV2FusedFunction` here run the fused kernels (one pass
over the CSR rows forward with an online softmax; backward one pass over the rows and one over
the transpose's rows, no atomics, no edge-level tensor at all) and save the softmax's
per-(node, head) max and sum, kept lossless, instead of recomputing them. The patched
`GATConv` and `GATv2Conv` take the kernels on CUDA tensors (`fused_kernel_applies`,
`EDGE_KERNEL`), the chunked stages elsewhere. The kernels draw attention dropout themselves
(Philox, from a seed tensor drawn on the device's generator, so no host sync), which cannot
equal stock's bits: in lossless mode (``bits=None``) a layer with attention dropout in
training keeps the chunked stage and stock's draw; compressed modes use the kernels' draw. Its
gradient is as unbiased as the chunked stage's (backward is linear in ``x'``;
tests/sparse/test_sparse_gat.py runs the statistic on CUDA).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gact_graph.kernels import force_triton, triton_available
from gact_graph.sparse.coded_rows import as_rows, row_matrix
from gact_graph.sparse.differentiable_once import differentiable_once
from gact_graph.sparse.edge_chunks import check_edge_stage
from gact_graph.switches import package_work, reading_rows

__all__ = [
    "EDGE_KERNEL",
    "GatFusedFunction",
    "GatV2FusedFunction",
    "adjacency_transpose",
    "fused_kernel_applies",
    "gat_attention_fused",
    "gatv2_attention_fused",
]

#: Which edge stage the patched `GATConv` / `GATv2Conv` run: ``"auto"``, the fused Triton kernels
#: (`gact_graph.kernels.gat_edge`, `gatv2_edge`) on CUDA tensors where they apply, else the
#: chunked PyTorch stage; ``"triton"``, the kernels wherever they apply, CPU tensors included
#: (which works only under ``TRITON_INTERPRET=1``: the tests); ``"chunked"``, never the kernels.
#: ``GACT_GRAPH_FORCE_TRITON=1`` acts as ``"triton"`` (`gact_graph.kernels.force_triton`).
EDGE_KERNEL = "auto"


_EDGE_KERNELS = ("auto", "triton", "chunked")


@package_work  # checks of devices and dtypes: nothing the forward's pointwise mode rewrites
def fused_kernel_applies(x: Tensor, logits: Tensor, dropout: float, lossless: bool) -> bool:
    """Whether the fused kernels run an edge stage of features ``x`` and node logits ``logits``
    under `EDGE_KERNEL`: Triton installed, a CUDA tensor (or the kernels forced), fp32 / bf16 /
    fp16 inputs (float64 stays exact on the chunked stage), and no attention dropout in
    lossless mode, whose draw stays stock's (the kernels draw their own; see the module
    docstring)."""
    if EDGE_KERNEL not in _EDGE_KERNELS:
        raise ValueError(f"EDGE_KERNEL must be one of {_EDGE_KERNELS}, got {EDGE_KERNEL!r}")
    if EDGE_KERNEL == "chunked" or not triton_available():
        return False
    forced = EDGE_KERNEL == "triton" or force_triton()
    if x.device.type != "cuda" and not forced:
        return False
    kernel_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    if x.dtype not in kernel_dtypes or logits.dtype not in kernel_dtypes:
        return False
    return not (dropout > 0 and lossless)


class GatFusedFunction(torch.autograd.Function):
    """`GatAttentionFunction`'s edge stage as the fused Triton kernels of
    `gact_graph.kernels.gat_edge`: one pass over the CSR rows forward, one over the rows and
    one over the transpose's rows backward, no edge-level tensor anywhere.

    ``forward(x_src, a_src, a_dst, rowptr, col, t_rowptr, t_col, t_pos, negative_slope,
    dropout, keep_lossless)``: as `GatAttentionFunction`, plus the transpose (``t_rowptr``,
    ``t_col``; ``t_pos``, each transposed edge's CSR position, needed with dropout only and
    None when the orders agree) and ``keep_lossless``, called on the softmax statistics before
    they are saved (the controller must not quantize them), or None. Attention dropout is the
    kernels' own Philox draw from a seed drawn here on the device's default generator (an
    int64 tensor: no host sync); backward regenerates it. Saves ``x_src`` (as its (N * H) x C
    view, the same quantization groups), ``a_src``, ``a_dst``, the CSR and its transpose, the
    statistics (2 x N_dst x H fp32) and the seed.

    A compressed ``x_src`` arrives as a matrix read by rows (`row_matrix`; in every step,
    ``reads_rows_every_step``, and in the sensitivity probe's work, ``reads_row_chunks``), and
    the backward kernels read its packed codes directly (`_kernel_features`): no dequantized
    N x H x C copy, the same values.
    """

    reads_row_chunks = True
    reads_rows_every_step = True

    @staticmethod
    @package_work  # grad is off in here: the forward's pointwise mode would rewrite nothing
    def forward(ctx, x_src, a_src, a_dst, rowptr, col, t_rowptr, t_col, t_pos, negative_slope,
                dropout, keep_lossless):  # fmt: skip
        from gact_graph.kernels import gat_edge, gat_rows

        check_edge_stage(x_src, rowptr, col, dropout, None)
        p, slope = float(dropout), float(negative_slope)
        seed = gat_rows.draw_seed(x_src.device) if p > 0 else None
        out_dtype = torch.promote_types(x_src.dtype, a_src.dtype)
        out, m, s = gat_edge.gat_edge_forward(
            x_src, a_src, a_dst, rowptr, col, slope, p, seed, out_dtype=out_dtype
        )
        if keep_lossless is not None:
            keep_lossless(m)
            keep_lossless(s)
        ctx.x_shape = x_src.shape
        ctx.save_for_backward(as_rows(x_src), a_src, a_dst, rowptr, col, t_rowptr, t_col, t_pos,
                              m, s, seed)  # fmt: skip
        ctx.negative_slope, ctx.dropout = slope, p
        return out

    @staticmethod
    @differentiable_once("the fused graph attention (sparse=True)")
    def backward(ctx, grad_out):
        from gact_graph.kernels import gat_edge

        with reading_rows(ctx._forward_cls.reads_rows_every_step):
            saved = ctx.saved_tensors
        x_src, a_src, a_dst, rowptr, col, t_rowptr, t_col, t_pos, m, s, seed = saved
        x_src = _kernel_features(x_src, ctx.x_shape)
        # (kept lossless: dense already)
        a_src, a_dst, m, s = _dense(a_src), _dense(a_dst), _dense(m), _dense(s)
        needs = tuple(ctx.needs_input_grad[:3])
        grad_x, grad_src, grad_dst = gat_edge.gat_edge_backward(
            grad_out, x_src, a_src, a_dst, rowptr, col, t_rowptr, t_col, t_pos, m, s,
            ctx.negative_slope, ctx.dropout, seed, needs=needs,
        )  # fmt: skip
        return grad_x, grad_src, grad_dst, None, None, None, None, None, None, None, None


def gat_attention_fused(
    x_src: Tensor,
    a_src: Tensor,
    a_dst: Tensor | None,
    rowptr: Tensor,
    col: Tensor,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    transpose: tuple[Tensor, Tensor, Tensor | None] | None = None,
    keep_lossless=None,
) -> Tensor:
    """`GatFusedFunction.apply` with keyword defaults; ``transpose`` = ``(t_rowptr, t_col,
    t_pos)`` (made here, per call, when None: callers with a cached adjacency pass its own)."""
    t_rowptr, t_col, t_pos = _transpose(transpose, rowptr, col, x_src.shape[0])
    return GatFusedFunction.apply(
        x_src, a_src, a_dst, rowptr, col, t_rowptr, t_col, t_pos, negative_slope, dropout,
        keep_lossless,
    )  # fmt: skip


class GatV2FusedFunction(torch.autograd.Function):
    """`GatV2AttentionFunction`'s edge stage on the fused Triton kernels (`GatFusedFunction`'s
    counterpart): ``forward(x_l, x_r, att, rowptr, col, t_rowptr, t_col, t_pos,
    negative_slope, dropout, recompute_stats)``. Saves ``x_l``, ``x_r``, ``att``, the CSR and
    its transpose and the dropout seed; no E x H tensor (the chunked stage keeps its E x H
    logits). The softmax statistics are saved only where ``x_l`` and ``x_r`` come back
    bit-exact; with ``recompute_stats`` (a compressing controller, which hands back
    dequantized features whose logits differ from the forward's) backward recomputes them
    from what it is handed (one pass over the rows, no aggregation):
    coefficients from the forward's statistics and the dequantized logits would not sum to
    one, and in half precision their exponentials overflow.

    ``x_l`` and ``x_r`` are saved as their (N * H) x C views; the kernels read a compressed
    one's packed codes directly (``reads_rows_every_step``, ``reads_row_chunks``: in every
    step and in the sensitivity probe's work), as `GatFusedFunction` reads ``x_src``: neither
    is dequantized whole."""

    reads_row_chunks = True
    reads_rows_every_step = True

    @staticmethod
    @package_work  # grad is off in here: the forward's pointwise mode would rewrite nothing
    def forward(ctx, x_l, x_r, att, rowptr, col, t_rowptr, t_col, t_pos, negative_slope,
                dropout, recompute_stats):  # fmt: skip
        from gact_graph.kernels import gat_rows, gatv2_edge

        check_edge_stage(x_l, rowptr, col, dropout, None)
        p, slope = float(dropout), float(negative_slope)
        seed = gat_rows.draw_seed(x_l.device) if p > 0 else None
        out_dtype = torch.promote_types(x_l.dtype, att.dtype)
        out, m, s = gatv2_edge.gatv2_edge_forward(
            x_l, x_r, att, rowptr, col, slope, p, seed, out_dtype=out_dtype
        )
        if recompute_stats:
            m = s = None
        ctx.shapes = (x_l.shape, x_r.shape)
        rows_l = as_rows(x_l)
        rows_r = rows_l if x_r is x_l else as_rows(x_r)  # one tensor, saved once
        ctx.save_for_backward(rows_l, rows_r, att, rowptr, col, t_rowptr, t_col, t_pos, m, s,
                              seed)  # fmt: skip
        ctx.negative_slope, ctx.dropout = slope, p
        return out

    @staticmethod
    @differentiable_once("the fused graph attention (sparse=True)")
    def backward(ctx, grad_out):
        from gact_graph.kernels import gatv2_edge

        with reading_rows(ctx._forward_cls.reads_rows_every_step):
            x_l, x_r, att, rowptr, col, t_rowptr, t_col, t_pos, m, s, seed = ctx.saved_tensors
        m, s = _dense(m), _dense(s)  # (kept lossless: dense already)
        same = x_r is x_l
        x_l = _kernel_features(x_l, ctx.shapes[0])
        x_r = x_l if same else _kernel_features(x_r, ctx.shapes[1])
        if m is None:
            _, m, s = gatv2_edge.gatv2_edge_forward(
                x_l, x_r, att, rowptr, col, ctx.negative_slope, stats_only=True
            )
        grads = gatv2_edge.gatv2_edge_backward(
            grad_out, x_l, x_r, att, rowptr, col, t_rowptr, t_col, t_pos, m, s,
            ctx.negative_slope, ctx.dropout, seed, needs=tuple(ctx.needs_input_grad[:3]),
        )  # fmt: skip
        return (*grads, None, None, None, None, None, None, None, None)


def gatv2_attention_fused(
    x_l: Tensor,
    x_r: Tensor,
    att: Tensor,
    rowptr: Tensor,
    col: Tensor,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    transpose: tuple[Tensor, Tensor, Tensor | None] | None = None,
    recompute_stats: bool = False,
) -> Tensor:
    """`GatV2FusedFunction.apply` with keyword defaults (``transpose`` as in
    `gat_attention_fused`)."""
    t_rowptr, t_col, t_pos = _transpose(transpose, rowptr, col, x_l.shape[0])
    return GatV2FusedFunction.apply(
        x_l, x_r, att, rowptr, col, t_rowptr, t_col, t_pos, negative_slope, dropout,
        recompute_stats,
    )  # fmt: skip


def _dense(x: Tensor | None) -> Tensor | None:
    """``x``, dequantized whole if it is a compressed matrix read by rows (`row_matrix`)."""
    return x.dense() if x is not None and row_matrix(x) is not None else x


def _kernel_features(x: Tensor, shape: torch.Size):
    """What the fused kernels read of features saved by `as_rows` (N x H x C = ``shape``):
    the packed codes (`gat_rows.CodedFeatures`) of a compressed matrix read by rows whose
    codes they decode (a `QTensor` of 1 / 2 / 4 / 8 bits, any group layout), else a dense
    N x H x C tensor: the one handed back, or (another compressed kind) its dequantization."""
    from gact_graph.kernels import gat_rows

    q = row_matrix(x)
    if q is None:
        return x.reshape(shape)
    lay = getattr(q, "layout", None)
    readable = (
        not getattr(x, "transposed", False)
        and all(hasattr(q, a) for a in ("packed", "meta", "bits", "dtype"))
        and getattr(q, "bits", None) in (1, 2, 4, 8)
        and q.dtype in gat_rows.KERNEL_DTYPES
        and lay is not None and lay.num_groups > 0
        and (lay.rows, lay.cols) == (shape[0] * shape[1], shape[2])
    )  # fmt: skip
    if not readable:
        return x.dense().reshape(shape)
    return gat_rows.coded_features(q.packed, q.meta, q.bits, lay, q.dtype, shape[1])


def _transpose(transpose, rowptr: Tensor, col: Tensor, num_src: int):
    """``transpose`` (``(t_rowptr, t_col, t_pos)``), or the CSR's made now when it is None."""
    if transpose is not None:
        return transpose
    from gact_graph.kernels import gat_rows

    return gat_rows.csr_transpose(rowptr, col, num_src)


def adjacency_transpose(adj, dropout: float) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(t_rowptr, t_col, t_pos)`` of a cached adjacency (`CompactAdjacency.walk_transpose`,
    built on a graph's first step; ``t_pos`` passed only when dropout needs it)."""
    t_rowptr, t_col, t_pos = adj.walk_transpose()
    return t_rowptr, t_col, t_pos if dropout > 0 else None
