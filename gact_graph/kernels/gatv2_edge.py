"""GATv2's edge stage as fused Triton kernels over a destination-sorted CSR, its launchers and
its reference (what it shares with GAT's: `gact_graph.kernels.gat_rows`).

The logits are ``<att[h], leaky_relu(x_l[src] + x_r[d])>``; otherwise the structure of GAT's
stage (`gact_graph.kernels.gat_edge`), with ``x_l`` both the logits' input and the message (one
gather per edge forward). Backward's row pass makes ``D``, ``grad x_r[d] = att * sum_e dl
leaky_relu'(z)`` and ``grad att = sum_e dl leaky_relu(z)`` from running sums in one pass
(``dl = alpha (g - D)`` expands into sums weighted by ``alpha g`` and by ``alpha``); it runs a
fixed number of programs per head, each over a stride of rows, so that ``grad att`` is summed
per program into a small P x H x C buffer instead of with atomics. The transpose pass makes
``grad x_l``.

`gatv2_edge_reference` is the stock-autograd oracle (it materializes E x H x C; tests only),
taking the dropout keep-mask explicitly.
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
    "gatv2_edge_backward",
    "gatv2_edge_forward",
    "gatv2_edge_reference",
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
    def _gatv2_edge_fwd_kernel(
        xl_ptr, xl_meta_ptr, xr_ptr, xr_meta_ptr, att_ptr, rowptr_ptr, col_ptr, seed_ptr,
        out_ptr, m_ptr, s_ptr,
        num_rows, H, C, slope, p, drop_scale, lk, ln, lg, rk, rn, rg,
        DROPOUT: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
        BLOCK_C: tl.constexpr, STATS_ONLY: tl.constexpr,
        L_BITS: tl.constexpr, R_BITS: tl.constexpr, X_ROUND: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        h, offs_e, offs_c, cmask, seed = prologue(
            seed_ptr, C, DROPOUT and not STATS_ONLY, BLOCK_E, BLOCK_C
        )
        HC = H * C
        att = tl.load(att_ptr + h * C + offs_c, mask=cmask, other=0.0).to(tl.float32)
        for r in range(ROWS):
            row, live, row_c, start, end = csr_row(
                rowptr_ptr, pid, r, num_rows, offs_c, cmask, ROWS
            )
            xr = feature_row(xr_ptr, xr_meta_ptr, row, h, H, C, offs_c, row_c, rk, rn, rg,
                             R_BITS, X_ROUND)  # fmt: skip
            m = tl.full((), float("-inf"), tl.float32)
            s = tl.zeros((), tl.float32)
            acc = tl.zeros((BLOCK_C,), tl.float32)
            for e0 in range(start, end, BLOCK_E):
                k = e0 + offs_e
                emask = k < end
                src = tl.load(col_ptr + k, mask=emask, other=0).to(tl.int64)
                xl = gather_features(xl_ptr, xl_meta_ptr, src, h, H, C, offs_c, emask, cmask,
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
                        w = w * dropout_multiplier(seed, k, h, H, p, drop_scale)
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
        h, offs_e, offs_c, cmask, seed = prologue(seed_ptr, C, DROPOUT, BLOCK_E, BLOCK_C)
        HC = H * C
        att = tl.load(att_ptr + h * C + offs_c, mask=cmask, other=0.0).to(tl.float32)
        gatt = tl.zeros((BLOCK_C,), tl.float32)
        for row in range(pid.to(tl.int64), num_rows, num_programs):
            start = tl.load(rowptr_ptr + row)
            end = tl.load(rowptr_ptr + row + 1)
            m = tl.load(m_ptr + row * H + h)
            s = tl.load(s_ptr + row * H + h)
            go = load_row(go_ptr, row, h, HC, C, offs_c, cmask)
            xr = feature_row(xr_ptr, xr_meta_ptr, row, h, H, C, offs_c, cmask, rk, rn, rg,
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
                xl = gather_features(xl_ptr, xl_meta_ptr, src, h, H, C, offs_c, emask, cmask,
                                     lk, ln, lg, L_BITS, X_ROUND)  # fmt: skip
                z = xl + xr[None, :]
                dz = tl.where(z > 0, 1.0, slope)
                lz = z * dz
                logit = tl.sum(lz * att[None, :], 1)
                alpha = tl.exp(logit - m) / s
                alpha = tl.where(emask, alpha, 0.0)
                g = tl.sum(xl * go[None, :], 1)
                if DROPOUT:
                    g = g * dropout_multiplier(seed, k, h, H, p, drop_scale)
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
        h, offs_e, offs_c, cmask, seed = prologue(seed_ptr, C, DROPOUT, BLOCK_E, BLOCK_C)
        HC = H * C
        att = tl.load(att_ptr + h * C + offs_c, mask=cmask, other=0.0).to(tl.float32)
        for r in range(ROWS):
            # a source node and its outgoing edges
            row, live, row_c, start, end = csr_row(
                t_rowptr_ptr, pid, r, num_rows, offs_c, cmask, ROWS
            )
            xs = feature_row(xl_ptr, xl_meta_ptr, row, h, H, C, offs_c, row_c, lk, ln, lg,
                             L_BITS, X_ROUND)  # fmt: skip
            gx = tl.zeros((BLOCK_C,), tl.float32)
            for j0 in range(start, end, BLOCK_E):
                j = j0 + offs_e
                emask = j < end
                dst = tl.load(t_col_ptr + j, mask=emask, other=0).to(tl.int64)
                xr = gather_features(xr_ptr, xr_meta_ptr, dst, h, H, C, offs_c, emask, cmask,
                                     rk, rn, rg, R_BITS, X_ROUND)  # fmt: skip
                go = gather(go_ptr, dst, h, HC, C, offs_c, emask, cmask)
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
                    beta = alpha * transposed_multiplier(
                        seed, t_pos_ptr, j, emask, h, H, p, drop_scale, HAS_POS
                    )
                g = tl.sum(go * xs[None, :], 1)
                dl = beta * g - alpha * dd  # alpha * (r <dO, x_l> - D)
                gx += tl.sum(beta[:, None] * go + dl[:, None] * dz * att[None, :], 0)
            tl.store(
                gxl_ptr + row * HC + h * C + offs_c, gx.to(gxl_ptr.dtype.element_ty),
                mask=row_c,
            )  # fmt: skip


# ---------------------------------------------------------------------------- launchers
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
    require_triton()
    _check_v2(x_l, x_r, att, rowptr, col)
    num_dst = rowptr.numel() - 1
    _, heads, channels = x_l.shape
    ld, lm, l_layout, l_bits, x_round = feature_args(x_l)
    rd, rm, r_layout, r_bits, _ = feature_args(x_r)
    att = att.contiguous()
    drop, drop_scale, seed_t = dropout_args(float(dropout), seed, x_l.device)
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
    run(tuned_blocking(key, bucket, run, x_l.device, config))
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
    require_triton()
    _check_v2(x_l, x_r, att, rowptr, col)
    need_l, need_r, need_att = needs
    num_dst, num_src = rowptr.numel() - 1, x_l.shape[0]
    _, heads, channels = x_l.shape
    check_transpose(t_rowptr, t_col, t_pos, col, num_src)
    ld, lm, l_layout, l_bits, x_round = feature_args(x_l)
    rd, rm, r_layout, r_bits, _ = feature_args(x_r)
    att, grad_out = att.contiguous(), grad_out.contiguous()
    drop, drop_scale, seed_t = dropout_args(float(dropout), seed, x_l.device)
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
        run_dst(tuned_blocking(key, bucket, run_dst, dev, config, rows=False))
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
        run_src(tuned_blocking(key, bucket, run_src, dev, config))
    return grad_l, grad_r, grad_att


# ---------------------------------------------------------------------------- reference
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
    dst = destinations(rowptr, col)
    src = col.long()
    z = torch.nn.functional.leaky_relu(x_l.float()[src] + x_r.float()[dst], negative_slope)
    logit = (z * att.float().reshape(1, *x_l.shape[1:])).sum(-1)
    return masked_attend_reference(logit, x_l, src, dst, num_dst, dropout, keep).to(out_dtype)
