"""GAT's attention edge stage, saving only node-level tensors for backward.

Stock PyG `GATConv` gathers ``x_j = x'[src]`` (E x H x C) and multiplies it by the attention
coefficients; autograd keeps that gather, the coefficients and the softmax intermediates alive
until backward. On an ogbn-arxiv-sized graph this edge-level state is most of what a 3-layer GAT
saves. Here the whole edge stage (logits, leaky-ReLU, segment softmax, attention dropout and
the weighted aggregation) is one `torch.autograd.Function`, `GatAttentionFunction`, that saves

- the projected features ``x'`` (N x H x C; the controller compresses it like any activation),
- the per-node logits ``a_src = <x'_i, att_src>``, ``a_dst = <x'_i, att_dst>`` (N x H, small;
  the patcher asks the controller to keep them lossless, since a softmax of quantized logits
  would be far off),
- the destination-sorted CSR adjacency (shared by every layer, stored once),
- for attention dropout: the state of the default generator before the draw (a few KiB),
  from which backward regenerates the mask (`gact_graph.sparse.edge_chunks`: the draw is
  stock's).

Backward recomputes the edge logits, the softmax and the dropout mask, and runs the
gather-multiply-scatter in chunks of edges, so no E x H x C tensor ever exists. Its edge-level
(E x H) quantities are made a chunk at a time too, from the softmax's per-destination max and
sum, so it holds no E x H tensor but the dropout's bool keep-mask and, in backward, the
coefficients' gradient.

**Why the logits come from the layer's input.** Stock computes ``a_src = <W h_i, att_src>``
from the projected features ``x' = W h``. Here that would multiply two uses of the one
quantized ``x'`` in the gradient of ``att_src`` (``sum_i grad_a_src[i] * x'_i``, where
``grad_a_src`` itself is linear in the quantized ``x'`` through the aggregation): its
expectation gains the rounding variance of ``x'`` and the gradient is biased (the statistic
of tests/benchmarks/test_scale_deep.py; figures in docs/design.md). The patcher
(`gact_graph.sparse.gat_convs`) computes the same logits as ``h @ (W^T att)``: ``h`` is the
projection's own saved input, rounded independently of ``x'`` (or exact), so every gradient is
a product of independent unbiased factors. Same values up to float rounding, no extra saved
tensor but the H x F_in matrix ``W^T att``. A `GATConv` whose projection is not a bias-free
``Linear`` (replaced by the user) takes PyG's path.

GAT's backward is linear in the saved ``x'`` (the softmax comes from the lossless logits), so
with stochastic rounding its gradient stays unbiased. It is differentiable once: a
``create_graph=True`` backward raises at once, naming the settings that support it
(`differentiable_once`).

Under autocast the Functions of this module, `gatv2` and `gat_fused` behave like PyG's edge
stage, which holds no op that autocast lowers: the projections arrive in bf16/fp16 from
autocast's ``Linear``, the logits and the softmax are computed in fp32 and the output promotes
like PyG's ``alpha * x_j`` (fp32). A ``backward()`` called inside the autocast region runs in
the same dtypes (`gact_graph.sparse.amp`).

Where the rest of the attention lives: `edge_chunks` (the chunk machinery and the dropout
draw, shared with GATv2), `gatv2` (GATv2's edge stage), `coded_rows` (compressed features
read in parts), `gat_fused` (the fused Triton Functions), `gat_convs` (how a `GATConv` or
`GATv2Conv` is routed through them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from gact_graph.sparse.coded_rows import SourceRows, as_rows, codes_readable, reader_bytes
from gact_graph.sparse.differentiable_once import differentiable_once
from gact_graph.sparse.edge_chunks import (
    DEFAULT_CHUNK_BYTES,
    EdgeChunks,
    acc_dtype,
    aggregate,
    aggregate_backward,
    attend_reference,
    attention_dropout,
    check_edge_stage,
    chunking,
    csr_destinations,
    item_bytes,
    leaky_relu_backward_,
    lean_chunk_size,
    segment_stats,
)
from gact_graph.switches import is_lean, package_work, reading_rows

__all__ = [
    "GatAttentionFunction",
    "gat_attention",
    "gat_attention_reference",
    "lean_gat_backward_bytes",
]


def _gat_logits(
    a_src: Tensor, a_dst: Tensor | None, col: Tensor, dst: Tensor, acc: torch.dtype
) -> Tensor:
    logit = a_src.index_select(0, col).to(acc)
    if a_dst is not None:
        logit = logit.add_(a_dst.index_select(0, dst).to(acc))
    return logit


def _softmax_stats(a_src, a_dst, chunks: EdgeChunks, num_dst: int, slope: float, acc):
    """`segment_stats` of GAT's leaky-ReLU'd logits, made from the node logits per chunk."""
    return segment_stats(
        lambda s, e, col, dst: F.leaky_relu(_gat_logits(a_src, a_dst, col, dst, acc), slope),
        chunks, num_dst, a_src.shape[1], acc, a_src.device,
    )  # fmt: skip


def _chunk_alpha(a_src, a_dst, col, dst, m, total, slope: float, acc, keep_pre: bool = False):
    """Softmax coefficients of one edge chunk from `_softmax_stats` (and the logits before
    the shift, for the leaky ReLU's slope, when ``keep_pre``)."""
    logit = _gat_logits(a_src, a_dst, col, dst, acc)
    pre = F.leaky_relu(logit, slope)
    alpha = pre.sub_(m.index_select(0, dst)).exp_().div_(total.index_select(0, dst))
    return (alpha, logit) if keep_pre else alpha


def lean_gat_backward_bytes(
    num_src: int,
    num_dst: int,
    num_edges: int,
    heads: int,
    channels: int,
    x_dtype: torch.dtype,
    src_dtype: torch.dtype,
    dst_dtype: torch.dtype | None,
    p: float,
    permuted: bool,
    chunk_bytes: int,
    need_x: bool,
    need_src: bool,
    need_dst: bool,
    features=None,
) -> int:
    """Upper bound of the bytes `GatAttentionFunction.backward` under `lean_backward` creates
    and holds at once (tensors it allocates, its outputs included; not its inputs), read off
    its code: the most over its phases of what each phase can hold, every tensor a loop
    iteration allocates counted as alive together. ``features``: the layout of a compressed
    ``x_src`` read in parts (`SourceRows` through `RowCodes`, as the probe's walk hands it), or
    None for a dense one (the replay's noisy copy). Per wide chunk of ``w`` edges (the lean
    chunks of `chunking`; ``H`` heads, ``a`` bytes per accumulated element, ``o`` per output
    element):

    - reading ``x_src`` in parts (`reader_bytes`, as GATv2's source): making the
      reader first, then its codes and per-row ``lo`` / ``scale`` kept until the coefficients'
      pass ends (the features' pass too where the logits need no gradient: the reader is
      released when the passes return), and a gather's decoding in place of the dense gather;
    - always: ``m`` and ``total`` (N_dst x H), the destinations of the chunk and of the one
      before it while the next is made (two int64 ``w``-vectors), the marks of its rows (two
      int64 vectors of at most N_dst + 1), the chunk starts' tensors (three of two int64 per
      wide chunk); the coefficients of a chunk (`_chunk_alpha`: the gathered node logits,
      their accumulator copies where the dtype differs, the leaky ReLU's output, the gathered
      max and sum: ``T``);
    - the dropout draw (before the passes): its ``o``-sized noise, the bool mask, the permuted
      mask; later the bool mask alone;
    - the coefficients' pass (when the logits need a gradient; under `lean_backward` apart
      from the features' pass): ``grad alpha`` (E x H) and ``dot``; per chunk alpha, the
      dropout multiplier, ``alpha * grad alpha``, and the two chunk x H x C gathers (incoming
      gradient and features) with their accumulator copies;
    - the features' pass (when ``x_src`` needs one): ``grad x_src`` (N_src x H x C), and per
      chunk alpha, the multiplier, their product, and the incoming gradient's gather;
    - the logits' pass: both logit gradients, and per chunk alpha, the logits, ``dot``
      gathered, the logits' gradient, the leaky ReLU's slope and its bool mask;
    - at the end the outputs' copies in their input dtypes where they differ from ``a``.

    Zero-dimensional tensors (the multiplier of ``p == 1``) are covered by a fixed 1 KiB."""
    out_dtype = torch.promote_types(x_dtype, src_dtype)
    acc = acc_dtype(out_dtype)
    a, o = item_bytes(acc), item_bytes(out_dtype)
    xi, si = item_bytes(x_dtype), item_bytes(src_dtype)
    di = 0 if dst_dtype is None else item_bytes(dst_dtype)
    need_logits = need_src or need_dst
    chunk = lean_chunk_size(num_edges, num_src, heads, channels, x_dtype, chunk_bytes)
    wide = max(1, chunk * channels)
    w = min(wide, num_edges)
    c = min(chunk, w)
    n_wide = -(-num_edges // wide)
    h, hc = heads, heads * channels

    def copy(dtype: torch.dtype | None) -> int:  # an accumulator copy's bytes, if one is made
        return a if dtype is not None and dtype != acc else 0

    stats = 2 * num_dst * h * a
    index = 16 * w + 16 * (num_dst + 1) + 48 * n_wide
    alpha_t = w * h * (si + copy(src_dtype) + di + copy(dst_dtype) + 3 * a)
    drawn = 0.0 < p < 1.0 and num_edges * h > 0
    mask = num_edges * h if drawn else 0
    # the features' reader: (kept, made, a gather's peak, its result)
    kept, made, gather, result = 0, 0, c * hc * xi, c * hc * xi
    if features is not None:
        kept, made, gather, result = reader_bytes("source", features, c, h, channels, xi, 0)
    features_gather = max(gather, result + copy(x_dtype))
    phases = [made + 48 * n_wide, kept + stats + index + alpha_t]
    if drawn:
        phases.append(kept + stats + num_edges * h * (o + 1 + int(permuted)))
    g_alpha = (num_edges * h + num_dst * h) * a if need_logits else 0
    g_x = num_src * hc * a if need_x else 0
    g_logits = (num_src * h if need_src else 0) * a + (num_dst * h if need_dst else 0) * a
    grad_gather = c * hc * (o + copy(out_dtype))
    if need_logits:
        it = w * h * (2 * a + o) + grad_gather + features_gather
        phases.append(kept + stats + mask + g_alpha + index + max(alpha_t, it))
        it = 4 * w * h * a + w * h
        phases.append(stats + mask + g_alpha + g_x + g_logits + index + max(alpha_t, it))
    if need_x:
        it = w * h * (a + o + max(a, o)) + grad_gather
        held = 0 if need_logits else kept  # split from the coefficients' pass, or not
        phases.append(held + stats + mask + g_alpha + g_x + index + max(alpha_t, it))
    ends = (
        (num_src * hc * xi if need_x and x_dtype != acc else 0)
        + (num_src * h * si if need_src and src_dtype != acc else 0)
        + (num_dst * h * di if need_dst and dst_dtype != acc else 0)
    )
    phases.append(stats + g_alpha + g_x + g_logits + ends)
    return max(phases) + 1024


class GatAttentionFunction(torch.autograd.Function):
    """The edge stage of `GATConv` on a destination-sorted CSR.

    ``forward(x_src, a_src, a_dst, rowptr, col, negative_slope, dropout, perm, chunk_bytes)``:
    ``x_src`` N_src x H x C projected source features, ``a_src`` N_src x H and ``a_dst``
    N_dst x H (or None) node logits, ``rowptr`` (N_dst + 1) and ``col`` (E, source of each edge)
    the CSR, ``dropout`` the attention-dropout probability (0 outside training), drawn as
    stock's ``F.dropout`` on the default generator in the edge order that ``perm`` (CSR position
    -> stock position, or None for CSR order) gives. Returns N_dst x H x C: ``out[i] = sum_j
    dropout(softmax_j(leaky_relu(a_src[j] + a_dst[i]))) * x_src[j]``. Saves ``x_src``,
    ``a_src``, ``a_dst``, ``rowptr``, ``col``, ``perm`` and the generator state of the draw.

    Every edge-level quantity is made one edge chunk at a time from node-level ones (the
    softmax's per-destination max and sum, then each chunk's coefficients), so the only
    E x H tensors are the dropout's keep-mask (bool) and, in backward, the coefficients'
    gradient (between the two passes the softmax's backward needs): at ogbn-products' size
    every E x H fp32 tensor is over a GiB (docs/design.md).

    ``x_src`` is saved as its (N * H) x C view where it is one (the same quantization groups
    as N x H x C), so that inside the sensitivity probe's work (`reads_row_chunks`) a
    compressed one arrives as a matrix it reads in parts: gathered from its unpacked codes
    (`SourceRows`, a quarter of an fp32 copy) and released after the coefficients' pass
    under `lean_backward`. That backward, which the probe runs on top of the user's, then
    holds no dequantized copy of it. A plain step's backward is handed a dense copy
    (``reads_rows_every_step`` off), as GATv2's is: reading in parts costs CPU time that one
    input's copy does not repay there.
    """

    reads_row_chunks = True
    reads_rows_every_step = False

    @staticmethod
    @package_work  # grad is off in here: the forward's pointwise mode would rewrite nothing
    def forward(ctx, x_src, a_src, a_dst, rowptr, col, negative_slope, dropout, perm, chunk_bytes):
        check_edge_stage(x_src, rowptr, col, dropout, perm)
        num_edges, num_dst = col.numel(), rowptr.numel() - 1
        heads = x_src.shape[1]
        # PyG's alpha and message alpha * x_j promote (bf16 features, fp32 logits: fp32).
        out_dtype = torch.promote_types(x_src.dtype, a_src.dtype)
        acc = acc_dtype(out_dtype)
        slope = float(negative_slope)
        chunk, wide = chunking(x_src, rowptr, col, chunk_bytes)
        m, total = _softmax_stats(a_src, a_dst, wide, num_dst, slope, acc)
        mask, state = attention_dropout(dropout, num_edges, heads, out_dtype, x_src.device, perm)
        out = aggregate(
            x_src, lambda s, e, col_w, dst_w: _chunk_alpha(
                a_src, a_dst, col_w, dst_w, m, total, slope, acc
            ), mask, dropout, out_dtype, wide, chunk, num_dst,
        )  # fmt: skip
        del mask

        # the (N * H) x C view where it is one (see the class docstring)
        ctx.save_for_backward(as_rows(x_src), a_src, a_dst, rowptr, col, perm, state)
        ctx.negative_slope = slope
        ctx.dropout = float(dropout)
        ctx.chunk_bytes = int(chunk_bytes)
        # what `lean_backward_bytes` reads (the saved tensors themselves would be unpacked)
        ctx.shapes = (
            x_src.shape[0], num_dst, num_edges, heads, x_src.shape[2], x_src.dtype,
            a_src.dtype, None if a_dst is None else a_dst.dtype, perm is not None,
        )  # fmt: skip
        return out.to(out_dtype)

    @staticmethod
    def lean_backward_bytes(ctx, layouts=(), walk: bool = False) -> int | None:
        """An upper bound of the bytes `backward` run under `lean_backward` creates and holds
        at once (its outputs included, its saved inputs and ``grad_out`` not), from the shapes
        the forward recorded, in the sensitivity probe's work (`gact_graph.budget.probe_cost`),
        ``layouts`` the group layouts of the compressed inputs the node read: in a replay
        (``walk`` false) the replayed input is handed as the replay's dense copy; in the
        probe's walk through the node (``walk``) a compressed ``x_src`` is handed as a matrix
        read in parts (`reads_row_chunks`, `SourceRows`). None where ``layouts`` holds more
        than one (the replay of one would dequantize another whole inside the node), and in
        the walk where the one is not ``x_src``'s (N * H) x C matrix in a layout `RowCodes`
        reads (the backward would dequantize it whole). `lean_gat_backward_bytes` derives
        it from the code of `backward`."""
        layouts = list(layouts)
        if len(layouts) > 1:
            return None
        num_src, num_dst, num_edges, heads, channels, x_dtype, src_dtype, dst_dtype, permuted = (
            ctx.shapes
        )
        features = layouts[0] if walk and layouts else None  # read in parts
        if walk and layouts and not codes_readable(features):
            return None
        if features is not None and (features.rows, features.cols) != (num_src * heads, channels):
            return None
        need_x, need_src, need_dst = ctx.needs_input_grad[:3]
        return lean_gat_backward_bytes(
            num_src, num_dst, num_edges, heads, channels, x_dtype, src_dtype, dst_dtype,
            ctx.dropout, permuted, ctx.chunk_bytes, need_x, need_src, need_dst, features,
        )  # fmt: skip

    @staticmethod
    @differentiable_once("the fused graph attention (sparse=True)")
    def backward(ctx, grad_out):
        with reading_rows(ctx._forward_cls.reads_rows_every_step):
            x_src, a_src, a_dst, rowptr, col, perm, state = ctx.saved_tensors
        need_x, need_src, need_dst = ctx.needs_input_grad[:3]
        need_logits = need_src or need_dst
        num_edges, num_dst = col.numel(), rowptr.numel() - 1
        heads, channels = ctx.shapes[3:5]
        # a compressed x_src stays so: gathered from its unpacked codes (`SourceRows`)
        x_src = SourceRows(x_src, heads, channels)
        out_dtype = torch.promote_types(x_src.dtype, a_src.dtype)
        acc = acc_dtype(out_dtype)
        slope, p = ctx.negative_slope, ctx.dropout
        # as in forward, or smaller under `lean_backward` (the probe's work)
        chunk, wide = chunking(x_src, rowptr, col, ctx.chunk_bytes, lean=is_lean())
        m, total = _softmax_stats(a_src, a_dst, wide, num_dst, slope, acc)
        mask, _ = attention_dropout(p, num_edges, heads, out_dtype, x_src.device, perm, state)
        x_dtype = x_src.dtype

        # Pass 1 over the edges (chunk x H x C): the features' gradient and the coefficients'.
        features = [x_src]  # the reader's only reference: ``split`` releases it
        del x_src
        grad_x, grad_alpha, dot = aggregate_backward(
            features, grad_out,
            lambda s, e, col_w, dst_w: _chunk_alpha(
                a_src, a_dst, col_w, dst_w, m, total, slope, acc
            ),
            mask, p, out_dtype, acc, wide, chunk, num_dst, need_logits, need_x, split=is_lean(),
        )  # fmt: skip
        del mask

        # Pass 2 (chunk x H): grad logit = (grad alpha - dot[dst]) * alpha * leaky_relu'.
        grad_a_src = grad_a_dst = None
        if need_logits:
            if need_src:
                grad_a_src = torch.zeros(a_src.shape, dtype=acc, device=a_src.device)
            if need_dst:
                grad_a_dst = torch.zeros(a_dst.shape, dtype=acc, device=a_dst.device)
            for s, e, col_c, dst_c in wide:
                alpha, logit = _chunk_alpha(
                    a_src, a_dst, col_c, dst_c, m, total, slope, acc, keep_pre=True
                )
                gl = (grad_alpha[s:e] - dot.index_select(0, dst_c)).mul_(alpha)
                leaky_relu_backward_(gl, logit, slope)
                del alpha, logit
                if grad_a_src is not None:
                    grad_a_src.index_add_(0, col_c, gl)
                if grad_a_dst is not None:
                    grad_a_dst.index_add_(0, dst_c, gl)
                del gl
            del grad_alpha, dot
            if grad_a_src is not None:
                grad_a_src = grad_a_src.to(a_src.dtype)
            if grad_a_dst is not None:
                grad_a_dst = grad_a_dst.to(a_dst.dtype)
        if grad_x is not None:
            grad_x = grad_x.to(x_dtype)
        return grad_x, grad_a_src, grad_a_dst, None, None, None, None, None, None


def gat_attention(
    x_src: Tensor,
    a_src: Tensor,
    a_dst: Tensor | None,
    rowptr: Tensor,
    col: Tensor,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    perm: Tensor | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Tensor:
    """`GatAttentionFunction.apply` with keyword defaults."""
    return GatAttentionFunction.apply(
        x_src, a_src, a_dst, rowptr, col, negative_slope, dropout, perm, chunk_bytes
    )


def gat_attention_reference(
    x_src: Tensor,
    a_src: Tensor,
    a_dst: Tensor | None,
    rowptr: Tensor,
    col: Tensor,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    perm: Tensor | None = None,
) -> Tensor:
    """Stock-autograd oracle of `gat_attention` (materializes E x H x C; tests only)."""
    dst = csr_destinations(rowptr, col.numel())
    logit = a_src[col] if a_dst is None else a_src[col] + a_dst[dst]
    logit = F.leaky_relu(logit, negative_slope)
    return attend_reference(logit, x_src, col, dst, rowptr.numel() - 1, dropout, perm)
