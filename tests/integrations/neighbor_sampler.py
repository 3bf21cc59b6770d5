"""An emulation of PyG's `NeighborLoader` batches in pure PyTorch, for machines where neither
`pyg-lib` nor `torch-sparse` imports (PyG 2.8.1's `NeighborLoader` needs one of them).

`EmulatedNeighborLoader` yields what `NeighborLoader(data, num_neighbors, batch_size,
input_nodes, shuffle)` yields for a homogeneous `Data` with pyg-lib's default sampling
(``subgraph_type="directional"``, no replacement, no time, not disjoint): per batch of seed
nodes, hop by hop, each node added in the previous hop (the seeds for the first) keeps up to
``num_neighbors[i]`` of its incoming edges ``(u, v)``, chosen uniformly without replacement
(every one where it has at most that many, or where the fan-out is -1); each source ``u`` not
in the batch yet is appended to it in order of first appearance. The batch is a `Data` with
the seeds first (``n_id[:batch_size]``), ``edge_index`` relabelled to batch rows
(``[source, destination]``, as PyG's CSC sampler returns it), ``n_id``, ``e_id`` (edge ids of
the original graph), ``input_id`` (as PyG sets it: the seeds' node ids where ``input_nodes`` is
a mask, their positions in ``input_nodes`` otherwise), ``batch_size``,
``num_sampled_nodes`` and ``num_sampled_edges`` (per hop), and every node and edge attribute
of ``data`` filtered to them. The graph is put in CSC order and the node and edge attributes
are filtered by PyG's own functions (`to_csc`, `filter_data`, `get_input_nodes`, all pure
PyTorch), so only the sampling is this module's. Batches are ``ceil(n / batch_size)`` slices
of the input nodes, shuffled by ``generator`` where ``shuffle``; the last one is smaller where
``batch_size`` does not divide ``n``. Which neighbours are drawn follows this module's random
stream, not pyg-lib's: the layout and the distribution are NeighborLoader's, the draws are
not.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor
from torch_geometric.data import Data
from torch_geometric.loader.utils import filter_data, get_input_nodes
from torch_geometric.sampler.utils import to_csc

__all__ = ["EmulatedNeighborLoader", "sample_neighbors"]


def sample_neighbors(
    colptr: Tensor,
    row: Tensor,
    seeds: Tensor,
    num_neighbors: Sequence[int],
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, list[int], list[int]]:
    """Directional k-hop sampling without replacement from a CSC graph (``colptr``, ``row``:
    the sources of the edges into each node, grouped by destination).

    Returns ``(node, src, dst, edge, num_sampled_nodes, num_sampled_edges)``: the batch's
    nodes (global ids, ``seeds`` first, then each hop's new nodes in order of first
    appearance), each sampled edge's source and destination as positions in ``node``, each
    sampled edge's position in ``row`` (CSC order), and per hop how many nodes were added
    (the seeds first) and how many edges were sampled."""
    if seeds.dim() != 1 or seeds.dtype != torch.long:
        raise ValueError(
            f"seeds must be a 1-D int64 tensor, got {seeds.dtype} {tuple(seeds.shape)}"
        )
    if seeds.unique().numel() != seeds.numel():
        raise ValueError("seeds must be distinct (NeighborLoader's input nodes of one batch are)")
    num_nodes = colptr.numel() - 1
    local = torch.full((num_nodes,), -1, dtype=torch.long)  # global id -> row in the batch
    local[seeds] = torch.arange(seeds.numel())
    nodes, srcs, dsts, edges = [seeds], [], [], []
    num_sampled_nodes, num_sampled_edges = [seeds.numel()], []
    frontier, count = seeds, seeds.numel()
    for k in num_neighbors:
        if not isinstance(k, int) or (k < 0 and k != -1):
            raise ValueError(f"a fan-out is a count >= 0 or -1 (every neighbour), got {k!r}")
        start = colptr[frontier]
        deg = colptr[frontier + 1] - start
        total = int(deg.sum())
        seg = torch.repeat_interleave(torch.arange(frontier.numel()), deg)  # edge -> frontier
        offset = torch.cumsum(deg, 0) - deg
        pos = torch.arange(total) - offset[seg]  # the edge's place among its node's edges
        # Per frontier node, a random order of its edges where it has more than k (the first
        # k of it are a uniform draw without replacement), its CSC order where it keeps all.
        deg_e = deg[seg]
        keep_all = deg_e <= k if k >= 0 else torch.ones(total, dtype=torch.bool)
        key = torch.rand(total, generator=generator, dtype=torch.float64)
        key = torch.where(keep_all, pos.double() / (deg_e.double() + 1), key)
        order = torch.argsort(seg.double() + key, stable=True)  # grouped by node, then key
        rank = torch.arange(total) - offset[seg[order]]
        take = order[rank < k] if k >= 0 else order
        eid = start[seg[take]] + pos[take]
        src_global = row[eid]
        dst_local = local[frontier[seg[take]]]
        # sources not in the batch yet, in order of first appearance
        fresh = src_global[local[src_global] < 0]
        uniq, inverse = torch.unique(fresh, return_inverse=True)
        first = torch.full((uniq.numel(),), fresh.numel(), dtype=torch.long)
        first.scatter_reduce_(0, inverse, torch.arange(fresh.numel()), reduce="amin")
        new = uniq[torch.argsort(first)]
        local[new] = torch.arange(count, count + new.numel())
        count += new.numel()
        nodes.append(new)
        srcs.append(local[src_global])
        dsts.append(dst_local)
        edges.append(eid)
        num_sampled_nodes.append(new.numel())
        num_sampled_edges.append(eid.numel())
        frontier = new
    empty = torch.empty(0, dtype=torch.long)
    return (
        torch.cat(nodes),
        torch.cat(srcs) if srcs else empty,
        torch.cat(dsts) if dsts else empty,
        torch.cat(edges) if edges else empty,
        num_sampled_nodes,
        num_sampled_edges,
    )


class EmulatedNeighborLoader:
    """`NeighborLoader`'s batches for a homogeneous `Data` without a sampler library (see the
    module docstring); iterable like the loader, ``len()`` batches per pass."""

    def __init__(
        self,
        data: Data,
        num_neighbors: Sequence[int],
        batch_size: int = 1,
        input_nodes: Tensor | None = None,
        shuffle: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        if not isinstance(data, Data):
            raise TypeError(f"data must be a torch_geometric Data, got {type(data).__name__}")
        if data.edge_index is None:
            raise ValueError("data has no edge_index to sample from")
        for k in num_neighbors:
            if not isinstance(k, int) or (k < 0 and k != -1):
                raise ValueError(f"a fan-out is a count >= 0 or -1 (every neighbour), got {k!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.data = data
        self.num_neighbors = list(num_neighbors)
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.generator = generator
        #: the seed nodes, and what ``input_id`` reports for each (None: its position)
        _, self.input_nodes, self.input_ids = get_input_nodes(data, input_nodes)
        self.colptr, self.row, self.perm = to_csc(data, device=torch.device("cpu"))

    @property
    def csc(self) -> tuple[Tensor, Tensor]:
        """The graph as `sample_neighbors` reads it: ``(colptr, row)``."""
        return self.colptr, self.row

    def __len__(self) -> int:
        return math.ceil(self.input_nodes.numel() / self.batch_size)

    def __iter__(self) -> Iterator[Data]:
        n = self.input_nodes.numel()
        order = torch.randperm(n, generator=self.generator) if self.shuffle else torch.arange(n)
        for index in order.split(self.batch_size):
            yield self.batch(index)

    def batch(self, index: Tensor) -> Data:
        """The batch whose seeds are the input nodes at positions ``index``."""
        node, src, dst, edge, n_nodes, n_edges = sample_neighbors(
            self.colptr, self.row, self.input_nodes[index], self.num_neighbors,
            self.generator,
        )  # fmt: skip
        # what `NodeLoader.filter_fn` builds from a `SamplerOutput`
        data = filter_data(self.data, node, src, dst, edge, self.perm)
        data.n_id = node
        data.e_id = self.perm[edge] if self.perm is not None else edge
        data.num_sampled_nodes = n_nodes
        data.num_sampled_edges = n_edges
        data.input_id = index if self.input_ids is None else self.input_ids[index]
        data.batch_size = index.numel()
        return data
