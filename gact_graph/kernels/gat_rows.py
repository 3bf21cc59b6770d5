"""What GAT's and GATv2's fused edge stages (`gact_graph.kernels.gat_edge`,
`gact_graph.kernels.gatv2_edge`) share: the ``@triton.jit`` helpers their kernels walk a
destination-sorted CSR's rows with, the dropout draw, node features read from their codes, the
blocking tuner, the CSR transpose and the references' softmax and aggregation.

A kernel's program starts from its head and offsets (`prologue`) and walks its rows
(`csr_row`: one block of ``ROWS`` rows; GATv2's backward row pass strides over them), reading
each row's edges ``BLOCK_E`` at a time. No E x H x C and no E x H tensor exists in either
direction. Everything accumulates in fp32; offsets into N x H x C tensors are
int64.

**Attention dropout** is drawn in the kernels with Triton's Philox (`tl.rand`) from a seed
(an int64 one-element tensor, read in the kernel: no host sync) and the counter ``k * H + h``
of CSR edge ``k`` and head ``h`` (`dropout_multiplier`). Backward regenerates it bit for bit;
no mask is stored. `gact_graph.kernels.gat_edge.gat_edge_dropout_keep` materializes the same
mask (tests and debugging).

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
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
from torch import Tensor

from gact_graph.kernels.layout import GroupLayout

try:  # Triton is optional; the references below never need it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

__all__ = [
    "CodedFeatures",
    "KERNEL_DTYPES",
    "SOFTMAX_EPS",
    "TUNE",
    "aggregate_reference",
    "check_transpose",
    "coded_features",
    "csr_transpose",
    "degree_bucket",
    "destinations",
    "draw_seed",
    "dropout_args",
    "edge_softmax_reference",
    "feature_args",
    "masked_attend_reference",
    "require_triton",
    "tuned_blocking",
]

#: Feature dtypes the kernels take (they accumulate in fp32; float64 stays on the PyTorch path).
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: PyG's softmax adds this to the sum of exponentials.
SOFTMAX_EPS = 1e-16


def require_triton() -> None:
    if triton is None:
        raise RuntimeError("the fused GAT edge kernels need Triton: pip install triton")


# ---------------------------------------------------------------------------- kernel helpers
if triton is not None:

    @triton.jit
    def dropout_multiplier(seed, k, h, H, p, drop_scale):
        """``keep / (1 - p)`` of CSR edges ``k`` (int64) at head ``h``: Philox at counter
        ``k * H + h``."""
        u = tl.rand(seed, k * H + h)
        return tl.where(u >= p, drop_scale, 0.0)

    @triton.jit
    def prologue(seed_ptr, C, DROPOUT: tl.constexpr, BLOCK_E: tl.constexpr,
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
    def csr_row(rowptr_ptr, pid, r, num_rows, offs_c, cmask, ROWS: tl.constexpr):
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
    def gather(ptr, nodes, h, HC, C, offs_c, emask, cmask):
        """Rows ``nodes`` (one per edge of a block) of an N x H x C tensor at head ``h``, as an
        fp32 edges x channels tile, zero where an edge or channel is masked off."""
        return tl.load(
            ptr + nodes[:, None] * HC + h * C + offs_c[None, :],
            mask=emask[:, None] & cmask[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip

    @triton.jit
    def load_row(ptr, row, h, HC, C, offs_c, mask):
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
    def gather_features(ptr, meta_ptr, nodes, h, H, C, offs_c, emask, cmask, qk, qn, qg,
                        BITS: tl.constexpr, ROUND: tl.constexpr):  # fmt: skip
        """`gather` of node features that are dense (``BITS == 0``) or quantized codes
        (``ptr`` the packed bytes, ``meta_ptr`` the groups' metadata words; `_decode`)."""
        # if / else, not an early return: Triton compiles what follows a return in a
        # constexpr branch too, and `_decode` does not compile for dense 16-bit features
        if BITS == 0:
            val = gather(ptr, nodes, h, H * C, C, offs_c, emask, cmask)
        else:
            r = nodes * H + h
            val = _decode(ptr, meta_ptr, r[:, None], offs_c[None, :],
                          emask[:, None] & cmask[None, :], C, qk, qn, qg, BITS, ROUND)  # fmt: skip
        return val

    @triton.jit
    def feature_row(ptr, meta_ptr, row, h, H, C, offs_c, mask, qk, qn, qg,
                    BITS: tl.constexpr, ROUND: tl.constexpr):  # fmt: skip
        """`load_row` of node features that are dense or quantized codes, as
        `gather_features`."""
        if BITS == 0:  # (if / else as in `gather_features`)
            val = load_row(ptr, row, h, H * C, C, offs_c, mask)
        else:
            val = _decode(ptr, meta_ptr, offs_c * 0 + (row * H + h), offs_c, mask, C, qk, qn,
                          qg, BITS, ROUND)  # fmt: skip
        return val

    @triton.jit
    def transposed_multiplier(seed, t_pos_ptr, j, emask, h, H, p, drop_scale,
                              HAS_POS: tl.constexpr):  # fmt: skip
        """The dropout multiplier of the transpose's edges ``j``: drawn at their CSR positions
        (``t_pos``, or ``j`` itself where the two orders agree)."""
        k = j
        if HAS_POS:
            k = tl.load(t_pos_ptr + j, mask=emask, other=0).to(tl.int64)
        return dropout_multiplier(seed, k, h, H, p, drop_scale)


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


def tuned_blocking(key: tuple, bucket: int, run, device: torch.device, config=None, rows=True):
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


def dropout_args(p: float, seed: Tensor | None, device: torch.device):
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


def feature_args(x: Tensor | CodedFeatures) -> tuple:
    """``(data, metadata, (rows per group, groups per row, group size), bits, round)``: the
    kernels' arguments for features ``x``, dense (``bits`` 0; the metadata pointer unused) or
    `CodedFeatures`."""
    if isinstance(x, CodedFeatures):
        lay = x.layout
        layout = (lay.rows_per_group, lay.groups_per_row, lay.group_size)
        return x.packed, x.meta, layout, x.bits, _ROUND[x.dtype]
    x = x.contiguous()
    return x, x, (1, 1, 1), 0, 0


def check_transpose(t_rowptr: Tensor, t_col: Tensor, t_pos: Tensor | None, col: Tensor,
                    num_src: int) -> None:  # fmt: skip
    if t_rowptr.numel() != num_src + 1 or t_col.shape != col.shape:
        raise ValueError("the transpose must have N_src + 1 row pointers and E columns")
    if t_pos is not None and t_pos.shape != col.shape:
        raise ValueError("t_pos must hold one CSR position per edge")


def draw_seed(device: torch.device | str) -> Tensor:
    """A fresh dropout seed (one-element int64 tensor on ``device``) from the device's default
    generator: a device-side draw, so no host sync; reproducible under ``torch.manual_seed``."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)


def destinations(rowptr: Tensor, col: Tensor) -> Tensor:
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
    dst = destinations(rowptr, col)
    t_col = dst[t_pos].to(col.dtype)
    pos_dtype = torch.int32 if col.numel() <= 2**31 - 1 else torch.int64
    return t_rowptr, t_col, t_pos.to(pos_dtype)


# ---------------------------------------------------------------------------- references
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


def masked_attend_reference(logit, x, src, dst, num_dst: int, dropout: float, keep) -> Tensor:
    """The references' softmax (PyG's), dropout by ``keep`` and aggregation, in fp32."""
    alpha = edge_softmax_reference(logit, dst, num_dst)
    if dropout > 0:
        if keep is None:
            raise ValueError("the reference needs the keep-mask when dropout > 0")
        alpha = alpha * (keep.to(alpha.dtype) * (0.0 if dropout >= 1 else 1.0 / (1.0 - dropout)))
    return aggregate_reference(alpha, x.float(), src, dst, num_dst)
