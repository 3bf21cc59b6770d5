"""The compact adjacency: one graph as a destination-sorted CSR matrix.

Stock PyG message passing keeps, for every layer, its own copies of the edge index (int64,
2 x E) and of the normalized edge weights for backward. The graph is the same for every layer,
so the package holds it once as a `CompactAdjacency` (``rowptr`` int64 N+1, ``col`` int32 when
it fits, ``weight``), which every layer of a forward and later forwards on the same graph share
(`gact_graph.sparse.adjacency_build` makes it, `gact_graph.sparse.adjacency_cache` keeps it).
This module holds the structure itself, its lazily built transpose, and the small tests of what
a graph input is.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch_geometric.typing as pyg_typing
from torch import Tensor

from gact_graph.sparse.torch_notices import sparse_csr_tensor
from gact_graph.switches import once_per_graph

__all__ = ["CompactAdjacency", "is_torch_sparse", "is_sparse_tensor"]

_INT32_MAX = 2**31 - 1


def is_torch_sparse(t: Any) -> bool:
    """A `torch.sparse` COO/CSR/CSC tensor."""
    return isinstance(t, Tensor) and t.layout in (
        torch.sparse_coo,
        torch.sparse_csr,
        torch.sparse_csc,
    )


def is_sparse_tensor(t: Any) -> bool:
    """A `torch_sparse.SparseTensor`: PyG's own test, against the class its typing module holds
    now (a placeholder that cannot be instantiated when torch_sparse is not installed)."""
    return isinstance(t, pyg_typing.SparseTensor)


class CompactAdjacency:
    """A graph as a destination-sorted CSR matrix: ``out = A @ x`` sums, for every node ``i``,
    ``weight[k] * x[col[k]]`` over ``k in rowptr[i]:rowptr[i+1]`` (PyG's source_to_target flow:
    row = target, col = source).

    Attributes:
        num_nodes: N (the matrix is N x N).
        rowptr: int64 [N + 1].
        col: source node of every edge in CSR order; int32 when N < 2**31, else int64.
        weight: float [E] in CSR order, or None (every edge weighs 1; or, with
            ``weight_is_external``, the caller supplies a differentiable weight per call).
        perm: int32 [E] (int64 past 2**31 - 1 edges): CSR position -> position in the edge
            list that PyG itself would use (the input ``edge_index`` after its self-loop
            handling); None when that is the
            identity (input already sorted, or a torch.sparse input) or when it was not asked
            for (``get_adjacency(..., keep_perm=True)``; learnable weights always keep it).
            CSR order is by (destination, source), stable among duplicates.
        weight_is_external: the graph came with a learnable ``edge_weight``; its structure is
            cached here, its weights are computed per forward (`differentiable_edge_weight`).
        scale: float [N] or None: the matrix is ``diag(scale) (W + loop I) diag(scale)``,
            GCN's symmetric normalization without a normalized weight per edge (`SpmmFunction`
            forms ``W[i, j] * scale[j]`` for the length of one product).
        loop: an implicit diagonal added to the stored entries (0: none).

    Duplicate edges are kept as separate entries (PyG sums their messages); isolated nodes
    simply have empty rows.
    """

    def __init__(
        self,
        num_nodes: int,
        rowptr: Tensor,
        col: Tensor,
        weight: Tensor | None = None,
        perm: Tensor | None = None,
        *,
        weight_is_external: bool = False,
        scale: Tensor | None = None,
        loop: float = 0.0,
    ) -> None:
        if rowptr.dtype != torch.int64 or rowptr.dim() != 1 or rowptr.numel() != num_nodes + 1:
            raise ValueError("rowptr must be int64 of length num_nodes + 1")
        if col.dim() != 1 or col.dtype not in (torch.int32, torch.int64):
            raise ValueError("col must be a 1-D int32/int64 tensor")
        if weight is not None and (weight.shape != col.shape or not weight.is_floating_point()):
            raise ValueError("weight must be a float tensor shaped like col")
        if perm is not None and (
            perm.shape != col.shape or perm.dtype not in (torch.int32, torch.int64)
        ):
            raise ValueError("perm must be an int32/int64 tensor shaped like col")
        if scale is not None and (scale.shape != (num_nodes,) or not scale.is_floating_point()):
            raise ValueError("scale must be a float tensor of one value per node")
        self.num_nodes = int(num_nodes)
        self.scale, self.loop = scale, float(loop)
        self.rowptr = rowptr
        self.col = col
        self.weight = weight
        self.perm = perm
        self.weight_is_external = weight_is_external
        self._transpose: CompactAdjacency | None = None
        self._walk: tuple[Tensor, Tensor, Tensor | None] | None = None  # see walk_transpose
        self._symmetric = False  # A^T == A: transpose() is self (a flag, not a ref cycle)
        self._symmetric_identity = False  # ... and A^T lists the edges in the same order
        self._ctl_ref: weakref.ref | None = None
        self.__weakref__: Any

    # ------------------------------------------------------------------ shape and bytes
    @property
    def num_edges(self) -> int:
        return self.col.numel()

    @property
    def device(self) -> torch.device:
        return self.rowptr.device

    def tensors(self, with_transpose: bool = True) -> list[Tensor]:
        """Every tensor this adjacency holds (the transpose's too, once it exists)."""
        out = [
            t for t in (self.rowptr, self.col, self.weight, self.perm, self.scale) if t is not None
        ]
        more = []
        if with_transpose and self._transpose is not None:
            more += self._transpose.tensors(with_transpose=False)
        if with_transpose and self._walk is not None:
            more += self._walk
        for t in more:  # each tensor once (the transpose shares `scale`, the walk more)
            if t is not None and not any(t is u for u in out):
                out.append(t)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes held, the lazily built transpose included once it exists."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def __repr__(self) -> str:
        w = "external" if self.weight_is_external else ("none" if self.weight is None else "yes")
        return (
            f"CompactAdjacency(num_nodes={self.num_nodes}, num_edges={self.num_edges}, "
            f"weight={w}, perm={'yes' if self.perm is not None else 'none'}, "
            f"transpose={self._transpose_state()}, "
            f"nbytes={self.nbytes})"
        )

    def _transpose_state(self) -> str:
        return "self" if self._symmetric else "built" if self._transpose is not None else "no"

    # ------------------------------------------------------------------ derived (transient)
    def degree(self) -> Tensor:
        """Entries per row (in-degree counting duplicates), int64 [N]."""
        return self.rowptr[1:] - self.rowptr[:-1]

    def dst_index(self) -> Tensor:
        """Destination (row) of every edge in CSR order, int64 [E]; transient."""
        return torch.repeat_interleave(
            torch.arange(self.num_nodes, device=self.device),
            self.degree(),
            output_size=self.num_edges,
        )

    def edge_index(self) -> Tensor:
        """int64 [2, E] edge index in CSR order (``[source; destination]``); transient."""
        return torch.stack([self.col.long(), self.dst_index()], dim=0)

    def to_csr_order(self, edge_values: Tensor) -> Tensor:
        """Per-edge values in PyG's edge order -> CSR order (differentiable gather)."""
        return edge_values if self.perm is None else edge_values[self.perm]

    def to_edge_order(self, csr_values: Tensor) -> Tensor:
        """Per-edge values in CSR order -> PyG's edge order (inverse of `to_csr_order`)."""
        if self.perm is None:
            return csr_values
        out = csr_values.new_empty(csr_values.shape)
        out[self.perm] = csr_values
        return out

    def transpose(self) -> CompactAdjacency:
        """A^T as a source-sorted CSR, built once and cached on this object: its ``col`` is the
        destination of each edge; its ``perm`` (kept when per-call weights are expected:
        external weights or ``keep_perm``) maps its positions to CSR positions here. A
        symmetric matrix (an undirected graph with symmetric weights, e.g. GCN's) is its own
        transpose and costs nothing extra."""
        if self._symmetric:
            return self
        if self._transpose is None:
            with once_per_graph():  # cached on this object: later steps reuse it
                return self._build_transpose()
        return self._transpose

    def _build_transpose(self) -> CompactAdjacency:
        """`transpose`'s work (the caller checked that none is cached)."""
        n, src = self.num_nodes, self.col
        t_perm = torch.argsort(src, stable=True)
        t_rowptr = _rowptr_from_sorted_counts(torch.bincount(src, minlength=n), n)
        t_col = self.dst_index()[t_perm].to(self.col.dtype)
        t_weight = None if self.weight is None else self.weight[t_perm]
        symmetric = (
            torch.equal(t_rowptr, self.rowptr)
            and torch.equal(t_col, self.col)
            and (t_weight is None or torch.equal(t_weight, self.weight))
        )
        identity = torch.equal(t_perm, _arange_like(t_perm))
        # Per-call weights (learnable, dropped-out) need the transposed order of the edges.
        wants_perm = self.weight_is_external or self.perm is not None
        if symmetric and (identity or not wants_perm):
            self._symmetric = True
            self._symmetric_identity = identity
            return self
        keep = t_perm.to(index_dtype(t_perm.numel())) if wants_perm else None
        self._transpose = CompactAdjacency(
            n, t_rowptr, t_col, t_weight, keep, scale=self.scale, loop=self.loop
        )
        del t_perm
        ctl = self._ctl_ref() if self._ctl_ref is not None else None
        if ctl is not None:
            for t in self._transpose.tensors():
                ctl.keep_lossless(t, "index")
        return self._transpose

    def transpose_perm(self) -> Tensor | None:
        """Positions (in this CSR order) of the transpose's edges, for per-call weights:
        None when the orders agree; recomputed (transient) when it was not kept."""
        at = self.transpose()
        if at is self:
            return None if self._symmetric_identity else torch.argsort(self.col, stable=True)
        return at.perm if at.perm is not None else torch.argsort(self.col, stable=True)

    def walk_transpose(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(rowptr, col, positions)`` of A^T for kernels that walk its rows every step (the
        fused attention's backward): its row pointers and columns, which are this adjacency's
        own tensors when A is symmetric (no copy, whether or not `transpose` keeps one for
        per-call weights), and each of its edges' position in this CSR order (int32 where the
        edges fit; None when the orders agree), which in-kernel per-edge randomness needs.
        Built once and cached on this object; a transpose built before is reused."""
        if self._walk is None:
            with once_per_graph():  # cached on this object: later steps reuse it
                self._walk = self._build_walk()
            ctl = self._ctl_ref() if self._ctl_ref is not None else None
            if ctl is not None:
                for t in self._walk:
                    if t is not None:
                        ctl.keep_lossless(t, "index")
        return self._walk

    def _build_walk(self) -> tuple[Tensor, Tensor, Tensor | None]:
        if self._symmetric or self._transpose is not None:
            at = self.transpose()
            pos = self.transpose_perm()
            return at.rowptr, at.col, None if pos is None else pos.to(index_dtype(pos.numel()))
        t_perm = torch.argsort(self.col, stable=True)
        t_rowptr = _rowptr_from_sorted_counts(torch.bincount(self.col, minlength=self.num_nodes),
                                              self.num_nodes)  # fmt: skip
        t_col = self.dst_index()[t_perm].to(self.col.dtype)
        if torch.equal(t_rowptr, self.rowptr) and torch.equal(t_col, self.col):
            t_rowptr, t_col = self.rowptr, self.col
        pos = None if torch.equal(t_perm, _arange_like(t_perm)) else t_perm
        return t_rowptr, t_col, None if pos is None else pos.to(index_dtype(pos.numel()))

    def stock_form(self, kind: str) -> Any:
        """This matrix as stock PyG caches a normalized graph: ``(edge_index, edge_weight)``
        (``kind="edge_index"``), a torch.sparse CSR matrix (``"torch_sparse"``) or a
        ``torch_sparse.SparseTensor`` (``"sparse_tensor"``); edges in CSR order."""
        a = self.explicit()
        n = self.num_nodes
        if kind == "edge_index":
            return a.edge_index(), a.weight
        if kind == "sparse_tensor":
            return pyg_typing.SparseTensor(
                rowptr=a.rowptr, col=a.col.long(), value=a.weight, sparse_sizes=(n, n),
                is_sorted=True,
            )  # fmt: skip
        return sparse_csr_tensor(a.rowptr, a.col.long(), a.weight, (n, n))

    def explicit(self) -> CompactAdjacency:
        """The same matrix with its diagonal and normalization written into the stored
        entries (``scale`` None, ``loop`` 0); ``self`` when they already are. Duplicate
        positions are kept, as stored entries are (their values add up in a product)."""
        if self.scale is None and not self.loop:
            return self
        n, e = self.num_nodes, self.num_edges
        dst = self.dst_index()
        weight = self.weight
        if weight is None:
            dtype = torch.float32 if self.scale is None else self.scale.dtype
            weight = torch.ones(e, dtype=dtype, device=self.device)
        if self.loop:
            nodes = torch.arange(n, device=self.device)
            key = torch.cat([dst * n + self.col.long(), nodes * (n + 1)])
            key, order = torch.sort(key, stable=True)
            weight = torch.cat([weight, weight.new_full((n,), self.loop)])[order]
            dst, col = key // n, (key % n).to(self.col.dtype)
            rowptr = _rowptr_from_sorted_counts(torch.bincount(dst, minlength=n), n)
        else:
            rowptr, col = self.rowptr, self.col
        if self.scale is not None:
            weight = self.scale[col.long()] * weight * self.scale[dst]
        return CompactAdjacency(n, rowptr, col, weight)

    def to_torch_csr(self, values: Tensor | None = None, dtype: torch.dtype | None = None):
        """A `torch.sparse_csr_tensor` view for `torch.sparse.mm` (indices converted to one
        dtype, weights of ones when there are none): transient, O(N + E)."""
        if values is None:
            values = self.weight
        if values is None:
            values = _ones(self.num_edges, dtype or torch.float32, self.device)
        elif dtype is not None and values.dtype != dtype:
            values = values.to(dtype)
        col = self.col
        if col.dtype == torch.int32 and self.num_edges <= _INT32_MAX:
            crow = self.rowptr.to(torch.int32)
        else:
            crow, col = self.rowptr, col.long()
        return sparse_csr_tensor(crow, col, values, (self.num_nodes, self.num_nodes))


def _ones(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``n`` ones; on CPU one value seen ``n`` times (no memory), which MKL's CSR product
    reads as any values tensor (GPU sparse libraries are not checked with it yet)."""
    if device.type == "cpu":
        return torch.ones(1, dtype=dtype, device=device).expand(n)
    return torch.ones(n, dtype=dtype, device=device)


def _arange_like(t: Tensor) -> Tensor:
    return torch.arange(t.numel(), dtype=t.dtype, device=t.device)


def _rowptr_from_sorted_counts(counts: Tensor, n: int) -> Tensor:
    rowptr = torch.zeros(n + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts, 0, out=rowptr[1:])
    return rowptr


def index_dtype(num_nodes: int) -> torch.dtype:
    return torch.int32 if num_nodes <= _INT32_MAX else torch.int64


def plain(t: Tensor) -> Tensor:
    """The plain tensor behind a subclass such as PyG's `EdgeIndex`."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return t
    as_tensor = getattr(t, "as_tensor", None)
    if callable(as_tensor):
        return as_tensor()
    return t.as_subclass(torch.Tensor)
