"""Optimization levels: L0 (off), L2 (swap, simulated on CPU), CB1 (compressed checkpoints)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import DeepGCNLayer, GCNConv

from gact_graph import compress_gnn
from gact_graph.models import GAT, GCN, GCNII
from gact_graph.policy.levels import (
    CheckpointManager,
    SwapManager,
    SwappedPayload,
    checkpoint_segments,
)


def _graph(n=400, f=24, e=2400, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, f, generator=g), torch.randint(0, n, (2, e), generator=g)


_MODELS = {
    # dropout and BatchNorm inside: the recomputation must replay the same RNG and must not
    # update running statistics twice
    "gcn": lambda f, c: GCN(f, 48, c, num_layers=3, dropout=0.5, batch_norm=True),
    "gat": lambda f, c: GAT(
        f, 12, c, num_layers=3, heads=2, dropout=0.5, attn_dropout=0.3, batch_norm=True
    ),
    "gcnii": lambda f, c: GCNII(f, 48, c, num_layers=4, dropout=0.3),
}


def _make(name, f=24, c=5, seed=0):
    torch.manual_seed(seed)
    return _MODELS[name](f, c).train()


def _step(model, x, ei, **kw):
    """One forward/backward (with compress_gnn(**kw) when kw is given): grads, BN buffers,
    controller stats and the level manager's counters."""
    if kw:
        kw.setdefault("adaptive", False)  # fixed bits: the comparisons below are exact
    ctl = compress_gnn(model, **kw) if kw else None
    try:
        torch.manual_seed(1)  # same dropout masks in every run
        model.zero_grad(set_to_none=True)
        out = model(x, ei)
        out.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        bufs = {n: b.clone() for n, b in model.named_buffers()}
        stats = ctl.stats() if ctl else None
        mgr = getattr(ctl, "level_manager", None)
        counters = mgr.stats() if mgr is not None else None
    finally:
        if ctl is not None:
            ctl.remove()
    return grads, bufs, stats, counters


def _rel(a: dict, b: dict) -> float:
    num = sum((a[k] - b[k]).square().sum() for k in b)
    den = sum(b[k].square().sum() for k in b)
    return (num / den).sqrt().item()


# ------------------------------------------------------------------------------------ L0
def test_l0_installs_nothing_and_is_stock():
    x, ei = _graph()
    model = _make("gcn")
    ref, _, _, _ = _step(model, x, ei)
    ctl = compress_gnn(model, bits=2, opt_level="L0")
    assert ctl._handles == [] and not ctl._context_factories
    assert not any("forward" in m.__dict__ for m in model.modules())
    ctl.remove()
    got, _, _, _ = _step(model, x, ei, bits=2, opt_level="L0")
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


# ------------------------------------------------------------------------------------ L2
def test_l2_on_cpu_warns_once_and_equals_l1():
    x, ei = _graph()
    model = _make("gcn")
    ref, _, _, _ = _step(model, x, ei, bits=2)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ctl = compress_gnn(model, bits=2, adaptive=False, opt_level="L2")
        assert isinstance(ctl.level_manager, SwapManager)
        for _ in range(3):
            torch.manual_seed(1)
            model.zero_grad(set_to_none=True)
            model(x, ei).square().mean().backward()
        ctl.remove()
    ours = [w for w in rec if "L2" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in rec]
    assert "runs exactly as L1" in str(ours[0].message)
    assert ctl.level_manager.stats()["offloaded"] == 0
    got, _, _, _ = _step(model, x, ei, bits=2, opt_level="L2")
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


@pytest.mark.parametrize("name,bits", [("gcn", 2), ("gat", 4)])
def test_l2_swap_is_bit_exact(name, bits):
    """The swap path (plain CPU copies in place of pinned memory and streams) changes no bit."""
    x, ei = _graph()
    model = _make(name)
    ref, _, ref_stats, _ = _step(model, x, ei, bits=bits)
    got, _, stats, counters = _step(
        model, x, ei, bits=bits, opt_level="L2", swap_simulate=True, swap_min_bytes=0
    )
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    assert stats["total"] == ref_stats["total"]
    assert counters["offloaded"] > 0
    assert counters["fetched"] >= counters["offloaded"]
    # one layer of look-ahead: every layer but the last one backward starts with is prefetched
    assert counters["prefetch_hits"] > 0
    assert counters["prefetch_hits"] <= counters["prefetched"]


def test_l2_layers_and_release():
    x, ei = _graph()
    model = _make("gcn")
    ctl = compress_gnn(
        model, bits=2, adaptive=False, opt_level="L2", swap_simulate=True, swap_min_bytes=0
    )
    mgr = ctl.level_manager
    out = model(x, ei)
    layers = mgr._layers
    # a layer per conv; norm, ReLU and dropout after conv k belong to layer k
    assert len(layers) == 3
    payloads = [r() for layer in layers for r in layer]
    assert all(isinstance(p, SwappedPayload) and p.dev is None for p in payloads)
    assert all(p.cpu is not None for p in payloads)
    del payloads
    out.square().mean().backward()
    del out
    assert ctl.stats()["live_stored_bytes"] == 0
    assert all(r() is None for layer in layers for r in layer)
    ctl.remove()
    assert ctl.payload_wrapper is None


def test_l2_lossless_swaps_nothing():
    """Only compressed payloads are swapped: a lossless tensor could still be modified in
    place while an asynchronous copy reads it."""
    x, ei = _graph()
    model = _make("gat")
    ref, _, _, _ = _step(model, x, ei, bits=None)
    got, _, _, counters = _step(
        model, x, ei, bits=None, opt_level="L2", swap_simulate=True, swap_min_bytes=0
    )
    assert counters["offloaded"] == 0
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


# ------------------------------------------------------------------------------------ CB1
def test_checkpoint_segments():
    assert [p for p, _ in checkpoint_segments(GCN(8, 8, 2, num_layers=3))] == [
        "convs.0",
        "convs.1",
        "convs.2",
    ]

    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 16)
            self.layers = nn.ModuleList(
                DeepGCNLayer(GCNConv(16, 16), nn.LayerNorm(16), nn.ReLU(), block="res+")
                for _ in range(3)
            )

        def forward(self, x, ei):
            x = self.inp(x)
            for layer in self.layers:
                x = layer(x, ei)
            return x

    deep = Deep()
    assert [p for p, _ in checkpoint_segments(deep)] == ["layers.0", "layers.1", "layers.2"]
    assert [p for p, _ in checkpoint_segments(deep, ["inp", "layers.1", "layers.1.conv"])] == [
        "inp",
        "layers.1",
    ]
    picked = checkpoint_segments(deep, lambda p, m: isinstance(m, GCNConv))
    assert [p for p, _ in picked] == ["layers.0.conv", "layers.1.conv", "layers.2.conv"]
    with pytest.raises(ValueError, match="no module"):
        checkpoint_segments(deep, ["layers.7"])


@pytest.mark.parametrize("name", ["gcn", "gat", "gcnii"])
def test_cb1_lossless_matches_l1(name):
    x, ei = _graph()
    model = _make(name)
    ref, ref_bufs, _, _ = _step(model, x, ei, bits=None)
    model = _make(name)  # fresh BN statistics
    got, bufs, _, counters = _step(model, x, ei, bits=None, opt_level="CB1")
    assert _rel(got, ref) < 1e-5
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-6)
    for k in ref_bufs:  # running statistics updated once, not twice
        torch.testing.assert_close(bufs[k], ref_bufs[k])
    n_seg = len(checkpoint_segments(model))
    assert counters["segments_run"] == n_seg
    assert counters["recomputes"] == n_seg


def test_cb1_compresses_inputs_and_recomputed():
    x, ei = _graph()
    model = _make("gat")
    exact, _, _, _ = _step(model, x, ei, bits=None)
    l1, _, l1_stats, _ = _step(model, x, ei, bits=2)
    got, _, stats, counters = _step(model, x, ei, bits=2, opt_level="CB1")
    names = [r["name"] for r in stats["tensors"]]
    # nothing inside a segment is saved in forward: only the segments' inputs (by reference
    # or quantized), under the segment's own name
    assert not any(n.startswith("convs.") and n.split("#")[0].count(".") > 1 for n in names)
    seg_inputs = [r for r in stats["tensors"] if r["name"].split("#")[0] in ("convs.1", "convs.2")]
    assert seg_inputs and all(r["bits"] == 2 for r in seg_inputs if r["kind"] == "activation")
    assert stats["total"]["stored_bytes"] < l1_stats["total"]["stored_bytes"]
    # what the recomputation saved was quantized before backward read it
    assert counters["recomputed_tensors"] > 0
    assert counters["recomputed_stored_bytes"] < counters["recomputed_orig_bytes"] / 3
    # the gradient stays as close to the exact one as plain L1's
    assert _rel(got, exact) < 2 * _rel(l1, exact) + 0.05
    # the error is quantization's: it shrinks with the bits. CB1 recomputes each segment from
    # its quantized input, so (unlike L1) the recomputed forward is off too; at 8 bits its error
    # is 0.01-0.03 over seeds, while a recomputation with other dropout masks would give ~1
    got4, _, _, _ = _step(model, x, ei, bits=4, opt_level="CB1")
    got8, _, _, _ = _step(model, x, ei, bits=8, opt_level="CB1")
    assert _rel(got8, exact) < min(0.05, _rel(got4, exact) / 4)


def test_cb1_under_no_grad_and_remove():
    x, ei = _graph()
    model = _make("gcnii")
    ctl = compress_gnn(model, bits=2, adaptive=False, opt_level="CB1")
    assert isinstance(ctl.level_manager, CheckpointManager)
    with torch.no_grad():
        model(x, ei)
    with torch.inference_mode():
        model.eval()(x, ei)
    model.train()
    assert ctl.level_manager.stats()["segments_run"] == 0
    model(x, ei).sum().backward()
    assert ctl.level_manager.stats()["segments_run"] == len(ctl.level_manager.segments)
    assert "+ckpt" in ctl.module_paths["convs.0"] and "+ckpt" in ctl.report()
    ctl.remove()
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_cb1_retain_graph_backward_twice():
    x, ei = _graph()
    model = _make("gcnii")
    ctl = compress_gnn(model, bits=None, opt_level="CB1")
    torch.manual_seed(1)
    loss = model(x, ei).square().mean()
    g1 = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    g2 = torch.autograd.grad(loss, list(model.parameters()))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)
    assert ctl.level_manager.stats()["recomputes"] == 2 * len(ctl.level_manager.segments)
    ctl.remove()


def test_cb1_detects_nondeterministic_segment():
    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            h = self.lin(x)
            return h.sin() if self.calls == 1 else h * 2.0  # saves less when recomputed

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Flaky()

        def forward(self, x):
            return self.block(x)

    net = Net()
    ctl = compress_gnn(net, bits=None, opt_level="CB1", checkpoint_segments=["block"])
    out = net(torch.randn(8, 16))
    with pytest.raises(RuntimeError, match="checkpoint segment 'block'"):
        out.sum().backward()
    ctl.remove()


class _TorchCheckpointed(nn.Module):
    """A model that uses torch's non-reentrant checkpoint itself."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(24, 32)
        self.convs = nn.ModuleList(GCNConv(32, 32) for _ in range(2))

    def forward(self, x, ei):
        from torch.utils.checkpoint import checkpoint

        x = F.relu(self.inp(x))
        for conv in self.convs:
            x = checkpoint(lambda h, conv=conv: F.relu(conv(h, ei)), x, use_reentrant=False)
        return x


def test_torch_checkpoint_composes_with_controller():
    """torch's checkpoint hooks nest inside ours: its inputs are saved through our pack hook
    (and compressed), what it saves inside is its own business."""
    x, ei = _graph()
    torch.manual_seed(0)
    net = _TorchCheckpointed()
    ref, _, _, _ = _step(net, x, ei)
    got, _, _, _ = _step(net, x, ei, bits=None, pointwise=False)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k])
    q, _, stats, _ = _step(net, x, ei, bits=8, pointwise=False)
    quantized = [r for r in stats["tensors"] if r["bits"] == 8]
    # the two checkpoints' inputs (the first one is also what ReLU saved: stored once)
    assert len(quantized) == 2 and sum(r["uses"] for r in quantized) == 3
    assert _rel(q, ref) < 0.02


def test_torch_checkpoint_with_pointwise_mode():
    """The pointwise mode runs in torch's checkpointed forward but not in its recomputation;
    it steps aside inside a non-reentrant checkpoint so that both save the same tensors (it
    raised torch's CheckpointError about metadata before)."""
    x, ei = _graph()
    torch.manual_seed(0)
    net = _TorchCheckpointed()
    ref, _, _, _ = _step(net, x, ei)
    got, _, _, _ = _step(net, x, ei, bits=None)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k])
    q, _, _, _ = _step(net, x, ei, bits=8)
    assert _rel(q, ref) < 0.02


def test_cb1_large_graph_over_65535_nodes():
    n = 70_000
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 8, generator=g)
    ei = torch.randint(0, n, (2, 4 * n), generator=g)
    torch.manual_seed(0)
    model = GCNII(8, 16, 3, num_layers=2, dropout=0.2).train()
    ref, _, _, _ = _step(model, x, ei, bits=None)
    got, _, _, _ = _step(model, x, ei, bits=None, opt_level="CB1")
    assert _rel(got, ref) < 1e-5
    got2, _, _, _ = _step(
        model, x, ei, bits=None, opt_level="L2", swap_simulate=True, swap_min_bytes=0
    )
    for k in ref:
        assert torch.equal(got2[k], ref[k])


def _held_by_forward(model, x, ei):
    """Bytes a training forward leaves allocated on the GPU (its output and what autograd
    saved), after one warm step so that caches built once per graph (the adjacency) exist
    already and are not counted."""
    model.zero_grad(set_to_none=True)
    model(x, ei).square().mean().backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = model(x, ei)
    torch.cuda.synchronize()
    return out, torch.cuda.memory_allocated() - before


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_l2_swap_cuda_bit_exact_and_offloaded():
    dev = torch.device("cuda")
    x, ei = (t.to(dev) for t in _graph(n=20_000, f=64, e=200_000))
    model = _make("gcn", f=64).to(dev)
    ref, _, _, _ = _step(model, x, ei, bits=2)
    ctl = compress_gnn(model, bits=2, adaptive=False, opt_level="L2", swap_min_bytes=0)
    out, held = _held_by_forward(model, x, ei)
    payloads = [r() for layer in ctl.level_manager._layers for r in layer]
    assert payloads and all(p.cpu.packed.is_pinned() for p in payloads)
    assert all(p.dev is None for p in payloads)
    del payloads
    del out
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    model(x, ei).square().mean().backward()
    torch.cuda.synchronize()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    ctl.remove()
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    l1 = compress_gnn(model, bits=2, adaptive=False)
    out, held_l1 = _held_by_forward(model, x, ei)
    del out
    l1.remove()
    assert held < held_l1, (held, held_l1)  # the compressed payloads left the GPU


def _cb1_run(steps=3, state=None):
    """``steps`` compressed CB1 training steps of a fresh GAT (optionally resumed from a
    controller ``state``): the gradients of each step, and the state at the end."""
    x, ei = _graph()
    model = _make("gat")  # its segments recompute tensors that are quantized again
    ctl = compress_gnn(model, bits=2, adaptive=False, opt_level="CB1")
    if state is not None:
        ctl.load_state_dict(state)
    grads = []
    for _ in range(steps):
        torch.manual_seed(1)
        model.zero_grad(set_to_none=True)
        model(x, ei).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        ctl.iterate()
    state = ctl.state_dict()
    ctl.remove()
    return grads, state


def test_cb1_same_run_twice_in_one_process_is_bit_identical():
    first, _ = _cb1_run()
    second, _ = _cb1_run()
    for a, b in zip(first, second):
        assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_cb1_resumed_from_state_dict_rounds_like_the_uninterrupted_run():
    # no optimizer step: the weights stay the initial ones, so step 2 of the whole run and the
    # first step of the run resumed at step 2 see the same inputs and must round alike
    whole, _ = _cb1_run(steps=3)
    _, state = _cb1_run(steps=2)
    resumed, _ = _cb1_run(steps=1, state=state)
    assert state["step"] == 2
    assert all(torch.equal(p, q) for p, q in zip(whole[2], resumed[0]))
    assert not all(torch.equal(p, q) for p, q in zip(whole[1], resumed[0]))  # steps differ
