"""GATv2's attention edge stage, saving only node-level tensors for backward
(`GatV2AttentionFunction`: plain PyTorch, edge chunk by edge chunk; the CPU path and the
reference of the fused kernels).

GATv2 (``a(W x_i + W x_j)``) has no node-level logit decomposition: each logit costs a
chunk x H x C gather, so the logits are computed in edge chunks in forward, kept whole
(E x H) for the pass, and recomputed in chunks in backward; the softmax's statistics, the
coefficients and the logits' gradient are made a chunk at a time as in GAT's
(`gact_graph.sparse.gat`), and attention dropout is stock's draw
(`gact_graph.sparse.edge_chunks`). It saves only ``x_l``, ``x_r`` (N x H x C) and the
adjacency, but its backward is nonlinear in them: quantizing them biases its gradient (give
them more bits). It is differentiable once, as GAT's is.

Inside the sensitivity probe's work a compressed ``x_l`` or ``x_r`` is read in parts
(`gact_graph.sparse.coded_rows`), and `GatV2AttentionFunction.lean_backward_bytes` states
what its backward holds then, for the memory budget's bound on the probe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from gact_graph.sparse.amp import autocast_off
from gact_graph.sparse.coded_rows import (
    DestinationRows,
    SourceRows,
    codes_readable,
    destination_span_codes,
    reader_bytes,
)
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
    leaky_relu_slope,
    lean_chunk_size,
    segment_stats,
)
from gact_graph.switches import is_lean, package_work, reading_rows

__all__ = [
    "GatV2AttentionFunction",
    "gatv2_attention",
    "gatv2_attention_reference",
]


def _gatv2_logits(
    x_l: Tensor | SourceRows,
    x_r: DestinationRows,
    att: Tensor,
    chunks: EdgeChunks,
    negative_slope: float,
    chunk: int,
) -> Tensor:
    """logit[e] = <att, leaky_relu(x_l[src_e] + x_r[dst_e])> per head (E x H), gathered in
    chunks of ``chunk`` edges inside each of ``chunks``."""
    acc = acc_dtype(x_l.dtype)
    heads, channels = x_l.shape[1:]
    att = att.reshape(1, heads, channels).to(acc)
    logit = torch.empty(chunks.num_edges, heads, dtype=acc, device=x_l.device)
    for s, e, col_w, dst_w in chunks:
        for a in range(0, e - s, chunk):
            b = min(a + chunk, e - s)
            z = x_r.gather(s + a, dst_w[a:b]).to(acc)
            z.add_(x_l.index_select(0, col_w[a:b]))
            F.leaky_relu(z, negative_slope, inplace=True)
            torch.sum(z.mul_(att), dim=-1, out=logit[s + a : s + b])
            del z
    return logit


def _lean_gatv2_backward_bytes(
    num_src: int,
    num_dst: int,
    num_edges: int,
    heads: int,
    channels: int,
    l_dtype: torch.dtype,
    r_dtype: torch.dtype,
    att_dtype: torch.dtype,
    p: float,
    permuted: bool,
    chunk_bytes: int,
    need_l: bool,
    need_r: bool,
    need_att: bool,
    readers: tuple = (),
) -> int:
    """Upper bound of the bytes `GatV2AttentionFunction.backward` under `lean_backward`
    creates and holds at once (tensors it allocates, its outputs included; not its inputs),
    read off its code as `lean_gat_backward_bytes` is: the most over its phases, every
    tensor an edge-chunk iteration allocates counted as alive together. ``readers``: per
    input handed compressed and read in parts, ``(role, layout, span_codes)``
    (`reader_bytes`); the others are dense (the replay's noisy copy, or a tensor kept
    as it is). Per gather chunk of ``c`` edges and wide chunk of
    ``w = c * C`` (``H`` heads, ``a`` bytes per accumulated element, ``o`` per output
    element):

    - always: the readers' kept bytes (codes, per-row lo and scale), the destinations of a
      wide chunk and of the one before it, the marks of its rows, the chunk starts' tensors;
    - making the readers: the metadata's decoding, the source codes' unpacking, the gather
      chunks' bounds;
    - the logits (E x H, kept until the second pass): per gather the destination rows'
      gather, its accumulator copy (``z``), the source rows' gather added into it;
    - the softmax statistics (N_dst x H twice): per wide chunk the scores' copy and the
      gathered max, and the first loop's last copy;
    - the dropout draw: its ``o``-sized noise, the bool mask, the permuted mask;
    - the first pass: ``grad alpha`` (E x H), ``dot``, ``grad x_l`` (N_src x H x C); per
      wide chunk alpha (two w x H while made), the multiplier, ``beta``, and per gather the
      incoming gradient's gather with its accumulator copy and the source rows' gather with
      its copy, or ``alpha * grad alpha``;
    - the second pass: per wide chunk alpha and ``dot`` gathered;
    - the third pass: ``grad x_r`` (N_dst x H x C), ``grad att``; per gather ``z`` and either
      gather, or the leaky ReLU of ``z`` with the einsum's operand copies and result, or
      the slope and its bool mask;
    - at the end the outputs' copies in their input dtypes where they differ from ``a``,
      with the logits' gradient (the third pass's last view of it holds it).

    Zero-dimensional tensors (the multiplier of ``p == 1``) are covered by a fixed 1 KiB."""
    acc = acc_dtype(l_dtype)
    out_dtype = torch.promote_types(l_dtype, att_dtype)
    a, o = item_bytes(acc), item_bytes(out_dtype)
    li, ri, ti = item_bytes(l_dtype), item_bytes(r_dtype), item_bytes(att_dtype)
    h, hc = heads, heads * channels
    c = lean_chunk_size(num_edges, num_src, heads, channels, l_dtype, chunk_bytes)
    wide = max(1, c * channels)
    w = min(wide, num_edges)
    c = min(c, max(w, 1))
    n_wide = -(-num_edges // wide)
    n_gather = -(-num_edges // max(c, 1))

    # the two inputs' gathers: (kept, made, peak, result) per role
    src = (0, 0, c * hc * li, c * hc * li)
    dst = (0, 0, c * hc * ri, c * hc * ri)
    bounds = 0
    for role, lay, span in readers:
        if role == "source":
            src = reader_bytes(role, lay, c, h, channels, li, span)
        else:
            dst = reader_bytes(role, lay, c, h, channels, ri, span)
            bounds = 32 * n_gather  # the gather chunks' first and last edges and their rows
    kept = src[0] + dst[0]
    z = c * hc * a

    def to_acc(peak: int, result: int, size: int) -> int:  # a gather and its copy to ``a``
        return max(peak, result + z if size != a else 0)

    src_acc, dst_acc = to_acc(src[2], src[3], li), to_acc(dst[2], dst[3], ri)
    drawn = 0.0 < p < 1.0 and num_edges * h > 0
    mask = num_edges * h if drawn else 0
    logit = num_edges * h * a
    stats = 2 * num_dst * h * a
    index = 16 * w + 16 * (num_dst + 1) + 48 * n_wide
    att_acc = hc * a if ti != a else 0
    g_l = num_src * hc * a if need_l else 0
    g_r = num_dst * hc * a if need_r else 0
    g_att = hc * a if need_att else 0
    wh = w * h

    phases = [kept + max(dst[1], dst[0] + src[1]) + bounds + 48 * n_wide]
    phases.append(kept + logit + att_acc + index + max(dst_acc, z + src[2]))
    # the first loop's last scores stay bound through the second loop's copy and gather
    phases.append(kept + logit + stats + index + 3 * wh * a)
    if drawn:
        phases.append(kept + logit + stats + num_edges * h * (o + 1 + int(permuted)))
    g_out = c * hc * (o + (a if o != a else 0))
    inner = max(g_out, z + src_acc, wh * a)
    it = max(2 * wh * a, wh * a + (wh * o if drawn else 0) + (wh * a if drawn and need_l else 0)
             + inner)  # fmt: skip
    g_alpha = logit + num_dst * h * a  # grad alpha (E x H) and dot
    phases.append(kept + logit + stats + mask + g_alpha + g_l + index + it)
    phases.append(kept + logit + stats + g_alpha + g_l + index + 2 * wh * a)
    att_work = 2 * z + c * h * a + hc * a if need_att else 0
    it = max(dst_acc, z + src[2], z + att_work, z + z + c * hc)
    phases.append(kept + logit + g_l + g_r + g_att + att_acc + index + it)
    ends = (
        (num_src * hc * li if need_l and l_dtype != acc else 0)
        + (num_dst * hc * ri if need_r and r_dtype != acc else 0)
        + (hc * ti if need_att and att_dtype != acc else 0)
    )
    # the third pass's last view of the logits' gradient keeps it (E x H) to the end
    phases.append(kept + logit + g_l + g_r + g_att + index + ends)
    return max(phases) + 1024


class GatV2AttentionFunction(torch.autograd.Function):
    """The edge stage of `GATv2Conv` on a destination-sorted CSR.

    ``forward(x_l, x_r, att, rowptr, col, negative_slope, dropout, perm, chunk_bytes)``:
    ``x_l`` N_src x H x C (source, also the message), ``x_r`` N_dst x H x C, ``att`` 1 x H x C;
    ``dropout`` and ``perm`` as in `GatAttentionFunction`. Returns ``out[i] = sum_j
    dropout(softmax_j(<att, leaky_relu(x_l[j] + x_r[i])>)) * x_l[j]``. Saves ``x_l``, ``x_r``,
    ``att``, ``rowptr``, ``col``, ``perm`` and the generator state of the draw.

    The logits cost a chunk x H x C gather each, so they are made once per pass and kept
    whole (E x H); the softmax's per-destination max and sum, the coefficients and (in
    backward) the logits' gradient are made a chunk at a time as in `GatAttentionFunction`.
    What it holds at once: the logits, the dropout's bool keep-mask and, in backward, one more
    E x H tensor (the coefficients' gradient, then the logits' in its place).

    ``x_l`` and ``x_r`` are saved as their (N * H) x C views (the same quantization groups
    as N x H x C), so that inside the sensitivity probe's work (`reads_row_chunks`) a
    compressed one arrives as a matrix it reads in parts: ``x_r`` a gather chunk's rows at a
    time (`DestinationRows`), ``x_l`` from its unpacked codes (`SourceRows`, a quarter of an
    fp32 copy). That backward, which the probe runs on top of the user's, then holds no
    dequantized copy of either; its edge chunks are smaller there too (`chunking`). A plain
    step's backward is handed dense copies (``reads_rows_every_step`` off): reading in parts
    costs CPU time that the copy's memory, one input's, does not repay there.
    """

    reads_row_chunks = True
    reads_rows_every_step = False

    @staticmethod
    @package_work  # grad is off in here: the forward's pointwise mode would rewrite nothing
    def forward(ctx, x_l, x_r, att, rowptr, col, negative_slope, dropout, perm, chunk_bytes):
        check_edge_stage(x_l, rowptr, col, dropout, perm)
        num_edges, num_dst = col.numel(), rowptr.numel() - 1
        heads = x_l.shape[1]
        acc = acc_dtype(x_l.dtype)
        if x_r.dim() != 3 or x_r.shape[1:] != x_l.shape[1:] or x_r.shape[0] != num_dst:
            raise ValueError(
                f"x_r must be N_dst x H x C = {(num_dst, *x_l.shape[1:])}, got {tuple(x_r.shape)}"
            )
        chunk, wide = chunking(x_l, rowptr, col, chunk_bytes)
        rows_r = DestinationRows(x_r, rowptr, *x_l.shape[1:])
        logit = _gatv2_logits(x_l, rows_r, att, wide, negative_slope, chunk)
        del rows_r
        m, total = segment_stats(_kept(logit), wide, num_dst, heads, acc, x_l.device)
        out_dtype = torch.promote_types(x_l.dtype, att.dtype)  # PyG's alpha and message
        mask, state = attention_dropout(dropout, num_edges, heads, out_dtype, x_l.device, perm)
        out = aggregate(
            x_l, _kept_softmax(logit, m, total), mask, dropout, out_dtype, wide, chunk, num_dst,
        )  # fmt: skip
        del mask

        # (N * H) x C views where they are views (see the class docstring); one tensor when
        # x_l is x_r (shared weights), saved once
        same = x_r is x_l
        num_src, l_dtype, r_dtype = x_l.shape[0], x_l.dtype, x_r.dtype
        if x_l.is_contiguous():
            x_l = x_l.view(-1, x_l.shape[-1])
        if same:
            x_r = x_l
        elif x_r.is_contiguous():
            x_r = x_r.view(-1, x_r.shape[-1])
        ctx.save_for_backward(x_l, x_r, att, rowptr, col, perm, state)
        ctx.negative_slope = float(negative_slope)
        ctx.dropout = float(dropout)
        ctx.chunk_bytes = int(chunk_bytes)
        # what `lean_backward_bytes` reads (the saved tensors themselves would be unpacked);
        # the CSR's row starts (the adjacency's own tensor, no copy) give the destination
        # rows a gather chunk spans
        ctx.shapes = (
            num_src, num_dst, num_edges, heads, x_l.shape[-1], l_dtype, r_dtype, att.dtype,
            perm is not None,
        )  # fmt: skip
        ctx.rowptr = rowptr
        return out.to(out_dtype)

    @staticmethod
    def lean_backward_bytes(ctx, layouts=(), walk: bool = False) -> int | None:
        """An upper bound of the bytes `backward` run under `lean_backward` creates and holds
        at once (its outputs included, its saved inputs and ``grad_out`` not) in the sensitivity
        probe's work (`gact_graph.budget.probe_cost`), ``layouts`` the group layouts of the
        compressed inputs the node read (`gact_graph.core.quantize.QTensor.layout`), in the
        order it read them: in a replay of one of them (``walk`` false) that one is handed as
        the replay's dense copy and the other, if compressed, handed compressed and read in
        parts (`reads_row_chunks`); in the probe's walk through the node (``walk``) every
        compressed one is. At any code width; the most over which input is replayed and
        which role (source or destination) a compressed one may have (its rows tell, where
        the node counts differ). None where a layout read in parts is not one `RowCodes` reads
        (the backward would dequantize it whole) or more than two are compressed.
        `_lean_gatv2_backward_bytes` derives it from the code of `backward`."""
        num_src, num_dst, num_edges, heads, channels, l_dtype, r_dtype, att_dtype, permuted = (
            ctx.shapes
        )
        layouts = list(layouts)
        parts = layouts if walk or len(layouts) == 2 else []  # those read in parts
        if len(layouts) > 2 or not all(map(codes_readable, parts)):
            return None
        chunk = lean_chunk_size(num_edges, num_src, heads, channels, l_dtype, ctx.chunk_bytes)

        def roles(lay) -> list:  # what reading ``lay`` in parts can be
            out = []
            if lay.rows == num_src * heads:
                out.append(("source", lay, 0))
            if lay.rows == num_dst * heads:
                span = destination_span_codes(ctx.rowptr, num_edges, chunk, heads, lay)
                out.append(("destination", lay, span))
            return out

        if any(not roles(lay) for lay in parts):
            return None
        if walk:  # every compressed input read in parts, in any assignment of the roles
            options = [()] if not layouts else [(r,) for r in roles(layouts[0])]
            if len(layouts) == 2:
                options = [
                    (a, b) for a in roles(layouts[0]) for b in roles(layouts[1]) if a[0] != b[0]
                ]
        else:  # one replayed (dense), the other (either) read in parts
            options = [()] + [(r,) for lay in parts for r in roles(lay)]
        if not options:  # two compressed reads that cannot be one source, one destination
            return None
        need = tuple(ctx.needs_input_grad[:3])
        args = (num_src, num_dst, num_edges, heads, channels, l_dtype, r_dtype, att_dtype,
                ctx.dropout, permuted, ctx.chunk_bytes, *need)  # fmt: skip
        return max(_lean_gatv2_backward_bytes(*args, readers=r) for r in options)

    @staticmethod
    @differentiable_once("the fused graph attention (sparse=True)")
    def backward(ctx, grad_out):
        with reading_rows(ctx._forward_cls.reads_rows_every_step):
            x_l, x_r, att, rowptr, col, perm, state = ctx.saved_tensors
        need_l, need_r, need_att = ctx.needs_input_grad[:3]
        num_edges, num_dst = col.numel(), rowptr.numel() - 1
        heads, channels = att.shape[-2:]
        acc = acc_dtype(x_l.dtype)
        slope, p = ctx.negative_slope, ctx.dropout
        # compressed ones stay so: read a gather chunk at a time
        rows_r = DestinationRows(x_r, rowptr, heads, channels)
        x_l = SourceRows(x_l, heads, channels)
        del x_r
        chunk, wide = chunking(x_l, rowptr, col, ctx.chunk_bytes, lean=is_lean())
        rows_r.bounds(chunk)
        logit = _gatv2_logits(x_l, rows_r, att, wide, slope, chunk)
        m, total = segment_stats(_kept(logit), wide, num_dst, heads, acc, x_l.device)
        out_dtype = torch.promote_types(x_l.dtype, att.dtype)
        mask, _ = attention_dropout(p, num_edges, heads, out_dtype, x_l.device, perm, state)

        # Pass 1 (chunk x H x C): x_l's gradient through the message, the coefficients'.
        grad_l, grad_s, dot = aggregate_backward(
            [x_l], grad_out, _kept_softmax(logit, m, total), mask, p, out_dtype, acc, wide,
            chunk, num_dst, True, need_l,
        )  # fmt: skip
        del mask
        # Pass 2 (chunk x H): grad logit = (grad alpha - dot[dst]) * alpha, in grad_s's place.
        for s, e, _, dst_w in wide:
            alpha = _chunk_softmax(logit, s, e, dst_w, m, total)
            grad_s[s:e].sub_(dot.index_select(0, dst_w)).mul_(alpha)
            del alpha
        del logit, dot, m, total
        grad_logit = grad_s

        # Pass 3 (chunk x H x C): through <att, leaky_relu(x_l[src] + x_r[dst])>.
        grad_r = grad_att = None
        att_acc = att.reshape(1, heads, channels).to(acc)
        if need_r:
            grad_r = torch.zeros(rows_r.shape, dtype=acc, device=rows_r.device)
        if need_att:
            grad_att = torch.zeros(heads, channels, dtype=acc, device=att.device)
        if need_l or need_r or need_att:
            for s, e, col_w, dst_w in wide:
                for a in range(0, e - s, chunk):
                    b = min(a + chunk, e - s)
                    z = rows_r.gather(s + a, dst_w[a:b]).to(acc)
                    z.add_(x_l.index_select(0, col_w[a:b]))
                    gl = grad_logit[s + a : s + b]
                    if need_att:
                        # grad att[h, c] += sum_e grad_logit[e, h] * leaky_relu(z)[e, h, c]; a
                        # backward() inside autocast would run this bmm in bf16/fp16 (amp.py)
                        with autocast_off(z.device):
                            grad_att += torch.einsum("eh,ehc->hc", gl, F.leaky_relu(z, slope))
                    # grad z = grad_logit * att * leaky_relu'(z), reusing z's buffer.
                    slope_of_z = leaky_relu_slope(z, slope, acc)
                    torch.mul(gl.unsqueeze(-1), att_acc, out=z)
                    z.mul_(slope_of_z)
                    del slope_of_z
                    if grad_l is not None:
                        grad_l.index_add_(0, col_w[a:b], z)
                    if grad_r is not None:
                        grad_r.index_add_(0, dst_w[a:b], z)
                    del z
        del grad_logit, grad_s
        if grad_l is not None:
            grad_l = grad_l.to(x_l.dtype).view(x_l.shape)
        if grad_r is not None:
            grad_r = grad_r.to(rows_r.dtype)
        if grad_att is not None:
            grad_att = grad_att.reshape(att.shape).to(att.dtype)
        return grad_l, grad_r, grad_att, None, None, None, None, None, None


def _kept(scores: Tensor):
    """`segment_stats`'s ``scores`` for scores kept whole: a copy of each chunk's rows."""
    return lambda s, e, col, dst: scores[s:e].clone()


def _kept_softmax(scores: Tensor, m: Tensor, total: Tensor):
    """`aggregate`'s ``coefficients`` from scores kept whole and `segment_stats`."""
    return lambda s, e, col, dst: _chunk_softmax(scores, s, e, dst, m, total)


def _chunk_softmax(scores: Tensor, s: int, e: int, dst: Tensor, m: Tensor, total: Tensor):
    """Softmax coefficients of edges ``s:e`` from their kept scores and `segment_stats`."""
    return (scores[s:e] - m.index_select(0, dst)).exp_().div_(total.index_select(0, dst))


def gatv2_attention(
    x_l: Tensor,
    x_r: Tensor,
    att: Tensor,
    rowptr: Tensor,
    col: Tensor,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    perm: Tensor | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Tensor:
    """`GatV2AttentionFunction.apply` with keyword defaults."""
    return GatV2AttentionFunction.apply(
        x_l, x_r, att, rowptr, col, negative_slope, dropout, perm, chunk_bytes
    )


def gatv2_attention_reference(
    x_l: Tensor,
    x_r: Tensor,
    att: Tensor,
    rowptr: Tensor,
    col: Tensor,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    seed: int | None = None,
) -> Tensor:
    """Stock-autograd oracle of `gatv2_attention` (materializes E x H x C; tests only)."""
    dst = csr_destinations(rowptr, col.numel())
    z = F.leaky_relu(x_l[col] + x_r[dst], negative_slope)
    logit = (z * att.reshape(1, *x_l.shape[1:])).sum(-1)
    return attend_reference(logit, x_l, col, dst, rowptr.numel() - 1, dropout, seed)
