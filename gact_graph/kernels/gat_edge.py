"""GAT's and GATv2's edge stages as fused Triton kernels over a destination-sorted CSR, and
their references.

The edge stage of a GAT layer, per destination ``d``, head ``h`` and channel ``c``::

    pre[e, h]   = a_src[src_e, h] + a_dst[d, h]                     (e an edge into d)
    alpha[e, h] = softmax over the edges into d of leaky_relu(pre[e, h])
    out[d, h, c] = sum_e alpha[e, h] * r[e, h] * x[src_e, h, c]

with ``r`` the attention-dropout multiplier (``keep / (1 - p)``, or 1 without dropout). The
softmax is PyG's: ``exp(l - max) / (sum exp(l - max) + 1e-16)``.

**Forward** (`_gat_edge_fwd_kernel`): one program per block of ``ROWS`` destination rows and
one head; each row's edges are read ``BLOCK_E`` at a time with an online max and sum (the
FlashAttention pattern on a sparse row), so every edge is read once and nothing edge-level is
written. It writes ``out`` and the per-(row, head) statistics ``m`` (the max) and ``s`` (the
sum plus 1e-16), from which backward recomputes every coefficient as ``exp(l - m) / s``.

**Attention dropout** is drawn in the kernels with Triton's Philox (`tl.rand`) from a seed
(an int64 one-element tensor, read in the kernel: no host sync) and the counter ``k * H + h``
of CSR edge ``k`` and head ``h``. Backward regenerates it bit for bit; no mask is stored.
`gat_edge_dropout_keep` materializes the same mask (tests and debugging).

**Backward**, given ``dO``: with ``g[e] = r[e] * <dO[d], x[src_e]>`` (per head), the gradient of
the coefficients, the softmax's backward is ``dl[e] = alpha[e] * (g[e] - D[d])`` with
``D[d] = sum_e alpha[e] * g[e]``, which equals ``<dO[d], out[d]>`` (``out`` already holds the
dropout multiplier, the softmax's Jacobian acts on the undropped alpha), and the logit's
gradient is ``dpre = dl * leaky_relu'(pre)``. Two kernels, neither with atomics:

- `_gat_edge_bwd_dst_kernel` walks the CSR rows: ``D[d]`` and ``grad a_dst[d] = sum_e dpre``
  (from the three sums ``sum alpha g``, ``sum alpha g slope``, ``sum alpha slope``, one pass;
  ``D`` is computed from the edges rather than from a saved ``out``, which the library would
  otherwise have to keep: N x H x C more saved per layer);
- `_gat_edge_bwd_src_kernel` walks the transpose's rows (for each source, its outgoing edges
  with their destinations and CSR positions): ``grad x[s] = sum_e alpha r dO[d]`` and
  ``grad a_src[s] = sum_e dpre``, recomputing alpha, ``r`` and ``g`` per edge.

**GATv2** (`_gatv2_edge_*`): the logits are ``<att[h], leaky_relu(x_l[src] + x_r[d])>``; the
same structure, with ``x_l`` both the logits' input and the message (one gather per edge
forward). Backward's row pass makes ``D``, ``grad x_r[d] = att * sum_e dl leaky_relu'(z)`` and
``grad att = sum_e dl leaky_relu(z)`` from running sums in one pass (``dl = alpha (g - D)``
expands into sums weighted by ``alpha g`` and by ``alpha``); it runs a fixed number of
programs per head, each over a stride of rows, so that ``grad att`` is summed per program into
a small P x H x C buffer instead of with atomics. The transpose pass makes ``grad x_l``.

No E x H x C and no E x H tensor exists in either direction. Everything accumulates in fp32;
offsets into N x H x C tensors are int64.

**Features read from their codes.** The backward kernels and GATv2's statistics pass take
their node features dense or as `CodedFeatures`: the quantizer's packed codes and per-group
metadata of the (N * H) x C matrix (any `GroupLayout`), decoded per element in the kernel
(`_decode`) to the very value the dequantized copy holds, so no N x H x C copy is made
(the sensitivity probe's backwards hand their compressed features so,
`gact_graph.sparse.gat_fused._kernel_features`).

**Blocking** (edges per block, rows per program, warps) is chosen lazily per kernel, head
count, width, dtype and a coarse degree bucket (the mean degree ``E / N`` rounded to a power of
two, from the shapes alone), timed once on CUDA and cached; never keyed on exact node or edge
counts, so mini-batches do not re-tune. Under Triton's CPU interpreter, and with
``GACT_GRAPH_GAT_TUNE=0``, the first candidate is used untimed.

`gat_edge_reference` and `gatv2_edge_reference` are the stock-autograd oracles (they
materialize E x H x C; tests only), taking the dropout keep-mask explicitly.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
from torch import Tensor

from gact_graph.kernels.layout import GroupLayout

try:  # Triton is optional; the reference below never needs it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

__all__ = [
    "CodedFeatures",
    "KERNEL_DTYPES",
    "aggregate_reference",
    "coded_features",
    "csr_transpose",
    "degree_bucket",
    "draw_seed",
    "edge_softmax_reference",
    "gat_edge_backward",
    "gat_edge_dropout_keep",
    "gat_edge_forward",
    "gat_edge_reference",
    "gatv2_edge_backward",
    "gatv2_edge_forward",
    "gatv2_edge_reference",
]

#: Feature dtypes the kernels take (they accumulate in fp32; float64 stays on the PyTorch path).
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: PyG's softmax adds this to the sum of exponentials.
SOFTMAX_EPS = 1e-16


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError("the fused GAT edge kernels need Triton: pip install triton")


# ---------------------------------------------------------------------------- kernels
if triton is not None:

    @triton.jit
    def _dropout_multiplier(seed, k, h, H, p, drop_scale):
        """``keep / (1 - p)`` of CSR edges ``k`` (int64) at head ``h``: Philox at counter
        ``k * H + h``."""
        u = tl.rand(seed, k * H + h)
        return tl.where(u >= p, drop_scale, 0.0)

    @triton.jit
    def _program(seed_ptr, C, DROPOUT: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_C: tl.constexpr):  # fmt: skip
        """What every program starts from: its head (the grid's second axis), the offsets of
        an edge block and of the channels, the channel mask, and the dropout seed (read once;
        unused without dropout)."""
        offs_c = tl.arange(0, BLOCK_C)
        seed = tl.zeros((), tl.int64)
        if DROPOUT:
            seed = tl.load(seed_ptr)
        return tl.program_id(1), tl.arange(0, BLOCK_E), offs_c, offs_c < C, seed

    @triton.jit
    def _row(rowptr_ptr, pid, r, num_rows, offs_c, cmask, ROWS: tl.constexpr):
        """Row ``r`` of program ``pid``'s block of ``ROWS`` rows (int64), whether it exists,
        the channel mask of its stores and its edge range ``[start, end)``."""
        row = pid.to(tl.int64) * ROWS + r
        live = row < num_rows
        # (a scalar-and-block `&` fails in Triton's interpreter: broadcast the row first)
        row_c = cmask & ((offs_c * 0 + row) < num_rows)
        start = tl.load(rowptr_ptr + row, mask=live, other=0)
        end = tl.load(rowptr_ptr + row + 1, mask=live, other=0)
        return row, live, row_c, start, end

    @triton.jit
    def _gather(ptr, nodes, h, HC, C, offs_c, emask, cmask):
        """Rows ``nodes`` (one per edge of a block) of an N x H x C tensor at head ``h``, as an
        fp32 edges x channels tile, zero where an edge or channel is masked off."""
        return tl.load(
            ptr + nodes[:, None] * HC + h * C + offs_c[None, :],
            mask=emask[:, None] & cmask[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip

    @triton.jit
    def _load_row(ptr, row, h, HC, C, offs_c, mask):
        """Row ``row`` of an N x H x C tensor at head ``h``, in fp32 (zero where masked)."""
        return tl.load(ptr + row * HC + h * C + offs_c, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _decode(packed_ptr, meta_ptr, r, c, mask, C, qk, qn, qg, BITS: tl.constexpr,
                ROUND: tl.constexpr):  # fmt: skip
        """Element ``(r, c)`` (int64 rows ``r`` and channels ``c``, broadcast) of a quantized
        (N * H) x C matrix read from its packed codes, as fp32: the value its dequantization
        holds (`decode_codes_`: ``code * scale + lo``, the product exact), rounded to the
        features' dtype (``ROUND``: 0 fp32, 1 bf16, 2 fp16) and back, so that it equals the
        dequantized copy's element bit for bit. The layout (`GroupLayout`): ``qk`` rows per
        group, ``qn`` groups per row, ``qg`` elements per group; element ``(r, c)`` lies in
        group ``(r // qk) * qn + c // qg`` at position ``(r % qk) * C + c % qg``, its code at
        bit ``(group * qg + position) * BITS`` of the packed bytes (little-endian in a byte)."""
        grp = (r // qk) * qn + c // qg
        bit = (grp * qg + (r % qk) * C + c % qg) * BITS
        byte = tl.load(packed_ptr + (bit >> 3), mask=mask, other=0).to(tl.int32)
        code = (byte >> (bit & 7).to(tl.int32)) & ((1 << BITS) - 1)
        # the group's bf16 (lo, scale) pair as one little-endian word (`decode_meta`)
        word = tl.load(meta_ptr + grp, mask=mask, other=0).to(tl.uint32, bitcast=True)
        lo16 = word & 0xFFFF
        sc16 = word >> 16
        const = (sc16 & 0x8000) != 0
        b0 = tl.where(const, (lo16 << 16) | ((sc16 & 0x7FFF) << 1), lo16 << 16)
        lo = b0.to(tl.float32, bitcast=True)
        scale = tl.where(
            const,
            (b0 | 1).to(tl.float32, bitcast=True) - lo,
            (sc16 << 16).to(tl.float32, bitcast=True),
        )
        val = code.to(tl.float32) * scale + lo  # the product is exact: one rounding
        if ROUND == 1:
            # to bf16, round to nearest even on the bits (Triton's interpreter truncates a
            # cast), NaN canonical as torch's; back to fp32 by the same bits
            vb = val.to(tl.uint32, bitcast=True)
            vb = ((vb + 0x7FFF + ((vb >> 16) & 1)) >> 16) << 16
            vb = tl.where(val != val, 0x7FC00000, vb)
            val = vb.to(tl.float32, bitcast=True)
        elif ROUND == 2:  # fp16: clamped to its range as `decode_codes_` does, NaN kept
            val = tl.minimum(tl.maximum(val, -65504.0, tl.PropagateNan.ALL), 65504.0,
                             tl.PropagateNan.ALL)  # fmt: skip
            val = val.to(tl.float16).to(tl.float32)
        return tl.where(mask, val, 0.0)

    @triton.jit
    def _gather_features(ptr, meta_ptr, nodes, h, H, C, offs_c, emask, cmask, qk, qn, qg,
                         BITS: tl.constexpr, ROUND: tl.constexpr):  # fmt: skip
        """`_gather` of node features that are dense (``BITS == 0``) or quantized codes
        (``ptr`` the packed bytes, ``meta_ptr`` the groups' metadata words; `_decode`)."""
        # if / else, not an early return: Triton compiles what follows a return in a
        # constexpr branch too, and `_decode` does not compile for dense 16-bit features
        if BITS == 0:
            val = _gather(ptr, nodes, h, H * C, C, offs_c, emask, cmask)
        else:
            r = nodes * H + h
            val = _decode(ptr, meta_ptr, r[:, None], offs_c[None, :],
                          emask[:, None] & cmask[None, :], C, qk, qn, qg, BITS, ROUND)  # fmt: skip
        return val

    @triton.jit
    def _feature_row(ptr, meta_ptr, row, h, H, C, offs_c, mask, qk, qn, qg,
                     BITS: tl.constexpr, ROUND: tl.constexpr):  # fmt: skip
        """`_load_row` of node features that are dense or quantized codes, as
        `_gather_features`."""
        if BITS == 0:  # (if / else as in `_gather_features`)
            val = _load_row(ptr, row, h, H * C, C, offs_c, mask)
        else:
            val = _decode(ptr, meta_ptr, offs_c * 0 + (row * H + h), offs_c, mask, C, qk, qn,
                          qg, BITS, ROUND)  # fmt: skip
        return val

    @triton.jit
    def _transposed_multiplier(seed, t_pos_ptr, j, emask, h, H, p, drop_scale,
                               HAS_POS: tl.constexpr):  # fmt: skip
        """The dropout multiplier of the transpose's edges ``j``: drawn at their CSR positions
        (``t_pos``, or ``j`` itself where the two orders agree)."""
        k = j
        if HAS_POS:
            k = tl.load(t_pos_ptr + j, mask=emask, other=0).to(tl.int64)
        return _dropout_multiplier(seed, k, h, H, p, drop_scale)

    @triton.jit(do_not_specialize=["p", "drop_scale"])
    def _gat_edge_fwd_kernel(
        x_ptr, a_src_ptr, a_dst_ptr, rowptr_ptr, col_ptr, seed_ptr,
        out_ptr, m_ptr, s_ptr,
        num_rows, H, C, slope, p, drop_scale,
        HAS_DST: tl.constexpr, DROPOUT: tl.constexpr,
        ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        h, offs_e, offs_c, cmask, seed = _program(seed_ptr, C, DROPOUT, BLOCK_E, BLOCK_C)
        HC = H * C
        for r in range(ROWS):
            row, live, row_c, start, end = _row(rowptr_ptr, pid, r, num_rows, offs_c, cmask, ROWS)
            if HAS_DST:
                ad = tl.load(a_dst_ptr + row * H + h, mask=live, other=0.0).to(tl.float32)
            else:
                ad = 0.0
            m = tl.full((), float("-inf"), tl.float32)
            s = tl.zeros((), tl.float32)
            acc = tl.zeros((BLOCK_C,), tl.float32)
            for e0 in range(start, end, BLOCK_E):
                k = e0 + offs_e
                emask = k < end
                src = tl.load(col_ptr + k, mask=emask, other=0).to(tl.int64)
                pre = tl.load(a_src_ptr + src * H + h, mask=emask, other=0.0).to(tl.float32)
                pre = pre + ad
                lrelu = tl.where(pre > 0, pre, pre * slope)
                lrelu = tl.where(emask, lrelu, float("-inf"))
                m_new = tl.maximum(m, tl.max(lrelu, 0))
                rescale = tl.exp(m - m_new)
                ex = tl.exp(lrelu - m_new)
                s = s * rescale + tl.sum(ex, 0)
                w = ex
                if DROPOUT:
                    w = w * _dropout_multiplier(seed, k, h, H, p, drop_scale)
                xv = _gather(x_ptr, src, h, HC, C, offs_c, emask, cmask)
                acc = acc * rescale + tl.sum(w[:, None] * xv, 0)
                m = m_new
            s = s + 1e-16
            tl.store(
                out_ptr + row * HC + h * C + offs_c,
                (acc / s).to(out_ptr.dtype.element_ty), mask=row_c,
            )  # fmt: skip
            tl.store(m_ptr + row * H + h, m, mask=live)
            tl.store(s_ptr + row * H + h, s, mask=live)

    @triton.jit(do_not_specialize=["p", "drop_scale"])
    def _gat_edge_bwd_dst_kernel(
        x_ptr, x_meta_ptr, a_src_ptr, a_dst_ptr, rowptr_ptr, col_ptr, seed_ptr, m_ptr, s_ptr,
        go_ptr, d_ptr, ga_dst_ptr,
        num_rows, H, C, slope, p, drop_scale, xk, xn, xg,
        HAS_DST: tl.constexpr, NEED_DST: tl.constexpr, DROPOUT: tl.constexpr,
        ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
        X_BITS: tl.constexpr, X_ROUND: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        h, offs_e, offs_c, cmask, seed = _program(seed_ptr, C, DROPOUT, BLOCK_E, BLOCK_C)
        HC = H * C
        for r in range(ROWS):
            row, live, row_c, start, end = _row(rowptr_ptr, pid, r, num_rows, offs_c, cmask, ROWS)
            if HAS_DST:
                ad = tl.load(a_dst_ptr + row * H + h, mask=live, other=0.0).to(tl.float32)
            else:
                ad = 0.0
            m = tl.load(m_ptr + row * H + h, mask=live, other=0.0)
            s = tl.load(s_ptr + row * H + h, mask=live, other=1.0)
            go = _load_row(go_ptr, row, h, HC, C, offs_c, row_c)
            sum_ag = tl.zeros((), tl.float32)
            sum_ag_slope = tl.zeros((), tl.float32)
            sum_a_slope = tl.zeros((), tl.float32)
            for e0 in range(start, end, BLOCK_E):
                k = e0 + offs_e
                emask = k < end
                src = tl.load(col_ptr + k, mask=emask, other=0).to(tl.int64)
                pre = tl.load(a_src_ptr + src * H + h, mask=emask, other=0.0).to(tl.float32)
                pre = pre + ad
                dslope = tl.where(pre > 0, 1.0, slope)
                alpha = tl.exp(pre * dslope - m) / s
                alpha = tl.where(emask, alpha, 0.0)
                xv = _gather_features(x_ptr, x_meta_ptr, src, h, H, C, offs_c, emask, cmask,
                                      xk, xn, xg, X_BITS, X_ROUND)  # fmt: skip
                g = tl.sum(xv * go[None, :], 1)
                if DROPOUT:
                    g = g * _dropout_multiplier(seed, k, h, H, p, drop_scale)
                ag = alpha * g
                sum_ag += tl.sum(ag, 0)
                sum_ag_slope += tl.sum(ag * dslope, 0)
                sum_a_slope += tl.sum(alpha * dslope, 0)
            tl.store(d_ptr + row * H + h, sum_ag, mask=live)
            if NEED_DST:
                grad = sum_ag_slope - sum_ag * sum_a_slope
                tl.store(
                    ga_dst_ptr + row * H + h, grad.to(ga_dst_ptr.dtype.element_ty), mask=live
                )

    @triton.jit(do_not_specialize=["p", "drop_scale"])
    def _gat_edge_bwd_src_kernel(
        x_ptr, x_meta_ptr, a_src_ptr, a_dst_ptr, t_rowptr_ptr, t_col_ptr, t_pos_ptr, seed_ptr,
        m_ptr, s_ptr, go_ptr, d_ptr,
        gx_ptr, ga_src_ptr,
        num_rows, H, C, slope, p, drop_scale, xk, xn, xg,
        HAS_DST: tl.constexpr, HAS_POS: tl.constexpr, NEED_X: tl.constexpr,
        NEED_SRC: tl.constexpr, DROPOUT: tl.constexpr,
        ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
        X_BITS: tl.constexpr, X_ROUND: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        h, offs_e, offs_c, cmask, seed = _program(seed_ptr, C, DROPOUT, BLOCK_E, BLOCK_C)
        HC = H * C
        for r in range(ROWS):
            # a source node and its outgoing edges
            row, live, row_c, start, end = _row(
                t_rowptr_ptr, pid, r, num_rows, offs_c, cmask, ROWS
            )
            a_s = tl.load(a_src_ptr + row * H + h, mask=live, other=0.0).to(tl.float32)
            xs = tl.zeros((BLOCK_C,), tl.float32)
            if NEED_SRC:  # (the features' gradient never reads the features)
                xs = _feature_row(x_ptr, x_meta_ptr, row, h, H, C, offs_c, row_c, xk, xn, xg,
                                  X_BITS, X_ROUND)  # fmt: skip
            gx = tl.zeros((BLOCK_C,), tl.float32)
            ga = tl.zeros((), tl.float32)
            for j0 in range(start, end, BLOCK_E):
                j = j0 + offs_e
                emask = j < end
                dst = tl.load(t_col_ptr + j, mask=emask, other=0).to(tl.int64)
                pre = a_s
                if HAS_DST:
                    pre = pre + tl.load(a_dst_ptr + dst * H + h, mask=emask, other=0.0).to(
                        tl.float32
                    )
                dslope = tl.where(pre > 0, 1.0, slope)
                m = tl.load(m_ptr + dst * H + h, mask=emask, other=0.0)
                s = tl.load(s_ptr + dst * H + h, mask=emask, other=1.0)
                alpha = tl.exp(pre * dslope - m) / s
                alpha = tl.where(emask, alpha, 0.0)
                go = _gather(go_ptr, dst, h, HC, C, offs_c, emask, cmask)
                beta = alpha
                if DROPOUT:
                    beta = alpha * _transposed_multiplier(
                        seed, t_pos_ptr, j, emask, h, H, p, drop_scale, HAS_POS
                    )
                if NEED_X:
                    gx += tl.sum(beta[:, None] * go, 0)
                if NEED_SRC:
                    g = tl.sum(go * xs[None, :], 1)
                    dd = tl.load(d_ptr + dst * H + h, mask=emask, other=0.0)
                    # alpha * (r * <dO, x> - D), with beta = alpha * r
                    ga += tl.sum((beta * g - alpha * dd) * dslope, 0)
            if NEED_X:
                tl.store(
                    gx_ptr + row * HC + h * C + offs_c,
                    gx.to(gx_ptr.dtype.element_ty), mask=row_c,
                )  # fmt: skip
            if NEED_SRC:
                tl.store(ga_src_ptr + row * H + h, ga.to(ga_src_ptr.dtype.element_ty), mask=live)

    @triton.jit(do_not_specialize=["p", "drop_scale"])
    def _gat_edge_keep_kernel(seed_ptr, keep_ptr, num_edges, H, p, drop_scale,
                              BLOCK: tl.constexpr):  # fmt: skip
        k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        h = tl.program_id(1)
        seed = tl.load(seed_ptr)
        mult = _dropout_multiplier(seed, k, h, H, p, drop_scale)
        tl.store(keep_ptr + k * H + h, (mult != 0).to(tl.int8), mask=k < num_edges)

    # ------------------------------------------------------------------------ GATv2
    @triton.jit(do_not_specialize=["p", "drop_scale"])
    def _gatv2_edge_fwd_kernel(
        xl_ptr, xl_meta_ptr, xr_ptr, xr_meta_ptr, att_ptr, rowptr_ptr, col_ptr, seed_ptr,
        out_ptr, m_ptr, s_ptr,
        num_rows, H, C, slope, p, drop_scale, lk, ln, lg, rk, rn, rg,
        DROPOUT: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
        BLOCK_C: tl.constexpr, STATS_ONLY: tl.constexpr,
        L_BITS: tl.constexpr, R_BITS: tl.constexpr, X_ROUND: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        h, offs_e, offs_c, cmask, seed = _program(
            seed_ptr, C, DROPOUT and not STATS_ONLY, BLOCK_E, BLOCK_C
        )
        HC = H * C
        att = tl.load(att_ptr + h * C + offs_c, mask=cmask, other=0.0).to(tl.float32)
        for r in range(ROWS):
            row, live, row_c, start, end = _row(rowptr_ptr, pid, r, num_rows, offs_c, cmask, ROWS)
            xr = _feature_row(xr_ptr, xr_meta_ptr, row, h, H, C, offs_c, row_c, rk, rn, rg,
                              R_BITS, X_ROUND)  # fmt: skip
            m = tl.full((), float("-inf"), tl.float32)
            s = tl.zeros((), tl.float32)
            acc = tl.zeros((BLOCK_C,), tl.float32)
            for e0 in range(start, end, BLOCK_E):
                k = e0 + offs_e
                emask = k < end
                src = tl.load(col_ptr + k, mask=emask, other=0).to(tl.int64)
                xl = _gather_features(xl_ptr, xl_meta_ptr, src, h, H, C, offs_c, emask, cmask,
                                      lk, ln, lg, L_BITS, X_ROUND)  # fmt: skip
                z = xl + xr[None, :]
                z = tl.where(z > 0, z, z * slope)
                logit = tl.sum(z * att[None, :], 1)
                logit = tl.where(emask, logit, float("-inf"))
                m_new = tl.maximum(m, tl.max(logit, 0))
                rescale = tl.exp(m - m_new)
                ex = tl.exp(logit - m_new)
                s = s * rescale + tl.sum(ex, 0)
                if not STATS_ONLY:
                    w = ex
                    if DROPOUT:
                        w = w * _dropout_multiplier(seed, k, h, H, p, drop_scale)
                    acc = acc * rescale + tl.sum(w[:, None] * xl, 0)
                m = m_new
            s = s + 1e-16
            if not STATS_ONLY:
                tl.store(
                    out_ptr + row * HC + h * C + offs_c,
                    (acc / s).to(out_ptr.dtype.element_ty), mask=row_c,
                )  # fmt: skip
            tl.store(m_ptr + row * H + h, m, mask=live)
            tl.store(s_ptr + row * H + h, s, mask=live)

    @triton.jit(do_not_specialize=["p", "drop_scale"])
    def _gatv2_edge_bwd_dst_kernel(
        xl_ptr, xl_meta_ptr, xr_ptr, xr_meta_ptr, att_ptr, rowptr_ptr, col_ptr, seed_ptr,
        m_ptr, s_ptr, go_ptr, d_ptr, gxr_ptr, gatt_part_ptr,
        num_rows, num_programs, H, C, slope, p, drop_scale, lk, ln, lg, rk, rn, rg,
        NEED_R: tl.constexpr, NEED_ATT: tl.constexpr, DROPOUT: tl.constexpr,
        BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
        L_BITS: tl.constexpr, R_BITS: tl.constexpr, X_ROUND: tl.constexpr,
    ):  # fmt: skip
        # A fixed number of programs per head, each walking rows pid, pid + P, ...: the
        # attention vector's gradient is summed per program (P x H x C partials), no atomics.
        pid = tl.program_id(0)
        h, offs_e, offs_c, cmask, seed = _program(seed_ptr, C, DROPOUT, BLOCK_E, BLOCK_C)
        HC = H * C
        att = tl.load(att_ptr + h * C + offs_c, mask=cmask, other=0.0).to(tl.float32)
        gatt = tl.zeros((BLOCK_C,), tl.float32)
        for row in range(pid.to(tl.int64), num_rows, num_programs):
            start = tl.load(rowptr_ptr + row)
            end = tl.load(rowptr_ptr + row + 1)
            m = tl.load(m_ptr + row * H + h)
            s = tl.load(s_ptr + row * H + h)
            go = _load_row(go_ptr, row, h, HC, C, offs_c, cmask)
            xr = _feature_row(xr_ptr, xr_meta_ptr, row, h, H, C, offs_c, cmask, rk, rn, rg,
                              R_BITS, X_ROUND)  # fmt: skip
            sum_ag = tl.zeros((), tl.float32)
            v1 = tl.zeros((BLOCK_C,), tl.float32)  # sum alpha g lrelu(z)
            v2 = tl.zeros((BLOCK_C,), tl.float32)  # sum alpha lrelu(z)
            w1 = tl.zeros((BLOCK_C,), tl.float32)  # sum alpha g lrelu'(z)
            w2 = tl.zeros((BLOCK_C,), tl.float32)  # sum alpha lrelu'(z)
            for e0 in range(start, end, BLOCK_E):
                k = e0 + offs_e
                emask = k < end
                src = tl.load(col_ptr + k, mask=emask, other=0).to(tl.int64)
                xl = _gather_features(xl_ptr, xl_meta_ptr, src, h, H, C, offs_c, emask, cmask,
                                      lk, ln, lg, L_BITS, X_ROUND)  # fmt: skip
                z = xl + xr[None, :]
                dz = tl.where(z > 0, 1.0, slope)
                lz = z * dz
                logit = tl.sum(lz * att[None, :], 1)
                alpha = tl.exp(logit - m) / s
                alpha = tl.where(emask, alpha, 0.0)
                g = tl.sum(xl * go[None, :], 1)
                if DROPOUT:
                    g = g * _dropout_multiplier(seed, k, h, H, p, drop_scale)
                ag = alpha * g
                sum_ag += tl.sum(ag, 0)
                if NEED_ATT:
                    v1 += tl.sum(ag[:, None] * lz, 0)
                    v2 += tl.sum(alpha[:, None] * lz, 0)
                if NEED_R:
                    w1 += tl.sum(ag[:, None] * dz, 0)
                    w2 += tl.sum(alpha[:, None] * dz, 0)
            tl.store(d_ptr + row * H + h, sum_ag)
            if NEED_ATT:
                gatt += v1 - sum_ag * v2
            if NEED_R:
                gxr = att * (w1 - sum_ag * w2)
                tl.store(
                    gxr_ptr + row * HC + h * C + offs_c, gxr.to(gxr_ptr.dtype.element_ty),
                    mask=cmask,
                )  # fmt: skip
        if NEED_ATT:
            tl.store(gatt_part_ptr + (pid.to(tl.int64) * H + h) * C + offs_c, gatt, mask=cmask)

    @triton.jit(do_not_specialize=["p", "drop_scale"])
    def _gatv2_edge_bwd_src_kernel(
        xl_ptr, xl_meta_ptr, xr_ptr, xr_meta_ptr, att_ptr, t_rowptr_ptr, t_col_ptr, t_pos_ptr,
        seed_ptr, m_ptr, s_ptr, go_ptr, d_ptr, gxl_ptr,
        num_rows, H, C, slope, p, drop_scale, lk, ln, lg, rk, rn, rg,
        HAS_POS: tl.constexpr, DROPOUT: tl.constexpr,
        ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
        L_BITS: tl.constexpr, R_BITS: tl.constexpr, X_ROUND: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        h, offs_e, offs_c, cmask, seed = _program(seed_ptr, C, DROPOUT, BLOCK_E, BLOCK_C)
        HC = H * C
        att = tl.load(att_ptr + h * C + offs_c, mask=cmask, other=0.0).to(tl.float32)
        for r in range(ROWS):
            # a source node and its outgoing edges
            row, live, row_c, start, end = _row(
                t_rowptr_ptr, pid, r, num_rows, offs_c, cmask, ROWS
            )
            xs = _feature_row(xl_ptr, xl_meta_ptr, row, h, H, C, offs_c, row_c, lk, ln, lg,
                              L_BITS, X_ROUND)  # fmt: skip
            gx = tl.zeros((BLOCK_C,), tl.float32)
            for j0 in range(start, end, BLOCK_E):
                j = j0 + offs_e
                emask = j < end
                dst = tl.load(t_col_ptr + j, mask=emask, other=0).to(tl.int64)
                xr = _gather_features(xr_ptr, xr_meta_ptr, dst, h, H, C, offs_c, emask, cmask,
                                      rk, rn, rg, R_BITS, X_ROUND)  # fmt: skip
                go = _gather(go_ptr, dst, h, HC, C, offs_c, emask, cmask)
                z = xs[None, :] + xr
                dz = tl.where(z > 0, 1.0, slope)
                logit = tl.sum(z * dz * att[None, :], 1)
                m = tl.load(m_ptr + dst * H + h, mask=emask, other=0.0)
                s = tl.load(s_ptr + dst * H + h, mask=emask, other=1.0)
                dd = tl.load(d_ptr + dst * H + h, mask=emask, other=0.0)
                alpha = tl.exp(logit - m) / s
                alpha = tl.where(emask, alpha, 0.0)
                beta = alpha
                if DROPOUT:
                    beta = alpha * _transposed_multiplier(
                        seed, t_pos_ptr, j, emask, h, H, p, drop_scale, HAS_POS
                    )
                g = tl.sum(go * xs[None, :], 1)
                dl = beta * g - alpha * dd  # alpha * (r <dO, x_l> - D)
                gx += tl.sum(beta[:, None] * go + dl[:, None] * dz * att[None, :], 0)
            tl.store(
                gxl_ptr + row * HC + h * C + offs_c, gx.to(gxl_ptr.dtype.element_ty),
                mask=row_c,
            )  # fmt: skip

# ---------------------------------------------------------------------------- blocking
#: (BLOCK_E, ROWS, num_warps) candidates, in the order `_candidates` takes them after its
#: default (always one of them).
_CANDIDATES = [(16, 1, 4), (32, 1, 4), (16, 4, 4), (64, 1, 4), (32, 2, 8)]
_TUNED: dict[tuple, tuple[int, int, int]] = {}
#: ``GACT_GRAPH_GAT_TUNE=0``: never time candidates, take the default blocking (each timed
#: candidate is one more compilation in a process's first steps).
TUNE = os.environ.get("GACT_GRAPH_GAT_TUNE", "1") != "0"


def degree_bucket(num_edges: int, num_rows: int) -> int:
    """The mean degree rounded up to a power of two (1..1024): a shape-only tuning key."""
    mean = num_edges / max(num_rows, 1)
    return 1 << min(10, max(0, math.ceil(math.log2(max(mean, 1.0)))))


def _candidates(bucket: int) -> list[tuple[int, int, int]]:
    """Blockings worth timing for a mean degree ``bucket``, the default first: no block four
    times wider than the mean row (mostly padding), and at most four in all (each one timed
    is one more compilation in the first steps)."""
    default = (max(16, min(64, triton.next_power_of_2(bucket))), 1, 4)
    rest = [c for c in _CANDIDATES if c != default and c[0] <= max(16, 4 * bucket)]
    return [default] + rest[:3]


def _blocking(key: tuple, bucket: int, run, device: torch.device, config=None, rows=True):
    """``config`` if given, else the cached or (on CUDA, outside graph capture) timed
    blocking for ``key``; ``run(config)`` launches the kernel. ``rows=False``: a kernel that
    ignores rows per program (candidates differing only there are timed once)."""
    if config is not None:
        return config
    hit = _TUNED.get(key)
    if hit is not None:
        return hit
    cands = _candidates(bucket)
    if not rows:
        cands = list(dict.fromkeys((c[0], 1, c[2]) for c in cands))
    if not TUNE or device.type != "cuda" or len(cands) == 1:
        return cands[0]
    if torch.cuda.is_current_stream_capturing():
        return cands[0]
    best, best_t = cands[0], float("inf")
    for c in cands:
        try:
            t = _time_ms(run, c)
        except triton.runtime.errors.OutOfResources:  # too large for this device: skip it
            continue
        if t < best_t:
            best, best_t = c, t
    _TUNED[key] = best
    return best


def _time_ms(run, config, reps: int = 3) -> float:
    """Mean milliseconds of ``run(config)`` after one warm-up call, with CUDA events only: no
    buffer of its own (`triton.testing.do_bench` flushes the cache with a 256 MiB tensor, which
    would land in the memory peak of the step that tunes)."""
    run(config)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run(config)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _dropout_args(p: float, seed: Tensor | None, device: torch.device):
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout must be in [0, 1], got {p}")
    dropout = p > 0.0
    if dropout and (seed is None or seed.dtype != torch.int64 or seed.numel() != 1):
        raise ValueError("attention dropout needs a one-element int64 seed tensor")
    drop_scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
    dummy = seed if dropout else torch.zeros(1, dtype=torch.int64, device=device)
    return dropout, drop_scale, dummy


class CodedFeatures(NamedTuple):
    """Node features (N x H x C) that the backward kernels (and GATv2's statistics pass) read
    from the quantizer's packed codes rather than from a dequantized copy (`coded_features`
    makes one). Every element they read is the value the dequantized copy would hold, bit for
    bit (`_decode`), so the results equal those of the kernels fed that copy."""

    packed: Tensor  #: uint8 codes of the (N * H) x C matrix, group after group
    meta: Tensor  #: int32 per group: bf16 ``lo`` in the low half, bf16 ``scale`` in the high
    bits: int
    layout: GroupLayout  #: of the (N * H) x C matrix
    shape: torch.Size  #: N x H x C
    dtype: torch.dtype  #: of the dequantized features

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def dim(self) -> int:
        return 3


def coded_features(packed: Tensor, meta: Tensor, bits: int, layout: GroupLayout,
                   dtype: torch.dtype, heads: int) -> CodedFeatures:  # fmt: skip
    """`CodedFeatures` of a quantized (N * H) x C matrix (a `QTensor`'s ``packed``, ``meta``
    (num_groups x 2 bf16), ``bits``, ``layout`` and ``dtype``), read as N x H x C. Any
    `GroupLayout` is read: groups of several whole rows, of one row, or of part of a row,
    padded or not."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"codes of 1, 2, 4 or 8 bits are read, got {bits!r}")
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"coded features must dequantize to one of {KERNEL_DTYPES}, got {dtype}")
    if heads < 1 or layout.rows % heads or layout.cols < 1 or layout.num_groups < 1:
        raise ValueError(
            f"a {layout.rows} x {layout.cols} quantized matrix is not (N * {heads}) x C"
        )
    if packed.dtype != torch.uint8 or packed.numel() < layout.packed_nbytes(bits):
        raise ValueError(
            f"packed codes must be uint8 of {layout.packed_nbytes(bits)} bytes for this layout"
        )
    if meta.shape != (layout.num_groups, 2) or meta.element_size() != 2:
        raise ValueError(f"meta must be {layout.num_groups} x 2 16-bit (lo, scale) pairs")
    words = meta.contiguous().view(torch.int16).view(torch.int32).reshape(-1)
    shape = torch.Size((layout.rows // heads, heads, layout.cols))
    return CodedFeatures(packed.reshape(-1), words, bits, layout, shape, dtype)


#: ``X_ROUND`` of the kernels: the dtype a dequantized element is rounded to.
_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _feature_args(x: Tensor | CodedFeatures) -> tuple:
    """``(data, metadata, (rows per group, groups per row, group size), bits, round)``: the
    kernels' arguments for features ``x``, dense (``bits`` 0; the metadata pointer unused) or
    `CodedFeatures`."""
    if isinstance(x, CodedFeatures):
        lay = x.layout
        layout = (lay.rows_per_group, lay.groups_per_row, lay.group_size)
        return x.packed, x.meta, layout, x.bits, _ROUND[x.dtype]
    x = x.contiguous()
    return x, x, (1, 1, 1), 0, 0


def _check(x: Tensor, a_src: Tensor, a_dst: Tensor | None, rowptr: Tensor, col: Tensor):
    if x.dim() != 3:
        raise ValueError(f"x must be N x H x C, got shape {tuple(x.shape)}")
    if x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"x must be one of {KERNEL_DTYPES}, got {x.dtype}")
    heads = x.shape[1]
    if a_src.shape != (x.shape[0], heads):
        raise ValueError(f"a_src must be {x.shape[0]} x {heads}, got {tuple(a_src.shape)}")
    if a_dst is not None and a_dst.shape != (rowptr.numel() - 1, heads):
        raise ValueError(
            f"a_dst must be {rowptr.numel() - 1} x {heads}, got {tuple(a_dst.shape)}"
        )
    if rowptr.dtype != torch.int64 or rowptr.dim() != 1 or col.dim() != 1:
        raise ValueError("rowptr must be 1-D int64 and col 1-D (destination-sorted CSR)")
    if col.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"col must be int32 or int64, got {col.dtype}")


def _check_transpose(t_rowptr: Tensor, t_col: Tensor, t_pos: Tensor | None, col: Tensor,
                     num_src: int) -> None:  # fmt: skip
    if t_rowptr.numel() != num_src + 1 or t_col.shape != col.shape:
        raise ValueError("the transpose must have N_src + 1 row pointers and E columns")
    if t_pos is not None and t_pos.shape != col.shape:
        raise ValueError("t_pos must hold one CSR position per edge")


# ---------------------------------------------------------------------------- launchers
def gat_edge_forward(
    x: Tensor,
    a_src: Tensor,
    a_dst: Tensor | None,
    rowptr: Tensor,
    col: Tensor,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    seed: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: tuple[int, int, int] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(out N_dst x H x C, m N_dst x H, s N_dst x H)``: the edge stage and its softmax
    statistics (fp32). ``x`` N_src x H x C, ``a_src`` N_src x H, ``a_dst`` N_dst x H or None;
    ``seed`` (one-element int64 tensor) draws the dropout when ``dropout > 0``; ``out_dtype``
    defaults to ``x``'s; ``config`` = (edges per block, rows per program, warps) skips tuning."""
    _require_triton()
    _check(x, a_src, a_dst, rowptr, col)
    num_dst = rowptr.numel() - 1
    _, heads, channels = x.shape
    x, a_src = x.contiguous(), a_src.contiguous()
    a_dst = a_dst.contiguous() if a_dst is not None else None
    drop, drop_scale, seed_t = _dropout_args(float(dropout), seed, x.device)
    out = torch.empty(num_dst, heads, channels, dtype=out_dtype or x.dtype, device=x.device)
    m = torch.empty(num_dst, heads, dtype=torch.float32, device=x.device)
    s = torch.empty(num_dst, heads, dtype=torch.float32, device=x.device)
    if num_dst == 0 or heads * channels == 0:
        return out.zero_(), m.fill_(float("-inf")), s.fill_(SOFTMAX_EPS)
    bucket = degree_bucket(col.numel(), num_dst)
    block_c = triton.next_power_of_2(channels)

    def run(cfg):
        block_e, rows, warps = cfg
        _gat_edge_fwd_kernel[(triton.cdiv(num_dst, rows), heads)](
            x, a_src, a_dst if a_dst is not None else a_src, rowptr, col, seed_t,
            out, m, s, num_dst, heads, channels, float(negative_slope), float(dropout),
            drop_scale, HAS_DST=a_dst is not None, DROPOUT=drop, ROWS=rows, BLOCK_E=block_e,
            BLOCK_C=block_c, num_warps=warps,
        )  # fmt: skip

    key = ("fwd", heads, channels, x.dtype, out.dtype, bucket, a_dst is not None, drop)
    run(_blocking(key, bucket, run, x.device, config))
    return out, m, s


def gat_edge_backward(
    grad_out: Tensor,
    x: Tensor,
    a_src: Tensor,
    a_dst: Tensor | None,
    rowptr: Tensor,
    col: Tensor,
    t_rowptr: Tensor,
    t_col: Tensor,
    t_pos: Tensor | None,
    m: Tensor,
    s: Tensor,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    seed: Tensor | None = None,
    needs: tuple[bool, bool, bool] = (True, True, True),
    config: tuple[int, int, int] | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(grad x, grad a_src, grad a_dst)`` (each None where ``needs`` says so) of
    `gat_edge_forward` from its statistics ``m``, ``s``. ``t_rowptr`` (N_src + 1), ``t_col``
    (destination of each edge) and ``t_pos`` (its CSR position, or None when the transpose
    lists the edges in CSR order) are the transpose, as `csr_transpose` makes it."""
    _require_triton()
    _check(x, a_src, a_dst, rowptr, col)
    need_x, need_src, need_dst = needs
    need_dst = need_dst and a_dst is not None
    num_dst, num_src = rowptr.numel() - 1, x.shape[0]
    _, heads, channels = x.shape
    _check_transpose(t_rowptr, t_col, t_pos, col, num_src)
    xd, xm, (xk, xn, xg), x_bits, x_round = _feature_args(x)
    a_src, grad_out = a_src.contiguous(), grad_out.contiguous()
    a_dst = a_dst.contiguous() if a_dst is not None else None
    drop, drop_scale, seed_t = _dropout_args(float(dropout), seed, x.device)
    dev = x.device
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=dev) if need_x else None
    grad_src = torch.empty_like(a_src) if need_src else None
    grad_dst = torch.empty_like(a_dst) if need_dst else None
    if heads * channels == 0:
        return tuple(None if g is None else g.zero_() for g in (grad_x, grad_src, grad_dst))
    bucket = degree_bucket(col.numel(), max(num_dst, 1))
    block_c = triton.next_power_of_2(channels)
    slope, p = float(negative_slope), float(dropout)
    a_dst_arg = a_dst if a_dst is not None else a_src
    d = torch.empty(num_dst, heads, dtype=torch.float32, device=dev)
    if (need_src or need_dst) and num_dst > 0:

        def run_dst(cfg):
            block_e, rows, warps = cfg
            _gat_edge_bwd_dst_kernel[(triton.cdiv(num_dst, rows), heads)](
                xd, xm, a_src, a_dst_arg, rowptr, col, seed_t, m, s, grad_out, d,
                grad_dst if need_dst else d, num_dst, heads, channels, slope, p, drop_scale,
                xk, xn, xg, HAS_DST=a_dst is not None, NEED_DST=need_dst, DROPOUT=drop,
                ROWS=rows, BLOCK_E=block_e, BLOCK_C=block_c, X_BITS=x_bits, X_ROUND=x_round,
                num_warps=warps,
            )  # fmt: skip

        key = ("bwd_dst", heads, channels, x.dtype, x_bits, grad_out.dtype, bucket, need_dst,
               drop)  # fmt: skip
        run_dst(_blocking(key, bucket, run_dst, dev, config))
    if (need_x or need_src) and num_src > 0:

        def run_src(cfg):
            block_e, rows, warps = cfg
            _gat_edge_bwd_src_kernel[(triton.cdiv(num_src, rows), heads)](
                xd, xm, a_src, a_dst_arg, t_rowptr, t_col,
                t_pos if t_pos is not None else t_col, seed_t, m, s, grad_out, d,
                grad_x if need_x else grad_out, grad_src if need_src else a_src,
                num_src, heads, channels, slope, p, drop_scale, xk, xn, xg,
                HAS_DST=a_dst is not None, HAS_POS=t_pos is not None, NEED_X=need_x,
                NEED_SRC=need_src, DROPOUT=drop, ROWS=rows, BLOCK_E=block_e, BLOCK_C=block_c,
                X_BITS=x_bits, X_ROUND=x_round, num_warps=warps,
            )  # fmt: skip

        key = ("bwd_src", heads, channels, x.dtype, x_bits, grad_out.dtype, bucket, need_x,
               need_src, drop)  # fmt: skip
        run_src(_blocking(key, bucket, run_src, dev, config))
    return grad_x, grad_src, grad_dst


def _check_v2(x_l: Tensor, x_r: Tensor, att: Tensor, rowptr: Tensor, col: Tensor) -> None:
    if x_l.dim() != 3 or x_r.dim() != 3 or x_l.shape[1:] != x_r.shape[1:]:
        raise ValueError(
            f"x_l and x_r must be N x H x C alike, got {tuple(x_l.shape)}, {tuple(x_r.shape)}"
        )
    if x_l.dtype not in KERNEL_DTYPES or x_r.dtype != x_l.dtype:
        raise ValueError(f"x_l and x_r must share one of {KERNEL_DTYPES}")
    if att.numel() != x_l.shape[1] * x_l.shape[2]:
        raise ValueError(f"att must hold H x C = {x_l.shape[1] * x_l.shape[2]} values")
    if x_r.shape[0] != rowptr.numel() - 1:
        raise ValueError("x_r must have one row per destination (rowptr's length - 1)")
    if rowptr.dtype != torch.int64 or rowptr.dim() != 1 or col.dim() != 1:
        raise ValueError("rowptr must be 1-D int64 and col 1-D (destination-sorted CSR)")
    if col.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"col must be int32 or int64, got {col.dtype}")


def _persistent_programs(device: torch.device, num_rows: int) -> int:
    """Programs per head of `_gatv2_edge_bwd_dst_kernel`: a few per multiprocessor (from the
    device alone, so the grid never depends on the graph beyond tiny ones)."""
    if device.type == "cuda":
        per_device = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        per_device = 4
    return max(1, min(per_device, num_rows))


def gatv2_edge_forward(
    x_l: Tensor,
    x_r: Tensor,
    att: Tensor,
    rowptr: Tensor,
    col: Tensor,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    seed: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: tuple[int, int, int] | None = None,
    stats_only: bool = False,
) -> tuple[Tensor | None, Tensor, Tensor]:
    """GATv2's edge stage: ``(out, m, s)`` as `gat_edge_forward`, with the logits
    ``<att[h], leaky_relu(x_l[src, h] + x_r[dst, h])>``; ``x_l`` N_src x H x C (also the
    message), ``x_r`` N_dst x H x C, ``att`` H x C values (PyG's 1 x H x C). ``stats_only``
    computes ``m`` and ``s`` alone (``out`` is None): backward's statistics when the saved
    ``x_l`` / ``x_r`` are not the forward's bits (compressed), so that the coefficients it
    recomputes from them are a softmax that sums to one."""
    _require_triton()
    _check_v2(x_l, x_r, att, rowptr, col)
    num_dst = rowptr.numel() - 1
    _, heads, channels = x_l.shape
    ld, lm, l_layout, l_bits, x_round = _feature_args(x_l)
    rd, rm, r_layout, r_bits, _ = _feature_args(x_r)
    att = att.contiguous()
    drop, drop_scale, seed_t = _dropout_args(float(dropout), seed, x_l.device)
    m = torch.empty(num_dst, heads, dtype=torch.float32, device=x_l.device)
    s = torch.empty(num_dst, heads, dtype=torch.float32, device=x_l.device)
    out = None
    if not stats_only:
        out_dtype = out_dtype or x_l.dtype
        out = torch.empty(num_dst, heads, channels, dtype=out_dtype, device=x_l.device)
    if num_dst == 0 or heads * channels == 0:
        return (None if out is None else out.zero_()), m.fill_(float("-inf")), s.fill_(SOFTMAX_EPS)
    bucket = degree_bucket(col.numel(), num_dst)
    block_c = triton.next_power_of_2(channels)

    def run(cfg):
        block_e, rows, warps = cfg
        _gatv2_edge_fwd_kernel[(triton.cdiv(num_dst, rows), heads)](
            ld, lm, rd, rm, att, rowptr, col, seed_t, m if out is None else out, m, s, num_dst,
            heads, channels, float(negative_slope), float(dropout), drop_scale, *l_layout,
            *r_layout, DROPOUT=drop, ROWS=rows, BLOCK_E=block_e, BLOCK_C=block_c,
            STATS_ONLY=stats_only, L_BITS=l_bits, R_BITS=r_bits, X_ROUND=x_round,
            num_warps=warps,
        )  # fmt: skip

    key = ("v2_fwd", heads, channels, x_l.dtype, l_bits, r_bits, out_dtype, bucket, drop,
           stats_only)  # fmt: skip
    run(_blocking(key, bucket, run, x_l.device, config))
    return out, m, s


def gatv2_edge_backward(
    grad_out: Tensor,
    x_l: Tensor,
    x_r: Tensor,
    att: Tensor,
    rowptr: Tensor,
    col: Tensor,
    t_rowptr: Tensor,
    t_col: Tensor,
    t_pos: Tensor | None,
    m: Tensor,
    s: Tensor,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    seed: Tensor | None = None,
    needs: tuple[bool, bool, bool] = (True, True, True),
    config: tuple[int, int, int] | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(grad x_l, grad x_r, grad att)`` of `gatv2_edge_forward` (None where ``needs`` says
    so), from its statistics; the transpose as in `gat_edge_backward`. With ``g = r <dO[d],
    x_l[src]>``, ``D[d] = sum alpha g`` and ``dl = alpha (g - D)``: grad att ``= sum_e dl
    leaky_relu(z_e)``, grad x_r[d] ``= att * sum_e dl leaky_relu'(z_e)`` (a pass over the CSR
    rows, the attention vector's sum per program, then summed), grad x_l[s] ``= sum_e alpha r
    dO[d] + att * dl leaky_relu'(z_e)`` (a pass over the transpose's rows)."""
    _require_triton()
    _check_v2(x_l, x_r, att, rowptr, col)
    need_l, need_r, need_att = needs
    num_dst, num_src = rowptr.numel() - 1, x_l.shape[0]
    _, heads, channels = x_l.shape
    _check_transpose(t_rowptr, t_col, t_pos, col, num_src)
    ld, lm, l_layout, l_bits, x_round = _feature_args(x_l)
    rd, rm, r_layout, r_bits, _ = _feature_args(x_r)
    att, grad_out = att.contiguous(), grad_out.contiguous()
    drop, drop_scale, seed_t = _dropout_args(float(dropout), seed, x_l.device)
    dev = x_l.device
    grad_l = torch.empty(x_l.shape, dtype=x_l.dtype, device=dev) if need_l else None
    grad_r = torch.empty(x_r.shape, dtype=x_r.dtype, device=dev) if need_r else None
    grad_att = None
    if heads * channels == 0 or not (need_l or need_r or need_att):
        if need_att:
            grad_att = torch.zeros_like(att)
        return tuple(None if g is None else g.zero_() for g in (grad_l, grad_r)) + (grad_att,)
    bucket = degree_bucket(col.numel(), max(num_dst, 1))
    block_c = triton.next_power_of_2(channels)
    slope, p = float(negative_slope), float(dropout)
    d = torch.zeros(num_dst, heads, dtype=torch.float32, device=dev)
    programs = _persistent_programs(dev, num_dst)
    part = torch.zeros(programs, heads, channels, dtype=torch.float32, device=dev)
    if num_dst > 0:

        def run_dst(cfg):
            block_e, _, warps = cfg
            _gatv2_edge_bwd_dst_kernel[(programs, heads)](
                ld, lm, rd, rm, att, rowptr, col, seed_t, m, s, grad_out, d,
                grad_r if need_r else grad_out, part, num_dst, programs, heads, channels,
                slope, p, drop_scale, *l_layout, *r_layout, NEED_R=need_r, NEED_ATT=need_att,
                DROPOUT=drop, BLOCK_E=block_e, BLOCK_C=block_c, L_BITS=l_bits, R_BITS=r_bits,
                X_ROUND=x_round, num_warps=warps,
            )  # fmt: skip

        key = ("v2_bwd_dst", heads, channels, x_l.dtype, l_bits, r_bits, grad_out.dtype,
               bucket, need_r, need_att, drop)  # fmt: skip
        run_dst(_blocking(key, bucket, run_dst, dev, config, rows=False))
    elif need_r:
        grad_r.zero_()
    if need_att:
        grad_att = part.sum(0).reshape(att.shape).to(att.dtype)
    if need_l and num_src > 0:

        def run_src(cfg):
            block_e, rows, warps = cfg
            _gatv2_edge_bwd_src_kernel[(triton.cdiv(num_src, rows), heads)](
                ld, lm, rd, rm, att, t_rowptr, t_col, t_pos if t_pos is not None else t_col,
                seed_t, m, s, grad_out, d, grad_l, num_src, heads, channels, slope, p,
                drop_scale, *l_layout, *r_layout, HAS_POS=t_pos is not None, DROPOUT=drop,
                ROWS=rows, BLOCK_E=block_e, BLOCK_C=block_c, L_BITS=l_bits, R_BITS=r_bits,
                X_ROUND=x_round, num_warps=warps,
            )  # fmt: skip

        key = ("v2_bwd_src", heads, channels, x_l.dtype, l_bits, r_bits, grad_out.dtype,
               bucket, drop)  # fmt: skip
        run_src(_blocking(key, bucket, run_src, dev, config))
    return grad_l, grad_r, grad_att


def gat_edge_dropout_keep(seed: Tensor, num_edges: int, heads: int, dropout: float) -> Tensor:
    """The keep-mask (bool, E x H, CSR order) the kernels draw for ``seed`` and ``dropout``:
    materialized for tests and debugging only (the kernels never store it)."""
    _require_triton()
    drop, drop_scale, seed_t = _dropout_args(float(dropout), seed, seed.device)
    keep = torch.ones(num_edges, heads, dtype=torch.int8, device=seed.device)
    if drop and num_edges * heads > 0:
        block = 128
        _gat_edge_keep_kernel[(triton.cdiv(num_edges, block), heads)](
            seed_t, keep, num_edges, heads, float(dropout), drop_scale, BLOCK=block
        )
    return keep.bool()


def draw_seed(device: torch.device | str) -> Tensor:
    """A fresh dropout seed (one-element int64 tensor on ``device``) from the device's default
    generator: a device-side draw, so no host sync; reproducible under ``torch.manual_seed``."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)


def _destinations(rowptr: Tensor, col: Tensor) -> Tensor:
    """The destination row of every CSR edge (int64, E)."""
    num_dst = rowptr.numel() - 1
    return torch.repeat_interleave(
        torch.arange(num_dst, device=col.device), rowptr[1:] - rowptr[:-1],
        output_size=col.numel(),
    )  # fmt: skip


def csr_transpose(rowptr: Tensor, col: Tensor, num_src: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(t_rowptr, t_col, t_pos)`` of a destination-sorted CSR: the source-sorted transpose
    (``t_col`` the destination of each edge, in ``col``'s dtype) and each of its edges'
    position in the CSR (stable: a source's edges in CSR order)."""
    t_pos = torch.argsort(col, stable=True)
    counts = torch.bincount(col.long(), minlength=num_src)
    t_rowptr = torch.zeros(num_src + 1, dtype=torch.int64, device=col.device)
    torch.cumsum(counts, 0, out=t_rowptr[1:])
    dst = _destinations(rowptr, col)
    t_col = dst[t_pos].to(col.dtype)
    pos_dtype = torch.int32 if col.numel() <= 2**31 - 1 else torch.int64
    return t_rowptr, t_col, t_pos.to(pos_dtype)


# ---------------------------------------------------------------------------- reference
def gat_edge_reference(
    x: Tensor,
    a_src: Tensor,
    a_dst: Tensor | None,
    rowptr: Tensor,
    col: Tensor,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    keep: Tensor | None = None,
) -> Tensor:
    """Stock-autograd oracle of the kernels (materializes E x H x C; tests only): PyG's
    softmax, then ``alpha * keep / (1 - p)`` (``keep``: bool E x H in CSR order, required
    when ``dropout > 0``), computed in fp32 and returned in ``x``'s dtype promoted with the
    logits'."""
    num_dst = rowptr.numel() - 1
    out_dtype = torch.promote_types(x.dtype, a_src.dtype)
    dst = _destinations(rowptr, col)
    src = col.long()
    pre = a_src.float()[src]
    if a_dst is not None:
        pre = pre + a_dst.float()[dst]
    logit = torch.nn.functional.leaky_relu(pre, negative_slope)
    return _attend(logit, x, src, dst, num_dst, dropout, keep).to(out_dtype)


def edge_softmax_reference(logit: Tensor, dst: Tensor, num_dst: int) -> Tensor:
    """PyG's softmax of the E x H ``logit`` over the edges into each destination ``dst``
    (stock autograd; the references' and the chunked stage's oracle)."""
    zeros = torch.zeros(num_dst, logit.size(1), dtype=logit.dtype, device=logit.device)
    idx = dst.unsqueeze(-1).expand_as(logit)
    m = zeros.scatter_reduce(0, idx, logit.detach(), "amax", include_self=False)
    ex = (logit - m[dst]).exp()
    return ex / (zeros.index_add(0, dst, ex) + SOFTMAX_EPS)[dst]


def aggregate_reference(alpha: Tensor, x: Tensor, src: Tensor, dst: Tensor, num_dst: int):
    """``out[d] = sum_e alpha[e] * x[src_e]`` over the edges into ``d`` (stock autograd)."""
    msg = alpha.unsqueeze(-1) * x[src]
    out = torch.zeros(num_dst, *x.shape[1:], dtype=msg.dtype, device=msg.device)
    return out.index_add(0, dst, msg)


def _attend(logit, x, src, dst, num_dst: int, dropout: float, keep) -> Tensor:
    """The references' softmax (PyG's), dropout by ``keep`` and aggregation, in fp32."""
    alpha = edge_softmax_reference(logit, dst, num_dst)
    if dropout > 0:
        if keep is None:
            raise ValueError("the reference needs the keep-mask when dropout > 0")
        alpha = alpha * (keep.to(alpha.dtype) * (0.0 if dropout >= 1 else 1.0 / (1.0 - dropout)))
    return aggregate_reference(alpha, x.float(), src, dst, num_dst)


def gatv2_edge_reference(
    x_l: Tensor,
    x_r: Tensor,
    att: Tensor,
    rowptr: Tensor,
    col: Tensor,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    keep: Tensor | None = None,
) -> Tensor:
    """Stock-autograd oracle of the GATv2 kernels (materializes E x H x C; tests only):
    ``logit = <att, leaky_relu(x_l[src] + x_r[dst])>``, then as `gat_edge_reference`."""
    num_dst = rowptr.numel() - 1
    out_dtype = torch.promote_types(x_l.dtype, att.dtype)
    dst = _destinations(rowptr, col)
    src = col.long()
    z = torch.nn.functional.leaky_relu(x_l.float()[src] + x_r.float()[dst], negative_slope)
    logit = (z * att.float().reshape(1, *x_l.shape[1:])).sum(-1)
    return _attend(logit, x_l, src, dst, num_dst, dropout, keep).to(out_dtype)
