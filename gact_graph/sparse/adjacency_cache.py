"""The per-controller cache of compact adjacencies and the keys it finds them by.

Recognizing "the same graph" is cheap first (storage identity, view and version of the input
tensors) and falls back to a content hash, so a copy of the edge index, an expanded or strided
view of it, or the same matrix given once as COO and once as CSR all share one adjacency. A
write that leaves the version counter alone (a NumPy buffer behind `torch.from_numpy`, a write
through ``.data``) keeps the identity, so an identity hit is confirmed by the inputs' content
hash once per training forward (at every call outside one), compared on their device. The cache
holds a few graphs strongly (most recently used first) and everything else weakly, so it never
keeps a graph alive forever.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from gact_graph.sparse.adjacency import CompactAdjacency, is_sparse_tensor, is_torch_sparse, plain
from gact_graph.sparse.content_hash import content_hash, hash_key, hash_pair
from gact_graph.sparse.torch_notices import quiet_sparse_notices
from gact_graph.switches import eager_when_compiling

__all__ = ["AdjacencyCache"]

#: Graphs a controller keeps alive between forwards (most recently used); older ones are held
#: weakly (alive only while autograd still needs them). ``compress_gnn(..., max_graphs=N)``.
DEFAULT_MAX_GRAPHS = 4


class _Entry:
    """A cache entry: the adjacency (weakly), the storages its key names (weakly), and for an
    identity key the content digest of those tensors when it was made (`digest_of`) and the
    forward that last found them unchanged."""

    __slots__ = ("adj", "refs", "digest", "checked_in")

    def __init__(
        self, adj: CompactAdjacency, refs: list[StorageWeakRef], digest: Tensor | None = None
    ) -> None:
        self.adj = weakref.ref(adj)
        self.refs = refs
        self.digest = digest
        self.checked_in: int | None = None

    def get(self) -> CompactAdjacency | None:
        if any(r.expired() for r in self.refs):
            return None
        return self.adj()


class AdjacencyCache:
    """Per-controller cache: identity keys -> adjacency (weakly), content keys -> adjacency
    (weakly), and the ``max_graphs`` most recently used adjacencies held strongly."""

    def __init__(self, max_graphs: int = DEFAULT_MAX_GRAPHS) -> None:
        self.max_graphs = max(0, int(max_graphs))
        self._by_identity: dict[tuple, _Entry] = {}
        self._by_content: dict[tuple, _Entry] = {}
        self._recent: collections.OrderedDict[int, CompactAdjacency] = collections.OrderedDict()
        self.builds = 0  # adjacencies built (a test and debugging aid)
        self.hits = 0

    def __len__(self) -> int:
        return len(self._recent)

    def clear(self) -> None:
        self._by_identity.clear()
        self._by_content.clear()
        self._recent.clear()

    def touch(self, adj: CompactAdjacency) -> None:
        self._recent[id(adj)] = adj
        self._recent.move_to_end(id(adj))
        while len(self._recent) > self.max_graphs:
            self._recent.popitem(last=False)

    def entry(self, table: dict, key: tuple) -> _Entry | None:
        """The live entry under ``key`` (a dead one is dropped)."""
        entry = table.get(key)
        if entry is not None and entry.get() is None:
            del table[key]
            return None
        return entry

    def lookup(self, table: dict, key: tuple) -> CompactAdjacency | None:
        entry = self.entry(table, key)
        return None if entry is None else entry.get()

    def insert(
        self, table: dict, key: tuple, adj: CompactAdjacency, refs=(), digest=None
    ) -> _Entry:
        entry = table[key] = _Entry(adj, list(refs), digest)
        return entry

    def tensors(self) -> list[Tensor]:
        """The tensors of the adjacencies it holds."""
        return [t for adj in self._recent.values() for t in adj.tensors()]

    def prune(self) -> None:
        """Drop entries whose source storage or adjacency is gone."""
        for table in (self._by_identity, self._by_content):
            for key in [k for k, e in table.items() if e.get() is None]:
                del table[key]


def cache_of(ctl) -> AdjacencyCache:
    cache = getattr(ctl, "_gg_adjacency_cache", None)
    if cache is None:
        cache = AdjacencyCache(int(ctl.config.extra.get("max_graphs", DEFAULT_MAX_GRAPHS)))
        ctl._gg_adjacency_cache = cache
        ctl.step_memory.graph_sources.append(cache.tensors)  # the graph's row of `report()`

        def undo() -> None:
            cache.clear()
            if getattr(ctl, "_gg_adjacency_cache", None) is cache:
                del ctl._gg_adjacency_cache

        ctl.add_undo(undo)
    return cache


@eager_when_compiling  # Dynamo would build the reference itself and drop it half made
def _storage_ref(t: Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def identity_key(
    t: Tensor | None,
) -> tuple[tuple, list[StorageWeakRef], list[Tensor]] | None:
    """(key, weak refs, parts) naming exactly this view of this storage at this version, with
    the plain tensors it is made of (a sparse matrix's indices and values); None when the
    tensor has no inspectable storage. The version counter misses writes that bypass it (a
    NumPy array behind `torch.from_numpy`, ``.data``): `digest_of` of the parts covers those."""
    if t is None:
        return ("none",), [], []
    if is_torch_sparse(t) or is_sparse_tensor(t):
        if is_sparse_tensor(t):  # its CSR: rowptr (built once, cached on it), col, value
            parts, comps = ["SparseTensor", tuple(t.sizes())], t.csr()
        elif t.layout == torch.sparse_coo:
            parts, comps = [str(t.layout), tuple(t.shape)], (t._indices(), t._values())
        elif t.layout == torch.sparse_csr:
            parts = [str(t.layout), tuple(t.shape)]
            comps = (t.crow_indices(), t.col_indices(), t.values())
        else:
            parts = [str(t.layout), tuple(t.shape)]
            comps = (t.ccol_indices(), t.row_indices(), t.values())
        refs, tensors = [], []
        for c in comps:
            sub = identity_key(c)
            if sub is None:
                return None
            parts.append(sub[0])
            refs += sub[1]
            tensors += sub[2]
        return tuple(parts), refs, tensors
    t = plain(t)
    if t.layout != torch.strided or t.device.type == "meta":
        return None
    ref = _storage_ref(t)
    key = (ref.cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version)
    return key, [ref], [t]


def digest_of(parts: list[Tensor]) -> Tensor | None:
    """The `hash_pair` of every part, on their device (one pass over each; no host sync)."""
    if not parts:
        return None
    if len(parts) == 1:
        return hash_pair(parts[0])
    return torch.cat([hash_pair(p) for p in parts])


def unchanged(digest: Tensor | None, before: Tensor | None) -> bool:
    """Whether two digests agree. Deciding which adjacency serves the forward is the host's
    work: on a GPU this reads one flag back, the check's only sync."""
    if digest is None or before is None:
        return digest is None and before is None
    if digest.shape != before.shape or digest.device != before.device:
        return False
    return bool(torch.equal(digest, before))


def checks_content(ctl) -> bool:
    """Whether a graph found by identity has its content checked too (``graph_check``)."""
    config = getattr(ctl, "config", None)
    return config is None or config.extra.get("graph_check", "forward") == "forward"


def forward_token(ctl) -> int | None:
    """The training forward now running (its inputs are checked once in it), or None (eval,
    ``no_grad``, outside a forward: every call checks)."""
    if not getattr(ctl, "compressing", False):
        return None
    return getattr(ctl, "_forward_id", None)


def input_dtypes(t: Any) -> tuple:
    """The dtypes of what a graph input is made of (part of its content key: a uint8 and an
    int64 edge index of equal values are two entries)."""
    if t is None:
        return ()
    if is_sparse_tensor(t):
        value = t.storage.value()
        return ("SparseTensor", None if value is None else value.dtype)
    if is_torch_sparse(t):
        values = t._values() if t.layout == torch.sparse_coo else t.values()
        return ("sparse", values.dtype)  # COO and CSR of one matrix: one content key
    return (t.dtype,)


def content_key(t: Tensor | None, pair: list[int] | None = None) -> tuple:
    """``t``'s content key; ``pair``: its `hash_pair`, already made and read (a plain
    tensor)."""
    if t is None:
        return ("none",)
    if pair is not None:
        return hash_key(t, pair)
    if is_sparse_tensor(t):
        rowptr, col, value = t.csr()
        sizes = tuple(t.sizes())
        return ("SparseTensor", sizes, content_hash(rowptr), content_hash(col), content_hash(value))
    if is_torch_sparse(t):
        # Canonical: the CSR (as PyG's spmm would convert it) of the matrix.
        csr = t.detach()
        if csr.layout != torch.sparse_csr:
            with quiet_sparse_notices():
                csr = csr.to_sparse_csr()
        return (
            "sparse",
            tuple(t.shape),
            content_hash(csr.crow_indices()),
            content_hash(csr.col_indices()),
            content_hash(csr.values()),
        )
    return content_hash(plain(t))
