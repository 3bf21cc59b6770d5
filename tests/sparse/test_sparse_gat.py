"""Fused GAT / GATv2 attention (`gact_graph.sparse.gat`, `gatv2`, `gat_fused`, `gat_convs`):
exact against stock PyG in lossless mode, the exact gradient of its own forward under
attention dropout, node-level saved state only, no edge x feature tensor in forward or
backward, and close gradients when quantized."""

import contextlib
import itertools
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch_geometric.nn import GATConv, GATv2Conv
from torch_geometric.utils import to_torch_coo_tensor

from gact_graph import compress_gnn
from gact_graph.memory import saved_bytes_stats
from gact_graph.sparse import edge_chunks as sedge
from gact_graph.sparse import gat as sgat
from gact_graph.sparse import gat_fused as sfused
from gact_graph.sparse import gatv2 as sgatv2
from gact_graph.sparse import install_sparse_paths
from gact_graph.switches import lean_backward
from tests.benchmarks.test_scale_deep import _bias_stats
from tests.devices import DEVICES

# ---------------------------------------------------------------------------- helpers


def _compress(model, **kwargs):
    """compress_gnn + the sparse patchers (applied here when compress_gnn does not yet)."""
    ctl = compress_gnn(model, **kwargs)
    convs = [m for m in model.modules() if isinstance(m, (GATConv, GATv2Conv))]
    if not any("forward" in m.__dict__ for m in convs):
        install_sparse_paths(ctl)
    return ctl


def _csr(src, dst, n):
    dst, perm = dst.sort(stable=True)
    rowptr = torch.zeros(n + 1, dtype=torch.long)
    rowptr[1:] = torch.bincount(dst, minlength=n).cumsum(0)
    return rowptr, src[perm].to(torch.int32)


def _graph(kind, n=60, e=300, seed=0):
    """Edge lists that break naive implementations."""
    g = torch.Generator().manual_seed(seed)
    if kind == "isolated":  # the last 7 nodes have no edge at all
        ei = torch.randint(0, n - 7, (2, e), generator=g)
    elif kind == "self_loops":  # existing self-loops (GAT removes, then adds one per node)
        ei = torch.randint(0, n, (2, e), generator=g)
        loops = torch.arange(0, n, 3)
        ei = torch.cat([ei, torch.stack([loops, loops])], 1)
    elif kind == "duplicates":  # repeated edges count twice in the softmax
        ei = torch.randint(0, n, (2, e // 2), generator=g)
        ei = torch.cat([ei, ei[:, : e // 4], ei[:, :10]], 1)
    else:
        raise ValueError(kind)
    return ei


def _run(model, x, edge_index, loss_seed=0, **kwargs):
    """Output, grad of x and grads of all parameters (by name) of one forward/backward."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = model(x, edge_index, **kwargs)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(loss_seed)).to(out)
    (out * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.clone(), grads


def _assert_same_run(a, b, rtol=1e-4, atol=1e-5):
    out_a, gx_a, g_a = a
    out_b, gx_b, g_b = b
    torch.testing.assert_close(out_a, out_b, rtol=rtol, atol=atol)
    torch.testing.assert_close(gx_a, gx_b, rtol=rtol, atol=atol)
    assert g_a.keys() == g_b.keys()
    for name in g_a:
        torch.testing.assert_close(
            g_a[name], g_b[name], rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
        )


def _stock_vs_fused(model, x, edge_index, **kwargs):
    stock = _run(model, x, edge_index, **kwargs)
    ctl = _compress(model, bits=None)
    try:
        fused = _run(model, x, edge_index, **kwargs)
        paths = dict(ctl.module_paths)
    finally:
        ctl.remove()
    return stock, fused, paths


def _randomize(model, seed=0):
    """Non-trivial biases and attention vectors (PyG zero-initializes the bias)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


class _MaxOutput(TorchDispatchMode):
    """Largest storage (bytes) any ATen op returns while active: forward, and backward too."""

    def __init__(self):
        super().__init__()
        self.max_bytes, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > self.max_bytes:
                self.max_bytes, self.op = t.untyped_storage().nbytes(), str(func)
        return out


# ---------------------------------------------------------------------------- the Functions


def _tiny_inputs(n=9, e=30, heads=2, channels=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, n - 2, (e,), generator=g)  # nodes n-2, n-1: isolated
    dst = torch.randint(0, n - 2, (e,), generator=g)
    src = torch.cat([src, src[:4]])  # duplicate edges
    dst = torch.cat([dst, dst[:4]])
    rowptr, col = _csr(src, dst, n)

    def leaf(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    x, a_src, a_dst = leaf(n, heads, channels), leaf(n, heads), leaf(n, heads)
    return rowptr, col, x, a_src, a_dst, leaf(n, heads, channels), leaf(1, heads, channels)


@pytest.mark.parametrize("variant", ["gat", "gatv2"])
@pytest.mark.parametrize("dropout", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("chunk_bytes", [1, 2**30])
@pytest.mark.parametrize("lean", [False, True])
def test_function_matches_reference(variant, dropout, chunk_bytes, lean):
    """Against stock autograd with ``F.dropout`` drawn in another edge order than CSR's
    (``perm``): same output and gradients, and the same global RNG state after the draw; the
    same again under `lean_backward` (GAT's two-pass backward, which the probe runs)."""
    rowptr, col, x, a_src, a_dst, x_r, att = _tiny_inputs()
    perm = torch.randperm(col.numel(), generator=torch.Generator().manual_seed(3))
    if variant == "gat":
        inputs, fn, ref_fn = (x, a_src, a_dst), sgat.gat_attention, sgat.gat_attention_reference
    else:
        inputs = (x, x_r, att)
        fn, ref_fn = sgatv2.gatv2_attention, sgatv2.gatv2_attention_reference
    torch.manual_seed(7)
    fused = fn(*inputs, rowptr, col, 0.2, dropout, perm, chunk_bytes)
    after_fused = torch.get_rng_state()
    torch.manual_seed(7)
    ref = ref_fn(*inputs, rowptr, col.long(), 0.2, dropout, perm)
    assert torch.equal(after_fused, torch.get_rng_state())
    torch.testing.assert_close(fused, ref, rtol=1e-12, atol=1e-12)
    w = torch.randn(fused.shape, dtype=fused.dtype)
    before_backward = torch.get_rng_state()
    with lean_backward() if lean else contextlib.nullcontext():
        g_fused = torch.autograd.grad((fused * w).sum(), inputs)
    assert torch.equal(before_backward, torch.get_rng_state())  # the replay is private
    g_ref = torch.autograd.grad((ref * w).sum(), inputs)
    for a, b in zip(g_fused, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    if 0 < dropout < 1:  # the mask is really applied: some attention weights are zero
        assert not torch.allclose(ref, ref_fn(*inputs, rowptr, col.long(), 0.2, 0.0))


@pytest.mark.parametrize("needs", [n for n in itertools.product([False, True], repeat=3) if any(n)])
def test_lean_backward_gives_the_same_gradients_whichever_inputs_need_them(needs):
    """GAT's two-pass backward (features released before their gradient exists) against its
    one-pass backward, for every subset of ``(x, a_src, a_dst)`` that needs a gradient."""
    rowptr, col, x, a_src, a_dst, _, _ = _tiny_inputs(seed=4)
    inputs = [t.detach().requires_grad_(need) for t, need in zip((x, a_src, a_dst), needs)]
    wanted = [t for t in inputs if t.requires_grad]
    out = sgat.gat_attention(*inputs, rowptr, col, 0.2, 0.3, None, 64)
    w = torch.randn(out.shape, dtype=out.dtype)
    one_pass = torch.autograd.grad((out * w).sum(), wanted, retain_graph=True)
    with lean_backward():
        two_pass = torch.autograd.grad((out * w).sum(), wanted)
    for a, b in zip(one_pass, two_pass, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("variant", ["gat", "gatv2"])
def test_gradcheck_with_attention_dropout(variant):
    """Backward is the exact derivative of forward with the dropout mask of forward's draw."""
    rowptr, col, x, a_src, a_dst, x_r, att = _tiny_inputs(n=6, e=12, heads=2, channels=2)
    if variant == "gat":
        fn = sgat.GatAttentionFunction.apply
        inputs = (x, a_src, a_dst)
    else:
        fn = sgatv2.GatV2AttentionFunction.apply
        inputs = (x, x_r, att)

    def seeded(*t):  # every evaluation of gradcheck draws the same mask
        torch.manual_seed(1234)
        # 40 bytes: chunks of one edge, so the chunk loop is exercised too.
        return fn(*t, rowptr, col, 0.2, 0.5, None, 40)

    assert torch.autograd.gradcheck(seeded, inputs, eps=1e-6, atol=1e-5)


# ---------------------------------------------------------------------------- GATConv lossless


@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("concat", [True, False])
@pytest.mark.parametrize("kind", ["isolated", "self_loops", "duplicates"])
def test_gatconv_lossless_matches_pyg(heads, concat, kind):
    torch.manual_seed(0)
    ei = _graph(kind)
    x = torch.randn(60, 12)
    conv = _randomize(GATConv(12, 5, heads=heads, concat=concat))
    stock, fused, paths = _stock_vs_fused(conv, x, ei)
    assert paths["<root>"] == "sparse-fused"
    _assert_same_run(stock, fused)
    assert {"lin.weight", "att_src", "att_dst", "bias"} <= stock[2].keys()


@pytest.mark.parametrize(
    "options",
    [
        dict(residual=True),
        dict(bias=False),
        dict(add_self_loops=False),
        dict(negative_slope=0.05, heads=2),
        dict(residual=True, concat=False, heads=2),
    ],
)
def test_gatconv_options_match_pyg(options):
    torch.manual_seed(1)
    ei = _graph("self_loops")
    x = torch.randn(60, 12)
    conv = _randomize(GATConv(12, 5, **options))
    stock, fused, paths = _stock_vs_fused(conv, x, ei)
    assert paths["<root>"] == "sparse-fused"
    _assert_same_run(stock, fused)


def test_gatconv_pair_input_same_size_matches_pyg():
    """(x_src, x_dst) of one node set, with separate lin_src / lin_dst."""
    torch.manual_seed(2)
    ei = _graph("duplicates")
    xs, xd = torch.randn(60, 12), torch.randn(60, 7)
    conv = _randomize(GATConv((12, 7), 4, heads=2, residual=True))

    def run():
        conv.zero_grad(set_to_none=True)
        a, b = xs.clone().requires_grad_(), xd.clone().requires_grad_()
        out = conv((a, b), ei)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads = {n: p.grad.clone() for n, p in conv.named_parameters()}
        return out.detach(), torch.cat([a.grad, b.grad], 1), grads

    stock = run()
    ctl = _compress(conv, bits=None)
    fused = run()
    assert ctl.module_paths["<root>"] == "sparse-fused"
    ctl.remove()
    _assert_same_run(stock, fused)


def test_gatconv_lazy_projections_initialize_as_stock():
    """in_channels=-1: the fused path initializes lin_src and lin_dst in stock's order (the
    logits never call lin_dst on its own), so both draw the same weights."""
    ei, xs, xd = _graph("isolated"), torch.randn(60, 12), torch.randn(60, 7)
    outs = []
    for compressed in (False, True):
        torch.manual_seed(3)
        conv = GATConv((-1, -1), 4, heads=2)
        ctl = _compress(conv, bits=None) if compressed else None
        outs.append(conv((xs, xd), ei))
        if ctl is not None:
            assert ctl.module_paths["<root>"] == "sparse-fused"
            ctl.remove()
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)


def test_gatconv_replaced_projection():
    """A bias-free nn.Linear folds like PyG's; one with a bias takes PyG's path."""
    torch.manual_seed(4)
    ei, x = _graph("duplicates"), torch.randn(60, 12)
    for bias, path in [
        (False, "sparse-fused"),
        (True, "generic (projection is not a bias-free Linear)"),
    ]:
        conv = _randomize(GATConv(12, 4, heads=2))
        conv.lin = _randomize(nn.Linear(12, 8, bias=bias))
        stock, fused, paths = _stock_vs_fused(conv, x, ei)
        assert paths["<root>"] == path
        _assert_same_run(stock, fused)


def test_gatconv_lossless_more_than_65535_nodes():
    """float64, so that sums over 70k nodes compare tightly."""
    n, e = 70_000, 70_000
    g = torch.Generator().manual_seed(3)
    ei = torch.randint(0, n, (2, e), generator=g)
    ei[:, :1000] = torch.randint(65_536, n, (2, 1000), generator=g)  # edges among high ids
    x = torch.randn(n, 8, generator=g, dtype=torch.float64)
    conv = _randomize(GATConv(8, 4, heads=2)).double()
    stock, fused, paths = _stock_vs_fused(conv, x, ei)
    assert paths["<root>"] == "sparse-fused"
    _assert_same_run(stock, fused, rtol=1e-9, atol=1e-9)
    assert stock[0][65_536:].abs().sum() > 0  # high ids really receive messages


# ---------------------------------------------------------------------------- GATv2Conv lossless


@pytest.mark.parametrize("heads,concat", [(1, True), (3, True), (3, False)])
@pytest.mark.parametrize("share_weights", [False, True])
def test_gatv2conv_lossless_matches_pyg(heads, concat, share_weights):
    torch.manual_seed(4)
    ei = _graph("isolated")
    x = torch.randn(60, 12)
    conv = _randomize(
        GATv2Conv(12, 5, heads=heads, concat=concat, share_weights=share_weights, residual=True)
    )
    stock, fused, paths = _stock_vs_fused(conv, x, ei)
    assert paths["<root>"] == "sparse-fused"
    _assert_same_run(stock, fused)


# ---------------------------------------------------------------------------- fallbacks


def test_fallbacks_run_pyg_and_say_why():
    torch.manual_seed(5)
    ei = _graph("duplicates")
    x = torch.randn(60, 12)
    conv = _randomize(GATConv(12, 4, heads=2, edge_dim=3))
    edge_attr = torch.randn(ei.size(1), 3)
    stock = _run(conv, x, ei, edge_attr=edge_attr)
    ctl = _compress(conv, bits=None)
    try:
        _assert_same_run(stock, _run(conv, x, ei, edge_attr=edge_attr))
        assert ctl.module_paths["<root>"] == "generic (edge_attr)"
        # edge_dim set but no edge_attr given: nothing edge-level to add, the fused path is exact
        fused_no_attr = _run(conv, x, ei)
        assert ctl.module_paths["<root>"] == "sparse-fused"
        _assert_same_run(fused_no_attr, _stock_forward_run(conv, x, ei))
        out, (ei_out, alpha) = conv(x, ei, return_attention_weights=True)
        assert ctl.module_paths["<root>"] == "generic (return_attention_weights)"
        assert alpha.shape == (ei_out.size(1), 2)
        adj_t = to_torch_coo_tensor(ei.flip(0), size=(60, 60))
        conv(x, adj_t)
        assert ctl.module_paths["<root>"] == "generic (sparse adj)"
        conv((x, torch.randn(40, 12)), ei[:, (ei[1] < 40)])
        assert ctl.module_paths["<root>"] == "generic (bipartite)"
        conv(x, ei)
        assert ctl.module_paths["<root>"] == "sparse-fused"
    finally:
        ctl.remove()


@pytest.mark.parametrize("conv_cls", [GATConv, GATv2Conv])
@pytest.mark.parametrize("num_attr", [None, 7])
def test_edge_attr_without_edge_dim_acts_as_stock(conv_cls, num_attr):
    """Built without ``edge_dim`` and called with ``edge_attr``: stock GATConv ignores the
    features (and refuses ones of the wrong length when it adds self-loops), stock GATv2Conv
    refuses them; ours does the same."""
    torch.manual_seed(5)
    ei = _graph("self_loops")
    x = torch.randn(60, 12)
    edge_attr = torch.randn(num_attr or ei.size(1), 3)
    conv = _randomize(conv_cls(12, 4, heads=2))
    try:
        stock = _run(conv, x, ei, edge_attr=edge_attr)
    except Exception as e:  # the stock error is the outcome to match
        stock = e
    ctl = _compress(conv, bits=None)
    try:
        if isinstance(stock, Exception):
            with pytest.raises(type(stock)):
                _run(conv, x, ei, edge_attr=edge_attr)
        else:
            _assert_same_run(stock, _run(conv, x, ei, edge_attr=edge_attr))
        assert ctl.module_paths["<root>"] == "generic (edge_attr)"
    finally:
        ctl.remove()


def _stock_forward_run(conv, x, ei):
    """`_run` through PyG's own class forward (no hooks, no patch) while a controller is on."""
    conv.zero_grad(set_to_none=True)
    xg = x.detach().clone().requires_grad_()
    out = type(conv).forward(conv, xg, ei)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    (out * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in conv.named_parameters() if p.grad is not None}
    return out.detach(), xg.grad.clone(), grads


def test_remove_restores_stock_forward():
    conv = GATConv(12, 4, heads=2)
    ctl = _compress(conv, bits=2)
    assert "forward" in conv.__dict__
    ctl.remove()
    assert "forward" not in conv.__dict__


# ---------------------------------------------------------------------------- attention dropout


def _dropout_conv():
    torch.manual_seed(6)
    return _randomize(GATConv(12, 5, heads=3, dropout=0.5)).train()


@pytest.mark.parametrize("bits", [None, 4])
def test_dropout_two_backwards_match(bits):
    conv = _dropout_conv()
    ei, x = _graph("isolated"), torch.randn(60, 12, requires_grad=True)
    ctl = _compress(conv, bits=bits, min_numel=0)
    try:
        out = conv(x, ei)
        w = torch.randn(out.shape)
        g1 = torch.autograd.grad((out * w).sum(), [x, *conv.parameters()], retain_graph=True)
        g2 = torch.autograd.grad((out * w).sum(), [x, *conv.parameters()])
    finally:
        ctl.remove()
    for a, b in zip(g1, g2, strict=True):
        assert torch.equal(a, b)


def test_dropout_follows_torch_seed_and_eval_mode():
    conv = _dropout_conv()
    ei, x = _graph("self_loops"), torch.randn(60, 12)
    ctl = _compress(conv, bits=None)
    try:
        torch.manual_seed(10)
        a = conv(x, ei)
        b = conv(x, ei)
        torch.manual_seed(10)
        c = conv(x, ei)
        assert torch.equal(a, c) and not torch.equal(a, b)  # reproducible, fresh per forward
        conv.eval()
        fused_eval = conv(x, ei)
    finally:
        ctl.remove()
    torch.testing.assert_close(fused_eval, conv(x, ei), rtol=1e-4, atol=1e-5)  # stock, eval


class _TwoLayer(nn.Module):
    """GAT's Cora setup, small: feature dropout, attention dropout, ELU."""

    def __init__(self, conv_cls):
        super().__init__()
        self.conv1 = conv_cls(12, 4, heads=3, dropout=0.6)
        self.conv2 = conv_cls(12, 5, heads=1, dropout=0.6)

    def forward(self, x, edge_index):
        x = F.dropout(x, 0.6, self.training)
        x = F.dropout(F.elu(self.conv1(x, edge_index)), 0.6, self.training)
        return self.conv2(x, edge_index)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("conv_cls", [GATConv, GATv2Conv])
def test_attention_dropout_lossless_equals_stock(conv_cls, device):
    """bits=None with attention dropout: stock's loss, gradients and RNG state after the step.
    The masks are stock's: drawn from the global generator as ``F.dropout`` draws them, in
    PyG's edge order (self-loops appended), though the fused path runs in CSR order."""
    torch.manual_seed(13)
    ei, x = _graph("self_loops").to(device), torch.randn(60, 12, device=device)
    y = torch.randint(0, 5, (60,), device=device)
    model = _randomize(_TwoLayer(conv_cls)).to(device).train()

    def step():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        loss = F.cross_entropy(model(x, ei), y)
        loss.backward()
        rng = torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, rng

    stock = step()
    ctl = _compress(model, bits=None)
    try:
        fused = step()
        assert ctl.module_paths["conv1"] == ctl.module_paths["conv2"] == "sparse-fused"
    finally:
        ctl.remove()
    torch.testing.assert_close(fused[0], stock[0], rtol=1e-6, atol=1e-6)
    for name, grad in stock[1].items():
        torch.testing.assert_close(fused[1][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    assert torch.equal(fused[2], stock[2])


def test_dropout_is_unbiased():
    """E[out] over dropout masks = out without dropout (attention dropout is inverted)."""
    rowptr, col, x, a_src, a_dst, _, _ = _tiny_inputs(n=12, e=60, heads=2, channels=4)
    with torch.no_grad():
        expected = sgat.gat_attention(x, a_src, a_dst, rowptr, col, 0.2, 0.0)
        draws = [sgat.gat_attention(x, a_src, a_dst, rowptr, col, 0.2, 0.2) for _ in range(1000)]
    mean = torch.stack(draws).mean(0)
    assert not torch.equal(draws[0], draws[1])
    # per element: std of the mean <= 0.5 |expected| / sqrt(1000) ~ 1.6%
    assert ((mean - expected).abs().mean() / expected.abs().mean()).item() < 0.03


def test_fused_kernel_routing(monkeypatch):
    """Which edge stage runs (`fused_kernel_applies`): the Triton kernels on CUDA tensors, or
    anywhere when forced; never for float64 (exact on the chunked stage) nor for attention
    dropout in lossless mode (stock's draw)."""
    from gact_graph.kernels import triton_available

    x = torch.randn(4, 2, 3)
    logits = torch.randn(4, 2)
    monkeypatch.delenv("GACT_GRAPH_FORCE_TRITON", raising=False)
    monkeypatch.setattr(sfused, "EDGE_KERNEL", "auto")
    assert not sfused.fused_kernel_applies(x, logits, 0.0, lossless=False)  # a CPU tensor
    monkeypatch.setattr(sfused, "EDGE_KERNEL", "triton")
    forced = triton_available()
    assert sfused.fused_kernel_applies(x, logits, 0.0, lossless=False) == forced
    assert sfused.fused_kernel_applies(x.half(), logits, 0.5, lossless=False) == forced
    assert sfused.fused_kernel_applies(x, logits, 0.0, lossless=True) == forced
    assert not sfused.fused_kernel_applies(x, logits, 0.5, lossless=True)
    assert not sfused.fused_kernel_applies(x.double(), logits, 0.0, lossless=False)
    assert not sfused.fused_kernel_applies(x, logits.double(), 0.0, lossless=False)
    monkeypatch.setattr(sfused, "EDGE_KERNEL", "chunked")
    assert not sfused.fused_kernel_applies(x, logits, 0.0, lossless=False)
    monkeypatch.setattr(sfused, "EDGE_KERNEL", "fast")
    with pytest.raises(ValueError, match="EDGE_KERNEL"):
        sfused.fused_kernel_applies(x, logits, 0.0, lossless=False)


@pytest.mark.parametrize("symmetric", [True, False])
def test_walk_transpose_for_the_kernels(symmetric):
    """`CompactAdjacency.walk_transpose`: the transpose's rows (the adjacency's own tensors
    when it is symmetric: no copy) and each transposed edge's CSR position; cached."""
    from gact_graph.sparse.adjacency import CompactAdjacency

    torch.manual_seed(0)
    n = 30
    ei = torch.randint(0, n, (2, 90))
    if symmetric:
        ei = torch.cat([ei, ei.flip(0)], 1)
    ei = ei[:, torch.argsort(ei[1] * n + ei[0])]  # by (destination, source), as the cache's
    rowptr, col = _csr(ei[0], ei[1], n)
    adj = CompactAdjacency(n, rowptr, col)
    before = adj.nbytes
    t_rowptr, t_col, pos = adj.walk_transpose()
    assert (t_rowptr is rowptr and t_col is col) == symmetric
    dst = sedge.csr_destinations(rowptr, col.numel())
    src_t = sedge.csr_destinations(t_rowptr, t_col.numel())
    # transposed edge j runs from source src_t[j] to t_col[j]; CSR edge pos[j] is that edge
    assert torch.equal(col[pos.long()].long(), src_t)
    assert torch.equal(dst[pos.long()], t_col.long())
    assert torch.equal(pos.sort().values.long(), torch.arange(col.numel()))
    assert adj.walk_transpose()[2] is pos  # cached
    extra = pos.numel() * pos.element_size()
    if not symmetric:
        extra += t_rowptr.numel() * 8 + t_col.numel() * t_col.element_size()
    assert adj.nbytes == before + extra


# ---------------------------------------------------------------------------- memory


class _GAT3(nn.Module):
    """3-layer GAT as on ogbn-arxiv (concat hidden heads, mean output heads, ELU)."""

    def __init__(self, d_in, hidden, d_out, heads, residual=True, dropout=0.0, conv=GATConv):
        super().__init__()
        kw = dict(residual=residual, dropout=dropout)
        self.convs = nn.ModuleList(
            [
                conv(d_in, hidden, heads=heads, **kw),
                conv(hidden * heads, hidden, heads=heads, **kw),
                conv(hidden * heads, d_out, heads=heads, concat=False, **kw),
            ]
        )

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = F.elu(x)
        return x


class _FirstColumns(nn.Module):
    def __init__(self, conv, k):
        super().__init__()
        self.conv, self.k = conv, k

    def forward(self, x, edge_index):
        return self.conv(x, edge_index)[:, : self.k]


def _edge_count(ei, n):
    return int((ei[0] != ei[1]).sum()) + n  # after remove_self_loops + add_self_loops


@pytest.mark.parametrize("conv_cls", [GATConv, GATv2Conv])
@pytest.mark.parametrize("bits", [None, 2])
def test_saved_state_is_node_level(conv_cls, bits):
    torch.manual_seed(7)
    n, e, heads, hidden = 300, 2500, 3, 16
    ei = torch.randint(0, n, (2, e))
    edges = _edge_count(ei, n)
    x = torch.randn(n, 24)
    model = _GAT3(24, hidden, 5, heads, conv=conv_cls)

    stock = saved_bytes_stats(model, lambda: model(x, ei))
    stock_shapes = [r["shape"] for r in stock["tensors"]]
    assert (edges, heads, hidden) in stock_shapes  # the gathered x_j: the test can fail

    ctl = _compress(model, bits=bits)
    try:
        out = model(x, ei)
        stats = ctl.stats()
        assert set(ctl.module_paths[f"convs.{i}"] for i in range(3)) == {"sparse-fused"}
        out.sum().backward()
    finally:
        ctl.remove()
    for r in stats["tensors"]:
        shape = r["shape"]
        assert edges not in shape[1:] and (len(shape) < 2 or shape[0] != edges), r
        if shape and shape[0] == edges:  # the shared adjacency's col, stored once
            assert r["kind"] == "index" and len(shape) == 1 and r["uses"] == 3, r
    edge_level = [r for r in stats["tensors"] if r["shape"] and r["shape"][0] == edges]
    assert len(edge_level) == 1
    if bits is not None:
        quantized = [r for r in stats["tensors"] if r["bits"] is not None]
        assert quantized and all(r["bits"] == bits for r in quantized)
        if conv_cls is GATConv:  # node logits (N x H) stay lossless
            logits = [r for r in stats["tensors"] if r["shape"] == (n, heads)]
            assert len(logits) == 6 and all(r["bits"] is None for r in logits)
    assert stats["total"]["orig_bytes"] < stock["total"]["orig_bytes"] / 3


@pytest.mark.parametrize("conv_cls", [GATConv, GATv2Conv])
def test_no_edge_feature_tensor_in_forward_or_backward(conv_cls):
    """With small chunks, no ATen op (forward or backward) returns anything near E x H x C."""
    torch.manual_seed(8)
    n, e, heads, channels = 1000, 20_000, 2, 16
    ei = torch.randint(0, n, (2, e))
    edge_feature_bytes = _edge_count(ei, n) * heads * channels * 4
    x = torch.randn(n, 8, requires_grad=True)
    conv = conv_cls(8, channels, heads=heads)

    def peak_op_bytes():
        with _MaxOutput() as fwd:
            out = conv(x, ei)
        with _MaxOutput() as bwd:
            out.sum().backward()
        return fwd.max_bytes, bwd.max_bytes

    stock_fwd, stock_bwd = peak_op_bytes()
    assert stock_fwd >= 0.99 * edge_feature_bytes  # PyG does gather E x H x C

    ctl = _compress(conv, bits=None, chunk_bytes=256 * 1024)  # < 1/8 of E x H x C
    try:
        fused_fwd, fused_bwd = peak_op_bytes()
        assert ctl.module_paths["<root>"] == "sparse-fused"
    finally:
        ctl.remove()
    # The largest are the E-long index copies of building the adjacency (forward) and
    # the E x H attention / int64 destinations (backward): 8x below E x H x C here.
    assert fused_fwd < edge_feature_bytes / 6, fused_fwd
    assert fused_bwd < edge_feature_bytes / 6, fused_bwd


class _LivePeak(TorchDispatchMode):
    """Peak bytes of the storages ATen ops create while active and that are still alive
    (views of the storages of ``existing`` tensors, e.g. a slice of the CSR, are not new)."""

    def __init__(self, *existing):
        super().__init__()
        self.live, self.bytes, self.peak = {}, 0, 0
        self.old = {t.untyped_storage().data_ptr() for t in existing}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [k for k, (ref, _) in self.live.items() if ref() is None]:
            self.bytes -= self.live.pop(key)[1]
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if key not in self.live and key not in self.old and st.nbytes():
                    self.live[st.data_ptr()] = (weakref.ref(st), st.nbytes())
                    self.bytes += st.nbytes()
        self.peak = max(self.peak, self.bytes)
        return out


def _edge_stage_peaks(attention, node_inputs, lean: bool, n=2000, e=100_000, heads=2, channels=8):
    """Live-byte peaks of one edge stage's forward and backward (attention dropout on, chunks
    of 64 KiB) on a random graph: ``attention(*node_inputs, rowptr, col)``; ``node_inputs``
    are shapes. Returns (forward peak, backward peak, E x H fp32 bytes, chunk bytes, one
    N x H x C fp32 tensor's bytes)."""
    torch.manual_seed(3)
    rowptr, col = _csr(torch.randint(0, n, (e,)), torch.randint(0, n, (e,)), n)
    tensors = [torch.randn(*shape(n, heads, channels), requires_grad=True) for shape in node_inputs]
    chunk_bytes = 64 * 1024
    existing = (rowptr, col, *tensors)
    with _LivePeak(*existing) as fwd:
        out = attention(*tensors, rowptr, col, dropout=0.3, chunk_bytes=chunk_bytes)
    grad = torch.randn_like(out)
    with contextlib.ExitStack() as stack:
        if lean:
            stack.enter_context(lean_backward())
        with _LivePeak(*existing, out, grad) as bwd:
            out.backward(grad)
    return fwd.peak, bwd.peak, e * heads * 4, chunk_bytes, n * heads * channels * 4


def _features(n, h, c):
    return (n, h, c)


@pytest.mark.parametrize("lean", [False, True])
def test_gatv2_attention_holds_its_logits_and_one_more_edge_by_head_tensor(lean):
    """GATv2's logits cost a gather each: they are kept whole (E x H) and the rest made a chunk
    at a time. At once: the logits, the dropout draw (fp32 for a moment, then a bool mask), in
    backward one more E x H tensor. About eight E x H and an E-long int64 before."""
    fwd, bwd, edge_by_head, chunk, node = _edge_stage_peaks(
        sgatv2.gatv2_attention, [_features, _features, lambda n, h, c: (1, h, c)], lean
    )
    assert fwd <= 2.25 * edge_by_head + 4 * chunk + 2 * node, (fwd, edge_by_head)
    assert bwd <= 2.5 * edge_by_head + 4 * chunk + 4 * node, (bwd, edge_by_head)


@pytest.mark.parametrize("lean", [False, True])
def test_gat_attention_holds_one_edge_by_head_tensor(lean):
    """GAT's edge stage makes every edge-level quantity a chunk at a time from node-level
    ones: what it holds at once is the dropout draw (stock's fp32 noise for a moment, then a
    bool keep-mask), in backward the coefficients' gradient (fp32, E x H) and chunks. It held
    about eight fp32 E x H tensors and an int64 per edge before, and a GAT at ogbn-products'
    size did not fit 16 GiB."""
    fwd, bwd, edge_by_head, chunk, node = _edge_stage_peaks(
        sgat.gat_attention, [_features, lambda n, h, c: (n, h), lambda n, h, c: (n, h)], lean
    )
    # chunk temporaries: chunk x H x C (bounded by chunk_bytes, a few at once) and, in the
    # softmax passes, chunk * C x H; node level: the output or x's gradient and N x H sums
    assert fwd <= 1.25 * edge_by_head + 4 * chunk + 2 * node, (fwd, edge_by_head)
    assert bwd <= 1.25 * edge_by_head + 4 * chunk + 3 * node, (bwd, edge_by_head)


# ---------------------------------------------------------------------------- quantized


def _quantized_grads(model, x, ei, y, steps, **kwargs):
    """FP32 gradient, then ``steps`` gradients under compression (a fresh rounding each)."""

    def grads():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x, ei), y).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    ref = grads()
    ctl = compress_gnn(model, **kwargs)
    try:
        got = []
        for _ in range(steps):
            got.append(grads())
            ctl.iterate()
        tensors = ctl.stats()["tensors"]
    finally:
        ctl.remove()
    return ref, got, tensors


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("conv_cls", [GATConv, GATv2Conv])
def test_quantized_4bit_single_layer(conv_cls):
    """Only the projected features are quantized here (x is the input, the logits are
    lossless). GAT's backward is linear in them, so its gradient is unbiased: the mean over
    16 roundings is 4x closer. GATv2 recomputes its logits from them (nonlinear): biased."""
    torch.manual_seed(9)
    n, e = 400, 3000
    ei, x, y = torch.randint(0, n, (2, e)), torch.randn(n, 32), torch.randint(0, 6, (n,))
    model = _FirstColumns(conv_cls(32, 16, heads=3), 6)
    steps = 16 if conv_cls is GATConv else 1
    ref, got, tensors = _quantized_grads(model, x, ei, y, steps, bits=4)
    assert [r["bits"] for r in tensors if r["kind"] == "activation" and r["bits"]] == [4] * (
        1 if conv_cls is GATConv else 2
    )
    one, mean = _rel(got[0], ref), _rel(torch.stack(got).mean(0), ref)
    assert 0 < one < (0.1 if conv_cls is GATConv else 0.25), one
    if conv_cls is GATConv:
        assert mean < 0.45 * one, (one, mean)


@pytest.mark.parametrize("device", DEVICES)
def test_quantized_gat_gradient_is_unbiased_per_parameter(device):
    """Every parameter's 2-bit gradient averages to the exact one over rounding seeds: the
    statistic R of tests/benchmarks/test_scale_deep.py per parameter tensor (about 1 when
    unbiased; measured 0.3-1.3 here). When the node logits came from the quantized projection
    itself, att_src's R was 50-150 on graphs like this one (see gact_graph/sparse/gat.py).
    On CUDA the edge stage runs on the fused Triton kernels (`gact_graph.kernels.gat_edge`)."""
    torch.manual_seed(0)
    n = 4000
    ei, x, y = torch.randint(0, n, (2, 2 * n)), torch.randn(n, 16), torch.randint(0, 4, (n,))
    ei, x, y = ei.to(device), x.to(device), y.to(device)
    model = _FirstColumns(GATConv(16, 2, heads=4), 4).to(device)
    ref, got, _ = _quantized_grads(model, x, ei, y, 8, bits=2, adaptive=False, min_numel=0)
    names, sizes = zip(*[(name, p.numel()) for name, p in model.named_parameters()])
    ref = dict(zip(names, ref.split(sizes)))
    got = [dict(zip(names, g.split(sizes))) for g in got]
    ratios = {}
    for name in ("conv.att_src", "conv.att_dst", "conv.lin.weight"):
        (ratios[name],), _ = _bias_stats([ref[name]], [[g[name]] for g in got])
    assert all(r < 6 for r in ratios.values()), ratios


def test_quantized_4bit_three_layer_gat():
    torch.manual_seed(9)
    n, e = 400, 3000
    ei, x, y = torch.randint(0, n, (2, e)), torch.randn(n, 32), torch.randint(0, 6, (n,))
    model = _GAT3(32, 16, 6, heads=3)
    ref, got, tensors = _quantized_grads(model, x, ei, y, 1, bits=4)
    assert any(r["bits"] == 4 for r in tensors)
    # ELU and the linear layers' inputs are quantized too (generic path): ~7-10% here.
    assert 0 < _rel(got[0], ref) < 0.15


# ---------------------------------------------------------------------------- CUDA


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("conv_cls", [GATConv, GATv2Conv])
def test_device_lossless_matches_pyg(conv_cls, device):
    """The same body on every available device (CPU in CI)."""
    torch.manual_seed(11)
    ei = _graph("self_loops").to(device)
    x = torch.randn(60, 12, device=device)
    conv = _randomize(conv_cls(12, 5, heads=3)).to(device)
    stock, fused, paths = _stock_vs_fused(conv, x, ei)
    assert paths["<root>"] == "sparse-fused"
    _assert_same_run(stock, fused)


@pytest.mark.parametrize("conv_cls", [GATConv, GATv2Conv])
def test_cpu_autocast_bf16_matches_pyg(conv_cls):
    """bf16 projected features, fp32 attention: same output dtype as PyG, values close."""
    torch.manual_seed(12)
    ei, x = _graph("duplicates"), torch.randn(60, 12)
    conv = _randomize(conv_cls(12, 8, heads=2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stock = conv(x, ei)
        ctl = _compress(conv, bits=None)
        try:
            fused = conv(x, ei)
            fused.float().sum().backward()
            assert ctl.module_paths["<root>"] == "sparse-fused"
        finally:
            ctl.remove()
    assert fused.dtype == stock.dtype
    torch.testing.assert_close(fused.float(), stock.float(), rtol=2e-2, atol=2e-2)


def test_source_and_destination_logits_share_one_matmul():
    # one matmul for both node logits: backward dequantizes the layer's input once for them
    # and forms one N x F_in gradient (apart: twice, and a sum of the two)
    torch.manual_seed(0)
    n, f_in, heads, channels = 300, 24, 3, 8
    x = torch.randn(n, f_in, requires_grad=True)
    ei = torch.randint(0, n, (2, 6 * n))
    conv = GATConv(f_in, channels, heads=heads)
    ref = GATConv(f_in, channels, heads=heads)
    ref.load_state_dict(conv.state_dict())
    ctl = compress_gnn(conv, bits=8, adaptive=False)
    out = conv(x, ei)
    assert "sparse-fused" in ctl.module_paths.values()
    records = ctl.stats()["tensors"]
    (inp,) = [r for r in records if tuple(r["shape"]) == (n, f_in)]
    assert inp["uses"] == 2  # the projection and the joint logits
    joint = {(2 * heads, f_in), (f_in, 2 * heads)}  # W^T att of both sides (saved transposed)
    assert any(tuple(r["shape"]) in joint for r in records)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    grad, x.grad = x.grad, None
    (ref(x, ei) * g).sum().backward()
    # stock's gradients within 8-bit rounding noise (about 1 % of the norm)
    for mine, stock in [(grad, x.grad)] + [
        (p.grad, q.grad) for p, q in zip(conv.parameters(), ref.parameters())
    ]:
        assert (mine - stock).norm() <= 0.02 * stock.norm()
    ctl.remove()


@pytest.mark.parametrize("conv_cls, bound", [(GATConv, 4.0), (GATv2Conv, 5.0)])
def test_forward_frees_the_projection_before_the_sums(conv_cls, bound):
    """A fused GAT layer's forward drops its fp32 projection(s) once saved (compressed) and
    adds the residual and the bias into the edge stage's output in place: at its widest it
    holds the residual's projection, the projection(s) and the aggregation (GATv2 also its
    whole logits), plus the quantizer's blocks and the edge chunks, not also their sum
    (3.7 and 4.7 N x H x C here; 4.3 and 5.3 before)."""
    torch.manual_seed(0)
    n, heads, channels = 10_000, 4, 48
    x, ei = torch.randn(n, 32), torch.randint(0, n, (2, 3 * n))
    conv = conv_cls(32, channels, heads=heads, residual=True, dropout=0.2)
    ctl = compress_gnn(conv, bits=2, adaptive=False, chunk_bytes=2**21)
    conv(x, ei)  # the adjacency is built and cached
    with _LivePeak(x, ei) as fwd:
        conv(x, ei)
    assert ctl.module_paths["<root>"] == "sparse-fused"
    assert fwd.peak < bound * n * heads * channels * 4, fwd.peak / (n * heads * channels * 4)
    ctl.remove()
