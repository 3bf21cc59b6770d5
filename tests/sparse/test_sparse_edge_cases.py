"""Inputs at the edges, handled as stock PyG handles them: a graph of 0 nodes gives an empty
output, a float ``edge_index`` raises as stock raises."""

import copy

import pytest
import torch
from torch_geometric.nn import APPNP, GATConv, GATv2Conv, GCN2Conv, GCNConv, GraphConv, SAGEConv

from gact_graph import compress_gnn
from gact_graph.models import GAT, GCN, GCNII

MODELS = {
    "GCN+BN": lambda: GCN(8, 16, 3, num_layers=3),
    "GCNII": lambda: GCNII(8, 16, 3, num_layers=4),
    "GAT": lambda: GAT(8, 16, 3, num_layers=2),
    "GCNConv": lambda: GCNConv(8, 4),
    "SAGEConv": lambda: SAGEConv(8, 4),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_graph_with_zero_nodes_behaves_like_stock(name):
    torch.manual_seed(0)
    stock = MODELS[name]()
    ours = copy.deepcopy(stock)
    ctl = compress_gnn(ours, bits=2)
    x = torch.randn(0, 8, requires_grad=True)
    ei = torch.zeros(2, 0, dtype=torch.long)
    out_s, out_o = stock(x, ei), ours(x, ei)
    assert out_o.shape == out_s.shape and out_o.dtype == out_s.dtype
    out_s.sum().backward()
    grads_s = [p.grad for p in stock.parameters()]
    out_o.sum().backward()
    for gs, go in zip(grads_s, [p.grad for p in ours.parameters()]):
        assert (gs is None) == (go is None) and (gs is None or torch.equal(gs, go))
    ctl.remove()


@pytest.mark.parametrize("conv", [GATConv, GATv2Conv, GCNConv, SAGEConv])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float_edge_index_raises_like_stock(conv, dtype):
    torch.manual_seed(0)
    stock = conv(8, 4)
    ours = copy.deepcopy(stock)
    compress_gnn(ours, bits=2)
    x = torch.randn(10, 8, requires_grad=True)
    ei = torch.randint(0, 10, (2, 30)).to(dtype)
    with pytest.raises((ValueError, RuntimeError)) as stock_err:
        stock(x, ei)
    with pytest.raises(type(stock_err.value)):
        ours(x, ei)


def test_gcn2conv_zero_nodes():
    torch.manual_seed(0)
    stock = GCN2Conv(8, alpha=0.1)
    ours = copy.deepcopy(stock)
    compress_gnn(ours, bits=2)
    x = torch.randn(0, 8, requires_grad=True)
    ei = torch.zeros(2, 0, dtype=torch.long)
    assert ours(x, x, ei).shape == stock(x, x, ei).shape == (0, 8)


# Convolutions whose fused path takes an ``edge_weight``, called as (x, edge_index, w).
WEIGHTED = {
    "GraphConv": lambda: GraphConv(8, 4),
    "GCNConv": lambda: GCNConv(8, 4),
    "GCNConv(normalize=False)": lambda: GCNConv(8, 4, normalize=False),
    "GCNConv(add_self_loops=False)": lambda: GCNConv(8, 4, add_self_loops=False),
    "GCN2Conv": lambda: _X0(GCN2Conv(8, alpha=0.1)),
    "GCN2Conv(normalize=False)": lambda: _X0(GCN2Conv(8, alpha=0.1, normalize=False)),
    "APPNP": lambda: APPNP(K=2, alpha=0.1),
    "APPNP(normalize=False)": lambda: APPNP(K=2, alpha=0.1, normalize=False),
}


class _X0(torch.nn.Module):
    """A GCN2Conv called as the others: x is its own initial residual x_0."""

    def __init__(self, conv):
        super().__init__()
        self.conv = conv

    def forward(self, x, edge_index, edge_weight=None):
        return self.conv(x, x, edge_index, edge_weight)


def _weighted_graph():
    g = torch.Generator().manual_seed(0)
    return torch.randn(60, 8, generator=g), torch.randint(0, 60, (2, 400), generator=g)


def _outcome(model, x, ei, w):
    """(output, grads of x / w / parameters) of one forward and backward, or the error."""
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    try:
        out = model(x, ei, w)
        out.pow(2).sum().backward()
    except Exception as e:  # the stock error is an outcome to compare
        return e
    return [out, x.grad, w.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("name", list(WEIGHTED))
@pytest.mark.parametrize("length", [401, 399])
def test_edge_weight_of_wrong_length_is_refused(name, length):
    torch.manual_seed(0)
    stock = WEIGHTED[name]()
    ours = copy.deepcopy(stock)
    ctl = compress_gnn(ours, bits=None)
    x, ei = _weighted_graph()
    w = torch.rand(length)
    assert isinstance(_outcome(stock, x, ei, w), Exception)  # stock refuses it too
    with pytest.raises(ValueError, match=f"edge_weight holds {length} values for 400 edges"):
        ours(x, ei, w)
    ctl.remove()


def test_cached_gcn_ignores_later_weights_like_stock():
    """A cached GCNConv never reads its weights once it has normalized: any length works."""
    torch.manual_seed(0)
    stock = GCNConv(8, 4, cached=True)
    ours = copy.deepcopy(stock)
    ctl = compress_gnn(ours, bits=None)
    x, ei = _weighted_graph()
    for w in (torch.rand(400), torch.rand(401)):
        torch.testing.assert_close(ours(x, ei, w), stock(x, ei, w))
    ctl.remove()


@pytest.mark.parametrize("name", list(WEIGHTED))
def test_one_edge_weight_for_all_edges_behaves_like_stock(name):
    """PyG broadcasts a single weight where it does not normalize, and refuses it where it
    does: ours does the same, gradients of the weight included."""
    torch.manual_seed(0)
    stock = WEIGHTED[name]()
    ours = copy.deepcopy(stock)
    ctl = compress_gnn(ours, bits=None)
    x, ei = _weighted_graph()
    w = torch.rand(1) + 0.5
    want, got = _outcome(stock, x, ei, w), _outcome(ours, x, ei, w)
    if isinstance(want, Exception):
        assert type(got) is type(want), got
    else:
        assert not isinstance(got, Exception), got
        for a, b in zip(got, want):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    ctl.remove()
