"""A compressed matrix that a matmul's backward reads a row chunk at a time.

The weight gradient of ``mat1 @ W`` is ``mat1^T G``: a sum over rows, which needs no more than
a row chunk of ``mat1`` dequantized at once. Autograd's ``MmBackward0`` / ``AddmmBackward0``
unpack ``mat1`` whole, though, so a compressed ``mat1`` costs one full-precision copy of it on
top of everything else the backward holds. `RowChunked` stands in for that copy: a tensor
subclass with ``mat1``'s shape, dtype and device whose data stay compressed; the two products
the matmul backward computes with it (``mat1.t().mm(G)`` and ``G.t().mm(mat1)``, see PyTorch's
``mm_mat2_backward``) are summed over row chunks (`chunked_tmm`), and any other operation gets
the whole dequantized copy (correct, just not lean). The sensitivity probe hands it to the
matmul nodes of its partial backwards (`gact_graph.policy.sensitivity`), where that copy would
be the largest single transient of a probed step on GAT. The fused graph-attention Functions
(``reads_rows_every_step``), whose kernels read packed codes, get it in every step too: the
controller's unpack hook hands it inside their `gact_graph.switches.reading_rows`
(`gact_graph.core.controller.Stored.unpack_rows`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from gact_graph.core.quantize import QTensor

aten = torch.ops.aten

#: a matrix is read in at most this many chunks (the loop's cost stays bounded, the transient
#: is an eighth of a dense copy) ...
MAX_CHUNKS = 8
#: ... of at least this many elements (a 64-wide matrix of 1,000 rows is one chunk)
MIN_CHUNK_ELEMS = 1 << 16


def row_ranges(q: QTensor, chunk_elems: int | None = None):
    """``(r0, r1)`` row ranges of ``q``'s 2-D view of about ``chunk_elems`` elements (default:
    an eighth of the matrix, `MAX_CHUNKS`, at least `MIN_CHUNK_ELEMS`), each starting on a
    group (`QTensor.rows`)."""
    if chunk_elems is None:
        chunk_elems = max(MIN_CHUNK_ELEMS, -(-q.numel() // MAX_CHUNKS))
    step = q.row_step()
    rows, cols = q.layout.rows, max(q.layout.cols, 1)
    per = max(step, chunk_elems // cols // step * step)
    for r0 in range(0, rows, per):
        yield r0, min(rows, r0 + per)


def chunked_tmm(q: QTensor, g: Tensor, chunk_elems: int | None = None) -> Tensor:
    """``q.dequantize().t() @ g`` (``q`` 2-D ``N x K``, ``g`` ``N x M``) dequantizing one row
    chunk of ``q`` at a time: ``K x M``."""
    dtype = torch.promote_types(q.dtype, g.dtype)
    out = torch.zeros(q.shape[1], g.shape[1], dtype=dtype, device=g.device)
    for r0, r1 in row_ranges(q, chunk_elems):
        x = q.rows(r0, r1).dequantize().to(dtype)
        out.addmm_(x.t(), g[r0:r1].to(dtype))
        del x
    return out


class RowChunked(Tensor):
    """``q`` (a 2-D `QTensor`) as a tensor, or its transpose when ``transposed``; see the
    module docstring."""

    q: QTensor
    transposed: bool

    @staticmethod
    def __new__(cls, q: QTensor, transposed: bool = False):
        if len(q.shape) != 2:
            raise ValueError(f"RowChunked holds a matrix, got shape {tuple(q.shape)}")
        rows, cols = q.shape
        shape, strides = ((cols, rows), (1, cols)) if transposed else ((rows, cols), (cols, 1))
        out = Tensor._make_wrapper_subclass(
            cls, shape, strides=strides, dtype=q.dtype, device=q.device, requires_grad=False
        )
        out.q, out.transposed = q, transposed
        return out

    def __repr__(self) -> str:  # the default repr would read the (absent) data
        t = ".t()" if self.transposed else ""
        return f"RowChunked({tuple(self.q.shape)}, {self.q.bits} bits){t}"

    def dense(self) -> Tensor:
        x = self.q.dequantize()
        return x.t() if self.transposed else x

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            (x,) = args
            return RowChunked(x.q, x.transposed)
        if func is aten.t.default:
            (x,) = args
            return RowChunked(x.q, not x.transposed)
        if func is aten.mm.default and not kwargs:
            a, b = args
            # mat1^T @ G: rows of mat1 meet rows of G
            if isinstance(a, RowChunked) and a.transposed and not isinstance(b, RowChunked):
                return chunked_tmm(a.q, b)
            # G^T @ mat1 = (mat1^T @ G)^T
            if isinstance(b, RowChunked) and not b.transposed and not isinstance(a, RowChunked):
                return chunked_tmm(b.q, a.t()).t()

        def dense(v: Any) -> Any:
            return v.dense() if isinstance(v, RowChunked) else v

        return func(*tree_map(dense, args), **tree_map(dense, kwargs))
