"""Pointwise ops on tensors the controller keeps as they are (``min_bytes``) run PyTorch's own op.

Where an op's input is under ``min_bytes``, everything the stock op saves is no larger, so the
controller would keep it uncompressed anyway: the memory-saving Function (mask, regenerated
dropout, inverted activation, BatchNorm's normalized input) buys nothing there and costs a
Python Function and, on a GPU, more launches. These tests check that such calls give stock's
values, gradients and RNG stream bit for bit, that the stock op really ran (what is saved is
stock's), and that the Functions still engage once the tensors are large enough.
"""

import torch
import torch.nn.functional as F
from torch import nn

from gact_graph import compress_gnn
from gact_graph.datasets.synthetic import load_synthetic
from gact_graph.models import build_model


class _Mlp(nn.Module):
    """Every kind of pointwise op the mode routes: ReLU, dropout, ELU, LeakyReLU, BatchNorm."""

    def __init__(self, width=16):
        super().__init__()
        self.a = nn.Linear(8, width)
        self.bn = nn.BatchNorm1d(width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, 3)

    def forward(self, x):
        h = F.dropout(F.relu(self.bn(self.a(x))), p=0.3, training=self.training)
        h = F.leaky_relu(F.elu(self.b(h)), 0.2)
        return self.c(h)


def _step(model, x, y, ctl_kwargs):
    """Loss, every gradient, the saved kinds and the RNG state after one training step."""
    ctl = None if ctl_kwargs is None else compress_gnn(model, **ctl_kwargs)
    try:
        torch.manual_seed(1)
        model.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        kinds = [] if ctl is None else [(r["kind"], r["bits"]) for r in ctl.stats()["tensors"]]
        return out.detach(), grads, kinds, torch.get_rng_state()
    finally:
        if ctl is not None:
            ctl.remove()


def _mlp_data(rows):
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, 8, generator=g), torch.randint(0, 3, (rows,), generator=g)


def _compressed(min_bytes):
    return {"bits": 2, "adaptive": False, "min_numel": 0, "sparse": False,
            "min_bytes": min_bytes}  # fmt: skip


def test_small_pointwise_ops_are_stock_bit_for_bit():
    x, y = _mlp_data(64)  # 64 x 16 fp32: 4 KiB per activation
    torch.manual_seed(0)
    base = _Mlp().train()
    stock = _step(_copy(base), x, y, None)
    ours = _step(_copy(base), x, y, _compressed(1 << 20))
    assert torch.equal(ours[0], stock[0])
    for name, g in stock[1].items():
        assert torch.equal(ours[1][name], g), name
    assert torch.equal(ours[3], stock[3])  # the same draws from the same generator
    kinds = ours[2]
    # the stock ops' own saves: no 1-bit mask, no saved generator state, nothing quantized
    assert all(bits is None for _, bits in kinds)
    assert not any(kind == "mask" for kind, _ in kinds)
    assert not any(kind == "index" for kind, _ in kinds)  # dropout's RNG state is one


def test_pointwise_functions_engage_above_min_bytes():
    x, y = _mlp_data(64)
    torch.manual_seed(0)
    base = _Mlp().train()
    kinds = _step(_copy(base), x, y, _compressed(1024))[2]  # 4 KiB activations: above
    assert sum(kind == "mask" for kind, _ in kinds) >= 2  # ReLU and LeakyReLU masks, packed
    assert any(kind == "index" for kind, _ in kinds)  # dropout's generator state
    assert any(bits == 2 for _, bits in kinds)  # the linear layers' inputs, quantized


def test_small_bool_masks_are_kept_unpacked():
    """A bool tensor saved under ``min_bytes`` is kept as it is (no packing launch); above it,
    packed to 1 bit. Gradients are the same either way."""

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 16)

        def forward(self, x):
            h = self.lin(x)
            return torch.where(h > 0, h, 0.5 * h)  # saves the bool condition

    x, _ = _mlp_data(64)
    grads, stored = {}, {}
    for min_bytes in (1 << 20, 0):
        torch.manual_seed(0)
        model = Masked()
        ctl = compress_gnn(model, bits=2, adaptive=False, min_numel=0, sparse=False,
                           pointwise=False, min_bytes=min_bytes)  # fmt: skip
        try:
            model(x).square().sum().backward()
            masks = [r for r in ctl.stats()["tensors"] if r["kind"] == "mask"]
            stored[min_bytes] = [(r["orig_bytes"], r["stored_bytes"]) for r in masks]
            grads[min_bytes] = model.lin.weight.grad.clone()
        finally:
            ctl.remove()
    assert stored[1 << 20] == [(64 * 16, 64 * 16)]  # one byte per element: kept
    assert stored[0] == [(64 * 16, 64 * 16 // 8)]  # one bit per element: packed
    assert torch.equal(grads[1 << 20], grads[0])


def _copy(model):
    import copy

    return copy.deepcopy(model)


def _graph(nodes):
    data = load_synthetic("synthetic", num_nodes=nodes, num_edges=4 * nodes, seed=0)
    data.x = data.x[:, :16].contiguous()
    return data


def _gnn_step(model, data, ctl_kwargs):
    ctl = None if ctl_kwargs is None else compress_gnn(model, **ctl_kwargs)
    try:
        torch.manual_seed(1)
        model.zero_grad()
        out = model(data.x, data.edge_index)
        F.cross_entropy(out, data.y).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        recs = [] if ctl is None else ctl.stats()["tensors"]
        return out.detach(), grads, recs, torch.get_rng_state()
    finally:
        if ctl is not None:
            ctl.remove()


def _gnn(name, data):
    torch.manual_seed(0)
    kw = {"num_layers": 3, "hidden_channels": 16, "dropout": 0.5}
    if name == "gcn":
        kw["batch_norm"] = True
    if name == "gcnii":
        kw.update(alpha=0.1, theta=0.5)
    return build_model(name, data.num_features, int(data.y.max()) + 1, **kw).train()


def test_small_graph_default_mode_matches_stock_pyg():
    """A GCN (batch norm, ReLU, dropout) and a GCNII on a graph whose every activation is under
    ``min_bytes``: the default mode stores nothing compressed and its output and gradients are
    stock PyG's (the graph-aware SpMM sums in another order: tight tolerance)."""
    data = _graph(300)  # 300 x 16 fp32: 19 KiB per activation
    for name in ("gcn", "gcnii"):
        base = _gnn(name, data)
        stock = _gnn_step(_copy(base), data, None)
        ours = _gnn_step(_copy(base), data, {"min_bytes": 1 << 20})
        torch.testing.assert_close(ours[0], stock[0], rtol=1e-5, atol=1e-6)
        for n, g in stock[1].items():
            torch.testing.assert_close(ours[1][n], g, rtol=1e-4, atol=1e-6, msg=n)
        assert torch.equal(ours[3], stock[3]), name  # dropout drew what stock drew
        assert all(r["bits"] is None for r in ours[2]), name
        assert not any(r["kind"] == "mask" for r in ours[2]), name


def test_large_enough_graph_keeps_the_compressed_path():
    """The same model and ``min_bytes`` on a graph ten times larger: activations above the
    rule are quantized and ReLU saves its 1-bit mask again."""
    min_bytes = 64 * 1024  # 1,024 rows of 16 fp32 columns
    small, large = _graph(300), _graph(3000)
    for data, engaged in ((small, False), (large, True)):
        recs = _gnn_step(_gnn("gcn", data), data, {"bits": 2, "adaptive": False,
                                                   "min_bytes": min_bytes})[2]  # fmt: skip
        assert any(r["kind"] == "mask" for r in recs) is engaged
        assert any(r["bits"] == 2 for r in recs) is engaged
