"""A stand-in for `torch_sparse` (``SparseTensor``, OGB's ``adj_t``), so that CI, where the
package is absent (no wheel on PyPI for this torch; a source build takes minutes), runs the
SparseTensor tests against PyG's own SparseTensor code paths.

It implements exactly what gact_graph and PyG 2.8.1 call on a SparseTensor in these tests, with
torch_sparse 0.6.18's semantics (checked against a source build of it): entries sorted by
(row, col), duplicates kept (every consumer sums them; torch_sparse's sort is not stable, so
its duplicates may come in another order), ``set_diag``/``fill_diag`` replace the diagonal, an
absent value means 1.

- gact_graph.sparse: ``csr``, ``sizes``, ``set_value``, ``has_value``, ``fill_value``,
  ``to_torch_sparse_csr_tensor``, ``storage.value``, ``set_diag``, ``fill_diag``;
- PyG's ``gcn_norm``: ``size``, ``has_value``, ``fill_value``, ``fill_diag``, ``sum``, ``mul``;
- ``MessagePassing``: ``size`` (``_check_input``), ``coo``/``csr`` (``_collect``);
- ``utils.spmm``: ``nnz``, ``is_cuda``, ``requires_grad``, ``to_torch_sparse_csr_tensor``;
- SAGEConv / GINConv: ``set_value(None, layout=None)``;
- ``T.ToSparseTensor``: the constructor, ``storage.rowptr``, ``storage.csr2csc``;
- ``Data``: ``size`` (``num_nodes`` from ``adj_t``).

The `torch_sparse` fixture gives the real package where it imports, else installs this module
for one test: as ``sys.modules["torch_sparse"]``, with ``torch_geometric.typing.WITH_TORCH_SPARSE``
set and every name of PyG that is bound to typing's placeholders (``SparseTensor``,
``SparseStorage``, ``torch_sparse``) pointed here. PyG imports those names at import time, so
patching ``torch_geometric.typing`` alone would not reach them.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch_geometric.typing as pyg_typing
from torch import Tensor


def _ptr(index: Tensor, size: int) -> Tensor:
    counts = torch.bincount(index, minlength=size)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


class SparseStorage:
    """Row-sorted COO with a lazily built (and cached) ``rowptr``."""

    def __init__(
        self, row=None, rowptr=None, col=None, value=None, sparse_sizes=None, is_sorted=False
    ):
        m, n = sparse_sizes if sparse_sizes is not None else (None, None)
        if m is None:
            m = rowptr.numel() - 1 if rowptr is not None else int(row.max()) + 1
        if n is None:
            n = int(col.max()) + 1
        if row is None:
            row = torch.repeat_interleave(torch.arange(m, device=col.device), rowptr.diff())
        if not is_sorted:
            perm = torch.argsort(row * n + col, stable=True)
            row, col = row[perm], col[perm]
            value = None if value is None else value[perm]
            rowptr = None
        self._row, self._rowptr, self._col, self._value = row, rowptr, col, value
        self._sizes = (m, n)

    def row(self) -> Tensor:
        return self._row

    def col(self) -> Tensor:
        return self._col

    def value(self) -> Tensor | None:
        return self._value

    def rowptr(self) -> Tensor:
        if self._rowptr is None:
            self._rowptr = _ptr(self._row, self._sizes[0])
        return self._rowptr

    def sparse_sizes(self) -> tuple[int, int]:
        return self._sizes

    def csr2csc(self) -> Tensor:
        return torch.argsort(self._col * self._sizes[0] + self._row, stable=True)


class SparseTensor:
    def __init__(
        self, row=None, rowptr=None, col=None, value=None, sparse_sizes=None, is_sorted=False,
        trust_data=False,
    ):  # fmt: skip
        self.storage = SparseStorage(row, rowptr, col, value, sparse_sizes, is_sorted)

    def coo(self):
        return self.storage.row(), self.storage.col(), self.storage.value()

    def csr(self):
        return self.storage.rowptr(), self.storage.col(), self.storage.value()

    def sparse_sizes(self) -> tuple[int, int]:
        return self.storage.sparse_sizes()

    def sizes(self) -> list[int]:
        value = self.storage.value()
        return [*self.sparse_sizes(), *(() if value is None else value.shape[1:])]

    def size(self, dim: int) -> int:
        return self.sizes()[dim]

    def nnz(self) -> int:
        return self.storage.col().numel()

    def has_value(self) -> bool:
        return self.storage.value() is not None

    def requires_grad(self) -> bool:
        return self.has_value() and self.storage.value().requires_grad

    def is_cuda(self) -> bool:
        return self.storage.col().is_cuda

    def set_value(self, value: Tensor | None, layout: str | None = None) -> SparseTensor:
        assert layout in (None, "coo", "csr")  # both are this row-sorted order
        s = self.storage
        return SparseTensor(
            row=s.row(), rowptr=s.rowptr(), col=s.col(), value=value,
            sparse_sizes=s.sparse_sizes(), is_sorted=True,
        )  # fmt: skip

    def fill_value(self, fill_value: float, dtype: torch.dtype | None = None) -> SparseTensor:
        value = torch.full((self.nnz(),), fill_value, dtype=dtype, device=self.storage.col().device)
        return self.set_value(value, layout="coo")

    def to_torch_sparse_csr_tensor(self, dtype: torch.dtype | None = None) -> Tensor:
        rowptr, col, value = self.csr()
        if value is None:
            value = torch.ones(self.nnz(), dtype=dtype, device=col.device)
        return torch.sparse_csr_tensor(rowptr, col, value, self.sizes())


def set_diag(src: SparseTensor, values: Tensor | None = None) -> SparseTensor:
    """The diagonal replaced: ``values`` there (ones when ``src`` has values and none are given)."""
    row, col, value = src.coo()
    keep = row != col
    row, col = row[keep], col[keep]
    diag = torch.arange(min(src.sparse_sizes()), device=row.device)
    if value is not None:
        if values is None:
            values = value.new_ones((diag.numel(), *value.shape[1:]))
        value = torch.cat([value[keep], values])
    row, col = torch.cat([row, diag]), torch.cat([col, diag])
    return SparseTensor(row=row, col=col, value=value, sparse_sizes=src.sparse_sizes())


def fill_diag(src: SparseTensor, fill_value: float) -> SparseTensor:
    value = src.storage.value()  # every caller here has filled the values first
    return set_diag(src, value.new_full((min(src.sparse_sizes()), *value.shape[1:]), fill_value))


def sum(src: SparseTensor, dim: int) -> Tensor:  # torch_sparse's name (shadows the builtin)
    assert dim == 1  # what gcn_norm asks: the sum of every row (of its filled values)
    row, _, value = src.coo()
    return value.new_zeros(src.size(0), *value.shape[1:]).index_add_(0, row, value)


def mul(src: SparseTensor, other: Tensor) -> SparseTensor:
    row, col, value = src.coo()
    if other.size(1) == 1 and other.size(0) == src.size(0):  # row-wise
        other = other.squeeze(1)[row]
    elif other.size(0) == 1 and other.size(1) == src.size(1):  # column-wise
        other = other.squeeze(0)[col]
    else:
        raise ValueError(f"cannot broadcast {tuple(other.shape)} over {src.sizes()}")
    return src.set_value(other.to(value.dtype).mul_(value), layout="csr")


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this module torch_sparse for PyG and gact_graph until ``monkeypatch`` undoes it."""
    this = sys.modules[__name__]
    pairs = [
        (pyg_typing.SparseTensor, SparseTensor),
        (pyg_typing.SparseStorage, SparseStorage),
        (pyg_typing.torch_sparse, this),
    ]
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] != "torch_geometric" or module is None:
            continue
        for attr, value in list(vars(module).items()):
            for placeholder, replacement in pairs:
                if value is placeholder:
                    monkeypatch.setattr(module, attr, replacement)
    monkeypatch.setattr(pyg_typing, "WITH_TORCH_SPARSE", True)
    monkeypatch.setitem(sys.modules, "torch_sparse", this)


@pytest.fixture
def torch_sparse(monkeypatch):
    """`torch_sparse`: the real package where it imports, else this stand-in for one test."""
    if not pyg_typing.WITH_TORCH_SPARSE:
        install(monkeypatch)
    import torch_sparse as module

    return module
