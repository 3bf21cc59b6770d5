"""``torch.compile`` of a compressed model: the same loss and gradients as the compressed model
run eagerly, and no "Exception ignored in StorageWeakRef.__del__" noise. Dynamo traced the
controller's hooks and the adjacency cache's keys, built the storage's weak reference itself
and dropped it half made; the reference is now made outside the trace."""

import gc
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import GCNConv

from gact_graph import compress_gnn


def _step(model, run, x, y):
    model.zero_grad(set_to_none=True)
    out = run(x)
    loss = F.cross_entropy(out, y) if y is not None else out.square().sum()
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow
def test_compiled_compressed_model_is_quiet_and_right(monkeypatch):
    torch._dynamo.reset()
    ignored = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: ignored.append(repr(u.exc_value)))
    torch.manual_seed(0)
    x, y = torch.randn(64, 16), torch.randint(0, 3, (64,))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))
    stock = _step(model, model, x, y)
    for bits, tol in ((None, 1e-6), (8, 0.02)):
        ctl = compress_gnn(model, bits=bits, adaptive=False, min_numel=0)
        compiled = torch.compile(model)
        for _ in range(2):
            loss, grads = _step(model, compiled, x, y)
            ctl.iterate()
            assert loss == pytest.approx(stock[0], rel=1e-6)
            for g, ref in zip(grads, stock[1]):
                err = float((g - ref).norm() / ref.norm())
                assert err <= tol, (bits, err)
        ctl.remove()
        torch._dynamo.reset()
    gc.collect()
    assert ignored == []


@pytest.mark.slow
def test_compiled_compressed_gcn_is_quiet_and_stock(monkeypatch):
    """The graph-aware path under Dynamo (the eager backend: Dynamo is where the noise was):
    stock's output and gradients in lossless mode, and no "Exception ignored"."""
    torch._dynamo.reset()
    ignored = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: ignored.append(repr(u.exc_value)))
    torch.manual_seed(0)
    x, ei = torch.randn(20, 8), torch.randint(0, 20, (2, 60))
    conv = GCNConv(8, 4)
    stock = _step(conv, lambda x: conv(x, ei), x, None)
    with compress_gnn(conv, bits=None, adaptive=False) as ctl:
        got = _step(conv, torch.compile(lambda x: conv(x, ei), backend="eager"), x, None)
        assert ctl.module_paths["<root>"] == "sparse-spmm"
    torch._dynamo.reset()
    gc.collect()
    assert ignored == []
    assert got[0] == pytest.approx(stock[0], rel=1e-6)
    for g, ref in zip(got[1], stock[1]):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6)
