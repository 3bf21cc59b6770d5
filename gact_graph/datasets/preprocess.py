"""Preprocessing shared by every loader: undirected coalesced edges, split masks, task metadata,
the cached GCN-normalized adjacency, and the clear offline error for missing files."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor
from torch_geometric.data import Data

__all__ = [
    "DatasetNotFoundError",
    "ProcessedDataError",
    "RawDataError",
    "default_root",
    "require_files",
    "undirected_coalesced",
    "pairs_to_edge_index",
    "pairs_to_compact_adj_t",
    "compact_adj_t",
    "sorted_unique_",
    "index_to_mask",
    "finalize",
    "gcn_normalized_adjacency",
    "normalized_adjacency",
]


class DatasetNotFoundError(FileNotFoundError):
    """A real dataset's files are not on disk. Nothing is downloaded: the message lists the
    files to put where."""


class ProcessedDataError(RuntimeError):
    """A cached processed file cannot be read as the loader's own (another tool or version
    wrote it). The message names the folder to delete; it is rebuilt from the raw files."""


class RawDataError(RuntimeError):
    """A real dataset's raw file is on disk but cannot be read (a truncated or corrupt copy).
    The message names the file and where to get it again."""


def default_root() -> str:
    """Where datasets live when ``root`` is not given: ``$GACT_GRAPH_DATA`` or ``./data``."""
    return os.environ.get("GACT_GRAPH_DATA", "data")


def require_files(dataset: str, base: str, files: Iterable[str], hint: str) -> None:
    """Raise :class:`DatasetNotFoundError` unless every ``base/<file>`` exists.

    Called before a PyG/OGB dataset object is built, because those classes start a download
    (OGB even asks on stdin) as soon as a file is missing.
    """
    files = list(files)
    missing = [f for f in files if not os.path.isfile(os.path.join(base, f))]
    if missing:
        listing = "\n".join(f"  {os.path.join(base, f)}" for f in files)
        absent = ", ".join(missing)
        raise DatasetNotFoundError(
            f"{dataset}: missing {absent} under {base!r}. Downloads are disabled; place the "
            f"dataset's files like this:\n{listing}\n{hint}"
        )


def undirected_coalesced(edge_index: Tensor, num_nodes: int) -> Tensor:
    """Both directions of every edge, sorted by (row, col), duplicates removed.

    Works on one int64 key per undirected pair (``min * N + max``) instead of PyG's
    ``to_undirected``, and sorts in place, so that graphs with 100M+ edges fit: peak memory is
    the key array plus the ``[2, E]`` result, never the doubled edge list with sort buffers.
    """
    row, col = edge_index[0].long(), edge_index[1].long()
    pairs = torch.minimum(row, col) * num_nodes + torch.maximum(row, col)
    return pairs_to_edge_index(sorted_unique_(pairs), num_nodes)


def sorted_unique_(keys: Tensor) -> Tensor:
    """Sorted distinct values of a 1-D int64 tensor, sorting ``keys`` itself in place.

    On CPU numpy's in-place sort needs no index buffer (``torch.sort`` and ``torch.unique``
    allocate one per element) and is several times faster.
    """
    if keys.device.type != "cpu":
        return torch.unique(keys, sorted=True)
    a = keys.numpy()
    a.sort()
    if a.size < 2:
        return keys
    keep = np.empty(a.size, dtype=bool)
    keep[0] = True
    np.not_equal(a[1:], a[:-1], out=keep[1:])
    return torch.from_numpy(a[keep])


def pairs_to_edge_index(pairs: Tensor, num_nodes: int) -> Tensor:
    """Distinct canonical pair keys ``min * N + max`` to a coalesced ``[2, E]`` edge index
    holding both directions (self-loops once)."""
    lo = torch.div(pairs, num_nodes, rounding_mode="floor")
    hi = pairs - lo * num_nodes
    not_loop = lo != hi
    mirrored = hi[not_loop] * num_nodes + lo[not_loop]
    del lo, hi, not_loop
    keys = torch.cat([pairs, mirrored])
    del mirrored
    if keys.device.type == "cpu":
        keys.numpy().sort()
    else:
        keys = torch.sort(keys).values
    edge_index = torch.empty(2, keys.numel(), dtype=torch.long, device=keys.device)
    torch.div(keys, num_nodes, rounding_mode="floor", out=edge_index[0])
    torch.remainder(keys, num_nodes, out=edge_index[1])
    return edge_index


#: index dtype of a compact adjacency: 4 bytes an edge while the edges fit
_COMPACT_INDEX = torch.int32


def compact_adj_t(edge_index: Tensor, num_nodes: int) -> Tensor:
    """``edge_index`` as the smallest ``adj_t`` PyG's convolutions take: a
    ``torch.sparse_csr_tensor`` with row = target, int32 indices and values of ones that take no
    memory (one value seen E times): 4 bytes an edge where ``edge_index`` holds 16. Duplicate
    edges stay separate entries (their messages add up, as over ``edge_index``). Under
    `compress_gnn` the convolutions share its columns instead of copying the graph; stock PyG
    takes it as any ``adj_t`` (checked on CPU)."""
    n = int(num_nodes)
    key = edge_index[1].to(torch.int64, copy=True).mul_(n).add_(edge_index[0])
    if key.device.type == "cpu":
        key.numpy().sort()
    else:
        key = torch.sort(key).values
    bounds = torch.arange(n + 1, dtype=torch.int64, device=key.device).mul_(n)
    crow = torch.searchsorted(key, bounds)
    col = key.remainder_(n).to(_COMPACT_INDEX)
    del key
    return _compact(crow, col, n)


def pairs_to_compact_adj_t(pairs: Tensor, num_nodes: int, chunk: int = 1 << 22) -> Tensor:
    """Distinct sorted canonical pair keys ``min * N + max`` to the `compact_adj_t` of the
    undirected graph (both directions, self-loops once), without an int64 edge list: row ``r``
    lists the pairs' smaller ends that meet ``r`` as their larger end, then the larger ends of
    the pairs that start at ``r``, each in ascending order, because a stable placement over the
    sorted keys keeps that order. Temporaries are bounded by ``chunk`` keys."""
    n = int(num_nodes)
    ahead = torch.zeros(n, dtype=torch.int64)  # entries of row r from pairs (r, c), c >= r
    behind = torch.zeros(n, dtype=torch.int64)  # ... from pairs (c, r), c < r
    for lo, hi in _pair_chunks(pairs, n, chunk):
        ahead += torch.bincount(lo, minlength=n)
        behind += torch.bincount(hi[lo != hi], minlength=n)
    crow = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(ahead + behind, 0, out=crow[1:])
    col = torch.empty(int(crow[-1]), dtype=_COMPACT_INDEX)
    ahead_start = torch.cumsum(ahead, 0) - ahead  # where row r's pairs begin in ``pairs``
    filled_behind = crow[:-1].clone()  # next free slot of each row's first part
    at = 0
    for lo, hi in _pair_chunks(pairs, n, chunk):
        idx = torch.arange(at, at + lo.numel())
        at += lo.numel()
        col[crow[lo] + behind[lo] + idx - ahead_start[lo]] = hi.to(_COMPACT_INDEX)
        back = lo != hi
        rows, cols = hi[back], lo[back]
        order = torch.argsort(rows, stable=True)  # in-chunk ranks, key order kept per row
        rows, cols = rows[order], cols[order]
        counts = torch.bincount(rows, minlength=n)
        first = torch.cumsum(counts, 0) - counts
        rank = torch.arange(rows.numel()) - first[rows]
        col[filled_behind[rows] + rank] = cols.to(_COMPACT_INDEX)
        filled_behind += counts
    return _compact(crow, col, n)


def _pair_chunks(pairs: Tensor, n: int, chunk: int):
    for start in range(0, pairs.numel(), chunk):
        part = pairs[start : start + chunk]
        lo = torch.div(part, n, rounding_mode="floor")
        yield lo, part - lo * n


def _compact(crow: Tensor, col: Tensor, n: int) -> Tensor:
    ones = torch.ones(1, device=col.device).expand(col.numel())
    with warnings.catch_warnings():  # torch's notices on a CSR that holds its invariants
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly")
        return torch.sparse_csr_tensor(crow.to(_COMPACT_INDEX), col, ones, (n, n))


def index_to_mask(index: Tensor, size: int) -> Tensor:
    mask = torch.zeros(size, dtype=torch.bool)
    mask[index] = True
    return mask


def finalize(
    data: Data,
    *,
    name: str,
    num_classes: int,
    multilabel: bool,
    metric: str,
    make_undirected: bool = True,
) -> Data:
    """Bring a loaded graph to the form trainers expect.

    ``edge_index`` undirected and coalesced; ``y`` a ``[N]`` int64 class vector, or ``[N, L]``
    float {0, 1} for multi-label tasks; boolean ``train/val/test_mask``; and the metadata
    ``name``, ``num_classes``, ``multilabel``, ``metric`` as plain attributes.
    """
    n = data.num_nodes
    if make_undirected:
        data.edge_index = undirected_coalesced(data.edge_index, n)
    data.x = data.x.float()
    y = data.y
    if multilabel:
        data.y = y.float()
    else:
        data.y = (y.view(-1) if y.dim() > 1 else y).long()
    data.name = name
    data.num_classes = int(num_classes)
    data.multilabel = bool(multilabel)
    data.metric = metric
    return data


def gcn_normalized_adjacency(
    edge_index: Tensor,
    num_nodes: int,
    edge_weight: Tensor | None = None,
    add_self_loops: bool = True,
) -> Tensor:
    r"""``D^{-1/2} (A + I) D^{-1/2}`` as a ``torch.sparse_csr`` tensor (row = target node).

    Matches :func:`torch_geometric.nn.conv.gcn_conv.gcn_norm` for an undirected graph, so
    ``GCNConv(normalize=False)`` on it equals ``GCNConv()`` on ``edge_index``.
    """
    row, col = edge_index[0], edge_index[1]
    if edge_weight is None:
        edge_weight = torch.ones(row.numel(), dtype=torch.float, device=row.device)
    if add_self_loops:
        # Nodes that already carry a self-loop keep it (as PyG's add_remaining_self_loops).
        keep = row != col
        loop = torch.arange(num_nodes, device=row.device)
        loop_weight = torch.ones(num_nodes, dtype=edge_weight.dtype, device=row.device)
        existing = ~keep
        loop_weight[row[existing]] = edge_weight[existing]
        row = torch.cat([row[keep], loop])
        col = torch.cat([col[keep], loop])
        edge_weight = torch.cat([edge_weight[keep], loop_weight])
    deg = torch.zeros(num_nodes, dtype=edge_weight.dtype, device=row.device)
    deg.scatter_add_(0, col, edge_weight)
    dinv = deg.pow(-0.5)
    dinv.masked_fill_(torch.isinf(dinv), 0.0)
    value = dinv[row] * edge_weight * dinv[col]
    # Row of the matrix is the target (col of edge_index): out = A_hat @ x aggregates sources.
    perm = torch.argsort(col * num_nodes + row)
    crow = torch.zeros(num_nodes + 1, dtype=torch.long, device=row.device)
    crow[1:] = torch.cumsum(torch.bincount(col, minlength=num_nodes), 0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Sparse CSR tensor support is in beta.*")
        return torch.sparse_csr_tensor(
            crow, row[perm], value[perm], (num_nodes, num_nodes), check_invariants=False
        )


def normalized_adjacency(data: Data) -> Tensor:
    """``data.adj_t``: the GCN-normalized adjacency of ``data``, computed on first request and
    cached on the object (``edge_index`` stays the primary format)."""
    adj = getattr(data, "adj_t", None)
    if adj is None:
        adj = gcn_normalized_adjacency(data.edge_index, data.num_nodes)
        data.adj_t = adj
    return adj
