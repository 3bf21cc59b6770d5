"""GAT's edge stage as fused Triton kernels over a destination-sorted CSR, its launchers and
its reference (what it shares with GATv2's: `gact_graph.kernels.gat_rows`).

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

`gat_edge_dropout_keep` materializes the dropout mask both stages' kernels draw (tests and
debugging). `gat_edge_reference` is the stock-autograd oracle (it materializes E x H x C;
tests only), taking the dropout keep-mask explicitly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gact_graph.kernels.gat_rows import (
    KERNEL_DTYPES,
    SOFTMAX_EPS,
    check_transpose,
    degree_bucket,
    destinations,
    dropout_args,
    feature_args,
    masked_attend_reference,
    require_triton,
    tuned_blocking,
)

try:  # Triton is optional; the reference below never needs it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

__all__ = [
    "gat_edge_backward",
    "gat_edge_dropout_keep",
    "gat_edge_forward",
    "gat_edge_reference",
]

# ---------------------------------------------------------------------------- kernels
if triton is not None:
    from gact_graph.kernels.gat_rows import (
        csr_row,
        dropout_multiplier,
        feature_row,
        gather,
        gather_features,
        load_row,
        prologue,
        transposed_multiplier,
    )

    @triton.jit(do_not_specialize=["p", "drop_scale"])
    def _gat_edge_fwd_kernel(
        x_ptr, a_src_ptr, a_dst_ptr, rowptr_ptr, col_ptr, seed_ptr,
        out_ptr, m_ptr, s_ptr,
        num_rows, H, C, slope, p, drop_scale,
        HAS_DST: tl.constexpr, DROPOUT: tl.constexpr,
        ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        h, offs_e, offs_c, cmask, seed = prologue(seed_ptr, C, DROPOUT, BLOCK_E, BLOCK_C)
        HC = H * C
        for r in range(ROWS):
            row, live, row_c, start, end = csr_row(
                rowptr_ptr, pid, r, num_rows, offs_c, cmask, ROWS
            )
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
                    w = w * dropout_multiplier(seed, k, h, H, p, drop_scale)
                xv = gather(x_ptr, src, h, HC, C, offs_c, emask, cmask)
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
        h, offs_e, offs_c, cmask, seed = prologue(seed_ptr, C, DROPOUT, BLOCK_E, BLOCK_C)
        HC = H * C
        for r in range(ROWS):
            row, live, row_c, start, end = csr_row(
                rowptr_ptr, pid, r, num_rows, offs_c, cmask, ROWS
            )
            if HAS_DST:
                ad = tl.load(a_dst_ptr + row * H + h, mask=live, other=0.0).to(tl.float32)
            else:
                ad = 0.0
            m = tl.load(m_ptr + row * H + h, mask=live, other=0.0)
            s = tl.load(s_ptr + row * H + h, mask=live, other=1.0)
            go = load_row(go_ptr, row, h, HC, C, offs_c, row_c)
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
                xv = gather_features(x_ptr, x_meta_ptr, src, h, H, C, offs_c, emask, cmask,
                                     xk, xn, xg, X_BITS, X_ROUND)  # fmt: skip
                g = tl.sum(xv * go[None, :], 1)
                if DROPOUT:
                    g = g * dropout_multiplier(seed, k, h, H, p, drop_scale)
                ag = alpha * g
                sum_ag += tl.sum(ag, 0)
                sum_ag_slope += tl.sum(ag * dslope, 0)
                sum_a_slope += tl.sum(alpha * dslope, 0)
            tl.store(d_ptr + row * H + h, sum_ag, mask=live)
            if NEED_DST:
                grad = sum_ag_slope - sum_ag * sum_a_slope
                tl.store(ga_dst_ptr + row * H + h, grad.to(ga_dst_ptr.dtype.element_ty), mask=live)

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
        h, offs_e, offs_c, cmask, seed = prologue(seed_ptr, C, DROPOUT, BLOCK_E, BLOCK_C)
        HC = H * C
        for r in range(ROWS):
            # a source node and its outgoing edges
            row, live, row_c, start, end = csr_row(
                t_rowptr_ptr, pid, r, num_rows, offs_c, cmask, ROWS
            )
            a_s = tl.load(a_src_ptr + row * H + h, mask=live, other=0.0).to(tl.float32)
            xs = tl.zeros((BLOCK_C,), tl.float32)
            if NEED_SRC:  # (the features' gradient never reads the features)
                xs = feature_row(x_ptr, x_meta_ptr, row, h, H, C, offs_c, row_c, xk, xn, xg,
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
                go = gather(go_ptr, dst, h, HC, C, offs_c, emask, cmask)
                beta = alpha
                if DROPOUT:
                    beta = alpha * transposed_multiplier(
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
        mult = dropout_multiplier(seed, k, h, H, p, drop_scale)
        tl.store(keep_ptr + k * H + h, (mult != 0).to(tl.int8), mask=k < num_edges)


def _check(x: Tensor, a_src: Tensor, a_dst: Tensor | None, rowptr: Tensor, col: Tensor):
    if x.dim() != 3:
        raise ValueError(f"x must be N x H x C, got shape {tuple(x.shape)}")
    if x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"x must be one of {KERNEL_DTYPES}, got {x.dtype}")
    heads = x.shape[1]
    if a_src.shape != (x.shape[0], heads):
        raise ValueError(f"a_src must be {x.shape[0]} x {heads}, got {tuple(a_src.shape)}")
    if a_dst is not None and a_dst.shape != (rowptr.numel() - 1, heads):
        raise ValueError(f"a_dst must be {rowptr.numel() - 1} x {heads}, got {tuple(a_dst.shape)}")
    if rowptr.dtype != torch.int64 or rowptr.dim() != 1 or col.dim() != 1:
        raise ValueError("rowptr must be 1-D int64 and col 1-D (destination-sorted CSR)")
    if col.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"col must be int32 or int64, got {col.dtype}")


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
    require_triton()
    _check(x, a_src, a_dst, rowptr, col)
    num_dst = rowptr.numel() - 1
    _, heads, channels = x.shape
    x, a_src = x.contiguous(), a_src.contiguous()
    a_dst = a_dst.contiguous() if a_dst is not None else None
    drop, drop_scale, seed_t = dropout_args(float(dropout), seed, x.device)
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
    run(tuned_blocking(key, bucket, run, x.device, config))
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
    require_triton()
    _check(x, a_src, a_dst, rowptr, col)
    need_x, need_src, need_dst = needs
    need_dst = need_dst and a_dst is not None
    num_dst, num_src = rowptr.numel() - 1, x.shape[0]
    _, heads, channels = x.shape
    check_transpose(t_rowptr, t_col, t_pos, col, num_src)
    xd, xm, (xk, xn, xg), x_bits, x_round = feature_args(x)
    a_src, grad_out = a_src.contiguous(), grad_out.contiguous()
    a_dst = a_dst.contiguous() if a_dst is not None else None
    drop, drop_scale, seed_t = dropout_args(float(dropout), seed, x.device)
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
        run_dst(tuned_blocking(key, bucket, run_dst, dev, config))
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
        run_src(tuned_blocking(key, bucket, run_src, dev, config))
    return grad_x, grad_src, grad_dst


def gat_edge_dropout_keep(seed: Tensor, num_edges: int, heads: int, dropout: float) -> Tensor:
    """The keep-mask (bool, E x H, CSR order) the kernels draw for ``seed`` and ``dropout``:
    materialized for tests and debugging only (the kernels never store it)."""
    require_triton()
    drop, drop_scale, seed_t = dropout_args(float(dropout), seed, seed.device)
    keep = torch.ones(num_edges, heads, dtype=torch.int8, device=seed.device)
    if drop and num_edges * heads > 0:
        block = 128
        _gat_edge_keep_kernel[(triton.cdiv(num_edges, block), heads)](
            seed_t, keep, num_edges, heads, float(dropout), drop_scale, BLOCK=block
        )
    return keep.bool()


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
    dst = destinations(rowptr, col)
    src = col.long()
    pre = a_src.float()[src]
    if a_dst is not None:
        pre = pre + a_dst.float()[dst]
    logit = torch.nn.functional.leaky_relu(pre, negative_slope)
    return masked_attend_reference(logit, x, src, dst, num_dst, dropout, keep).to(out_dtype)
