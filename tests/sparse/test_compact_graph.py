"""A compact ``adj_t`` (int32 CSR, values of ones that take no memory): stock PyG takes it, and
under `compress_gnn` the convolutions equal stock on it while sharing its columns, with GCN's
normalization held as N floats rather than a weight per edge."""

import copy

import pytest
import torch
from torch import nn
from torch_geometric.nn import (
    APPNP,
    GATConv,
    GATv2Conv,
    GCN2Conv,
    GCNConv,
    GINConv,
    GraphConv,
    SAGEConv,
)

from gact_graph import compress_gnn
from gact_graph.datasets import compact_adj_t
from gact_graph.sparse.adjacency_build import get_adjacency

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

F_IN = 6


def _graph(n=40, e=200, seed=0, loops=True):
    """Random directed edges with duplicates, isolated nodes (the last 3) and self-loops."""
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n - 3, (2, e), generator=g)
    if not loops:
        ei = ei[:, ei[0] != ei[1]]
    return ei, n


def test_compact_adj_t_is_pygs_adj_t_in_four_bytes_an_edge():
    ei, n = _graph()
    adj = compact_adj_t(ei, n)
    dense = torch.zeros(n, n)  # PyG's adj_t: row = target; duplicates add up
    dense.index_put_((ei[1], ei[0]), torch.ones(ei.size(1)), accumulate=True)
    assert adj.col_indices().dtype == adj.crow_indices().dtype == torch.int32
    assert adj.values().stride() == (0,) and adj.values().untyped_storage().nbytes() == 4
    x = torch.randn(n, 3)
    torch.testing.assert_close(adj @ x, dense @ x)


class One(nn.Module):
    def __init__(self, conv, gcn2=False):
        super().__init__()
        self.conv, self.gcn2 = conv, gcn2

    def forward(self, x, adj):
        return self.conv(x, x, adj) if self.gcn2 else self.conv(x, adj)


CONVS = {
    "gcn": lambda: GCNConv(F_IN, 5),
    "gcn-improved": lambda: GCNConv(F_IN, 5, improved=True),
    "gcn-no-loops": lambda: GCNConv(F_IN, 5, add_self_loops=False),
    "gcn-cached": lambda: GCNConv(F_IN, 5, cached=True),
    "gcn-unnormalized": lambda: GCNConv(F_IN, 5, normalize=False),
    "gcn2": lambda: GCN2Conv(F_IN, alpha=0.2),
    "appnp": lambda: APPNP(K=2, alpha=0.1),
    "sage": lambda: SAGEConv(F_IN, 5),
    "graphconv": lambda: GraphConv(F_IN, 5),
    "gin": lambda: GINConv(nn.Linear(F_IN, 5)),
    "gat": lambda: GATConv(F_IN, 5, heads=2),
    "gat-dropout": lambda: GATConv(F_IN, 5, heads=2, dropout=0.3),
    "gatv2": lambda: GATv2Conv(F_IN, 5, heads=2, dropout=0.3),
}


@pytest.mark.parametrize("loops", [True, False])
@pytest.mark.parametrize("case", list(CONVS))
def test_lossless_on_a_compact_adj_t_equals_stock(case, loops):
    ei, n = _graph(loops=loops)
    adj = compact_adj_t(ei, n)
    torch.manual_seed(0)
    stock = One(CONVS[case](), gcn2=case == "gcn2")
    ours = copy.deepcopy(stock)
    ctl = compress_gnn(ours, bits=None)
    x = torch.randn(n, F_IN)
    for _ in range(2):  # the cached layer's second call too
        outs, grads = [], []
        for model in (stock, ours):
            torch.manual_seed(1)  # attention dropout: stock's draw in lossless mode
            xx = x.clone().requires_grad_()
            out = model(xx, adj)
            out.square().sum().backward()
            outs.append(out.detach())
            grads.append([xx.grad] + [p.grad.clone() for p in model.parameters()])
            model.zero_grad()
        torch.testing.assert_close(outs[1], outs[0])
        for a, b in zip(grads[1], grads[0]):
            torch.testing.assert_close(a, b)
    expected = "sparse-fused" if case.startswith("gat") else "sparse-spmm"
    assert ctl.module_paths["conv"] == expected
    ctl.remove()


def test_a_compact_graph_is_shared_and_normalized_by_n_floats():
    ei, n = _graph(n=300, e=3000)
    adj_t = compact_adj_t(ei, n)
    adj = get_adjacency(None, adj_t, n, add_self_loops=True, normalize=True)
    assert adj.col.data_ptr() == adj_t.col_indices().data_ptr()  # the caller's, no copy
    assert adj.weight is None and adj.scale.shape == (n,) and adj.loop == 1.0
    # held beyond the caller's graph: the int64 row pointers and D^-1/2
    assert adj.nbytes - adj.col.numel() * 4 == (n + 1) * 8 + n * 4
    weighted = torch.sparse_csr_tensor(
        adj_t.crow_indices(), adj_t.col_indices(), torch.rand(adj_t._nnz()), (n, n)
    )
    adj = get_adjacency(None, weighted, n, add_self_loops=True, normalize=True)
    assert adj.weight.data_ptr() == weighted.values().data_ptr()  # its own values, shared
