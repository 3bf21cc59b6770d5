"""Lossless mode with two graphs forwarded and backwarded in one step (gradient accumulation):
every step's gradients equal stock's, graph by graph.

Two runs compared step after step may part although each step is exact: a sum taken in another
order differs in its last bits, and Adam's first update (about ``lr * g / |g|``) turns such
bits on a near-zero gradient entry into a parameter difference of ``lr``'s order, which later
flips ReLUs. Stock PyG against stock PyG with the same edges listed in another order parts in
the same way, so the first test gives both models the same parameters before every step (what
is compared is the step), and the second follows a trajectory with SGD, where nothing amplifies
the last bits.
"""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch_geometric.nn import GCN

from gact_graph import compress_gnn

warnings.filterwarnings("ignore", message=".*[Ss]parse.*")

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def _graphs(n=1500, e=15000, f=32, classes=8):
    out = []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        ei = torch.randint(0, n, (2, e), generator=g)
        out.append(
            (torch.randn(n, f, generator=g), ei, torch.randint(0, classes, (n,), generator=g))
        )
    return out


def _accumulated(model, graphs):
    """Parameter gradients after each graph's backward (accumulated, as in micro-batching)."""
    for p in model.parameters():
        p.grad = None
    per_graph = []
    for x, ei, y in graphs:
        F.cross_entropy(model(x, ei), y).backward()
        per_graph.append([p.grad.clone() for p in model.parameters()])
    return per_graph


def _assert_close(ours, stock):
    for grads_o, grads_s in zip(ours, stock):
        for a, b in zip(grads_o, grads_s):
            assert ((a - b).norm() / b.norm().clamp_min(1e-30)).item() < 1e-5


def _models():
    torch.manual_seed(0)
    stock = GCN(32, 64, 3, 8)
    ours = copy.deepcopy(stock)
    return stock, ours, compress_gnn(ours, bits=None)


def test_every_step_equals_stock_with_adam():
    stock, ours, ctl = _models()
    graphs = _graphs()
    opt = torch.optim.Adam(stock.parameters(), lr=0.01)
    for _ in range(6):
        with torch.no_grad():
            for p_o, p_s in zip(ours.parameters(), stock.parameters()):
                p_o.copy_(p_s)
        _assert_close(_accumulated(ours, graphs), _accumulated(stock, graphs))
        opt.step()
        ctl.iterate()
    ctl.remove()


def test_trajectory_equals_stock_with_sgd():
    stock, ours, ctl = _models()
    graphs = _graphs()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (stock, ours)]
    for _ in range(6):
        _assert_close(_accumulated(ours, graphs), _accumulated(stock, graphs))
        for opt in opts:
            opt.step()
        ctl.iterate()
    ctl.remove()
