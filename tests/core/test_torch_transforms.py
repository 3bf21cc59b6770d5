"""PyTorch's function transforms and tracer over a compressed model: ``torch.func`` transforms
(their wrapped tensors have no storage) and ``torch.jit.trace`` (which records no custom
autograd Function) run stock's computation, and give stock's values and gradients."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import GATConv, GCNConv

from gact_graph import compress_gnn

SETTINGS = [
    {"bits": None, "adaptive": False, "sparse": False, "pointwise": False},
    {"bits": 8, "adaptive": False, "min_numel": 0},
    {},  # the defaults: adaptive 2 bits, graph-aware paths, pointwise ops
]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.gcn = GCNConv(8, 16)
        self.gat = GATConv(16, 4, heads=2)

    def forward(self, x, edge_index):
        return self.gat(torch.relu(self.gcn(x, edge_index)), edge_index)


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(30, 8, generator=g), torch.randint(0, 30, (2, 90), generator=g)


@pytest.mark.parametrize("settings", SETTINGS, ids=["lossless-generic", "8bit", "defaults"])
def test_func_grad_over_functional_call_equals_stock(settings):
    torch.manual_seed(0)
    model = Net()
    x, ei = _data()
    y = torch.randint(0, 8, (30,))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p):
        return F.cross_entropy(torch.func.functional_call(model, p, (x, ei)), y)

    stock = torch.func.grad(loss)(params)
    with compress_gnn(model, **settings) as ctl:
        got = torch.func.grad(loss)(params)
        if settings.get("sparse", True):
            assert ctl.module_paths["gcn"] == "generic (torch.func transform)"
        model(x, ei).sum().backward()  # a plain step afterwards is compressed again
        assert ctl.stats()["tensors"]
    for k in stock:
        torch.testing.assert_close(got[k], stock[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_jit_trace_records_stock(grad):
    torch.manual_seed(0)
    model = Net().eval()
    x, ei = _data()
    x2, _ = _data(1)
    with torch.set_grad_enabled(grad):
        with compress_gnn(model, bits=8, adaptive=False, min_numel=0):
            traced = torch.jit.trace(model, (x, ei))
        torch.testing.assert_close(traced(x2, ei), model(x2, ei), rtol=1e-5, atol=1e-6)
