"""A graph rewritten in place without a version bump is seen: the cached adjacency is checked
against its inputs' content once per forward, whatever way the user wrote them."""

import copy
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch_geometric.nn import GATConv, GCNConv, SAGEConv

from gact_graph import compress_gnn
from gact_graph.sparse import adjacency_cache
from gact_graph.sparse import content_hash as hashing

warnings.filterwarnings("ignore", message=".*[Ss]parse.*")

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

N, E, F = 120, 900, 8
CONVS = {
    "gcn": lambda: GCNConv(F, F),
    "gat": lambda: GATConv(F, F, heads=2, concat=False),
    "sage": lambda: SAGEConv(F, F),
}


class _Net(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.c1, self.c2 = make(), make()

    def forward(self, x, edge_index, edge_weight=None):
        extra = () if edge_weight is None else (edge_weight,)
        return self.c2(self.c1(x, edge_index, *extra).relu(), edge_index, *extra)


def _pair(make):
    torch.manual_seed(0)
    stock = _Net(make)
    ours = copy.deepcopy(stock)
    return stock, ours, compress_gnn(ours, bits=None)


def _step(model, x, *graph):
    """Output and parameter gradients of one training step."""
    model.zero_grad()
    out = model(x, *graph)
    out.square().sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def _assert_same(stock, ours, x, *graph):
    out_s, grads_s = _step(stock, x, *graph)
    out_o, grads_o = _step(ours, x, *graph)
    torch.testing.assert_close(out_o, out_s, rtol=1e-5, atol=1e-5)
    for g_o, g_s in zip(grads_o, grads_s):
        torch.testing.assert_close(g_o, g_s, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("conv", sorted(CONVS))
def test_numpy_buffer_refilled_between_steps(conv):
    """A loader that refills one NumPy buffer shared through `torch.from_numpy`: the tensor's
    storage and version stay the same, its values change."""
    stock, ours, ctl = _pair(CONVS[conv])
    rng = np.random.default_rng(0)
    buf = rng.integers(0, N, (2, E))
    ei = torch.from_numpy(buf)
    x = torch.randn(N, F, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        version = ei._version
        _assert_same(stock, ours, x, ei)
        buf[:] = rng.integers(0, N, (2, E))
        assert ei._version == version  # nothing tells the tensor
    _assert_same(stock, ours, x, ei)
    ctl.remove()


@pytest.mark.parametrize("conv", sorted(CONVS))
def test_write_through_data_is_seen(conv):
    stock, ours, ctl = _pair(CONVS[conv])
    g = torch.Generator().manual_seed(2)
    ei = torch.randint(0, N, (2, E), generator=g)
    x = torch.randn(N, F, generator=g)
    _assert_same(stock, ours, x, ei)
    ei.data[0, : E // 2] = torch.randint(0, N, (E // 2,), generator=g)
    _assert_same(stock, ours, x, ei)
    # a no_grad forward after another such write sees it too
    ei.data[1, : E // 2] = torch.randint(0, N, (E // 2,), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, ei), stock(x, ei), rtol=1e-5, atol=1e-5)
    ctl.remove()


def test_edge_weight_written_through_data_is_seen():
    stock, ours, ctl = _pair(CONVS["gcn"])
    g = torch.Generator().manual_seed(3)
    ei = torch.randint(0, N, (2, E), generator=g)
    w = torch.rand(E, generator=g)
    x = torch.randn(N, F, generator=g)
    _assert_same(stock, ours, x, ei, w)
    w.data.mul_(torch.rand(E, generator=g) * 3)
    _assert_same(stock, ours, x, ei, w)
    ctl.remove()


def test_sparse_values_written_through_data_are_seen():
    """A `torch.sparse` adjacency whose values are rewritten through ``.data``."""
    torch.manual_seed(0)
    stock = _Net(lambda: GCNConv(F, F, normalize=False))
    ours = copy.deepcopy(stock)
    ctl = compress_gnn(ours, bits=None)
    g = torch.Generator().manual_seed(4)
    ei = torch.randint(0, N, (2, E), generator=g)
    adj = torch.sparse_coo_tensor(ei.flip(0), torch.rand(E, generator=g), (N, N)).coalesce()
    x = torch.randn(N, F, generator=g)
    _assert_same(stock, ours, x, adj)
    adj.values().data.mul_(-2.0)
    _assert_same(stock, ours, x, adj)
    ctl.remove()


def _hash_passes(monkeypatch) -> list[int]:
    """The sizes of the hash passes that follow: the cache's (its content check and keys) and
    `content_hash`'s own, each module holding its own reference to `hash_pair`."""
    calls = []
    real = hashing.hash_pair

    def spy(t):
        calls.append(t.numel())
        return real(t)

    for owner in (hashing, adjacency_cache):
        monkeypatch.setattr(owner, "hash_pair", spy)
    return calls


def test_checked_once_per_forward_and_rebuilt_only_on_change(monkeypatch):
    """Every layer of a training forward gets the adjacency; the content check runs once per
    graph per forward (not once per layer), and nothing is rebuilt while the content holds."""
    calls = _hash_passes(monkeypatch)
    stock, ours, ctl = _pair(CONVS["gcn"])
    buf = np.random.default_rng(5).integers(0, N, (2, E))
    ei = torch.from_numpy(buf)
    x = torch.randn(N, F)
    _step(ours, x, ei)  # first forward: hashed, built
    cache = ctl._gg_adjacency_cache
    assert cache.builds == 1
    for _ in range(3):
        calls.clear()
        _step(ours, x, ei)
        assert calls == [2 * E]  # one pass over the edge index, two layers
    assert cache.builds == 1
    buf[:, :10] = (buf[:, :10] + 1) % N
    _step(ours, x, ei)
    assert cache.builds == 2
    ctl.remove()


def test_graph_check_version_trusts_the_version_counter(monkeypatch):
    """``graph_check="version"`` makes no content pass on a graph found by identity (no host
    read on a GPU), and so, as documented, does not see a write that bypasses the version
    counter; an ordinary in-place write (a version bump) is still seen."""
    calls = _hash_passes(monkeypatch)
    torch.manual_seed(0)
    ours = _Net(CONVS["gcn"])
    ctl = compress_gnn(ours, bits=None, graph_check="version")
    g = torch.Generator().manual_seed(2)
    ei = torch.randint(0, N, (2, E), generator=g)
    x = torch.randn(N, F, generator=g)
    before, _ = _step(ours, x, ei)
    calls.clear()
    ei.data[0, : E // 2] = torch.randint(0, N, (E // 2,), generator=g)
    stale, _ = _step(ours, x, ei)
    assert calls == []  # found by identity, not hashed
    torch.testing.assert_close(stale, before, rtol=0, atol=0)  # the cached graph served
    ei[1, :10] = (ei[1, :10] + 1) % N  # a version bump: looked up again
    changed, _ = _step(ours, x, ei)
    assert calls and not torch.equal(changed, before)
    ctl.remove()


def test_graph_check_rejects_other_values():
    with pytest.raises(ValueError, match="graph_check must be one of"):
        compress_gnn(_Net(CONVS["gcn"]), graph_check="never")
