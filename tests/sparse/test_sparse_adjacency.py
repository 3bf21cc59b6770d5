"""The shared compact adjacency: PyG-exact edges and weights, caching, lifetime."""

import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch_geometric.nn.conv.gcn_conv import gcn_norm
from torch_geometric.utils import add_remaining_self_loops, add_self_loops, remove_self_loops

from gact_graph import CompressionConfig, Controller
from gact_graph.sparse import adjacency_build, adjacency_cache
from gact_graph.sparse import content_hash as hashing
from gact_graph.sparse.adjacency import CompactAdjacency
from gact_graph.sparse.adjacency_build import get_adjacency
from gact_graph.sparse.content_hash import content_hash

warnings.filterwarnings("ignore", message=".*[Ss]parse.*")


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def _awkward_graph(n=57, e=400, seed=0):
    """(No reference cycles anywhere: adjacencies die by refcount, no gc.collect needed.)
    Random directed graph with isolated nodes, self-loops (one node with two) and duplicate
    edges."""
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n - 5, (2, e), generator=g)  # nodes n-5..n-1 isolated
    extra = torch.tensor([[3, 3, 3, 7, 7, 10, 10], [3, 3, 9, 7, 2, 11, 11]])
    return torch.cat([ei, extra], dim=1), n


def _ctl():
    return Controller(nn.Linear(1, 1), CompressionConfig(bits=None))


def _dense_from_edges(ei, w, n):
    a = torch.zeros(n, n, dtype=torch.float64)
    w = torch.ones(ei.size(1), dtype=torch.float64) if w is None else w.double()
    a.index_put_((ei[1], ei[0]), w, accumulate=True)  # row = target, col = source
    return a


def _dense(adj: CompactAdjacency):
    adj = adj.explicit()
    n = adj.num_nodes
    rows = torch.repeat_interleave(torch.arange(n), adj.rowptr[1:] - adj.rowptr[:-1])
    w = torch.ones(adj.num_edges) if adj.weight is None else adj.weight
    a = torch.zeros(n, n, dtype=torch.float64)
    a.index_put_((rows, adj.col.long()), w.double(), accumulate=True)
    return a


@pytest.mark.parametrize("improved", [False, True])
@pytest.mark.parametrize("loops", [True, False])
def test_gcn_normalized_edges_match_pyg(improved, loops):
    ei, n = _awkward_graph()
    w_in = torch.rand(ei.size(1))
    for weight in (None, w_in):
        adj = get_adjacency(
            None, ei, n, add_self_loops=loops, normalize=True, improved=improved,
            edge_weight=weight, dtype=torch.float32,
        )  # fmt: skip
        ref_ei, ref_w = gcn_norm(ei, weight, n, improved, loops, dtype=torch.float32)
        assert adj.num_edges == ref_ei.size(1)  # duplicates kept, one loop per node
        torch.testing.assert_close(_dense(adj), _dense_from_edges(ref_ei, ref_w, n))
        # computed on the sort keys, the same edges and weights bit for bit in CSR order;
        # without edge weights (or loops of weight 2) as D^-1/2 on both sides, no weights
        assert (adj.weight is None) == (weight is None and not (improved and loops))
        assert (adj.scale is None) == (adj.weight is not None)
        order = torch.argsort(ref_ei[1] * n + ref_ei[0], stable=True)
        assert torch.equal(adj.col.long(), ref_ei[0, order])
        assert torch.equal(adj.explicit().weight, ref_w[order])
        if weight is not None:
            assert adj.weight.data_ptr() != weight.data_ptr()
        assert adj.rowptr.dtype == torch.int64 and adj.col.dtype == torch.int32
        assert adj.rowptr[-1] == adj.num_edges


@pytest.mark.parametrize("mode", ["remaining", "replace"])
def test_self_loops_without_normalization_match_pyg(mode):
    ei, n = _awkward_graph(seed=1)
    w = torch.rand(ei.size(1))
    adj = get_adjacency(
        None, ei, n, add_self_loops=True, edge_weight=w, fill_value=0.5, loop_mode=mode,
        keep_perm=True,
    )  # fmt: skip
    if mode == "remaining":
        ref_ei, ref_w = add_remaining_self_loops(ei, w, 0.5, n)
    else:
        ref_ei, ref_w = add_self_loops(*remove_self_loops(ei, w), fill_value=0.5, num_nodes=n)
    torch.testing.assert_close(_dense(adj), _dense_from_edges(ref_ei, ref_w, n))
    # perm maps CSR positions to PyG's edge order, and edge_index() is that edge list.
    assert torch.equal(adj.edge_index(), ref_ei[:, adj.perm])
    torch.testing.assert_close(adj.weight, ref_w[adj.perm])
    torch.testing.assert_close(adj.to_edge_order(adj.to_csr_order(ref_w)), ref_w)


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_replaced_loops_without_weights_match_pyg_edge_order(index_dtype):
    """GAT's adjacency (loops replaced, no weights) is built on the sort keys, without PyG's
    edge-list copies: the same CSR, and ``perm`` maps it to PyG's edge order exactly (the
    attention dropout draws in that order)."""
    ei, n = _awkward_graph(seed=4)
    ref_ei, _ = add_self_loops(*remove_self_loops(ei), num_nodes=n)
    adj = get_adjacency(
        None, ei.to(index_dtype), n, add_self_loops=True, loop_mode="replace", keep_perm=True
    )
    assert adj.weight is None and adj.num_edges == ref_ei.size(1)
    assert adj.perm.dtype == torch.int32  # kept for every step: 4 bytes per edge, not 8
    assert torch.equal(adj.edge_index(), ref_ei[:, adj.perm])
    assert torch.equal(adj.perm, torch.argsort(ref_ei[1] * n + ref_ei[0], stable=True))
    assert torch.equal(_dense(adj), _dense_from_edges(ref_ei, None, n))
    no_perm = get_adjacency(None, ei, n, add_self_loops=True, loop_mode="replace")
    assert no_perm.perm is None
    assert torch.equal(no_perm.rowptr, adj.rowptr) and torch.equal(no_perm.col, adj.col)


class _Live(TorchDispatchMode):
    """Peak bytes of the storages ATen ops create while active and that are still alive
    (``old``'s storage, e.g. the edge index an op returns as is, is not new)."""

    def __init__(self, old):
        super().__init__()
        self.live, self.bytes, self.peak = {}, 0, 0
        self.old = old.untyped_storage().data_ptr()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [k for k, (ref, _) in self.live.items() if ref() is None]:
            self.bytes -= self.live.pop(key)[1]
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st.data_ptr() not in self.live and st.data_ptr() != self.old:
                    self.live[st.data_ptr()] = (weakref.ref(st), st.nbytes())
                    self.bytes += st.nbytes()
        self.peak = max(self.peak, self.bytes)
        return out


def test_building_holds_about_three_edge_long_int64_vectors():
    """The build reads rows and columns back from the sorted keys and, for GAT's loops and
    GCN's normalization, makes no copy of the edge list: at most ~3.5-4 E-long int64 vectors
    at once (6.1 and 7.1 before; 0.94 GiB each at ogbn-products' size)."""
    g = torch.Generator().manual_seed(0)
    n, e = 5_000, 200_000
    ei = torch.randint(0, n, (2, e), generator=g)
    with _Live(ei) as live:
        adj = get_adjacency(None, ei, n, add_self_loops=True, loop_mode="replace", keep_perm=True)
    assert adj.num_edges >= e
    assert live.peak <= 3.5 * adj.num_edges * 8, live.peak / (adj.num_edges * 8)
    # GCN's normalization too (7.1 before: gcn_norm's copies of the edge list)
    with _Live(ei) as live:
        adj = get_adjacency(None, ei, n, add_self_loops=True, normalize=True)
    assert live.peak <= 4 * adj.num_edges * 8, live.peak / (adj.num_edges * 8)


def test_unweighted_loop_modes_agree_and_plain_graph_keeps_duplicates():
    ei, n = _awkward_graph(seed=2)
    a = get_adjacency(None, ei, n, add_self_loops=True, keep_perm=True)
    b = get_adjacency(None, ei, n, add_self_loops=True, loop_mode="replace", keep_perm=True)
    assert torch.equal(a.rowptr, b.rowptr) and torch.equal(a.col, b.col)
    assert torch.equal(a.perm, b.perm)
    plain = get_adjacency(None, ei, n, add_self_loops=False)
    assert plain.num_edges == ei.size(1) and plain.weight is None and plain.perm is None
    assert torch.equal(_dense(plain), _dense_from_edges(ei, None, n))
    assert (plain.degree()[-5:] == 0).all()  # isolated nodes: empty rows


@pytest.mark.parametrize("layout", ["coo", "coo-uncoalesced", "csr"])
def test_torch_sparse_inputs_match_pyg(layout):
    ei, n = _awkward_graph(seed=3)
    vals = torch.rand(ei.size(1))
    coo = torch.sparse_coo_tensor(torch.stack([ei[1], ei[0]]), vals, (n, n))  # adj_t
    sp = {"coo": coo.coalesce(), "coo-uncoalesced": coo, "csr": coo.coalesce().to_sparse_csr()}
    sp = sp[layout]
    dense_ref = coo.to_dense().double()
    plain = get_adjacency(None, sp, n, add_self_loops=False)
    torch.testing.assert_close(_dense(plain), dense_ref)
    norm = get_adjacency(None, sp, n, add_self_loops=True, normalize=True, dtype=torch.float32)
    ref, _ = gcn_norm(sp.clone() if layout != "coo-uncoalesced" else coo, None, n, False, True)
    torch.testing.assert_close(_dense(norm), ref.to_dense().double())


def test_large_graph_over_65535_nodes():
    n, e = 70_001, 150_000
    g = torch.Generator().manual_seed(4)
    ei = torch.randint(0, n, (2, e), generator=g)
    ei[:, :10] = torch.tensor([[70_000] * 10, list(range(69_990, 70_000))])
    adj = get_adjacency(None, ei, n, add_self_loops=True, normalize=True, dtype=torch.float32)
    ref_ei, ref_w = gcn_norm(ei, None, n)
    assert adj.num_edges == ref_ei.size(1)
    # compare as sorted edge lists (a dense 70k x 70k matrix would not fit)
    key = ref_ei[1] * n + ref_ei[0]
    order = torch.argsort(key, stable=True)
    got = adj.edge_index()
    assert torch.equal(got, ref_ei[:, order])
    torch.testing.assert_close(adj.explicit().weight, ref_w[order])
    assert adj.col.max().item() == n - 1


def test_identity_cache_returns_the_same_object():
    ctl = _ctl()
    ei, n = _awkward_graph()
    a = get_adjacency(ctl, ei, n, add_self_loops=True, normalize=True, dtype=torch.float32)
    b = get_adjacency(ctl, ei, n, add_self_loops=True, normalize=True, dtype=torch.float32)
    cache = ctl._gg_adjacency_cache
    assert a is b and cache.builds == 1 and cache.hits == 1
    c = get_adjacency(ctl, ei, n, add_self_loops=False)
    assert c is not a and cache.builds == 2  # other options: another adjacency


def test_content_cache_shares_copies_views_and_formats():
    ctl = _ctl()
    ei, n = _awkward_graph()
    kw = dict(add_self_loops=True, normalize=True, dtype=torch.float32)
    a = get_adjacency(ctl, ei, n, **kw)
    strided = torch.empty(ei.size(1), 2, dtype=torch.long).copy_(ei.t()).t()  # other strides
    expanded = ei[:, None, :].expand(2, 3, -1)[:, 1, :]  # a view of an expanded tensor
    for other in (ei.clone(), strided, expanded):
        assert get_adjacency(ctl, other, n, **kw) is a
    assert ctl._gg_adjacency_cache.builds == 1
    # another dtype is another content key (built once more), then the same CSR: one object
    assert get_adjacency(ctl, ei.to(torch.int32), n, **kw) is a
    assert ctl._gg_adjacency_cache.builds == 2
    # the same matrix as COO and as CSR: one adjacency
    coo = torch.sparse_coo_tensor(torch.stack([ei[1], ei[0]]), torch.ones(ei.size(1)), (n, n))
    s1 = get_adjacency(ctl, coo.coalesce(), n, add_self_loops=False)
    s2 = get_adjacency(ctl, coo.coalesce().to_sparse_csr(), n, add_self_loops=False)
    s3 = get_adjacency(ctl, coo, n, add_self_loops=False)  # uncoalesced: same matrix
    assert s1 is s2 is s3


def test_inplace_change_of_the_graph_is_seen():
    ctl = _ctl()
    ei, n = _awkward_graph()
    a = get_adjacency(ctl, ei, n, add_self_loops=False)
    ei[0, 0] = (ei[0, 0] + 1) % n  # bumps the version: identity key misses, content differs
    b = get_adjacency(ctl, ei, n, add_self_loops=False)
    assert b is not a
    assert torch.equal(_dense(b), _dense_from_edges(ei, None, n))


def test_cache_is_bounded_and_does_not_keep_graphs_alive():
    ctl = Controller(nn.Linear(1, 1), CompressionConfig(bits=None, extra={"max_graphs": 2}))
    refs = []
    for seed in range(6):
        ei, n = _awkward_graph(seed=seed)
        refs.append(weakref.ref(get_adjacency(ctl, ei, n, add_self_loops=False)))
        del ei
    cache = ctl._gg_adjacency_cache
    assert len(cache) == 2
    alive = [r() is not None for r in refs]
    assert alive == [False] * 4 + [True] * 2
    ctl.remove()
    assert not hasattr(ctl, "_gg_adjacency_cache")
    assert all(r() is None for r in refs)


def test_building_is_once_per_graph_work_and_a_cache_hit_is_not(monkeypatch):
    """The budget planner counts a graph's adjacency build apart (later steps find it
    cached): the build, its canonical hash and the transpose run inside
    `gact_graph.switches.once_per_graph`; a cache hit (same tensors, or equal ones: hashed) builds
    nothing."""
    from gact_graph.switches import is_once_per_graph

    seen = []
    # each module's own reference: the build's and the cache's imports, the hash's inner call
    spied = ((adjacency_build, "_build"), (adjacency_build, "content_hash"),
             (adjacency_cache, "content_hash"), (adjacency_cache, "hash_pair"),
             (hashing, "hash_pair"), (CompactAdjacency, "_build_transpose"))  # fmt: skip
    for owner, name in spied:
        real = getattr(owner, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen.append((_name, is_once_per_graph()))
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    ctl = _ctl()
    ei, n = _awkward_graph()
    adj = get_adjacency(ctl, ei, n, add_self_loops=False)
    built = [s for s in seen if s[0] == "_build"]
    assert built == [("_build", True)]
    assert ("content_hash", True) in seen  # the built CSR's canonical hash
    seen.clear()
    assert get_adjacency(ctl, ei, n, add_self_loops=False) is adj  # identity hit
    assert get_adjacency(ctl, ei.clone(), n, add_self_loops=False) is adj  # content hit
    # only the inputs' hashes (the content check of the same tensors, the content key of the
    # new one), outside: they recur when a loop makes new tensors each step
    assert seen and all(s == ("hash_pair", False) for s in seen)
    seen.clear()
    adj.transpose()
    adj.transpose()
    assert seen == [("_build_transpose", True)]
    ctl.remove()


def test_transpose_and_symmetric_graphs():
    ei, n = _awkward_graph()
    w = torch.rand(ei.size(1))
    adj = get_adjacency(None, ei, n, add_self_loops=False, edge_weight=w)
    t = adj.transpose()
    assert t is not adj and adj.transpose() is t  # built once
    torch.testing.assert_close(_dense(t), _dense(adj).t())
    assert adj.nbytes == sum(x.numel() * x.element_size() for x in adj.tensors())
    assert len(adj.tensors()) == 6
    sym = torch.cat([ei, ei.flip(0)], dim=1)  # undirected: GCN's A is symmetric
    s = get_adjacency(None, sym, n, add_self_loops=True, normalize=True, dtype=torch.float32)
    assert s.transpose() is s and len(s.tensors()) == 3


def test_learnable_weight_keeps_structure_only():
    ei, n = _awkward_graph()
    w = torch.rand(ei.size(1), requires_grad=True)
    adj = get_adjacency(_ctl(), ei, n, add_self_loops=True, normalize=True, edge_weight=w)
    assert adj.weight_is_external and adj.weight is None and adj.perm is not None


def test_bad_inputs():
    ei, n = _awkward_graph()
    with pytest.raises(IndexError):
        get_adjacency(None, ei, 10, add_self_loops=False)
    with pytest.raises(ValueError):
        get_adjacency(None, ei, n, add_self_loops=False, normalize="row")
    with pytest.raises(TypeError):
        get_adjacency(None, [[0], [1]], n, add_self_loops=False)


def test_content_hash_holds_four_chunks_and_leaves_its_input(monkeypatch):
    """The cache's content hash (a graph's first step, on an identity miss) works in chunks
    (2^16 elements on CPU) with four chunk-sized int64 tensors at once (seven of 2^20 before:
    on a small graph seven edge-index copies, the first step's peak), in place only on its
    own; its value does not depend on the chunk size (CPU and GPU chunks differ)."""
    ei = torch.randint(0, 10**6, (2, 1_500_000), generator=torch.Generator().manual_seed(1))
    before = ei.clone()
    with _Live(ei) as live:
        h = content_hash(ei)
    assert torch.equal(ei, before)
    chunk = hashing._hash_chunk(ei.device) * 8
    assert chunk <= 2**19
    assert live.peak <= 4 * chunk + 4096, live.peak / chunk
    assert h == content_hash(ei.to(torch.int32)) and h != content_hash(ei.flip(1))
    monkeypatch.setattr(hashing, "_hash_chunk", lambda device: 12_345)
    assert content_hash(ei) == h


def _hash_pair_reference(t: torch.Tensor) -> torch.Tensor:
    """The content hash's two int64 sums in one pass over the whole tensor (no chunks)."""
    v = hashing._as_int64_values(t.reshape(-1))
    m = torch.arange(v.numel(), dtype=torch.int64)
    m = m * hashing._M1
    m = (m ^ (m >> 31)) * hashing._M2
    m = m ^ (m >> 27)
    x = (v ^ m) * hashing._M3
    y = (v + m) * hashing._M1
    return torch.stack(((x ^ (x >> 29)).sum(), (y ^ (y >> 32)).sum()))


@pytest.mark.parametrize("chunk", [None, 1000, 4096])
@pytest.mark.parametrize("numel", [0, 1, 4096, 10_001])
def test_hash_pair_equals_its_one_pass_reference(monkeypatch, chunk, numel):
    """One chunk (the hash is its own pair) and several (summed) give the one-pass sums."""
    if chunk is not None:
        monkeypatch.setattr(hashing, "_hash_chunk", lambda device: chunk)
    gen = torch.Generator().manual_seed(numel)
    for t in (torch.randint(-(2**40), 2**40, (numel,), generator=gen),
              torch.randn(numel, generator=gen)):  # fmt: skip
        before = t.clone()
        got = hashing.hash_pair(t)
        assert torch.equal(t, before)
        assert got.dtype == torch.int64 and got.shape == (2,)
        assert torch.equal(got, _hash_pair_reference(t))


def test_content_hash_distinguishes_and_ignores_width():
    a = torch.arange(1000)
    assert content_hash(a) == content_hash(a.to(torch.int32))
    b = a.clone()
    b[500], b[501] = a[501], a[500]  # a swap keeps the sum: position mixing must see it
    assert content_hash(a) != content_hash(b)
    assert content_hash(torch.ones(3)) == content_hash(torch.ones(3, dtype=torch.float64))
    assert content_hash(torch.zeros(4)) != content_hash(torch.zeros(2, 2))


def test_torch_sparse_sparsetensor_input(torch_sparse):
    ei, n = _awkward_graph()
    adj_t = torch_sparse.SparseTensor(row=ei[1], col=ei[0], sparse_sizes=(n, n))  # row = target
    adj = get_adjacency(None, adj_t, n, add_self_loops=True, normalize=True)
    ref = gcn_norm(adj_t, None, n, False, True)
    row, col, value = ref.coo()
    # Summed like every product with it sums its duplicate edges (torch_sparse's to_dense()
    # writes one of them: 25 of these 3249 entries would differ).
    torch.testing.assert_close(_dense(adj), _dense_from_edges(torch.stack([col, row]), value, n))
    assert adj.num_edges == ref.nnz()


@pytest.mark.parametrize("loop_mode, diagonal", [("replace", 1.0), ("remaining", 0.5)])
def test_sparsetensor_self_loops_replace_the_diagonal(torch_sparse, loop_mode, diagonal):
    """As PyG treats a SparseTensor (GATConv: set_diag, gcn_norm: fill_diag): the graph's own
    self-loops (node 3 has two) give way to one loop per node, ``fill_value`` in "remaining"
    mode."""
    ei, n = _awkward_graph()
    adj_t = torch_sparse.SparseTensor(row=ei[1], col=ei[0], sparse_sizes=(n, n))
    adj = get_adjacency(None, adj_t, n, add_self_loops=True, fill_value=0.5, loop_mode=loop_mode)
    expected = _dense_from_edges(ei, None, n)
    expected.fill_diagonal_(diagonal)
    assert torch.equal(_dense(adj), expected)


def test_sparsetensor_cache_by_identity_content_and_matrix(torch_sparse):
    ctl = _ctl()
    ei, n = _awkward_graph()
    adj_t = torch_sparse.SparseTensor(row=ei[1], col=ei[0], sparse_sizes=(n, n))
    a = get_adjacency(ctl, adj_t, n, add_self_loops=False)
    cache = ctl._gg_adjacency_cache
    assert get_adjacency(ctl, adj_t, n, add_self_loops=False) is a and cache.hits == 1
    copy = torch_sparse.SparseTensor(row=ei[1].clone(), col=ei[0].clone(), sparse_sizes=(n, n))
    assert get_adjacency(ctl, copy, n, add_self_loops=False) is a
    rowptr, col, _ = adj_t.csr()  # the same matrix, duplicate entries and all, as torch CSR
    csr = torch.sparse_csr_tensor(rowptr, col, torch.ones(col.numel()), (n, n))
    assert get_adjacency(ctl, csr, n, add_self_loops=False) is a
    assert cache.builds == 2  # the CSR was built, then found equal to the SparseTensor's
    assert torch.equal(_dense(a), _dense_from_edges(ei, None, n))
