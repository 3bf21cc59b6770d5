"""One compact, shared adjacency per distinct graph.

Stock PyG message passing keeps, for every layer, its own copies of the edge index (int64,
2 x E) and of the normalized edge weights for backward. The graph is the same for every layer,
so `get_adjacency` builds it once, as a destination-sorted CSR matrix (``rowptr`` int64 N+1,
``col`` int32 when it fits, ``weight``), caches it on the controller, and hands the SAME object
to every layer of a forward and to later forwards on the same graph. Self-loops and the GCN
normalization are applied with PyG's own functions (`gcn_norm`, `add_remaining_self_loops`,
...), so the edges and weights are exactly those the stock convolution would use.

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
import contextlib
import warnings
import weakref
from typing import Any

import torch
import torch_geometric.typing as pyg_typing
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from gact_graph.kernels import force_triton, triton_available
from gact_graph.sparse.torch_notices import quiet_sparse_notices, sparse_csr_tensor
from gact_graph.switches import eager_when_compiling, once_per_graph, package_work

__all__ = [
    "CompactAdjacency",
    "AdjacencyCache",
    "get_adjacency",
    "differentiable_edge_weight",
    "content_hash",
    "is_torch_sparse",
    "is_sparse_tensor",
    "pyg_edge_list",
]

#: Graphs a controller keeps alive between forwards (most recently used); older ones are held
#: weakly (alive only while autograd still needs them). ``compress_gnn(..., max_graphs=N)``.
DEFAULT_MAX_GRAPHS = 4


def _hash_chunk(device: torch.device) -> int:
    """Elements `content_hash` takes at once (the hash does not depend on it). Four int64
    temporaries of this many are alive at once: small on CPU, where the budget planner reads a
    small graph's first step from the resident set and a larger chunk would be its highest
    moment; large on a GPU, where each chunk costs a dozen kernel launches. The figures behind
    the two sizes are in docs/design.md (memory budget: the graph's first step)."""
    return 1 << 16 if device.type == "cpu" else 1 << 20


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
        keep = t_perm.to(_index_dtype(t_perm.numel())) if wants_perm else None
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
            return at.rowptr, at.col, None if pos is None else pos.to(_index_dtype(pos.numel()))
        t_perm = torch.argsort(self.col, stable=True)
        t_rowptr = _rowptr_from_sorted_counts(torch.bincount(self.col, minlength=self.num_nodes),
                                              self.num_nodes)  # fmt: skip
        t_col = self.dst_index()[t_perm].to(self.col.dtype)
        if torch.equal(t_rowptr, self.rowptr) and torch.equal(t_col, self.col):
            t_rowptr, t_col = self.rowptr, self.col
        pos = None if torch.equal(t_perm, _arange_like(t_perm)) else t_perm
        return t_rowptr, t_col, None if pos is None else pos.to(_index_dtype(pos.numel()))

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


# ---------------------------------------------------------------------------- content hash
_M1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_M2 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M3 = -7723592293110705685  # 0x94D049BB133111EB


def _as_int64_values(t: Tensor) -> Tensor:
    """Values as int64: integers by value (int32 and int64 of equal values agree), floats by
    the bits of their float64 value (float32 and float64 of equal values agree)."""
    if t.is_floating_point():
        return t.to(torch.float64).view(torch.int64)
    if t.dtype == torch.bool:
        return t.to(torch.int64)
    return t.to(torch.int64)


def _hash_on_triton(flat: Tensor) -> bool:
    """Whether `_hash_pair` runs the one-launch Triton kernel (`gact_graph.kernels.content_hash`,
    CUDA; CPU tensors only when the kernel tests force it) rather than the chunked PyTorch ops:
    both give the same two sums."""
    if not (flat.is_cuda or force_triton()) or not triton_available():
        return False
    from gact_graph.kernels.content_hash import HASHABLE_DTYPES

    return flat.dtype in HASHABLE_DTYPES and flat.is_contiguous()


def _hash_pair(t: Tensor) -> Tensor:
    """`content_hash`'s two 64-bit sums as one int64 [2] tensor on ``t``'s device: no host sync,
    so a cached graph is checked against it with device ops."""
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return torch.zeros(2, dtype=torch.int64, device=flat.device)
    if _hash_on_triton(flat):  # one launch, no temporaries (every forward's check on a GPU)
        pair = _checked_triton_hash_pair(flat)
        if pair is not None:
            return pair
    return _torch_hash_pair(flat)


#: (device, dtype) -> whether the Triton hash agreed with the PyTorch one on its first use there
_TRITON_HASH_TRUSTED: dict[tuple[torch.device, torch.dtype], bool] = {}


def _checked_triton_hash_pair(flat: Tensor) -> Tensor | None:
    """The Triton kernel's pair, or None where it is not trusted. On its first use per device
    and dtype the kernel's pair is compared with the PyTorch ops' (one read to the host, once):
    a cache key computed two ways would mistake every graph for a new one, or worse, a changed
    graph for the cached one, so a kernel that fails to build or disagrees is set aside with a
    warning and the PyTorch path serves from then on."""
    from gact_graph.kernels.content_hash import triton_hash_pair

    key = (flat.device, flat.dtype)
    trusted = _TRITON_HASH_TRUSTED.get(key)
    if trusted is False:
        return None
    if trusted:
        return triton_hash_pair(flat, _M1, _M2, _M3)
    try:
        pair = triton_hash_pair(flat, _M1, _M2, _M3)
        agrees = torch.equal(pair, _torch_hash_pair(flat))
        problem = "" if agrees else "its hash differs from the PyTorch reference's"
    except Exception as exc:  # a kernel that cannot build here must not stop training
        pair, problem = None, f"{type(exc).__name__}: {exc}"
    _TRITON_HASH_TRUSTED[key] = not problem
    if problem:
        warnings.warn(
            f"gact_graph: the Triton content hash is not used on {flat.device} for "
            f"{flat.dtype} ({problem}); the graph check uses PyTorch ops there instead "
            "(correct, more kernel launches). Please report this with your GPU and Triton version.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return pair


def _torch_hash_pair(flat: Tensor) -> Tensor:
    """`_hash_pair` by PyTorch ops, in bounded chunks: the CPU path and the kernel's oracle."""
    n = flat.numel()
    chunk = _hash_chunk(flat.device)
    pair = None
    for start in range(0, n, chunk):
        # in place where the tensor is this loop's own (``v`` may be the caller's int64 data):
        # four chunk-sized int64 tensors at once, not seven (a graph's first step builds its
        # adjacency, and on a small graph this hash of its edge index can be that step's peak)
        v = _as_int64_values(flat[start : start + chunk] if n > chunk else flat)
        m = torch.arange(start, start + v.numel(), dtype=torch.int64, device=flat.device)
        m.mul_(_M1).bitwise_xor_(m >> 31).mul_(_M2).bitwise_xor_(m >> 27)
        a = torch.bitwise_xor(v, m).mul_(_M3)
        h1 = a.bitwise_xor_(a >> 29).sum()
        b = torch.add(v, m, out=a).mul_(_M1)
        h2 = b.bitwise_xor_(b >> 32).sum()
        # one chunk (a graph of up to `_hash_chunk` entries: every step's check) needs no
        # running sum: its pair is the hash (int64 sums wrap alike in either order)
        part = torch.stack((h1, h2))
        pair = part if pair is None else pair.add_(part)
        del v, m, a, b
    return pair


def content_hash(t: Tensor | None) -> tuple:
    """A 128-bit hash of a tensor's shape and values (not of its layout, strides or dtype
    width): position-dependent mixing summed with int64 wrap-around, in bounded chunks."""
    if t is None:
        return ("none",)
    return _hash_key(t, _hash_pair(t).tolist())  # (to the host: a sync on a GPU)


def _hash_key(t: Tensor, pair: list[int]) -> tuple:
    """`content_hash` of ``t`` from its `_hash_pair`, read to the host."""
    return ("float" if t.is_floating_point() else "int", tuple(t.shape), pair[0], pair[1])


# ---------------------------------------------------------------------------- cache
class _Entry:
    """A cache entry: the adjacency (weakly), the storages its key names (weakly), and for an
    identity key the content digest of those tensors when it was made (`_digest`) and the
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


def _cache_of(ctl) -> AdjacencyCache:
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


def _identity_key(
    t: Tensor | None,
) -> tuple[tuple, list[StorageWeakRef], list[Tensor]] | None:
    """(key, weak refs, parts) naming exactly this view of this storage at this version, with
    the plain tensors it is made of (a sparse matrix's indices and values); None when the
    tensor has no inspectable storage. The version counter misses writes that bypass it (a
    NumPy array behind `torch.from_numpy`, ``.data``): `_digest` of the parts covers those."""
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
            sub = _identity_key(c)
            if sub is None:
                return None
            parts.append(sub[0])
            refs += sub[1]
            tensors += sub[2]
        return tuple(parts), refs, tensors
    t = _plain(t)
    if t.layout != torch.strided or t.device.type == "meta":
        return None
    ref = _storage_ref(t)
    key = (ref.cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version)
    return key, [ref], [t]


def _digest(parts: list[Tensor]) -> Tensor | None:
    """The `_hash_pair` of every part, on their device (one pass over each; no host sync)."""
    if not parts:
        return None
    if len(parts) == 1:
        return _hash_pair(parts[0])
    return torch.cat([_hash_pair(p) for p in parts])


def _unchanged(digest: Tensor | None, before: Tensor | None) -> bool:
    """Whether two digests agree. Deciding which adjacency serves the forward is the host's
    work: on a GPU this reads one flag back, the check's only sync."""
    if digest is None or before is None:
        return digest is None and before is None
    if digest.shape != before.shape or digest.device != before.device:
        return False
    return bool(torch.equal(digest, before))


def _checks_content(ctl) -> bool:
    """Whether a graph found by identity has its content checked too (``graph_check``)."""
    config = getattr(ctl, "config", None)
    return config is None or config.extra.get("graph_check", "forward") == "forward"


def _forward_token(ctl) -> int | None:
    """The training forward now running (its inputs are checked once in it), or None (eval,
    ``no_grad``, outside a forward: every call checks)."""
    if not getattr(ctl, "compressing", False):
        return None
    return getattr(ctl, "_forward_id", None)


def _plain(t: Tensor) -> Tensor:
    """The plain tensor behind a subclass such as PyG's `EdgeIndex`."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return t
    as_tensor = getattr(t, "as_tensor", None)
    if callable(as_tensor):
        return as_tensor()
    return t.as_subclass(torch.Tensor)


def _dtypes(t: Any) -> tuple:
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


def _content_key(t: Tensor | None, pair: list[int] | None = None) -> tuple:
    """``t``'s content key; ``pair``: its `_hash_pair`, already made and read (a plain
    tensor)."""
    if t is None:
        return ("none",)
    if pair is not None:
        return _hash_key(t, pair)
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
    return content_hash(_plain(t))


# ---------------------------------------------------------------------------- building
def pyg_edge_list(
    edge_index: Tensor,
    edge_weight: Tensor | None,
    num_nodes: int,
    add_self_loops: bool,
    normalize: bool,
    improved: bool,
    fill_value: float,
    loop_mode: str,
    dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor | None]:
    """The (edge_index, edge_weight) PyG's convolution would message-pass over: PyG's own
    functions, so self-loop handling and normalization match it exactly."""
    from torch_geometric.nn.conv.gcn_conv import gcn_norm
    from torch_geometric.utils import add_remaining_self_loops, remove_self_loops
    from torch_geometric.utils import add_self_loops as add_all_self_loops

    if normalize:
        return gcn_norm(
            edge_index, edge_weight, num_nodes, improved, add_self_loops, "source_to_target", dtype
        )
    if add_self_loops:
        if loop_mode == "replace":
            edge_index, edge_weight = remove_self_loops(edge_index, edge_weight)
            return add_all_self_loops(edge_index, edge_weight, fill_value, num_nodes)
        return add_remaining_self_loops(edge_index, edge_weight, fill_value, num_nodes)
    return edge_index, edge_weight


def _pyg_sparse(
    adj: Tensor,
    num_nodes: int,
    add_self_loops: bool,
    normalize: bool,
    improved: bool,
    fill_value: float,
    loop_mode: str,
    dtype: torch.dtype | None,
) -> Tensor:
    """The torch.sparse matrix PyG's convolution would multiply with, as CSR."""
    from torch_geometric.nn.conv.gcn_conv import gcn_norm
    from torch_geometric.utils import add_self_loops as add_all_self_loops
    from torch_geometric.utils import remove_self_loops

    if normalize:
        adj, _ = gcn_norm(adj, None, num_nodes, improved, add_self_loops, "source_to_target", dtype)
    elif add_self_loops:
        if loop_mode == "replace":
            adj, _ = remove_self_loops(adj)
        adj, _ = add_all_self_loops(adj, None, fill_value, num_nodes)
    if adj.layout != torch.sparse_csr:  # what torch_geometric.utils.spmm does
        adj = adj.to_sparse_csr()
    return adj


def _index_dtype(num_nodes: int) -> torch.dtype:
    return torch.int32 if num_nodes <= _INT32_MAX else torch.int64


def _from_edge_list(
    edge_index: Tensor,
    edge_weight: Tensor | None,
    num_nodes: int,
    external: bool,
    keep_perm: bool,
    replace_loops: bool = False,
    gcn: tuple[bool, bool, torch.dtype | None] | None = None,
) -> CompactAdjacency:
    """CSR of an edge list. ``replace_loops``: every self-loop removed and one per node
    appended (PyG's ``remove_self_loops`` + ``add_self_loops``, GAT's; unweighted
    ``add_remaining_self_loops`` gives the same list). ``gcn``: ``(improved, add_self_loops,
    dtype)`` of PyG's ``gcn_norm`` (remaining self-loops, symmetric normalization), computed on
    the sort keys. Both without the edge-list copies PyG's functions make."""
    edge_index = _plain(edge_index)
    if edge_index.dim() != 2 or edge_index.size(0) != 2:
        raise ValueError(f"edge_index must be [2, E], got {tuple(edge_index.shape)}")
    src, dst = edge_index[0], edge_index[1]
    if src.numel():
        lo = torch.minimum(src.min(), dst.min()).item()
        hi = torch.maximum(src.max(), dst.max()).item()
        if lo < 0 or hi >= num_nodes:
            raise IndexError(
                f"edge_index holds node {lo if lo < 0 else hi}, outside [0, {num_nodes})"
            )
    # Sorted by (destination, source): rows in CSR order with their columns ascending, so an
    # undirected graph's CSR equals its transpose's and the transpose costs nothing. The key
    # dst * N + src is the only E-long int64 made from the edge list (at ogbn-products' size
    # each such vector is about 1 GB), and rows and columns are read back from the sorted
    # keys, so the build holds about three such vectors at its peak (the key, the sorted keys
    # and their permutation); GAT's self-loop replacement works on the keys, not on copies of
    # the edge list.
    weight = None if edge_weight is None else edge_weight.detach()
    caller_weight = weight  # never kept as is: an in-place change of it must not reach us
    dis = None  # gcn: D^-1/2 of the weighted in-degrees, self-loops included
    # gcn without edge weights, loops of weight 1: every normalized weight is a product of D^-1/2
    unit_weights = gcn is not None and weight is None and not (gcn[0] and gcn[1])
    if replace_loops or (gcn is not None and gcn[1]):
        keep = src != dst
        kept = int(keep.sum())
        key = torch.empty(kept + num_nodes, dtype=torch.int64, device=src.device)
        torch.mul(dst[keep], num_nodes, out=key[:kept])
        key[:kept].add_(src[keep])
        # PyG appends one loop per node after the remaining edges: key i * N + i
        torch.arange(num_nodes, out=key[kept:]).mul_(num_nodes + 1)
        if gcn is not None:
            if weight is not None:  # a node's loop keeps its (last listed) weight, else fill
                w = torch.empty(kept + num_nodes, dtype=weight.dtype, device=weight.device)
                w[kept:] = 2.0 if gcn[0] else 1.0
                inv = ~keep
                w[kept:].index_put_((src[inv],), weight[inv])
                torch.masked_select(weight, keep, out=w[:kept])
                weight = w
                del inv, w
            else:
                weight = torch.ones(kept + num_nodes, dtype=gcn[2], device=src.device)
            deg = weight.new_zeros(num_nodes)
            deg.scatter_add_(0, dst[keep].long(), weight[:kept])  # PyG's order: edges, loops
            deg.scatter_add_(0, torch.arange(num_nodes, device=deg.device), weight[kept:])
            dis = deg.pow_(-0.5).masked_fill_(deg == float("inf"), 0)
        del keep
    else:
        key = dst.to(torch.int64, copy=True).mul_(num_nodes).add_(src)
        if gcn is not None:
            if weight is None:
                weight = torch.ones(key.numel(), dtype=gcn[2], device=src.device)
            deg = weight.new_zeros(num_nodes).scatter_add_(0, dst.long(), weight)
            dis = deg.pow_(-0.5).masked_fill_(deg == float("inf"), 0)
    del src, dst
    perm = None
    if key.numel() >= 2 and not bool((key[1:] >= key[:-1]).all()):
        key, perm = torch.sort(key, stable=True)
    if weight is not None:
        # Copies: we own our data, so an in-place change of the caller's never reaches us.
        if perm is not None:
            weight = weight[perm]
        elif weight is caller_weight and dis is None:  # (gcn's weights are a new product)
            weight = weight.clone()
    del caller_weight
    if not keep_perm:
        perm = None
    elif perm is not None:  # positions, kept for every step: int32 where they fit (GAT's dropout)
        perm = perm.to(_index_dtype(perm.numel()))
    bounds = torch.arange(num_nodes + 1, dtype=torch.int64, device=key.device).mul_(num_nodes)
    rowptr = torch.searchsorted(key, bounds)  # row i starts at the first key >= i * N
    del bounds
    col = key.remainder_(num_nodes).to(_index_dtype(num_nodes))
    del key
    scale = None
    if dis is not None and unit_weights and not keep_perm:
        weight, scale = None, dis  # the SpMM scales by D^-1/2 on both sides (see `scale`)
    elif dis is not None:  # gcn_norm's D^-1/2[src] * w * D^-1/2[dst], in its order of products
        weight = dis.index_select(0, col).mul_(weight)
        weight.mul_(dis.repeat_interleave(rowptr.diff(), output_size=col.numel()))
    return CompactAdjacency(
        num_nodes, rowptr, col, None if external else weight, perm, weight_is_external=external,
        scale=scale,
    )  # fmt: skip


def _from_torch_csr(csr: Tensor, num_nodes: int, use_values: bool = True) -> CompactAdjacency:
    _check_square(csr, num_nodes)
    rowptr = csr.crow_indices().detach().to(torch.int64, copy=True)
    col = csr.col_indices().detach().to(_index_dtype(num_nodes), copy=True)
    weight = csr.values().detach().clone() if use_values else None
    return CompactAdjacency(num_nodes, rowptr, col, weight, None)


def _check_square(adj: Tensor, num_nodes: int) -> None:
    if adj.size(0) != adj.size(1) or adj.size(0) != num_nodes:
        raise ValueError(
            f"the sparse adjacency is {tuple(adj.shape)}, expected ({num_nodes}, {num_nodes})"
        )


def _sharing_torch_csr(
    adj: Tensor, num_nodes: int, use_values: bool, gcn: tuple[bool, bool] | None
) -> CompactAdjacency:
    """A torch.sparse CSR matrix's adjacency on its own columns and values, no copy of them
    (values of ones that take no memory stay implicit). ``gcn``: ``(improved,
    add_self_loops)`` of PyG's ``gcn_norm`` on a torch.sparse matrix, ``D^-1/2 (A + fill I)
    D^-1/2`` with ``D`` its row sums: as ``scale`` and an implicit ``loop``."""
    _check_square(adj, num_nodes)
    adj = adj.detach()
    col, values = adj.col_indices(), adj.values()
    rowptr = adj.crow_indices().to(torch.int64)
    weight = values if use_values and not _all_ones(values) else None
    if gcn is None:
        return CompactAdjacency(num_nodes, rowptr, col, weight)
    loop = (2.0 if gcn[0] else 1.0) if gcn[1] else 0.0
    if weight is None:
        deg = rowptr.diff().to(torch.float32)
    else:  # row sums, in float32 at least
        acc = torch.promote_types(weight.dtype, torch.float32)
        deg = torch.segment_reduce(weight.to(acc), "sum", offsets=rowptr, axis=0)
    deg.add_(loop)
    dis = deg.pow_(-0.5).masked_fill_(deg == float("inf"), 0).to(values.dtype)
    return CompactAdjacency(num_nodes, rowptr, col, weight, scale=dis, loop=loop)


def _all_ones(values: Tensor) -> bool:
    """Values that hold one 1 seen everywhere (`compact_adj_t`'s): read as no values."""
    return values.numel() > 0 and values.stride(0) == 0 and bool(values[0] == 1)


def _build(
    graph: Any,
    edge_weight: Tensor | None,
    num_nodes: int,
    add_self_loops: bool,
    normalize: bool,
    improved: bool,
    fill_value: float,
    loop_mode: str,
    dtype: torch.dtype | None,
    external: bool,
    use_values: bool,
    keep_perm: bool,
) -> CompactAdjacency:
    with torch.no_grad():
        if is_sparse_tensor(graph):  # torch_sparse.SparseTensor (PyG's adj_t: row = target)
            if not use_values:  # as SAGEConv / GINConv do
                graph = graph.set_value(None, layout=None)
            if normalize:
                from torch_geometric.nn.conv.gcn_conv import gcn_norm

                graph = gcn_norm(
                    graph, None, num_nodes, improved, add_self_loops, "source_to_target", dtype
                )
            else:
                if not graph.has_value():
                    graph = graph.fill_value(1.0, dtype=dtype or torch.float32)
                if add_self_loops:  # a SparseTensor's loops are replaced (PyG: set/fill_diag)
                    if loop_mode == "replace":
                        graph = pyg_typing.torch_sparse.set_diag(graph)
                    else:
                        graph = pyg_typing.torch_sparse.fill_diag(graph, fill_value)
            return _from_torch_csr(graph.to_torch_sparse_csr_tensor(), num_nodes)
        if is_torch_sparse(graph) and graph.layout == torch.sparse_csr:
            if normalize or not add_self_loops:
                gcn = (improved, add_self_loops) if normalize else None
                return _sharing_torch_csr(graph, num_nodes, use_values, gcn)
        if is_torch_sparse(graph):
            csr = _pyg_sparse(
                graph.detach(), num_nodes, add_self_loops, normalize, improved, fill_value,
                loop_mode, dtype,
            )  # fmt: skip
            return _from_torch_csr(csr, num_nodes, use_values)
        weight = None if external else edge_weight
        graph = _plain(graph)
        if graph.dtype not in _INDEX_DTYPES:  # uint8/int8/int16 (see _check_index_dtype)
            graph = graph.long()
        # on the sort keys, without copies of the edge list (see _from_edge_list)
        if normalize and not external:
            gcn = (improved, add_self_loops, dtype)
            return _from_edge_list(graph, weight, num_nodes, external, keep_perm, gcn=gcn)
        if add_self_loops and weight is None:  # GAT's loops; unweighted remaining loops
            return _from_edge_list(
                graph, None, num_nodes, external, keep_perm or external, replace_loops=True
            )
        ei, w = pyg_edge_list(
            graph, weight, num_nodes, add_self_loops, normalize, improved, fill_value,
            loop_mode, dtype,
        )  # fmt: skip
        return _from_edge_list(ei, w, num_nodes, external, keep_perm or external)


@package_work  # a cache look-up: the forward's pointwise mode need not see its torch calls
def get_adjacency(
    ctl,
    edge_index_or_adj: Any,
    num_nodes: int,
    *,
    add_self_loops: bool,
    normalize: bool | str = False,
    edge_weight: Tensor | None = None,
    improved: bool = False,
    fill_value: float = 1.0,
    loop_mode: str = "remaining",
    dtype: torch.dtype | None = None,
    use_values: bool = True,
    keep_perm: bool = False,
) -> CompactAdjacency:
    """The shared `CompactAdjacency` of a graph, built once per controller and graph.

    Args:
        ctl: the `Controller` (its cache; its ``keep_lossless`` marks the adjacency's tensors
            so they are stored once, losslessly, as kind ``index``). ``None``: no caching.
        edge_index_or_adj: ``edge_index`` (integer [2, E]; row 0 source, row 1 target), a
            `torch.sparse` COO/CSR/CSC matrix in PyG's ``adj_t`` convention (row = target), or
            a ``torch_sparse.SparseTensor`` when that package is installed.
        num_nodes: N.
        add_self_loops: add self-loops as the PyG convolution does (see ``loop_mode``).
        normalize: ``True``/``"sym"``: GCN normalization exactly as PyG's `gcn_norm`
            (self-loops with fill 1, or 2 with ``improved``; D^-1/2 (A + I) D^-1/2 with the
            degree summed at the target).
        edge_weight: per-edge weights of ``edge_index`` (ignored for sparse matrices, as PyG
            does). If it requires grad (and grad is on), the adjacency caches only the
            structure (``weight_is_external``); compute the weights per forward with
            `differentiable_edge_weight` and reorder them with ``adj.to_csr_order``.
        improved: GCN's ``improved`` (self-loop fill 2) when normalizing.
        fill_value: self-loop weight without normalization.
        loop_mode: ``"remaining"`` (GCN: `add_remaining_self_loops`; an existing self-loop
            keeps its weight) or ``"replace"`` (GAT: `remove_self_loops` + `add_self_loops`).
            Without edge weights both give the same edges in the same order. A
            ``SparseTensor``'s self-loops are replaced in both modes, as PyG's ``set_diag`` /
            ``fill_diag`` replace them.
        dtype: dtype of the normalized weights (the features' dtype, as PyG passes it).
        use_values: False drops a sparse matrix's values (SAGE/GIN with ``SparseTensor``).
        keep_perm: keep ``perm`` (CSR position -> PyG edge position); it is kept anyway with
            learnable weights. Without it ``perm`` is None (it costs 4 bytes per edge).

    Returns:
        The same `CompactAdjacency` object for every call on the same graph and options.
    """
    if normalize not in (False, True, "sym", "gcn"):
        raise ValueError(f"normalize must be False, True or 'sym', got {normalize!r}")
    normalize = bool(normalize)
    if loop_mode not in ("remaining", "replace"):
        raise ValueError(f"loop_mode must be 'remaining' or 'replace', got {loop_mode!r}")
    sparse_input = is_torch_sparse(edge_index_or_adj) or is_sparse_tensor(edge_index_or_adj)
    if not sparse_input and not isinstance(edge_index_or_adj, Tensor):
        if type(edge_index_or_adj).__name__ == "SparseTensor":
            raise ImportError(
                "a torch_sparse.SparseTensor adjacency needs the 'torch_sparse' package "
                "(pip install torch-sparse)"
            )
        raise TypeError(f"unsupported adjacency type {type(edge_index_or_adj).__name__}")
    if not sparse_input and edge_index_or_adj.is_floating_point():
        # PyG's own check and words: a float edge_index would be truncated into node ids
        raise ValueError(
            f"Expected 'edge_index' to be of integer type (got '{edge_index_or_adj.dtype}')"
        )
    if sparse_input:
        edge_weight = None
    else:
        _check_index_dtype(edge_index_or_adj.dtype, add_self_loops, edge_weight)
    external = edge_weight is not None and edge_weight.requires_grad and torch.is_grad_enabled()
    opts = (
        int(num_nodes), bool(add_self_loops), normalize, bool(improved), float(fill_value),
        loop_mode, dtype if normalize or sparse_input else None, bool(use_values),
        bool(keep_perm), external,
    )  # fmt: skip

    def build() -> CompactAdjacency:
        # from a sparse matrix, PyG's functions build sparse tensors of their own
        with quiet_sparse_notices() if sparse_input else contextlib.nullcontext():
            return _build(
                edge_index_or_adj, edge_weight, num_nodes, add_self_loops, normalize, improved,
                fill_value, loop_mode, dtype, external, use_values, keep_perm,
            )  # fmt: skip

    if ctl is None:
        return build()
    cache = _cache_of(ctl)

    # 1) identity: same storages, views and versions as a graph seen before, and (once per
    #    training forward) the same content: a write that bypasses the version counter (a
    #    NumPy buffer behind torch.from_numpy, ``.data``) changes the digest, not the key.
    id_graph = _identity_key(edge_index_or_adj)
    id_weight = _identity_key(None if external else edge_weight)
    id_key = digest = None
    token = _forward_token(ctl)
    if id_graph is not None and id_weight is not None:
        id_key = (opts, id_graph[0], id_weight[0])
        entry = cache.entry(cache._by_identity, id_key)
        if entry is not None:
            adj = entry.get()
            if _checks_content(ctl) and (token is None or entry.checked_in != token):
                digest = _digest(id_graph[2] + id_weight[2])
                if not _unchanged(digest, entry.digest):
                    adj = None  # rewritten in place: found or built by content below
            if adj is not None:
                entry.checked_in = token
                cache.hits += 1
                cache.touch(adj)
                return adj

    # 2) content: equal values arriving as other tensors (copy, view, COO vs CSR).
    cache.prune()
    graph_pair = weight_pair = None
    if id_key is not None and _is_plain(edge_index_or_adj) and _is_plain(edge_weight, external):
        # the identity entry's digest is the content key's hash: one pass, one read to the host
        if digest is None:
            digest = _digest(id_graph[2] + id_weight[2])
        host = digest.tolist()
        graph_pair, weight_pair = host[:2], (host[2:] if len(host) > 2 else None)
    c_key = (
        opts, _dtypes(edge_index_or_adj), _dtypes(None if external else edge_weight),
        _content_key(edge_index_or_adj, graph_pair),
        _content_key(None if external else edge_weight, weight_pair),
    )  # fmt: skip
    adj = cache.lookup(cache._by_content, c_key)
    if adj is None:
        with once_per_graph():  # later steps with this graph find it cached
            adj = build()
            # 3) canonical: the built CSR itself (a COO and a CSR of one matrix meet here).
            canon = (
                "csr", adj.num_nodes, external, content_hash(adj.rowptr), content_hash(adj.col),
                content_hash(adj.weight), None if adj.weight is None else adj.weight.dtype,
                content_hash(adj.perm), content_hash(adj.scale), adj.loop,
            )  # fmt: skip
        cache.builds += 1
        same = cache.lookup(cache._by_content, canon)
        if same is not None:
            adj = same
        else:
            adj._ctl_ref = weakref.ref(ctl)
            for t in adj.tensors():
                ctl.keep_lossless(t, "index")
            cache.insert(cache._by_content, canon, adj)
        cache.insert(cache._by_content, c_key, adj)
    else:
        cache.hits += 1
    if id_key is not None:
        if digest is None:
            digest = _digest(id_graph[2] + id_weight[2])
        entry = cache.insert(cache._by_identity, id_key, adj, id_graph[1] + id_weight[1], digest)
        entry.checked_in = token
    cache.touch(adj)
    return adj


def _is_plain(t: Tensor | None, external: bool = False) -> bool:
    """A plain (strided) tensor, or no tensor: its content key is its one `_hash_pair`."""
    return external or t is None or not (is_torch_sparse(t) or is_sparse_tensor(t))


#: Integer dtypes PyG's message passing indexes with.
_INDEX_DTYPES = (torch.int32, torch.int64)
#: Dtypes stock PyG also takes where it adds self-loops to an unweighted graph: the int64 loop
#: index concatenated to the edge index promotes it to int64.
_PROMOTED_DTYPES = (torch.uint8, torch.int8, torch.int16)


def _check_index_dtype(dtype: torch.dtype, add_self_loops: bool, edge_weight) -> None:
    """Refuse, with the fix, an edge index dtype that stock PyG would fail on (or misread: a
    weighted uint8 index is taken for a boolean mask there)."""
    if dtype in _INDEX_DTYPES:
        return
    if dtype in _PROMOTED_DTYPES and add_self_loops and edge_weight is None:
        return  # built from its int64 values, as PyG promotes it
    raise TypeError(
        f"edge_index of dtype {dtype} is not supported here: PyG's message passing indexes "
        "with int64 or int32 (a uint8, int8 or int16 index works in stock PyG only where it "
        "adds self-loops to an unweighted graph, which promotes the index to int64); pass "
        "edge_index.long()"
    )


def differentiable_edge_weight(
    adj: CompactAdjacency,
    edge_index: Tensor,
    edge_weight: Tensor,
    num_nodes: int,
    *,
    add_self_loops: bool,
    normalize: bool,
    improved: bool = False,
    fill_value: float = 1.0,
    loop_mode: str = "remaining",
    dtype: torch.dtype | None = None,
) -> Tensor:
    """The learnable ``edge_weight`` after PyG's self-loops / normalization, with autograd,
    in ``adj``'s CSR order (``adj`` from `get_adjacency` with the same arguments)."""
    _, w = pyg_edge_list(
        edge_index, edge_weight, num_nodes, add_self_loops, bool(normalize), improved,
        fill_value, loop_mode, dtype,
    )  # fmt: skip
    if w.numel() != adj.num_edges:
        raise ValueError("edge_weight does not belong to this adjacency")
    return adj.to_csr_order(w)
