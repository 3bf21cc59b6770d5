"""Higher-order gradients: the fused sparse paths refuse a ``create_graph=True`` backward at
once, naming the settings that support it; those settings give stock's second-order
gradients (a gradient penalty, the usual client)."""

import copy

import pytest
import torch
from torch import nn
from torch_geometric.nn import GATConv, GCNConv

from gact_graph import compress_gnn
from gact_graph.config import DOUBLE_BACKWARD_HELP


class _Net(nn.Module):
    def __init__(self, conv_cls):
        super().__init__()
        kw = {"heads": 2, "concat": False} if conv_cls is GATConv else {}
        self.c1, self.c2 = conv_cls(8, 16, **kw), conv_cls(16, 3, **kw)

    def forward(self, x, ei):
        return self.c2(torch.tanh(self.c1(x, ei)), ei)


def _penalty_grads(model, x, ei):
    """Gradients of ||d loss / d x||^2 with respect to the parameters (needs create_graph)."""
    x = x.detach().clone().requires_grad_()
    loss = model(x, ei).square().sum()
    (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    return torch.autograd.grad(gx.square().sum(), list(model.parameters()))


@pytest.mark.parametrize("conv_cls", [GCNConv, GATConv])
def test_fused_sparse_paths_refuse_create_graph_naming_the_settings(conv_cls):
    torch.manual_seed(0)
    x, ei = torch.randn(50, 8), torch.randint(0, 50, (2, 300))
    model = _Net(conv_cls)
    ctl = compress_gnn(model, bits=None, pointwise=False)  # sparse=True: the fused paths
    with pytest.raises(RuntimeError, match="differentiable once") as err:
        _penalty_grads(model, x, ei)
    assert DOUBLE_BACKWARD_HELP in str(err.value)
    # a plain grad with create_graph whose incoming gradient needs none raises too (PyTorch's
    # once_differentiable let it through and dropped the second-order term)
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(model(x, ei).sum(), list(model.parameters()), create_graph=True)
    ctl.remove()


@pytest.mark.parametrize("conv_cls", [GCNConv, GATConv])
def test_settings_named_in_the_error_give_stocks_second_order_gradients(conv_cls):
    torch.manual_seed(0)
    x, ei = torch.randn(50, 8), torch.randint(0, 50, (2, 300))
    stock = _Net(conv_cls).eval()  # GAT's attention dropout is 0; eval for certainty
    ours = copy.deepcopy(stock)
    ref = _penalty_grads(stock, x, ei)
    ctl = compress_gnn(ours, bits=None, pointwise=False, sparse=False)
    got = _penalty_grads(ours, x, ei)
    ctl.remove()
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
