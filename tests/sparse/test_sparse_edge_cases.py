"""Inputs at the edges, handled as stock PyG handles them: a graph of 0 nodes gives an empty
output, a float ``edge_index`` raises as stock raises."""

import copy

import pytest
import torch
from torch_geometric.nn import GATConv, GATv2Conv, GCN2Conv, GCNConv, SAGEConv

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
