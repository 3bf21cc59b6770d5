"""Deep models under compression: a 256-layer GCNII and a 128-layer GCN train with finite,
unbiased gradients; saved bytes grow linearly with depth at the compressed per-layer rate; the
scaling search of `benchmarks/harness.py` finds a deeper model for compression than for stock.

Everything runs on CPU on a 256-node graph; the deep models dominate the file's time (each
compressed pass of a 256-layer GCNII is some seconds on a loaded 2-core machine).

**The unbiasedness statistic.** For one parameter tensor with FP32 gradient ``g`` and ``K``
compressed gradients ``g_1..g_K`` (different rounding seeds, same weights), ``m`` their mean and
``s^2`` their per-coordinate sample variance,

    R = ||m - g||^2 / (sum(s^2) / K)

is the squared error of the mean over its expected value under unbiasedness (the squared
standard error). It is about 1 when the compressor is unbiased whatever ``K``, and grows as
``1 + K ||bias||^2 / tr(Cov)`` otherwise; the tests average it over the parameter tensors.
`test_unbiasedness_statistic_catches_a_biased_compressor` shows that it flags a compressor whose
rounding is off by 5% of a quantization step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gact_graph.core.controller as controller_module
from benchmarks.harness import (
    GraphInputs,
    Method,
    build_model,
    max_depth,
    run_step,
    search_max,
)
from gact_graph import compress_gnn
from gact_graph.datasets import load_dataset
from gact_graph.memory import saved_bytes_stats
from gact_graph.models import GCN, GCNII

HIDDEN = 32
NUM_NODES = 256


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def graph():
    data = load_dataset("synthetic-ogbn-arxiv", num_nodes=NUM_NODES, seed=0)
    return data.x, data.edge_index, data.y, int(data.num_classes)


def _gcnii(graph, depth):
    x, _, _, c = graph
    torch.manual_seed(0)
    return GCNII(x.shape[1], HIDDEN, c, num_layers=depth, dropout=0.0)


def _gcn(graph, depth, batch_norm=False, residual=False):
    # Plain GCN by default (no BatchNorm: see test_deep_batchnorm_gcn_at_2_bits). Its signal
    # shrinks with depth, but gradients stay finite and every layer's weights get one.
    x, _, _, c = graph
    torch.manual_seed(0)
    return GCN(
        x.shape[1], HIDDEN, c, num_layers=depth, dropout=0.0, batch_norm=batch_norm,
        residual=residual,
    )  # fmt: skip


def _grads(model, graph) -> tuple[float, list[torch.Tensor]]:
    x, edge_index, y, _ = graph
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x, edge_index), y)
    loss.backward()
    return loss.item(), [p.grad.detach().clone() for p in model.parameters()]


def _bias_stats(reference, samples):
    """Per parameter tensor with compression noise: ``R`` (see the module docstring) and the
    error of the mean relative to the mean error of one sample."""
    k = len(samples)
    ratios, shrinks = [], []
    for i, g in enumerate(reference):
        s = torch.stack([smp[i] for smp in samples]).double()
        total_var = s.var(0, unbiased=True).sum()
        if total_var <= 0:  # exact gradient (nothing quantized on its path)
            continue
        err_mean = s.mean(0) - g.double()
        ratios.append((err_mean.square().sum() / (total_var / k)).item())
        single = (s - g.double()).flatten(1).norm(dim=1).mean()
        shrinks.append((err_mean.norm() / single).item())
    return torch.tensor(ratios), torch.tensor(shrinks)


def _biased_quantize(shift):
    """A compressor that is wrong on purpose: stochastic rounding of ``x`` shifted by
    ``shift`` quantization steps (of the tensor's whole range)."""
    quantize = controller_module.quantize

    def biased(x, bits, group_size=256, seed=None):
        step = (x.max() - x.min()) / (2**bits - 1)
        return quantize(x + shift * step, bits, group_size=group_size, seed=seed)

    return biased


def _compressed_samples(model, graph, k, seed=0):
    # fixed bits: the samples must be identically distributed (an adaptive re-plan between
    # them would change their variance, not their mean)
    ctl = compress_gnn(model, bits=2, adaptive=False, seed=seed)
    try:
        samples = []
        for _ in range(k):  # no optimizer step in between: same weights, new rounding seeds
            samples.append(_grads(model, graph)[1])
            ctl.iterate()
    finally:
        ctl.remove()
    return samples


# ------------------------------------------------------------------ deep models
@pytest.mark.parametrize("build, depth", [(_gcnii, 256), (_gcn, 128)], ids=["gcnii-256", "gcn-128"])
def test_deep_model_trains_with_unbiased_gradients(graph, build, depth):
    model = build(graph, depth)
    _, reference = _grads(model, graph)  # stock FP32
    assert all(torch.isfinite(g).all() for g in reference)

    ctl = compress_gnn(model, bits=2, adaptive=False)  # same plan for both samples
    try:
        samples = []
        for _ in range(2):  # two gradients at the same weights, different rounding seeds
            loss, grads = _grads(model, graph)
            assert torch.isfinite(torch.tensor(loss))
            assert all(torch.isfinite(g).all() for g in grads)
            samples.append(grads)
            ctl.iterate()
        stats = ctl.stats()
        # the pass was compressed, and far below what stock saves
        assert stats["by_kind"]["activation"]["count"] >= depth - 1  # the 1st input is x
        assert stats["total"]["ratio"] > 8, stats["total"]

        # unbiased: the mean's error is its standard error, not more
        ratios, shrinks = _bias_stats(reference, samples)
        assert len(ratios) >= depth // 2  # most layers' weights carry compression noise
        assert ratios.mean() < 2.5, (ratios.mean(), ratios.median())
        # errors of different seeds are independent: the mean of 2 has ~1/sqrt(2) the error
        assert shrinks.median() < 0.8, shrinks.median()

        # and it trains: two optimizer steps, finite throughout, weights move
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()  # with the second sample's gradient
        loss, grads = _grads(model, graph)
        ctl.iterate()
        opt.step()
        assert torch.isfinite(torch.tensor(loss))
        assert all(torch.isfinite(g).all() for g in grads)
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    finally:
        ctl.remove()

    # the default (adaptive 2 bits on average) plans every layer and trains finite at depth
    with compress_gnn(model, bits=2) as ctl:
        for _ in range(3):
            loss, grads = _grads(model, graph)
            assert all(torch.isfinite(g).all() for g in grads)
            opt.step()
            ctl.iterate()
        assert len(ctl.plan) >= depth - 1 and ctl.adapter.n_estimates >= 1
        assert ctl.stats()["total"]["ratio"] > 8


@pytest.mark.parametrize("depth", [16, 128])
def test_deep_batchnorm_gcn_at_2_bits(graph, depth):
    """ResGCN with BatchNorm (the OGB GCN setup, made deep) at fixed 2 bits. BatchNorm saves
    its normalized input (gact_graph.ops.batchnorm): quantizing the raw input instead gives
    gradient errors ~1e4 x the gradient at 16 layers and inf/NaN at 64 (measured), because
    row-wise rounding steps are multiplied by 1/std of narrow channels."""
    model = _gcn(graph, depth, batch_norm=True, residual=True)
    _, reference = _grads(model, graph)
    ref = torch.cat([g.flatten() for g in reference])
    with compress_gnn(model, bits=2, adaptive=False):
        _, grads = _grads(model, graph)
    got = torch.cat([g.flatten() for g in grads])
    assert torch.isfinite(got).all()
    assert (got - ref).norm() < 0.8 * ref.norm()  # measured 0.44 (16) and 0.37 (128)
    if depth == 16:  # the raw-input BatchNorm (pointwise ops off) is what fails
        with compress_gnn(model, bits=2, adaptive=False, pointwise=False):
            _, grads = _grads(model, graph)
        raw = torch.cat([g.flatten() for g in grads])
        assert not ((raw - ref).norm() < 10 * ref.norm())


def test_unbiasedness_statistic_catches_a_biased_compressor(graph, monkeypatch):
    """The statistic of the deep tests, on a 16-layer GCNII: about 1 for the real compressor,
    far above the deep tests' threshold for one whose rounding is off by 5% of a step."""
    model = _gcnii(graph, 16)
    _, reference = _grads(model, graph)
    ratios, shrinks = _bias_stats(reference, _compressed_samples(model, graph, 2))
    assert ratios.mean() < 2.5 and shrinks.median() < 0.8

    monkeypatch.setattr(controller_module, "quantize", _biased_quantize(0.05))
    ratios, shrinks = _bias_stats(reference, _compressed_samples(model, graph, 2))
    assert ratios.mean() > 5, ratios.mean()  # deep tests require < 2.5
    assert shrinks.median() > 0.9  # averaging no longer helps: the error is the bias


# ------------------------------------------------------------------ bytes vs depth
def _saved_by_depth(graph, depths, **compress):
    """Saved bytes (total, activation) after one forward at each depth."""
    x, edge_index, _, _ = graph
    out = {}
    for depth in depths:
        model = _gcnii(graph, depth)
        if compress.get("stock"):
            st = saved_bytes_stats(model, lambda m=model: m(x, edge_index))
        else:
            with compress_gnn(model, **compress) as ctl:
                y = model(x, edge_index)
                st = ctl.stats()
                del y
        out[depth] = (st["total"]["stored_bytes"], st["by_kind"]["activation"]["stored_bytes"])
    return out


def _increments(by_depth, which):
    ds = sorted(by_depth)
    return [(by_depth[b][which] - by_depth[a][which]) / (b - a) for a, b in zip(ds, ds[1:])]


def test_saved_bytes_grow_linearly_at_the_compressed_rate(graph):
    depths = [4, 8, 16, 32]
    ours = _saved_by_depth(graph, depths, bits=2)
    lossless = _saved_by_depth(graph, depths, bits=None)  # same graph-aware paths, no rounding
    stock = _saved_by_depth(graph, depths, stock=True)

    inc_ours, inc_stock = _increments(ours, 0), _increments(stock, 0)
    # linear: every added layer costs the same
    assert max(inc_ours) - min(inc_ours) <= 0.02 * min(inc_ours), inc_ours
    assert max(inc_stock) - min(inc_stock) <= 0.02 * min(inc_stock), inc_stock
    # and much less than stock's layer
    assert inc_ours[-1] < inc_stock[-1] / 8, (inc_ours, inc_stock)

    # at the compressed rate: 2 bits per activation element plus 4 bytes per 256-element
    # group (2.125 bits) where lossless storage spends 32
    act_ours, act_lossless = _increments(ours, 1)[-1], _increments(lossless, 1)[-1]
    assert act_lossless > 0
    assert act_ours == pytest.approx(act_lossless * 2.125 / 32, rel=0.05)


# ------------------------------------------------------------------ the scaling search
def test_search_max_finds_the_boundary():
    limit = 37

    def fits(v):
        return v <= limit

    res = search_max(fits, start=1)
    assert res.best == limit and res.first_fail == limit + 1
    assert not res.capped and not res.timed_out
    assert len(res.trials) <= 2 * 7  # exponential to 64, then binary: logarithmic

    res = search_max(fits, start=8, unit=8)
    assert res.best == 32 and res.first_fail == 40

    res = search_max(fits, start=1, cap=20)
    assert res.best == 20 and res.capped and res.first_fail is None

    res = search_max(fits, start=1, rel_tol=0.25)  # stops with a bracket within 25%
    assert res.best <= limit < res.first_fail <= 1.25 * res.best + 1

    assert search_max(lambda v: False, start=4).best == 0
    res = search_max(fits, start=1, deadline=0.0)  # already late: only the start is tried
    assert res.timed_out and res.best == 1


def test_run_step_accounts_stock_like_saved_bytes_stats(graph):
    """The CPU budget counts stock's saved tensors exactly as `saved_bytes_stats` does."""
    x, edge_index, y, c = graph
    g = GraphInputs(x, edge_index, y)

    def make():
        torch.manual_seed(0)
        return GCN(x.shape[1], HIDDEN, c, num_layers=3, dropout=0.0)

    res = run_step(make, g, Method("stock"), budget_bytes=None)
    assert res.fits and res.steps_done == 1
    m = make()
    expected = saved_bytes_stats(m, lambda: m(x, edge_index))["total"]["stored_bytes"]
    assert res.bytes["saved"] == expected
    n_params = len(list(m.parameters()))  # Adam: two moments and a step count per tensor
    assert 2 * res.bytes["grads"] <= res.bytes["optimizer"] <= 2 * res.bytes["grads"] + 8 * n_params
    assert res.bytes["total"] == sum(
        res.bytes[k] for k in ("params", "grads", "optimizer", "inputs", "saved")
    )
    over = run_step(make, g, Method("stock"), budget_bytes=res.bytes["total"] - 1)
    assert not over.fits and over.reason == "budget"


def test_scaling_search_goes_deeper_with_compression(graph):
    """On a tiny budget, stock GCN fits a few layers; 2-bit compression fits several times
    as many."""
    x, edge_index, y, c = graph
    g = GraphInputs(x, edge_index, y)
    kwargs = dict(hidden_channels=HIDDEN, dropout=0.0)

    def make4():
        torch.manual_seed(0)
        return build_model("gcn", x.shape[1], c, num_layers=4, **kwargs)

    # the budget: what stock needs for 4 layers
    kwargs["budget_bytes"] = run_step(make4, g, Method("stock")).bytes["total"]
    kwargs["out_channels"] = c
    stock = max_depth("gcn", g, Method("stock"), cap=64, **kwargs)
    ours = max_depth("gcn", g, Method("L1 2-bit", {"bits": 2}), cap=32, rel_tol=0.25, **kwargs)
    assert stock.error is None and ours.error is None
    assert stock.best == 4, stock.trials
    assert ours.best / stock.best > 2, (ours.best, stock.best)
