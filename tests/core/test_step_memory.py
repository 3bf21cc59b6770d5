"""`ctl.report()`'s step memory: the process's peak in training split into graph, features,
parameters and optimizer, saved tensors and working set, each figure counted here independently."""

import gc

import pytest
import torch
import torch.nn.functional as F
from torch.optim.optimizer import _global_optimizer_post_hooks

from gact_graph import compress_gnn
from gact_graph.core.meter import StepMeter
from gact_graph.datasets import compact_adj_t
from gact_graph.models import GCN

N, E, FEATURES, CLASSES = 200, 800, 16, 4
ROWS = ("graph", "features", "parameters and optimizer", "saved tensors", "working set", "peak")


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, FEATURES, generator=g)
    edge_index = torch.randint(0, N, (2, E), generator=g)
    y = torch.randint(0, CLASSES, (N,), generator=g)
    torch.manual_seed(seed)
    model = GCN(FEATURES, 32, CLASSES, num_layers=2)
    return model, x, edge_index, y


def _step(model, ctl, opt, x, graph, y):
    if opt is not None:
        opt.zero_grad()
    F.cross_entropy(model(x, graph), y).backward()
    if opt is not None:
        opt.step()
    ctl.iterate()


def _bytes(tensors):
    """Bytes of the distinct storages behind ``tensors``."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _cached(ctl):
    return [t for adj in ctl._gg_adjacency_cache._recent.values() for t in adj.tensors()]


def _check_sum(fig):
    assert fig["peak"] is not None and fig["peak"] > 0  # Linux: /proc/self/status
    parts = fig["graph"] + fig["features"] + fig["parameters"] + fig["saved"]
    assert fig["working_set"] == fig["peak"] - parts


def test_report_splits_the_step_peak_into_its_parts():
    model, x, edge_index, y = _setup()
    ctl = compress_gnn(model, bits=2, adaptive=False)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    other = torch.nn.Linear(3, 3)  # another model's optimizer: not this model's memory
    other_opt = torch.optim.Adam(other.parameters())
    other(torch.randn(2, 3)).sum().backward()
    other_opt.step()
    for _ in range(2):
        _step(model, ctl, opt, x, edge_index, y)
    fig = ctl.step_memory.figures()

    assert _cached(ctl), "the GCN's normalized adjacency is cached"
    assert fig["graph"] == _bytes([edge_index, *_cached(ctl)])
    assert fig["features"] == x.untyped_storage().nbytes() == N * FEATURES * 4
    params = list(model.parameters())
    state = [opt.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq", "step")]
    assert fig["parameters"] == _bytes(params + [p.grad for p in params] + state)
    assert fig["optimizer"]
    assert fig["saved"] == ctl.stats()["total"]["stored_bytes"] > 0
    _check_sum(fig)

    text = ctl.report()
    section = text[text.index("step memory") :].splitlines()
    assert [row.split("  ")[1].strip() for row in section[1:7]] == list(ROWS)
    assert "optimizer: not seen" not in text
    mib = float(section[2].split()[1])  # features, in MB
    assert mib == pytest.approx(fig["features"] / 2**20, abs=1e-3)
    ctl.remove()


def test_the_peak_is_the_processs_and_the_step_that_set_it_is_named():
    """The peak is read, never reset (the example's and the benchmarks' readings of it stay
    whole): a 256 MiB tensor freed between steps is the peak, set outside training; a step
    that holds more (a 512 MiB temporary in its forward) is named as the one that set it."""
    model, x, edge_index, y = _setup()
    ctl = compress_gnn(model, bits=2, adaptive=False)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    meter = StepMeter(torch.device("cpu"))
    _step(model, ctl, opt, x, edge_index, y)
    big = torch.ones(64 * 2**20)
    held = meter.peak()
    del big
    _step(model, ctl, opt, x, edge_index, y)
    fig = ctl.step_memory.figures()
    assert fig["peak"] > held - 32 * 2**20 and fig["step"] is None
    assert "set before training" in ctl.report()
    hook = model.register_forward_hook(lambda *_: torch.ones(128 * 2**20).sum().item() and None)
    _step(model, ctl, opt, x, edge_index, y)
    hook.remove()
    fig = ctl.step_memory.figures()
    assert fig["peak"] > held + 128 * 2**20 and fig["step"] == ctl.step - 1
    assert f"set in step {ctl.step - 1}" in ctl.report()
    ctl.remove()


def test_a_compact_adj_t_is_the_graph():
    model, x, edge_index, y = _setup(seed=1)
    adj_t = compact_adj_t(edge_index, N)  # int32 columns, one stored value seen E times
    ctl = compress_gnn(model, bits=2, adaptive=False)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        _step(model, ctl, opt, x, adj_t, y)
    fig = ctl.step_memory.figures()

    inputs = [adj_t.crow_indices(), adj_t.col_indices(), adj_t.values()]
    assert adj_t.values().untyped_storage().nbytes() == 4
    assert fig["graph"] == _bytes(inputs + _cached(ctl))
    assert fig["features"] == x.untyped_storage().nbytes()
    _check_sum(fig)
    ctl.remove()


def test_a_sparse_tensor_adj_t_is_the_graph(torch_sparse):
    """`torch_sparse.SparseTensor`: every tensor its storage holds (the cached ``rowptr`` too)."""
    model, x, edge_index, y = _setup(seed=2)
    adj_t = torch_sparse.SparseTensor(row=edge_index[1], col=edge_index[0], sparse_sizes=(N, N))
    ctl = compress_gnn(model, bits=2, adaptive=False)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        _step(model, ctl, opt, x, adj_t, y)
    held = [t for t in vars(adj_t.storage).values() if isinstance(t, torch.Tensor)]
    assert any(t is adj_t.storage._rowptr for t in held)  # built by the first forward
    fig = ctl.step_memory.figures()
    assert fig["graph"] == _bytes(held + _cached(ctl))
    _check_sum(fig)
    ctl.remove()


def test_parameters_without_an_optimizer_say_so():
    model, x, edge_index, y = _setup()
    ctl = compress_gnn(model, bits=2, adaptive=False)
    _step(model, ctl, None, x, edge_index, y)  # gradients, no optimizer step
    fig = ctl.step_memory.figures()
    params = list(model.parameters())
    assert not fig["optimizer"]
    assert fig["parameters"] == _bytes(params + [p.grad for p in params])
    assert "parameters and optimizer" in ctl.report()
    assert "(optimizer: not seen)" in ctl.report()
    ctl.remove()


def test_the_optimizer_hook_goes_with_the_controller():
    gc.collect()  # controllers of earlier tests, dropped without remove(), take theirs now
    before = set(_global_optimizer_post_hooks)
    model, x, edge_index, y = _setup()
    ctl = compress_gnn(model, bits=2, adaptive=False)
    added = set(_global_optimizer_post_hooks) - before
    assert len(added) == 1
    ctl.remove()
    assert not added & set(_global_optimizer_post_hooks)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x, edge_index).sum().backward()
    opt.step()  # reaches no controller
    assert not ctl.step_memory._optimizers

    model, *_ = _setup()
    compress_gnn(model, bits=2, adaptive=False)  # dropped with its model, never removed
    added = set(_global_optimizer_post_hooks) - before
    assert len(added) == 1
    del model
    gc.collect()
    assert not added & set(_global_optimizer_post_hooks)
