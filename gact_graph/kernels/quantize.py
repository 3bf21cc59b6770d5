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

import contextlib
import functools
import os
import struct
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from gact_graph.kernels.bitpack import code_table, pack_bits
from gact_graph.kernels.layout import GroupLayout, group_layout
from gact_graph.kernels.rng import rng_key, uniform_bits_range_

try:  # Triton is optional; the references below never need it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

__all__ = [
    "LaunchConfig",
    "decode_codes_",
    "decode_meta",
    "dequantize_reference",
    "forced_config",
    "launch_ms",
    "quantize_reference",
    "triton_dequantize",
    "triton_quantize",
    "tuning_log",
]

_MASK32 = 0xFFFFFFFF
_BF16_NAN = 0x7FC0
_CONST_FLAG = 0x8000
_INV_2_16 = 1.0 / 65536.0
#: default block size of the reference (elements of the group matrix per step). A block holds
#: about 13 bytes per element in temporaries (fp32 values, int32 hash words and their scratch,
#: uint8 codes), so this bounds the reference's extra memory; smaller blocks pay Python overhead
#: per block (docs/design.md, the quantizer, gives the measured trade-off).
CHUNK_ELEMS = 1 << 18

#: Largest finite fp16. A group's range is stored rounded outward to bf16, so the top level
#: ``lo + (2^b - 1) * scale`` of a finite fp16 group near 65504 can exceed it and would round to
#: inf; dequantization clamps fp16 output to +-FP16_MAX (the true values lie inside, so this can
#: only move a reconstruction towards them).
FP16_MAX = torch.finfo(torch.float16).max


@functools.cache
def _inv_levels(bits: int) -> float:
    """``1 / (2**bits - 1)`` rounded to fp32 (the same constant in both paths)."""
    return struct.unpack("f", struct.pack("f", 1.0 / ((1 << bits) - 1)))[0]


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
    from gact_graph.kernels.rng import halves_to_u_half as _halves_to_u_half
    from gact_graph.kernels.rng import lowbias32 as _lowbias32

    @triton.jit
    def _tile(group0, num_groups, GROUPS: tl.constexpr, H: tl.constexpr, T: tl.constexpr,
              V: tl.constexpr):  # fmt: skip
        """This program's groups (int64), whether they exist, and the position in the group of
        each slot of a ``(H, 1, T, V)`` tile. A group is spread over ``T`` threads (the groups
        of a program over the warps), each holding ``H`` runs of ``V`` contiguous elements of
        it: its range needs few shuffles, and few threads compute its metadata."""
        pid = tl.program_id(0).to(tl.int64)
        grp = group0 + pid * GROUPS + tl.arange(0, GROUPS)
        h = tl.arange(0, H)[:, None, None, None]
        t = tl.arange(0, T)[None, None, :, None]
        v = tl.arange(0, V)[None, None, None, :]
        return grp, grp < num_groups, h * (T * V) + t * V + v

    @triton.jit
    def _packed_bytes(grp, live, BITS: tl.constexpr, G: tl.constexpr, H: tl.constexpr,
                      T: tl.constexpr, V: tl.constexpr, ES: tl.constexpr):  # fmt: skip
        """Byte offsets into ``packed`` of a ``(H, GROUPS, T, V // P)`` tile, ``P = 8 // BITS``
        (the bytes that pack the codes of the value tile of :func:`_tile`), and which exist.

        A thread accesses the values in vectors of ``min(V, 16 / ES)`` elements (``ES``: their
        bytes); the offsets are declared contiguous in runs of that vector's bytes only, so the
        packed side is laid out over the threads as the values are (otherwise Triton would give
        a thread the bytes of several threads' runs and move them through shared memory)."""
        P: tl.constexpr = 8 // BITS
        BPG: tl.constexpr = G * BITS // 8
        VEC: tl.constexpr = V if V * ES <= 16 else 16 // ES
        RUN_BYTES: tl.constexpr = VEC // P if VEC >= P else 1
        h = tl.arange(0, H)[:, None, None, None]
        t = tl.arange(0, T)[None, None, :, None]
        vb = tl.arange(0, V // P)[None, None, None, :]
        b = h * (T * V // P) + t * (V // P) + vb
        mask = live[None, :, None, None]
        if H * T * V != G:
            mask = mask & (b < BPG)
        offs = tl.max_contiguous(grp[None, :, None, None] * BPG + b, [1, 1, 1, RUN_BYTES])
        return offs, mask

    @triton.jit
    def _elements(grp, live, pos, numel, R, C, stride_r, stride_c, n, k, W, G: tl.constexpr,
                  BLOCK: tl.constexpr, DENSE: tl.constexpr, PARTIAL: tl.constexpr,
                  SPLIT: tl.constexpr):  # fmt: skip
        """Element offsets into the ``(R, C)`` view (strided) of positions ``pos`` of groups
        ``grp``, and which of them are real elements.

        ``DENSE``: group ``i`` is the flat range ``[i * G, (i + 1) * G)`` of a contiguous
        tensor (no padding inside it; ``PARTIAL``: the last group may end early), so the
        offsets are affine in ``pos`` and the loads and stores vectorize. ``SPLIT``: groups
        split rows (one row per group), so no position needs dividing by the row width.
        """
        if DENSE:
            offs = grp[None, :, None, None] * G + pos
            valid = live[None, :, None, None]
            if BLOCK != G:
                valid = valid & (pos < G)
            if PARTIAL:
                valid = valid & (offs < numel)
            out_offs = offs
        elif SPLIT:
            rb = grp // n
            j = grp - rb * n
            r = rb[None, :, None, None]
            c = j[None, :, None, None] * G + pos
            valid = live[None, :, None, None] & (c < C)
            if BLOCK != G:
                valid = valid & (pos < G)
            offs = r * stride_r + c * stride_c
            out_offs = r * C + c
        else:
            rb = grp // n
            j = grp - rb * n
            r = rb[None, :, None, None] * k + pos // W
            c = j[None, :, None, None] * G + pos % W
            valid = live[None, :, None, None] & (pos < k * W) & (r < R) & (c < C)
            offs = r * stride_r + c * stride_c
            out_offs = r * C + c
        return offs, out_offs, valid

    @triton.jit
    def _nan_min(a, b):
        return tl.minimum(a, b, tl.PropagateNan.ALL)

    @triton.jit
    def _nan_max(a, b):
        return tl.maximum(a, b, tl.PropagateNan.ALL)

    # Integer arguments are not specialized: Triton would compile another variant for every
    # value equal to 1 or divisible by 16, and a key equal to 1 would reach the hash as a
    # Python int. The strides keep their specialization (it lets strided loads vectorize).
    @triton.jit(do_not_specialize=["numel", "R", "C", "num_groups", "group0", "n", "k", "W",
                                   "key"])  # fmt: skip
    def _quantize_pack_kernel(
        x_ptr,
        packed_ptr,
        meta_ptr,
        numel,
        R,
        C,
        num_groups,
        group0,
        n,
        k,
        W,
        stride_r,
        stride_c,
        key,
        inv_levels,
        BITS: tl.constexpr,
        G: tl.constexpr,
        GROUPS: tl.constexpr,
        H: tl.constexpr,
        T: tl.constexpr,
        V: tl.constexpr,
        DENSE: tl.constexpr,
        PARTIAL: tl.constexpr,
        SPLIT: tl.constexpr,
        WIDE: tl.constexpr,
    ):
        """One program quantizes ``GROUPS`` groups: each element is read once, the group's
        range and the packed codes come from the same registers."""
        LEVELS: tl.constexpr = (1 << BITS) - 1
        P: tl.constexpr = 8 // BITS
        BLOCK: tl.constexpr = H * T * V
        ELEM_MASK: tl.constexpr = (not DENSE) or PARTIAL or BLOCK != G
        grp, live, pos = _tile(group0, num_groups, GROUPS, H, T, V)
        offs, _, valid = _elements(grp, live, pos, numel, R, C, stride_r, stride_c, n, k, W,
                                   G, BLOCK, DENSE, PARTIAL, SPLIT)  # fmt: skip
        x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)

        # Group range, NaN-propagating (a NaN makes the group non-finite, as an Inf does).
        if ELEM_MASK:
            x_lo = tl.where(valid, x, float("inf"))
            x_hi = tl.where(valid, x, -float("inf"))
        else:  # only whole groups are masked: their (zero) values are never stored
            x_lo = x
            x_hi = x
        # within each thread first (axes 3 and 0), then across the group's T threads
        lo = tl.reduce(tl.reduce(tl.reduce(x_lo, 3, _nan_min), 0, _nan_min), 1, _nan_min)
        hi = tl.reduce(tl.reduce(tl.reduce(x_hi, 3, _nan_max), 0, _nan_max), 1, _nan_max)
        finite = (tl.abs(lo) < float("inf")) & (tl.abs(hi) < float("inf"))
        # Keep the metadata arithmetic of dead/non-finite groups finite (it is discarded).
        lo = tl.where(finite, lo, 0.0)
        hi = tl.where(finite, hi, 0.0)

        # bf16 metadata: lo rounded down, scale rounded up (see the module docstring).
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

        const = finite & (hi == lo)
        regular = finite & (hi != lo) & (tl.abs(top) < float("inf"))
        lo16 = tl.where(regular, lo_b_bits >> 16, tl.where(const, lo_bits >> 16, 0x7FC0))
        sc16 = tl.where(
            regular, s_bits >> 16, tl.where(const, 0x8000 | ((lo_bits & 0xFFFF) >> 1), 0x7FC0)
        )
        bit = tl.where(const, lo_bits & 1, 0)
        keep = tl.where(regular, LEVELS, 0).to(tl.uint32)
        lo_q = tl.where(regular, lo_b, 0.0)
        inv = tl.where(regular, tl.math.div_rn(tl.full(lo.shape, 1.0, tl.float32), s), 0.0)

        # Stochastic rounding: q = round_half_even(min(t + u - 1/2, LEVELS)), t = (x - lo) / s.
        t = (x - lo_q[None, :, None, None]) * inv[None, :, None, None]
        # u - 1/2 per element, exact (see gact_graph.kernels.rng): one hash per pair of
        # elements, the even offset taking its low 16 bits, the odd one its high 16 bits
        PAIRED: tl.constexpr = (G % 2 == 0) and (V % 2 == 0) and (not WIDE)
        if PAIRED:  # a pair is two neighbours in one thread's run: hash once, split in place
            ph = tl.arange(0, H)[:, None, None, None]
            pt = tl.arange(0, T)[None, None, :, None]
            pv = tl.arange(0, V // 2)[None, None, None, :]
            # the key is added once per group, then each pair's place in the group
            base = (grp * (G // 2)).to(tl.uint32) + key.to(tl.uint32)
            slot = (ph * (T * V // 2) + pt * (V // 2) + pv).to(tl.uint32)
            u_lo, u_hi = _halves_to_u_half(_lowbias32(base[None, :, None, None] + slot))
            u_half = tl.reshape(tl.join(u_lo, u_hi), (H, GROUPS, T, V))
        else:
            eo = grp[None, :, None, None] * G + pos
            pair = eo >> 1
            if WIDE:  # offsets past 2**32: the key follows the pair's high word (`key` = seed)
                hi_key = _lowbias32((pair >> 32).to(tl.uint32) + 0x9E3779B9)
                h = _lowbias32(pair.to(tl.uint32) + _lowbias32(key.to(tl.uint32) ^ hi_key))
            else:  # every offset is below 2**32: one key, and 32-bit pair indices
                h = _lowbias32(pair.to(tl.uint32) + key.to(tl.uint32))
            m = (h >> ((eo & 1) * 16).to(tl.uint32)) & 0xFFFF
            u_half = ((m << 7) | 0x3F800000).to(tl.float32, bitcast=True) - 1.5
        w = tl.minimum(t + u_half, LEVELS * 1.0)
        # w + 1.5 * 2**23 rounds w to the nearest integer (ties to even), which then sits in the
        # low mantissa bits; w >= -1/2, so the integer is >= 0. NaN (non-regular groups) and
        # padding end up zero through `keep` / `valid`.
        code = (w + 12582912.0).to(tl.uint32, bitcast=True) & keep[None, :, None, None]
        code = code | bit[None, :, None, None]
        if ELEM_MASK:
            code = tl.where(valid, code, 0)

        # the P = 8 / BITS codes of a byte are adjacent along the tile's last axis (V >= P)
        shift = (tl.arange(0, P) * BITS).to(tl.uint32)[None, None, None, None, :]
        code = tl.reshape(code, (H, GROUPS, T, V // P, P))
        byte = tl.sum(code << shift, axis=4).to(tl.uint8)  # disjoint bits
        es: tl.constexpr = x_ptr.dtype.element_ty.primitive_bitwidth // 8
        boffs, bmask = _packed_bytes(grp, live, BITS, G, H, T, V, es)
        tl.store(packed_ptr + boffs, byte, mask=bmask)
        word = (lo16 | (sc16 << 16)).to(tl.int32, bitcast=True)  # (lo, scale) little-endian
        tl.store(meta_ptr + grp, word, mask=live)

    @triton.jit(do_not_specialize=["numel", "R", "C", "num_groups", "group0", "n", "k", "W"])
    def _unpack_dequantize_kernel(
        packed_ptr,
        meta_ptr,
        out_ptr,
        numel,
        R,
        C,
        num_groups,
        group0,
        n,
        k,
        W,
        BITS: tl.constexpr,
        G: tl.constexpr,
        GROUPS: tl.constexpr,
        H: tl.constexpr,
        T: tl.constexpr,
        V: tl.constexpr,
        DENSE: tl.constexpr,
        PARTIAL: tl.constexpr,
        SPLIT: tl.constexpr,
        OUT_BF16: tl.constexpr,
        OUT_FP16: tl.constexpr,
    ):
        """One program dequantizes ``GROUPS`` groups: each packed byte is read once and gives
        its ``8 / BITS`` values."""
        LEVELS: tl.constexpr = (1 << BITS) - 1
        P: tl.constexpr = 8 // BITS
        BLOCK: tl.constexpr = H * T * V
        grp, live, pos = _tile(group0, num_groups, GROUPS, H, T, V)
        _, offs, valid = _elements(grp, live, pos, numel, R, C, C, 1, n, k, W,
                                   G, BLOCK, DENSE, PARTIAL, SPLIT)  # fmt: skip
        es: tl.constexpr = out_ptr.dtype.element_ty.primitive_bitwidth // 8
        boffs, bmask = _packed_bytes(grp, live, BITS, G, H, T, V, es)
        byte = tl.load(packed_ptr + boffs, mask=bmask, other=0)
        shift = (tl.arange(0, P) * BITS).to(tl.uint32)[None, None, None, None, :]
        code = (byte.to(tl.uint32)[:, :, :, :, None] >> shift) & LEVELS
        code = tl.reshape(code, (H, GROUPS, T, V))

        word = tl.load(meta_ptr + grp, mask=live, other=0).to(tl.uint32, bitcast=True)
        lo16 = word & 0xFFFF
        sc16 = word >> 16
        const = (sc16 & 0x8000) != 0
        b0 = tl.where(const, (lo16 << 16) | ((sc16 & 0x7FFF) << 1), lo16 << 16)
        lo_eff = b0.to(tl.float32, bitcast=True)
        sc_eff = tl.where(
            const,
            (b0 | 1).to(tl.float32, bitcast=True) - lo_eff,
            (sc16 << 16).to(tl.float32, bitcast=True),
        )
        # the code as fp32 without a conversion instruction: 2**23 + code, minus 2**23
        code_f = (code | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        # lo + code * scale in one instruction: the product is exact (at most 8 + 8 significant
        # bits), so the fused form rounds once, as the reference's separate multiply and add do
        val = tl.fma(code_f, sc_eff[None, :, None, None], lo_eff[None, :, None, None])
        if OUT_FP16:  # 65504 = FP16_MAX (see there); NaN groups stay NaN
            val = tl.minimum(tl.maximum(val, -65504.0, tl.PropagateNan.ALL), 65504.0,
                             tl.PropagateNan.ALL)  # fmt: skip
        if OUT_BF16:
            # Round to nearest even on the bits (as torch does; Triton's interpreter truncates),
            # storing through an int16 view of the output. NaN -> torch's canonical 0x7FC0.
            vb = val.to(tl.uint32, bitcast=True)
            vb = (vb + 0x7FFF + ((vb >> 16) & 1)) >> 16
            vb = tl.where(val != val, 0x7FC0, vb)
            tl.store(out_ptr + offs, vb.to(tl.int16), mask=valid)
        else:
            tl.store(out_ptr + offs, val.to(out_ptr.dtype.element_ty), mask=valid)


class LaunchConfig(NamedTuple):
    """How the quantize / dequantize kernels cut the groups into programs and threads."""

    elems: int  #: elements per program (whole groups: a power of 2 of them)
    warps: int  #: warps per program
    threads: int  #: threads sharing a group
    run: int  #: contiguous elements a thread holds per run (see :func:`tile_shape`)


#: Configurations the lazy autotuner times. Fewer threads per group make its range cheaper
#: (fewer shuffles, metadata computed by fewer threads) but give each thread more elements, hence
#: more registers and fewer resident programs (less memory traffic in flight); 16 threads per
#: group halve both. A thread accesses at most 16 contiguous bytes at once, so a run longer than
#: that is shared by neighbouring threads: 8-element fp32 runs make each warp instruction cover
#: 256 contiguous bytes of a group instead of 128. Few entries: each one is a compilation the
#: first time a width is used.
CONFIGS = (
    LaunchConfig(4096, 4, 8, 8),
    LaunchConfig(4096, 4, 8, 4),
    LaunchConfig(8192, 8, 8, 8),
    LaunchConfig(8192, 4, 4, 8),
    LaunchConfig(2048, 4, 16, 4),
)
#: what runs untuned (small tensors, no CUDA, ``GACT_GRAPH_AUTOTUNE=0``): for quantize the
#: configuration with the fewest instructions per element; for dequantize 8-element runs, the
#: shape of the dequantize cases that ran fastest on the GPU (docs/results/gpu.md)
DEFAULTS = {"quantize": CONFIGS[1], "dequantize": CONFIGS[0]}
_TUNED: dict[tuple, LaunchConfig] = {}
#: milliseconds per launch of every configuration, for each key the tuner has timed
_TIMINGS: dict[tuple, dict[LaunchConfig, float]] = {}
_FORCED: list[LaunchConfig] = []
#: tensors with fewer (padded) elements than this never tune
TUNE_MIN_ELEMS = 1 << 20
#: back-to-back launches the tuner times per configuration (and rounds of them, best kept):
#: enough that the device, not the host's launch path, sets the pace on a large tensor
TUNE_LAUNCHES = 10
TUNE_ROUNDS = 2
#: padded sizes from which the quantizer keys its RNG per element (offsets past 2**32); a test
#: lowers it to run that path on small tensors
WIDE_FROM = 1 << 32
_SM_COUNT: dict[int, int] = {}


def _autotune_enabled(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and os.environ.get("TRITON_INTERPRET", "0") != "1"
        and os.environ.get("GACT_GRAPH_AUTOTUNE", "1") != "0"
    )


def _sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _is_dense(layout: GroupLayout) -> bool:
    """Group ``i`` is the flat range ``[i * g, (i + 1) * g)`` of the row-major tensor."""
    g, n, k, cols = layout.group_size, layout.groups_per_row, layout.rows_per_group, layout.cols
    return (k == 1 and n * g == cols) or (k > 1 and k * cols == g)


def tile_shape(
    g: int, bits: int, element_size: int, threads: int, run: int = 1
) -> tuple[int, int, int]:
    """``(H, T, V)``: a group is an ``(H, T, V)`` tile, ``T`` threads each holding ``H`` runs
    of ``V`` contiguous elements, ``V`` at least ``run``, one 16-byte vector of the unpacked
    dtype and one packed byte's codes; ``H * T * V`` is ``g`` rounded up to a power of 2."""
    block = triton.next_power_of_2(g)
    v = min(max(triton.next_power_of_2(run), 16 // element_size, 8 // bits), block)
    t = max(1, min(threads, block // v))
    return block // (t * v), t, v


@contextlib.contextmanager
def forced_config(cfg: LaunchConfig) -> Iterator[None]:
    """Within the block every launch uses ``cfg`` and nothing is tuned (benchmarks, tests)."""
    _FORCED.append(LaunchConfig(*cfg))
    try:
        yield
    finally:
        _FORCED.pop()


def tuning_log() -> dict[tuple, tuple[LaunchConfig, dict[LaunchConfig, float]]]:
    """For each ``(kind, bits, g, element size, dense)`` tuned so far: the configuration chosen
    and every configuration's milliseconds per launch."""
    return {key: (cfg, dict(_TIMINGS.get(key, {}))) for key, cfg in _TUNED.items()}


def _launch(
    kind: str,
    bits: int,
    layout: GroupLayout,
    element_size: int,
    device: torch.device,
    dense: bool,
    run,
) -> None:
    """Run ``run(grid, ints, constexprs)`` over all groups: ``ints`` are the kernels' layout
    arguments ``(numel, R, C, num_groups, group0, n, k, W)``, ``constexprs`` their tile
    parameters and ``num_warps``.

    The configuration is tuned once per ``(kind, bits, g, element size, dense)`` on CUDA, at
    first use, never per tensor size; programs are then made smaller only where a small tensor
    would leave most of the device idle. A dense layout whose last group ends early runs that
    group in a launch of its own, so the bulk keeps group-level masks (and vectorized loads and
    stores).
    """
    g, ng = layout.group_size, layout.num_groups
    block = triton.next_power_of_2(g)
    partial = dense and layout.rows * layout.cols != ng * g

    def launch(group0: int, end: int, groups: int, part: bool, warps: int, tile) -> None:
        """Groups ``[group0, end)``, ``groups`` per program."""
        ints = (layout.rows * layout.cols, layout.rows, layout.cols, end, group0,
                layout.groups_per_row, layout.rows_per_group, layout.row_width)  # fmt: skip
        cx = dict(BITS=bits, G=g, GROUPS=groups, H=tile[0], T=tile[1], V=tile[2], DENSE=dense,
                  PARTIAL=part, SPLIT=layout.rows_per_group == 1, num_warps=warps)  # fmt: skip
        run((triton.cdiv(end - group0, groups),), ints, cx)

    def go(cfg: LaunchConfig) -> None:
        tile = tile_shape(g, bits, element_size, cfg.threads, cfg.run)
        groups = triton.next_power_of_2(max(1, cfg.elems // block))
        if device.type == "cuda":  # at least about two programs per SM where the size allows
            while groups > 1 and -(-ng // groups) < 2 * _sm_count(device):
                groups //= 2
        bulk = ng - 1 if partial else ng
        if bulk > 0:
            launch(0, bulk, groups, False, cfg.warps, tile)
        if partial:
            launch(ng - 1, ng, 1, True, 4, tile)

    if _FORCED:
        go(_FORCED[-1])
        return
    key = (kind, bits, g, element_size, dense)
    cfg = _TUNED.get(key)
    if cfg is None:
        # a small tensor's timings say little (launch overhead): it runs the default and the
        # first large tensor of this kind tunes
        if not _autotune_enabled(device) or ng * g < TUNE_MIN_ELEMS:
            cfg = DEFAULTS[kind]
        else:
            _TIMINGS[key] = _time_configs(go, device)
            cfg = min(_TIMINGS[key], key=_TIMINGS[key].__getitem__)
            _TUNED[key] = cfg
    go(cfg)


def launch_ms(fn, launches: int, rounds: int) -> float:
    """Milliseconds per call of ``fn`` on the current CUDA device: CUDA events around
    ``launches`` calls queued back to back, best of ``rounds``. While the host's launch path is
    shorter than the kernels it stays hidden, so this is the device's time."""
    best = float("inf")
    for _ in range(rounds):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(launches):
            fn()
        stop.record()
        stop.synchronize()
        best = min(best, start.elapsed_time(stop) / launches)
    return best


def _time_configs(go, device: torch.device) -> dict[LaunchConfig, float]:
    """Milliseconds per launch of each of `CONFIGS` on this call's tensor (each one's output is
    the same)."""
    times = {}
    with torch.cuda.device(device):
        for cfg in CONFIGS:
            go(cfg)  # compile and warm up
            times[cfg] = launch_ms(lambda c=cfg: go(c), TUNE_LAUNCHES, TUNE_ROUNDS)
    return times


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
        dense = _is_dense(layout) and x2d.is_contiguous()
        wide = layout.padded_numel > WIDE_FROM
        key = (seed & _MASK32) if wide else rng_key(seed)
        key = key - (1 << 32) if key >= 1 << 31 else key  # as int32
        meta32 = meta.view(torch.int32)

        def run(grid, ints, cx):
            _quantize_pack_kernel[grid](
                x2d, packed, meta32, *ints, x2d.stride(0), x2d.stride(1), key, _inv_levels(bits),
                WIDE=wide, **cx,
                enable_fp_fusion=False,  # t + u must round after t = (x - lo) * inv
            )  # fmt: skip

        _launch("quantize", bits, layout, x.element_size(), x.device, dense, run)
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
        meta32 = meta.view(torch.int16).view(torch.int32)
        out_k = out.view(torch.int16) if dtype == torch.bfloat16 else out
        flags = dict(OUT_BF16=dtype == torch.bfloat16, OUT_FP16=dtype == torch.float16)

        def run(grid, ints, cx):
            _unpack_dequantize_kernel[grid](
                packed, meta32, out_k, *ints, **flags, **cx,
                enable_fp_fusion=False,  # the only fused operation is the explicit tl.fma
            )  # fmt: skip

        dense = _is_dense(layout)
        _launch("dequantize", bits, layout, out.element_size(), packed.device, dense, run)
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
    inv_q: Tensor  # fp32 1 / step used for rounding (0 in non-regular groups)
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
        inv_q=torch.where(regular, 1.0 / s, 0.0),
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
        v = m.sub(p.lo_q[:, None]).mul_(p.inv_q[:, None])
        # contiguous whatever v's strides (a transposed square input gives a transposed v):
        # the draws are numbered in group-matrix order, as the Triton kernel numbers them
        h = torch.empty(v.shape, dtype=torch.int32, device=v.device)
        h = uniform_bits_range_(h, seed, blk.first * g)
        # v + (u - 1/2) with u = h * 2**-16: the product is exact, so this is one rounding;
        # then round half to even, which is floor(v + u) but at exact ties.
        h.sub_(0x8000)
        v.add_(h, alpha=_INV_2_16).clamp_(max=levels).round_()
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


def decode_codes_(vals: Tensor, scale: Tensor, lo: Tensor, dtype: torch.dtype) -> Tensor:
    """fp32 codes ``vals`` as the values they stand for, in place: ``code * scale + lo`` (the
    product is exact, so a fused multiply-add gives the same), clamped to fp16's range for
    fp16 output (see ``FP16_MAX``; the clamp keeps NaN groups NaN). ``scale`` and ``lo``
    broadcast against ``vals``."""
    vals.mul_(scale).add_(lo)
    if dtype == torch.float16:
        vals.clamp_(-FP16_MAX, FP16_MAX)
    return vals


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
        vals = decode_codes_(codes.view(-1, g), scale[:, None], lo[:, None], dtype)
        if not direct:
            dst.copy_(_from_group_matrix(vals, blk, layout))
    return out
