"""Compressed features read in parts: what an attention edge stage's backward (GAT's
``x_src``, GATv2's ``x_l`` and ``x_r``) does with a saved N x H x C tensor handed back
compressed, as a matrix that reads a row range at a time (`row_matrix`: the sensitivity
probe's `RowChunked`, handed to Functions that set ``reads_row_chunks``; `as_rows` saves
them as such a matrix), instead of dequantizing it whole.

`SourceRows` serves gathers by source (any rows, in any order) from the codes unpacked once,
a byte per element; `DestinationRows` serves gathers by destination, which in a
destination-sorted CSR are a contiguous row range per edge chunk, unpacking only those rows;
both decode through `RowCodes` (codes and per-row ``lo`` / ``scale``), giving the values of
``q.dequantize()``. `reader_bytes` and `destination_span_codes` state what reading in parts
holds, for the Functions' stated lean-backward bounds (`gact_graph.budget.probe_cost`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "DestinationRows",
    "as_rows",
    "RowCodes",
    "SourceRows",
    "codes_readable",
    "destination_span_codes",
    "reader_bytes",
    "row_matrix",
]


def as_rows(x: Tensor) -> Tensor:
    """Features N x H x C as their (N * H) x C view (the same quantization groups), which a
    probe hands back as a matrix read by rows (`row_matrix`); ``x`` itself where no such
    view exists."""
    if x.dim() == 3 and x.is_contiguous() and x.numel() > 0:
        return x.view(-1, x.shape[-1])
    return x


def row_matrix(x: Tensor):
    """The compressed matrix behind ``x`` when ``x`` reads a row range at a time (a tensor
    with ``q``, whose ``q.rows(r0, r1).dequantize()`` gives rows ``r0:r1``: the sensitivity
    probe's `RowChunked`), else None."""
    q = getattr(x, "q", None)
    return q if q is not None and callable(getattr(q, "rows", None)) else None


class RowCodes:
    """Decoding of a compressed (N * H) x C matrix ``q`` whose groups hold whole rows without
    padding, read as N x H x C: codes one byte per element (`unpack_bits`) and, per (node,
    head) row, its group's fp32 ``lo`` and ``scale`` (made once, 2 / C of an fp32 copy), so
    that any rows dequantize as ``code * scale + lo`` in fp32, the operations and values of
    ``q.dequantize()`` (`dequantize_reference`; its product is exact, so the Triton
    dequantizer's fused multiply-add gives the same), without decoding the metadata again
    for each part. `RowCodes.of` is None for other layouts."""

    def __init__(self, q, heads: int, channels: int) -> None:
        from gact_graph.kernels.quantize import decode_meta

        lay = q.layout
        self.q, self.heads, self.channels, self.k = q, heads, channels, lay.rows_per_group
        self.bytes_per_group = lay.packed_nbytes(q.bits) // lay.num_groups
        lo, scale, _ = decode_meta(q.meta)
        self.lo = lo.repeat_interleave(self.k)[: lay.rows].view(-1, heads)
        self.scale = scale.repeat_interleave(self.k)[: lay.rows].view(-1, heads)

    @classmethod
    def of(cls, q, heads: int, channels: int):
        lay = getattr(q, "layout", None)
        whole_rows = (
            lay is not None and lay.groups_per_row == 1 and lay.num_groups > 0
            and lay.group_size == lay.rows_per_group * lay.cols
        )  # fmt: skip
        return cls(q, heads, channels) if whole_rows else None

    def codes(self, r0: int, r1: int) -> Tensor:
        """uint8 codes of node rows ``r0:r1`` (``r0 * heads`` a multiple of the rows per
        group) as (r1 - r0) x H x C."""
        from gact_graph.kernels.bitpack import unpack_bits

        first, last = r0 * self.heads // self.k, -(-r1 * self.heads // self.k)
        b = self.bytes_per_group
        g = self.q.layout.group_size
        codes = unpack_bits(self.q.packed[first * b : last * b], self.q.bits, (last - first) * g)
        return codes.view(-1, self.channels)[: (r1 - r0) * self.heads].view(
            r1 - r0, self.heads, self.channels
        )

    def decode(self, codes: Tensor, rows: Tensor, dtype: torch.dtype) -> Tensor:
        """Values of ``codes`` (m x H x C) of the node rows ``rows`` (m), in ``dtype``."""
        from gact_graph.kernels.quantize import decode_codes_

        scale = self.scale.index_select(0, rows).unsqueeze(-1)
        lo = self.lo.index_select(0, rows).unsqueeze(-1)
        return decode_codes_(codes.to(torch.float32), scale, lo, dtype).to(dtype)


class DestinationRows:
    """GATv2's destination features ``x_r`` (N x H x C) as its edge stage reads them: gathered
    by each edge's destination, which in a destination-sorted CSR is a contiguous row range
    per edge chunk.

    ``x`` is dense (N x H x C, or its (N * H) x C view) or a compressed matrix that reads a
    row range at a time (`row_matrix`: the sensitivity probe's `RowChunked`, handed to
    Functions that set ``reads_row_chunks``). A compressed one is dequantized one gather
    chunk's rows at a time (`RowCodes` where its layout allows, else ``q.rows``), never whole:
    the probe runs this backward on top of the user's, where one more N x H x C copy adds to
    the step's peak. ``bounds(chunk)`` finds the rows each gather chunk of ``chunk`` edges
    reads (one host sync); a dense one needs none and is gathered as before."""

    def __init__(self, x: Tensor, rowptr: Tensor, heads: int, channels: int) -> None:
        q = row_matrix(x)
        self.compressed = q is not None
        self.heads, self.channels, self.rowptr = heads, channels, rowptr
        self.shape = (x.numel() // (heads * channels), heads, channels)
        self.dtype, self.device = x.dtype, x.device
        self.x = self.q = self.codes = None
        if self.compressed:
            self.q, self.codes = q, RowCodes.of(q, heads, channels)
            # a node row range starts on a group when its first (N * H)-row does
            step = max(1, int(q.row_step()))
            self.align = step // math.gcd(step, heads)
        else:
            self.x = x.view(self.shape)
        self._bounds: dict[int, tuple[int, int]] = {}

    def bounds(self, chunk: int) -> None:
        """Finds the first and last destination row of every gather chunk (edges ``s:s +
        chunk`` for ``s`` a multiple of ``chunk``, the gathers of `EdgeChunks`, whose wide
        chunks are multiples of ``chunk``)."""
        if not self.compressed:
            return
        num_edges = int(self.rowptr[-1]) if self.rowptr.numel() else 0
        starts = list(range(0, num_edges, chunk))
        ends = [min(s + chunk, num_edges) - 1 for s in starts]
        pos = torch.tensor(starts + ends, dtype=self.rowptr.dtype, device=self.rowptr.device)
        rows = (torch.searchsorted(self.rowptr, pos, right=True) - 1).tolist()
        self._bounds = dict(zip(starts, zip(rows[: len(starts)], rows[len(starts) :])))

    def gather(self, start: int, dst: Tensor) -> Tensor:
        """``x_r[dst]`` (dtype of ``x_r``) for the gather chunk starting at edge ``start``."""
        if not self.compressed:
            return self.x.index_select(0, dst)
        d0, d1 = self._bounds[start]
        base = d0 - d0 % self.align
        if self.codes is not None:
            codes = self.codes.codes(base, d1 + 1).index_select(0, dst - base)
            return self.codes.decode(codes, dst, self.dtype)
        h = self.heads
        rows = self.q.rows(base * h, (d1 + 1) * h).dequantize()
        return rows.view(-1, h, self.channels).index_select(0, dst - base)


class SourceRows:
    """Source features (GATv2's ``x_l``, GAT's ``x_src``; N x H x C) as an edge stage reads
    them: gathered by each edge's source (any rows, in any order), through
    ``index_select(0, idx)``.

    ``x`` is dense (N x H x C, or its (N * H) x C view) or a compressed matrix
    (`row_matrix`). A compressed one whose layout `RowCodes` reads keeps its codes unpacked
    (one byte per element, a quarter of an fp32 copy) and dequantizes each gather, never the
    whole tensor; another layout is dequantized whole (the same values)."""

    def __init__(self, x: Tensor, heads: int, channels: int) -> None:
        # N x H x C, or its (N * H) x C view
        self.shape = (x.shape[0] if x.dim() == 3 else x.shape[0] // heads, heads, channels)
        self.dtype, self.device = x.dtype, x.device
        q = row_matrix(x)
        self.decoder = None if q is None else RowCodes.of(q, heads, channels)
        if self.decoder is None:
            self.x = (x.dense() if q is not None else x).view(self.shape)
            return
        self.x = None
        self.codes = self.decoder.codes(0, self.shape[0])

    def index_select(self, dim: int, idx: Tensor) -> Tensor:
        if self.x is not None:
            return self.x.index_select(dim, idx)
        return self.decoder.decode(self.codes.index_select(0, idx), idx, self.dtype)


#: bytes per quantization group that decoding a compressed input's metadata holds at once at
#: most (`decode_meta`: its int64 copy of the metadata and the int64 / fp32 / bool temporaries
#: of each bit pattern it forms, with room), and per (node, head) row while `RowCodes` expands
#: the per-group ``lo`` and ``scale`` to rows (an int64 index and the fp32 result)
_META_GROUP_BYTES, _META_ROW_BYTES = 160, 24


#: bytes per code that unpacking held at once at most, over the code widths a plan may choose
#: (`unpack_bits`: at 4 bits the int32 copy of the packed bytes, two bytes a code, and the
#: uint8 codes)
_UNPACK_BYTES = 3


def codes_readable(lay) -> bool:
    """Whether `RowCodes` reads a compressed input of layout ``lay`` (`RowCodes.of`); None (not
    a matrix, which the probe hands whole) it does not."""
    return lay is not None and (
        lay.groups_per_row == 1 and lay.num_groups > 0
        and lay.group_size == lay.rows_per_group * lay.cols
    )  # fmt: skip


def destination_span_codes(rowptr: Tensor, num_edges: int, chunk: int, heads: int, lay) -> int:
    """The most codes `DestinationRows.gather` unpacks at once from a compressed ``x_r`` of
    layout ``lay`` (`RowCodes.codes` of a gather chunk's destination rows, from the group its
    first row lies in): exact, from the CSR's rows of each gather chunk's first and last
    edge (one host sync)."""
    if num_edges == 0:
        return 0
    k = lay.rows_per_group
    align = k // math.gcd(k, heads)
    starts = torch.arange(0, num_edges, chunk, dtype=torch.int64, device=rowptr.device)
    ends = (starts + chunk).clamp_(max=num_edges).sub_(1)
    d0 = torch.searchsorted(rowptr, starts.to(rowptr.dtype), right=True).sub_(1).to(torch.int64)
    d1 = torch.searchsorted(rowptr, ends.to(rowptr.dtype), right=True).sub_(1).to(torch.int64)
    base = d0 - d0 % align
    first = base * heads // k
    last = ((d1 + 1) * heads + k - 1) // k
    return int((last - first).max()) * lay.group_size


def reader_bytes(role: str, lay, c: int, heads: int, channels: int, item: int,
                        span_codes: int) -> tuple[int, int, int, int]:  # fmt: skip
    """What reading a compressed GATv2 input of layout ``lay`` in parts (``role`` "source":
    `SourceRows`, "destination": `DestinationRows`, both through `RowCodes`) holds:
    ``(kept, made, peak, result)``: bytes kept from the reader's making to the end of the
    backward, at most held while it is made, at most held by one gather of ``c`` edges, and
    the gather's result (``item`` bytes an element)."""
    rows, groups = lay.rows, lay.num_groups
    lo_scale = 8 * groups * lay.rows_per_group  # fp32 lo and scale per (node, head) row
    meta = _META_GROUP_BYTES * groups + _META_ROW_BYTES * groups * lay.rows_per_group
    hc = heads * channels
    # a gather's decoding: the uint8 codes gathered, their fp32 values, the gathered lo and
    # scale, and the values in the input's dtype where it is not fp32
    decode = c * hc * (1 + 4 + (item if item != 4 else 0)) + 8 * c * heads
    result = c * hc * item
    if role == "source":  # every code unpacked once (one byte each), then gathered
        codes = groups * lay.group_size
        return lo_scale + codes, max(meta, lo_scale + _UNPACK_BYTES * codes), decode, result
    # a gather chunk's destination rows unpacked, then gathered by destination
    del rows
    unpack = max(_UNPACK_BYTES * span_codes, span_codes + 8 * c + c * hc)
    return lo_scale, meta, max(unpack, decode), result
