"""Group quantization with stochastic rounding + bit packing: Triton kernels and references.

Layout, metadata and rounding are specified in :mod:`gact_graph.core.quantize`. The Triton launchers
(``triton_quantize`` / ``triton_dequantize``) and the PyTorch references
(``quantize_reference`` / ``dequantize_reference``) produce bit-identical packed codes, metadata
and reconstructions for the same seed: both use the same fp32 operation sequence (IEEE
division via ``div_rn``; the only multiply-add has an exact product), the same counter-based
RNG (:mod:`gact_graph.kernels.rng`) and the same bf16 rounding done on the bit patterns.

The reference is the CPU path and the test oracle. It walks the group matrix in blocks of about
``chunk_elems`` elements, so its temporaries stay bounded however large the input is, and it
reads 2-D strided views (e.g. transposes) without copying them first.

Both take and return raw tensors: ``packed`` (1-D uint8) and ``meta`` (``(num_groups, 2)``
bf16 holding ``lo_b`` and ``scale_b``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from gact_graph.kernels.bitpack import code_table, pack_bits
from gact_graph.kernels.layout import GroupLayout, group_layout
from gact_graph.kernels.rng import uniform_bits_range_

try:  # Triton is optional; the references below never need it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

__all__ = [
    "decode_meta",
    "dequantize_reference",
    "quantize_reference",
    "triton_dequantize",
    "triton_quantize",
]

_MASK32 = 0xFFFFFFFF
_BF16_NAN = 0x7FC0
_CONST_FLAG = 0x8000
_INV_2_24 = 1.0 / 16777216.0
#: default block size of the reference (elements of the group matrix per step). A block of the
#: quantizer holds about 13 bytes per element in temporaries (fp32 values, int32 hash words and
#: their scratch, uint8 codes): 3.3 MiB at 2**18, which on CPU is the step's peak when it lands
#: on the forward's widest moment (GCN 8,000 x 64 at 1 bit: 16.0 -> 12.3 MiB of live tensors
#: going from 2**20 to 2**18). Smaller blocks pay Python overhead per block (2**16: quantize
#: 1.8x slower on a 169k x 256 tensor; 2**18: 1.1x).
CHUNK_ELEMS = 1 << 18

#: Largest finite fp16. A group's range is stored rounded outward to bf16, so the top level
#: ``lo + (2^b - 1) * scale`` of a finite fp16 group near 65504 can exceed it and would round to
#: inf; dequantization clamps fp16 output to +-FP16_MAX (the true values lie inside, so this can
#: only move a reconstruction towards them).
FP16_MAX = torch.finfo(torch.float16).max


def _inv_levels(bits: int) -> float:
    """``1 / (2**bits - 1)`` rounded to fp32 (the same constant in both paths)."""
    return torch.tensor(1.0 / ((1 << bits) - 1), dtype=torch.float32).item()


def _resolve_layout(shape: Sequence[int], group_size: int | GroupLayout) -> GroupLayout:
    if isinstance(group_size, GroupLayout):
        return group_size
    return group_layout(shape, group_size)


def _as_2d(x: Tensor, layout: GroupLayout) -> Tensor:
    """The ``(rows, cols)`` view of ``x``; a copy only when ``x``'s strides do not allow one."""
    return x.reshape(layout.rows, layout.cols)


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

if triton is not None:
    from gact_graph.kernels.rng import uniform as _uniform

    @triton.jit
    def _group_coords(grp, pos, R, C, g, n, k, W):
        """(row, col, valid) of positions ``pos`` of groups ``grp`` in the ``(R, C)`` view."""
        rb = grp // n
        j = grp - rb * n
        r = rb[:, None] * k + (pos // W)[None, :]
        c = j[:, None] * g + (pos % W)[None, :]
        valid = (pos < k * W)[None, :] & (r < R) & (c < C)
        return r, c, valid

    # Triton turns an integer argument equal to 1 into a compile-time constant; a seed of 1
    # would then reach `uniform` as a Python int and fail to compile (seen on an H100).
    @triton.jit(do_not_specialize=["seed"])
    def _quantize_pack_kernel(
        x_ptr,
        packed_ptr,
        meta_ptr,
        R,
        C,
        stride_r,
        stride_c,
        num_groups,
        g,
        n,
        k,
        W,
        seed,
        inv_levels,
        BITS: tl.constexpr,
        BLOCK: tl.constexpr,
        GROUPS: tl.constexpr,
    ):
        LEVELS: tl.constexpr = (1 << BITS) - 1
        PER_BYTE: tl.constexpr = 8 // BITS
        pid = tl.program_id(0).to(tl.int64)
        grp = pid * GROUPS + tl.arange(0, GROUPS)
        pos = tl.arange(0, BLOCK)
        live = grp < num_groups
        r, c, valid = _group_coords(grp, pos, R, C, g, n, k, W)
        valid = valid & live[:, None]
        x = tl.load(x_ptr + r * stride_r + c * stride_c, mask=valid, other=0.0).to(tl.float32)

        # Group statistics over the real elements; NaN/Inf are flagged, not reduced.
        bad = valid & ((x != x) | (tl.abs(x) == float("inf")))
        nonfinite = tl.max(bad.to(tl.int32), axis=1) > 0
        lo = tl.min(tl.where(valid, x, float("inf")), axis=1)
        hi = tl.max(tl.where(valid, x, -float("inf")), axis=1)
        # Keep the metadata arithmetic of dead/non-finite groups finite (it is discarded).
        lo = tl.where(live & ~nonfinite, lo, 0.0)
        hi = tl.where(live & ~nonfinite, hi, 0.0)

        # lo rounded down and the scale rounded up to bf16, on the bit patterns.
        lo_bits = lo.to(tl.uint32, bitcast=True)
        lo_trunc = lo_bits & 0xFFFF0000
        lo_away = ((lo_bits >> 31) != 0) & ((lo_bits & 0xFFFF) != 0)
        lo_b_bits = tl.where(lo_away, lo_trunc + 0x10000, lo_trunc)
        lo_b = lo_b_bits.to(tl.float32, bitcast=True)
        d_bits = ((hi - lo_b) * inv_levels).to(tl.uint32, bitcast=True)
        d_trunc = d_bits & 0xFFFF0000
        s_bits = tl.where((d_bits & 0xFFFF) != 0, d_trunc + 0x10000, d_trunc)
        s = s_bits.to(tl.float32, bitcast=True)
        s_bits = tl.where(lo_b + s * LEVELS < hi, s_bits + 0x10000, s_bits)
        s = s_bits.to(tl.float32, bitcast=True)
        top = lo_b + s * LEVELS

        const = (~nonfinite) & (hi == lo)
        regular = (~nonfinite) & (hi != lo) & (tl.abs(top) < float("inf"))
        lo16 = tl.where(regular, lo_b_bits >> 16, tl.where(const, lo_bits >> 16, 0x7FC0))
        sc16 = tl.where(
            regular, s_bits >> 16, tl.where(const, 0x8000 | ((lo_bits & 0xFFFF) >> 1), 0x7FC0)
        )
        bit = tl.where(const, lo_bits & 1, 0)
        lo_q = tl.where(regular, lo_b, 0.0)
        s_q = tl.where(regular, s, 1.0)

        # Stochastic rounding; non-regular groups never cast a NaN to an integer.
        t = tl.math.div_rn(x - lo_q[:, None], s_q[:, None])
        u = _uniform(seed, grp[:, None] * g + pos[None, :])
        v = tl.minimum(tl.maximum(tl.floor(t + u), 0.0), LEVELS)
        v = tl.where(valid & regular[:, None], v, 0.0)
        code = tl.where(valid, v.to(tl.uint32) | bit[:, None], 0)

        bpg = g * BITS // 8
        if PER_BYTE == 1:
            byte = code.to(tl.uint8)
            b = pos
        else:
            lanes = tl.reshape(code, (GROUPS, BLOCK // PER_BYTE, PER_BYTE))
            shift = tl.arange(0, PER_BYTE) * BITS
            byte = tl.sum(lanes << shift[None, None, :], axis=2).to(tl.uint8)
            b = tl.arange(0, BLOCK // PER_BYTE)
        tl.store(
            packed_ptr + grp[:, None] * bpg + b[None, :],
            byte,
            mask=live[:, None] & (b < bpg)[None, :],
        )
        tl.store(meta_ptr + grp * 2, lo16.to(tl.int16), mask=live)
        tl.store(meta_ptr + grp * 2 + 1, sc16.to(tl.int16), mask=live)

    @triton.jit
    def _unpack_dequantize_kernel(
        packed_ptr,
        meta_ptr,
        out_ptr,
        R,
        C,
        num_groups,
        g,
        n,
        k,
        W,
        BITS: tl.constexpr,
        BLOCK: tl.constexpr,
        GROUPS: tl.constexpr,
        OUT_BF16: tl.constexpr,
        OUT_FP16: tl.constexpr,
    ):
        LEVELS: tl.constexpr = (1 << BITS) - 1
        PER_BYTE: tl.constexpr = 8 // BITS
        pid = tl.program_id(0).to(tl.int64)
        grp = pid * GROUPS + tl.arange(0, GROUPS)
        pos = tl.arange(0, BLOCK)
        live = grp < num_groups
        r, c, valid = _group_coords(grp, pos, R, C, g, n, k, W)
        valid = valid & live[:, None]

        bpg = g * BITS // 8
        byte = tl.load(
            packed_ptr + grp[:, None] * bpg + (pos // PER_BYTE)[None, :],
            mask=live[:, None] & (pos < g)[None, :],
            other=0,
        )
        code = (byte.to(tl.uint32) >> ((pos % PER_BYTE) * BITS)[None, :]) & LEVELS

        lo16 = tl.load(meta_ptr + grp * 2, mask=live, other=0).to(tl.uint32) & 0xFFFF
        sc16 = tl.load(meta_ptr + grp * 2 + 1, mask=live, other=0).to(tl.uint32) & 0xFFFF
        const = (sc16 & 0x8000) != 0
        b0 = tl.where(const, (lo16 << 16) | ((sc16 & 0x7FFF) << 1), lo16 << 16)
        lo_eff = b0.to(tl.float32, bitcast=True)
        sc_eff = tl.where(
            const,
            (b0 | 1).to(tl.float32, bitcast=True) - lo_eff,
            (sc16 << 16).to(tl.float32, bitcast=True),
        )
        val = lo_eff[:, None] + code.to(tl.float32) * sc_eff[:, None]
        if OUT_FP16:  # 65504 = FP16_MAX (see there); NaN groups stay NaN
            val = tl.minimum(tl.maximum(val, -65504.0, tl.PropagateNan.ALL), 65504.0,
                             tl.PropagateNan.ALL)  # fmt: skip
        if OUT_BF16:
            # Round to nearest even on the bits (as torch does; Triton's interpreter truncates),
            # storing through an int16 view of the output. NaN -> torch's canonical 0x7FC0.
            vb = val.to(tl.uint32, bitcast=True)
            vb = (vb + 0x7FFF + ((vb >> 16) & 1)) >> 16
            vb = tl.where(val != val, 0x7FC0, vb)
            tl.store(out_ptr + r * C + c, vb.to(tl.int16), mask=valid)
        else:
            tl.store(out_ptr + r * C + c, val.to(out_ptr.dtype.element_ty), mask=valid)


def _launch_config(layout: GroupLayout) -> tuple[int, int, tuple[int]]:
    """BLOCK (power of 2 >= g), groups per program, grid. Keyed on g only, never on sizes."""
    block = triton.next_power_of_2(layout.group_size)
    groups = max(1, 4096 // block)
    groups = min(groups, triton.next_power_of_2(max(layout.num_groups, 1)))
    return block, groups, (triton.cdiv(layout.num_groups, groups),)


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError("the Triton quantization kernels need Triton: pip install triton")


def triton_quantize(
    x: Tensor, bits: int, group_size: int | GroupLayout, seed: int
) -> tuple[Tensor, Tensor]:
    """Triton launcher: ``(packed uint8, meta bf16 (num_groups, 2))`` of ``x``."""
    _require_triton()
    x = x.detach()
    layout = _resolve_layout(x.shape, group_size)
    packed = torch.empty(layout.packed_nbytes(bits), dtype=torch.uint8, device=x.device)
    meta = torch.empty((layout.num_groups, 2), dtype=torch.int16, device=x.device)
    if layout.num_groups:
        x2d = _as_2d(x, layout)
        block, groups, grid = _launch_config(layout)
        _quantize_pack_kernel[grid](
            x2d,
            packed,
            meta,
            layout.rows,
            layout.cols,
            x2d.stride(0),
            x2d.stride(1),
            layout.num_groups,
            layout.group_size,
            layout.groups_per_row,
            layout.rows_per_group,
            layout.row_width,
            seed & _MASK32,
            _inv_levels(bits),
            BITS=bits,
            BLOCK=block,
            GROUPS=groups,
            num_warps=4,
            enable_fp_fusion=False,  # belt and braces: no product here needs rounding anyway
        )
    return packed, meta.view(torch.bfloat16)


def triton_dequantize(
    packed: Tensor,
    meta: Tensor,
    bits: int,
    shape: Sequence[int],
    dtype: torch.dtype,
    group_size: int | GroupLayout,
) -> Tensor:
    """Triton launcher: the contiguous reconstruction of ``shape`` and ``dtype``."""
    _require_triton()
    layout = _resolve_layout(shape, group_size)
    out = torch.empty(tuple(shape), dtype=dtype, device=packed.device)
    if layout.num_groups:
        block, groups, grid = _launch_config(layout)
        _unpack_dequantize_kernel[grid](
            packed,
            meta.view(torch.int16),
            out.view(torch.int16) if dtype == torch.bfloat16 else out,
            layout.rows,
            layout.cols,
            layout.num_groups,
            layout.group_size,
            layout.groups_per_row,
            layout.rows_per_group,
            layout.row_width,
            BITS=bits,
            BLOCK=block,
            GROUPS=groups,
            OUT_BF16=dtype == torch.bfloat16,
            OUT_FP16=dtype == torch.float16,
            num_warps=4,
            enable_fp_fusion=False,  # belt and braces: no product here needs rounding anyway
        )
    return out


# --------------------------------------------------------------------------------------------
# PyTorch references
# --------------------------------------------------------------------------------------------


def _f32_bits(v: Tensor) -> Tensor:
    """fp32 -> its bit pattern as an int64 in ``[0, 2**32)``."""
    return v.contiguous().view(torch.int32).to(torch.int64) & _MASK32


def _bits_f32(b: Tensor) -> Tensor:
    """Bit pattern (int64 in ``[0, 2**32)``) -> fp32."""
    return torch.where(b >= 1 << 31, b - (1 << 32), b).to(torch.int32).view(torch.float32)


def _round_bits_away(b: Tensor, away: Tensor) -> Tensor:
    """Truncate a pattern to bf16 precision, one bf16 step further from zero where ``away``."""
    return (b & 0xFFFF0000) + (away.to(torch.int64) << 16)


class _GroupParams(NamedTuple):
    meta: Tensor  # (ng, 2) int16 bit patterns
    lo_q: Tensor  # fp32 offset used for rounding (0 in non-regular groups)
    scale_q: Tensor  # fp32 step used for rounding (1 in non-regular groups)
    regular: Tensor  # bool
    const_bit: Tensor  # uint8, bit 0 of the value of constant groups, else 0


def _group_params(lo: Tensor, hi: Tensor, bits: int) -> _GroupParams:
    """bf16 metadata from fp32 group min/max (NaN-propagating), as the kernel computes it."""
    levels = (1 << bits) - 1
    lo_bits = _f32_bits(lo)
    lo_away = (lo_bits >= 1 << 31) & ((lo_bits & 0xFFFF) != 0)
    lo_b_bits = _round_bits_away(lo_bits, lo_away)
    lo_b = _bits_f32(lo_b_bits)
    d_bits = _f32_bits((hi - lo_b) * _inv_levels(bits))
    s_bits = _round_bits_away(d_bits, (d_bits & 0xFFFF) != 0)
    s = _bits_f32(s_bits)
    s_bits = s_bits + (((lo_b + s * levels) < hi).to(torch.int64) << 16)
    s = _bits_f32(s_bits)
    top = lo_b + s * levels

    finite = torch.isfinite(lo) & torch.isfinite(hi)
    const = finite & (hi == lo)
    regular = finite & (hi != lo) & torch.isfinite(top)
    nan16 = torch.full_like(lo_bits, _BF16_NAN)
    lo16 = torch.where(regular, lo_b_bits >> 16, torch.where(const, lo_bits >> 16, nan16))
    sc16 = torch.where(
        regular,
        s_bits >> 16,
        torch.where(const, _CONST_FLAG | ((lo_bits & 0xFFFF) >> 1), nan16),
    )
    meta = torch.stack([lo16, sc16], dim=1)
    meta = torch.where(meta >= 1 << 15, meta - (1 << 16), meta).to(torch.int16)
    return _GroupParams(
        meta=meta,
        lo_q=torch.where(regular, lo_b, 0.0),
        scale_q=torch.where(regular, s, 1.0),
        regular=regular,
        const_bit=torch.where(const, lo_bits & 1, 0).to(torch.uint8),
    )


def decode_meta(meta: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 ``(lo, scale, is_constant)`` per group with ``dequant = lo + code * scale`` exactly.

    For constant groups ``lo`` is the value with bit 0 cleared and ``scale`` the distance to
    the value with bit 0 set (codes hold that bit), so the sum is exact and keeps signed zeros.
    """
    m = meta.view(torch.int16).to(torch.int64) & 0xFFFF
    lo16, sc16 = m[:, 0], m[:, 1]
    const = (sc16 & _CONST_FLAG) != 0
    b0 = torch.where(const, (lo16 << 16) | ((sc16 & 0x7FFF) << 1), lo16 << 16)
    lo = _bits_f32(b0)
    scale = torch.where(const, _bits_f32(b0 | 1) - lo, _bits_f32(sc16 << 16))
    return lo, scale, const


class _Block(NamedTuple):
    """A rectangle ``x2d[r0:r1, c0:c1]`` covering groups ``[first, first + count)``."""

    first: int
    count: int
    r0: int
    r1: int
    c0: int
    c1: int


def _blocks(layout: GroupLayout, chunk_elems: int) -> Iterator[_Block]:
    g, n, k, rows, cols = (
        layout.group_size,
        layout.groups_per_row,
        layout.rows_per_group,
        layout.rows,
        layout.cols,
    )
    if k > 1:  # groups of whole rows
        per = max(1, chunk_elems // g)
        for q0 in range(0, layout.num_groups, per):
            q1 = min(q0 + per, layout.num_groups)
            yield _Block(q0, q1 - q0, q0 * k, min(q1 * k, rows), 0, cols)
    elif n * g <= chunk_elems:  # several whole rows of groups
        per = max(1, chunk_elems // (n * g))
        for r0 in range(0, rows, per):
            r1 = min(r0 + per, rows)
            yield _Block(r0 * n, (r1 - r0) * n, r0, r1, 0, cols)
    else:  # one very long row at a time, a few groups at a time
        per = max(1, chunk_elems // g)
        for r in range(rows):
            for j0 in range(0, n, per):
                j1 = min(j0 + per, n)
                yield _Block(r * n + j0, j1 - j0, r, r + 1, j0 * g, min(j1 * g, cols))


def _pad_columns(xs: Tensor, width: int) -> Tensor:
    """``xs`` widened to ``width`` columns by repeating its last column (a copy only if needed)."""
    if width == xs.shape[1]:
        return xs
    out = torch.empty((xs.shape[0], width), dtype=xs.dtype, device=xs.device)
    out[:, : xs.shape[1]] = xs
    out[:, xs.shape[1] :] = xs[:, -1:]
    return out


def _to_group_matrix(x2d: Tensor, blk: _Block, layout: GroupLayout) -> Tensor:
    """fp32 ``(count, g)`` groups of the block, padded by repeating a real element of the group.

    The padding never changes a group's min/max; its codes are zeroed by ``_zero_padding_``.
    The result may be a view of ``x`` (never modified in place).
    """
    g, k, cols = layout.group_size, layout.rows_per_group, layout.cols
    xs = x2d[blk.r0 : blk.r1, blk.c0 : blk.c1].to(torch.float32)
    if k > 1:
        missing_rows = blk.count * k - (blk.r1 - blk.r0)
        if missing_rows:
            xs = torch.cat([xs, xs[-1:].expand(missing_rows, cols)])
        return _pad_columns(xs.reshape(blk.count, k * cols), g)
    width = (blk.count // (blk.r1 - blk.r0)) * g
    return _pad_columns(xs, width).reshape(blk.count, g)


def _zero_padding_(codes: Tensor, blk: _Block, layout: GroupLayout) -> None:
    k, cols = layout.rows_per_group, layout.cols
    if k > 1:
        codes[:, k * cols :] = 0
        real_rows_last = (blk.r1 - blk.r0) - (blk.count - 1) * k
        codes[-1, real_rows_last * cols : k * cols] = 0
    else:
        rows = blk.r1 - blk.r0
        codes.view(rows, -1)[:, blk.c1 - blk.c0 :] = 0


def _from_group_matrix(vals: Tensor, blk: _Block, layout: GroupLayout) -> Tensor:
    """Inverse of :func:`_to_group_matrix`: the ``(r1 - r0, c1 - c0)`` real values."""
    k, cols = layout.rows_per_group, layout.cols
    if k > 1:
        return vals[:, : k * cols].reshape(blk.count * k, cols)[: blk.r1 - blk.r0]
    return vals.view(blk.r1 - blk.r0, -1)[:, : blk.c1 - blk.c0]


def quantize_reference(
    x: Tensor,
    bits: int,
    group_size: int | GroupLayout = 256,
    seed: int = 0,
    *,
    chunk_elems: int = CHUNK_ELEMS,
) -> tuple[Tensor, Tensor]:
    """PyTorch reference of :func:`triton_quantize`: ``(packed uint8, meta bf16)``.

    Vectorized per block of about ``chunk_elems`` group-matrix elements (at least one group,
    and whole rows when they fit), so peak extra memory is ``O(chunk_elems)``, not ``O(numel)``.
    """
    x = x.detach()
    layout = _resolve_layout(x.shape, group_size)
    levels = (1 << bits) - 1
    g = layout.group_size
    bpg = g * bits // 8
    packed = torch.empty(layout.packed_nbytes(bits), dtype=torch.uint8, device=x.device)
    meta = torch.empty((layout.num_groups, 2), dtype=torch.int16, device=x.device)
    if layout.num_groups == 0:
        return packed, meta.view(torch.bfloat16)
    x2d = _as_2d(x, layout)
    for blk in _blocks(layout, chunk_elems):
        m = _to_group_matrix(x2d, blk, layout)
        lo, hi = torch.aminmax(m, dim=1)
        p = _group_params(lo, hi, bits)
        v = m.sub(p.lo_q[:, None]).div_(p.scale_q[:, None])
        # contiguous whatever v's strides (a transposed square input gives a transposed v):
        # the draws are numbered in group-matrix order, as the Triton kernel numbers them
        h = torch.empty(v.shape, dtype=torch.int32, device=v.device)
        h = uniform_bits_range_(h, seed, blk.first * g)
        # v + u with u = (h >> 8) * 2**-24: the product is exact, so this is one rounding.
        v.add_(h.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF), alpha=_INV_2_24)
        v.floor_().clamp_(0, levels)
        # Special groups need two more passes; skip them when there are none (on CPU only:
        # on CUDA that check would sync the device).
        special = m.is_cuda or not bool(p.regular.all())
        if special:
            v.nan_to_num_(0.0, 0.0, 0.0)  # NaN must not reach the integer cast
        codes = v.to(torch.uint8)
        if special:
            codes.mul_(p.regular.to(torch.uint8)[:, None]).bitwise_or_(p.const_bit[:, None])
        _zero_padding_(codes, blk, layout)
        pack_bits(codes, bits, out=packed[blk.first * bpg : (blk.first + blk.count) * bpg])
        meta[blk.first : blk.first + blk.count] = p.meta
        del m, v, h, codes  # free this block's temporaries before the next block makes its own
    return packed, meta.view(torch.bfloat16)


def dequantize_reference(
    packed: Tensor,
    meta: Tensor,
    bits: int,
    shape: Sequence[int],
    dtype: torch.dtype,
    group_size: int | GroupLayout = 256,
    *,
    chunk_elems: int = CHUNK_ELEMS,
) -> Tensor:
    """PyTorch reference of :func:`triton_dequantize`, blocked like :func:`quantize_reference`."""
    layout = _resolve_layout(shape, group_size)
    g = layout.group_size
    bpg = g * bits // 8
    out = torch.empty(tuple(shape), dtype=dtype, device=packed.device)
    if layout.num_groups == 0:
        return out
    out2d = out.view(layout.rows, layout.cols)
    table = code_table(bits, packed.device, torch.float32)  # byte -> its codes, as fp32
    for blk in _blocks(layout, chunk_elems):
        sl = slice(blk.first, blk.first + blk.count)
        lo, scale, _ = decode_meta(meta[sl])
        idx = packed[sl.start * bpg : sl.stop * bpg].to(torch.int32)
        dst = out2d[blk.r0 : blk.r1, blk.c0 : blk.c1]
        # fp32 output without padding: decode straight into it, no extra copy
        direct = dtype == torch.float32 and dst.is_contiguous() and dst.numel() == blk.count * g
        codes = torch.index_select(
            table, 0, idx, out=dst.view(-1, table.shape[1]) if direct else None
        )
        vals = codes.view(-1, g).mul_(scale[:, None]).add_(lo[:, None])  # exact product
        if dtype == torch.float16:
            vals.clamp_(-FP16_MAX, FP16_MAX)  # see FP16_MAX; clamp keeps NaN groups NaN
        if not direct:
            dst.copy_(_from_group_matrix(vals, blk, layout))
    return out
