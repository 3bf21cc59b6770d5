"""Edge indices of every integer dtype: stock's results where stock PyG accepts the dtype, a
clear error where it does not, and never one dtype's adjacency served to another."""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch_geometric.nn import APPNP, GATConv, GATv2Conv, GCN2Conv, GCNConv, GINConv, SAGEConv

from gact_graph import compress_gnn
from gact_graph.sparse.adjacency_build import get_adjacency

warnings.filterwarnings("ignore", message=".*[Ss]parse.*")

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

# 300 nodes: dst * N overflows uint8, int8 and int16 (the CSR sort key)
N, E, F = 300, 2000, 8
SMALL = (torch.uint8, torch.int8, torch.int16)

# stock PyG takes these small dtypes only where it adds self-loops to an unweighted graph (the
# concatenated int64 loop index promotes the edge index to int64)
ACCEPTING = {
    "gcn": lambda: GCNConv(F, F),
    "gcn_cached": lambda: GCNConv(F, F, cached=True),
    "gat": lambda: GATConv(F, F, heads=2, concat=False),
    "gatv2": lambda: GATv2Conv(F, F, heads=2, concat=False),
    "appnp": lambda: APPNP(2, 0.1),
}
REFUSING = {
    "gcn_no_loops": lambda: GCNConv(F, F, add_self_loops=False),
    "gcn_unnormalized": lambda: GCNConv(F, F, normalize=False),
    "sage": lambda: SAGEConv(F, F),
    "gin": lambda: GINConv(nn.Linear(F, F)),
    "gat_no_loops": lambda: GATConv(F, F, add_self_loops=False),
}


class _Net(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.c1, self.c2 = make(), make()

    def forward(self, x, edge_index):
        return self.c2(self.c1(x, edge_index).relu(), edge_index)


class _Gcn2(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = GCN2Conv(F, 0.1), GCN2Conv(F, 0.1)

    def forward(self, x, edge_index):
        return self.c2(self.c1(x, x, edge_index).relu(), x, edge_index)


def _graph(dtype, seed=0):
    """An edge index whose values fit ``dtype`` (int8: nodes < 128)."""
    g = torch.Generator().manual_seed(seed)
    hi = 128 if dtype == torch.int8 else N
    return torch.randint(0, hi, (2, E), generator=g), torch.randn(N, F, generator=g)


def _grads(model, x, ei):
    """Output, and gradients of the input and the parameters (APPNP has none)."""
    model.zero_grad()
    x = x.detach().requires_grad_()
    out = model(x, ei)
    out.square().sum().backward()
    return out.detach(), [x.grad] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", SMALL + (torch.int32,), ids=str)
@pytest.mark.parametrize("conv", sorted(ACCEPTING) + ["gcn2"])
def test_small_integer_index_matches_stock_and_does_not_poison_int64(conv, dtype):
    torch.manual_seed(0)
    stock = _Gcn2() if conv == "gcn2" else _Net(ACCEPTING[conv])
    ours = copy.deepcopy(stock)
    ctl = compress_gnn(ours, bits=None)
    ei, x = _graph(dtype)
    for index in (ei.to(dtype), ei):  # the small dtype first: its adjacency must not be reused
        out_s, grads_s = _grads(stock, x, index)
        out_o, grads_o = _grads(ours, x, index)
        torch.testing.assert_close(out_o, out_s, rtol=1e-5, atol=1e-5)
        for a, b in zip(grads_o, grads_s):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    ctl.remove()


@pytest.mark.parametrize("dtype", SMALL + (torch.uint16, torch.bool), ids=str)
@pytest.mark.parametrize("conv", sorted(REFUSING))
def test_dtype_stock_refuses_is_refused_with_its_name(conv, dtype):
    torch.manual_seed(0)
    stock = _Net(REFUSING[conv])
    ours = copy.deepcopy(stock)
    ctl = compress_gnn(ours, bits=None)
    ei, x = _graph(dtype)
    errors = (RuntimeError, IndexError, TypeError, ValueError)
    with pytest.raises(errors):
        stock(x, ei.to(dtype))  # stock fails (with its own words)
    with pytest.raises(errors) as err:
        ours(x, ei.to(dtype))
    assert str(dtype) in str(err.value) or "index" in str(err.value)
    ctl.remove()


@pytest.mark.parametrize("dtype", (torch.uint16, torch.uint32, torch.uint64), ids=str)
def test_unsigned_wide_dtypes_are_refused(dtype):
    ei, _ = _graph(torch.int64)
    with pytest.raises(TypeError, match=str(dtype)):
        get_adjacency(None, ei.to(dtype), N, add_self_loops=True, normalize=True)


def test_weighted_small_index_is_refused():
    """Stock reads a weighted uint8 edge index as a boolean mask (or fails): refused."""
    ei, _ = _graph(torch.uint8)
    w = torch.rand(E)
    with pytest.raises(TypeError, match="uint8"):
        get_adjacency(None, ei.to(torch.uint8), N, add_self_loops=True, edge_weight=w)


def test_cache_key_holds_the_dtype():
    """Equal values in two dtypes: two cache entries (one adjacency object, the same CSR)."""
    from gact_graph import CompressionConfig, Controller

    ctl = Controller(nn.Linear(1, 1), CompressionConfig(bits=None))
    ei, _ = _graph(torch.uint8)
    ei = ei % 256  # values uint8 holds
    a = get_adjacency(ctl, ei.to(torch.uint8), N, add_self_loops=True, normalize=True)
    b = get_adjacency(ctl, ei, N, add_self_loops=True, normalize=True)
    ref = get_adjacency(None, ei, N, add_self_loops=True, normalize=True)
    assert ctl._gg_adjacency_cache.builds == 2
    for adj in (a, b):
        assert torch.equal(adj.rowptr, ref.rowptr) and torch.equal(adj.col, ref.col)
        assert torch.equal(adj.explicit().weight, ref.explicit().weight)
    ctl.remove()
