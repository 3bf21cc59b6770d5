"""``cached=True`` GCN-family layers under `compress_gnn` hold one shared graph, not a
normalized copy each, and keep stock PyG's cache semantics (the first graph, until the slot is
emptied)."""

import copy
import pickle

import pytest
import torch
from torch import nn
from torch_geometric.nn import GCN2Conv, GCNConv

from gact_graph import compress_gnn
from gact_graph.sparse.convs import SharedNormalizedGraph

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


class CachedStack(nn.Module):
    def __init__(self, layers=4, width=8):
        super().__init__()
        self.convs = nn.ModuleList(GCNConv(width, width, cached=True) for _ in range(layers))
        self.gcn2 = GCN2Conv(width, alpha=0.1, cached=True)

    def forward(self, x, edge_index):
        x0 = x
        for conv in self.convs:
            x = torch.relu(conv(x, edge_index))
        return self.gcn2(x, x0, edge_index)


def _graph(n=60, e=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, (2, e), generator=g), torch.randn(n, 8, generator=g)


def _run(model, x, ei):
    out = model(x, ei)
    out.square().sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def test_cached_layers_share_one_graph_and_equal_stock():
    ei, x = _graph()
    torch.manual_seed(0)
    stock = CachedStack()
    ours = copy.deepcopy(stock)
    ctl = compress_gnn(ours, bits=None)
    for graph in (ei, _graph(seed=1)[0]):  # a second graph is ignored, as stock ignores it
        want, want_grads = _run(stock, x, graph)
        got, got_grads = _run(ours, x, graph)
        torch.testing.assert_close(got, want)
        for a, b in zip(got_grads, want_grads):
            torch.testing.assert_close(a, b)
    slots = [m._cached_edge_index for m in ours.modules() if hasattr(m, "_cached_edge_index")]
    assert len(slots) == 5 and all(isinstance(s, SharedNormalizedGraph) for s in slots)
    assert len({id(s.adj) for s in slots}) == 1  # one graph for five layers
    ctl.remove()
    assert all(m._cached_edge_index is None for m in ours.modules() if hasattr(m, "cached"))


def test_an_emptied_slot_is_filled_again_and_copies_start_empty():
    ei, x = _graph()
    model = CachedStack(layers=2)
    ctl = compress_gnn(model, bits=None)
    model(x, ei)
    first = model.convs[0]._cached_edge_index.adj
    for conv in model.convs:
        conv.reset_parameters()  # PyG empties the cache here
    other, _ = _graph(seed=2)
    model(x, other)
    assert model.convs[0]._cached_edge_index.adj is not first  # normalized again
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert all(c._cached_edge_index is None for c in twin.convs)
        twin(x, other)  # stock fills its own cache
        assert isinstance(twin.convs[0]._cached_edge_index, tuple)
    ctl.remove()


def test_a_cache_stock_filled_before_compression_is_used():
    ei, x = _graph()
    stock = CachedStack(layers=1)
    stock(x, ei)
    ours = copy.deepcopy(stock)
    filled = ours.convs[0]._cached_edge_index
    with compress_gnn(ours, bits=None):
        got = ours(x, _graph(seed=3)[0])
    assert ours.convs[0]._cached_edge_index is filled
    torch.testing.assert_close(got, stock(x, _graph(seed=3)[0]))
