"""The hook-based controller: what it stores, dedup, exactness, lifecycle."""

import subprocess
import sys

import pytest
import torch
from torch import nn
from torch_geometric.nn import GCNConv

from gact_graph import CompressionConfig, Controller, compress_gnn
from gact_graph.core.controller import Stored
from gact_graph.core.quantize import QTensor
from gact_graph.memory import count_saved_bytes
from tests.toy_models import LinearGCN, ReluGCN


def _mlp(seed=0, d_in=64, hidden=96, d_out=8):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(d_in, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.Tanh(),
        nn.Linear(hidden, d_out),
    )


def _grads(model, fn):
    model.zero_grad(set_to_none=True)
    fn().backward()
    return [p.grad.clone() for p in model.parameters()]


def _rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _graph(n=300, e=1500, f=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, e), generator=g)
    return torch.randn(n, f, generator=g), ei


def test_parameters_are_never_quantized_and_kept_by_reference():
    model = _mlp()
    x = torch.randn(4096, 64)
    seen = []
    ctl = compress_gnn(model, bits=2, pointwise=False, min_numel=0)
    orig_pack = ctl._pack

    def spy(t):
        s = orig_pack(t)
        seen.append(s)
        return s

    ctl._pack = spy
    model(x).sum().backward()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    param_stored = [s for s in seen if s.kind == "param"]
    assert param_stored, "linear layers save their weights"
    for s in param_stored:
        assert isinstance(s.payload, torch.Tensor) and s.bits is None
        assert s.payload.untyped_storage().data_ptr() in params
    quantized = [s for s in seen if isinstance(s.payload, QTensor)]
    assert quantized and all(s.kind == "activation" for s in quantized)
    # the model input is held by the caller: kept by reference, never quantized
    assert any(s.kind == "input" and s.payload is x for s in seen)
    ctl.remove()


def test_param_with_same_values_as_activation_is_still_told_apart_by_storage():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x):
            return self.lin(x + 0.0)  # x + 0.0: an activation with the weight's exact values

    m = M()
    x = m.lin.weight.detach().clone().requires_grad_(True)
    with compress_gnn(m, bits=2, min_numel=0) as ctl:
        m(x).sum().backward()
        recs = ctl.stats()["tensors"]
    assert {r["kind"] for r in recs} == {"param", "activation"}
    assert [r["bits"] for r in recs if r["kind"] == "activation"] == [2]


def test_bits8_gradients_match_fp32_mlp():
    model = _mlp()
    x, target = torch.randn(4096, 64), torch.randn(4096, 8)

    def loss():
        return nn.functional.mse_loss(model(x), target)

    ref = _grads(model, loss)
    with compress_gnn(model, bits=8, min_numel=0):
        got = _grads(model, loss)
    for g, r in zip(got, ref):
        assert _rel_err(g, r) < 2e-2


def test_bits8_gradients_match_fp32_pyg_gcn():
    torch.manual_seed(0)
    x, ei = _graph(n=2000, e=10000, f=64)
    model = ReluGCN(64, 64, 7)
    y = torch.randint(0, 7, (2000,))

    def loss():
        return nn.functional.cross_entropy(model(x, ei), y)

    ref = _grads(model, loss)
    with compress_gnn(model, bits=8, min_numel=0) as ctl:
        got = _grads(model, loss)
        assert ctl.stats()["by_kind"]["activation"]["count"] > 0
    for g, r in zip(got, ref):
        assert _rel_err(g, r) < 3e-2


def test_lossless_mode_is_bit_identical():
    torch.manual_seed(0)
    x, ei = _graph()
    model = ReluGCN(32, 32, 5)

    def loss():
        return model(x, ei).square().mean()

    ref = _grads(model, loss)
    for bits in (None, 32):
        # generic hooks alone: the very tensors autograd saved come back, bit for bit
        with compress_gnn(model, bits=bits, sparse=False, pointwise=False):
            got = _grads(model, loss)
        for g, r in zip(got, ref):
            assert torch.equal(g, r)
        # graph-aware paths on: same math in another summation order
        with compress_gnn(model, bits=bits):
            got = _grads(model, loss)
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def _mean_grad_error(model, loss, ref, n, bits=2):
    ctl = compress_gnn(model, bits=bits, min_numel=0, pointwise=False, sparse=False)
    acc = [torch.zeros_like(r) for r in ref]
    for _ in range(n):
        for a, g in zip(acc, _grads(model, loss)):
            a += g
        ctl.iterate()  # new step -> new seeds
    ctl.remove()
    return max(_rel_err(a / n, r) for a, r in zip(acc, ref))


def _errors_of_the_mean(model_class) -> tuple[float, float]:
    """Relative error of the mean 2-bit gradient over 16 and over 144 steps, against the
    exact gradient, of a 3-layer ``model_class`` regressing random targets on one graph."""
    torch.manual_seed(0)
    x, ei = _graph(n=256, e=1024, f=32)
    model = model_class(32, 32, 4)
    target = torch.randn(256, 4)

    def loss():
        return nn.functional.mse_loss(model(x, ei), target)

    ref = _grads(model, loss)
    return _mean_grad_error(model, loss, ref, 16), _mean_grad_error(model, loss, ref, 144)


def test_bits2_gradient_is_unbiased_when_saved_tensors_enter_backward_linearly():
    e_small, e_large = _errors_of_the_mean(LinearGCN)
    # Unbiased: the error of the mean shrinks like 1/sqrt(n) (x3 less for 9x more samples).
    assert e_large < e_small / 2.2, (e_small, e_large)


def test_bits2_quantized_relu_output_biases_the_gradient():
    """GACT's footnote 1: ReLU backward reads the sign of its saved *output*; quantizing it
    (without the 1-bit mask path) flips small positives to zero, a bias that averaging does
    not remove. Measured here so the pointwise path has a number to remove."""
    e_small, e_large = _errors_of_the_mean(ReluGCN)
    # The error plateaus at the bias instead of shrinking 3x.
    print(f"quantized-ReLU gradient bias (relative, mean of 144): {e_large:.4f}")
    assert e_large > e_small / 2.2, (e_small, e_large)


def test_dedup_stores_one_copy_of_a_tensor_saved_twice():
    class Square(nn.Module):
        def forward(self, x):
            h = x.exp()  # exp saves its output h
            return h * h  # mul saves h twice: same storage, view and version

    m = Square()
    x = torch.randn(512, 64, requires_grad=True)
    with compress_gnn(m, bits=4, min_numel=0) as ctl:
        y = m(x)
        st = ctl.stats()
        acts = [r for r in st["tensors"] if r["kind"] == "activation"]
        assert len(acts) == 1 and acts[0]["uses"] == 3
        y.sum().backward()
    # dequantized gradient of exp(x)^2 is 2 exp(2x) up to 4-bit error
    assert _rel_err(x.grad, 2 * torch.exp(2 * x.detach())) < 0.2


def test_freed_storage_is_not_mistaken_for_an_alias():
    """Same shape/stride at a reused address must not hit the dedup cache."""

    class TwoTemps(nn.Module):
        def forward(self, x):
            out = 0
            for k in range(4):
                t = x * float(k + 1)
                out = out + t.sin()  # sin saves t; t is freed at next iteration
            return out

    m = TwoTemps()
    x = torch.randn(256, 64, requires_grad=True)
    with compress_gnn(m, bits=8, min_numel=0) as ctl:
        m(x).sum().backward()
        acts = [r for r in ctl.stats()["tensors"] if r["kind"] == "activation"]
        assert len(acts) == 4
    ref = sum((k + 1) * torch.cos((k + 1) * x.detach()) for k in range(4))
    # 8-bit rounding of sin's input (range up to 24) costs ~2%; a false alias would be O(1).
    assert _rel_err(x.grad, ref) < 0.05


def test_stats_are_exact():
    lin = nn.Linear(300, 16)
    x = torch.randn(1000, 300)
    h = torch.randn(1000, 300, requires_grad=True)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, a):
            return self.lin(a * 2.0)

    m = M()
    with compress_gnn(m, bits=2, min_numel=0) as ctl:
        m(h).sum().backward()
        st = ctl.stats()
    act = [r for r in st["tensors"] if r["kind"] == "activation"]
    assert len(act) == 1
    from gact_graph.core.quantize import quantize

    q = quantize(torch.randn(1000, 300), 2)
    assert act[0]["orig_bytes"] == 1000 * 300 * 4
    assert act[0]["stored_bytes"] == q.nbytes
    assert st["total"]["orig_bytes"] == 1000 * 300 * 4
    assert st["total"]["stored_bytes"] == q.nbytes
    assert st["live_stored_bytes"] == 0  # backward released it
    del x


def test_masks_packed_and_indices_lossless():
    class M(nn.Module):
        def forward(self, x, idx):
            idx = idx.flip(0)  # an index made inside forward (the input itself is 'input')
            g = x.index_select(0, idx)  # saves idx (int64)
            return g.masked_fill(g > 0.5, 0.0)  # saves a bool mask

    m = M()
    x = torch.randn(1000, 64, requires_grad=True)
    idx = torch.randint(0, 1000, (5000,))
    with compress_gnn(m, bits=2) as ctl:
        y = m(x, idx)
        st = ctl.stats()
        y.sum().backward()
    idx = idx.flip(0)
    assert st["by_kind"]["index"]["count"] == 1
    assert st["by_kind"]["index"]["stored_bytes"] == 5000 * 8
    assert st["by_kind"]["mask"]["count"] == 1
    assert st["by_kind"]["mask"]["stored_bytes"] == (5000 * 64 + 7) // 8
    g = x.detach().index_select(0, idx)
    expected = torch.zeros_like(x).index_add_(0, idx, (g <= 0.5).float())
    assert torch.equal(x.grad, expected)


def test_retain_graph_two_backwards_identical():
    model = _mlp()
    x = torch.randn(2048, 64)
    with compress_gnn(model, bits=2, min_numel=0):
        out = model(x).square().mean()
        out.backward(retain_graph=True)
        g1 = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        out.backward()
        g2 = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_no_grad_and_eval_cost_nothing_and_keep_training_stats():
    model = _mlp()
    x = torch.randn(2048, 64)
    with compress_gnn(model, bits=2) as ctl:
        model(x).sum().backward()
        before = ctl.stats()["total"]
        with torch.no_grad():
            model(x)
        model.eval()
        with torch.no_grad():
            model(x)
        assert ctl.stats()["total"] == before


def test_autocast_bf16_activations():
    model = _mlp()
    x, target = torch.randn(2048, 64), torch.randn(2048, 8)

    def loss():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        return nn.functional.mse_loss(out.float(), target)

    ref = _grads(model, loss)
    with compress_gnn(model, bits=8, min_numel=0) as ctl:
        got = _grads(model, loss)
        st = ctl.stats()
    assert any(r["dtype"] == "bfloat16" and r["bits"] == 8 for r in st["tensors"])
    # autocast's bf16 weight copies count as parameters, never quantized
    assert all(r["bits"] is None for r in st["tensors"] if r["kind"] == "param")
    for g, r in zip(got, ref):
        assert _rel_err(g, r) < 5e-2


def test_inplace_change_of_a_referenced_saved_tensor_raises():
    lin = nn.Linear(8, 8)
    with compress_gnn(lin, bits=2):
        x = torch.randn(4, 8)
        y = lin(x)
        x.add_(1.0)  # the input is kept by reference: its change must not go unnoticed
        with pytest.raises(RuntimeError, match="inplace"):
            y.sum().backward()


def test_double_backward_through_quantized_tensor_raises():
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    x = torch.randn(512, 64, requires_grad=True)
    with compress_gnn(model, bits=4, min_numel=0):
        y = model(x).sum()
        with pytest.raises(RuntimeError, match="bits=None, pointwise=False, sparse=False"):
            torch.autograd.grad(y, x, create_graph=True)


class _Square(torch.autograd.Function):
    """x * x whose backward reads its saved input with grad mode on or off."""

    @staticmethod
    def forward(ctx, x, grad_on):
        ctx.save_for_backward(x)
        ctx.grad_on = grad_on
        return x * x

    @staticmethod
    def backward(ctx, g):
        with torch.set_grad_enabled(ctx.grad_on):
            (x,) = ctx.saved_tensors
            return 2 * x * g, None


class _SquareNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 32)
        self.grad_on = False

    def forward(self, x):
        return _Square.apply(self.lin(x), self.grad_on)


def test_custom_backward_under_enable_grad_reads_compressed_tensors():
    """A backward that merely runs with grad on (no create_graph) reads a compressed tensor as
    one with grad off does; create_graph, or a retained graph read with grad on, is refused."""
    x = torch.randn(64, 16)
    model = _SquareNet()

    def step(grad_on, **kw):
        model.zero_grad(set_to_none=True)
        model.grad_on = grad_on
        out = model(x).sum()
        if kw:
            return torch.autograd.grad(out, list(model.parameters()), **kw)
        out.backward()
        return [p.grad.clone() for p in model.parameters()]

    with compress_gnn(model, bits=8, adaptive=False, min_numel=0) as ctl:
        off, on = step(False), step(True)
        assert ctl.stats()["by_kind"]["activation"]["count"] == 1
        for a, b in zip(off, on):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for kw in ({"create_graph": True}, {"retain_graph": True}):
            with pytest.raises(RuntimeError, match="bits=None, pointwise=False, sparse=False"):
                step(True, **kw)


def test_remove_restores_model_exactly():
    torch.manual_seed(0)
    x, ei = _graph()
    model = ReluGCN(32, 32, 5)
    hooks_before = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
    sd_before = {k: v.clone() for k, v in model.state_dict().items()}
    ctl = compress_gnn(model, bits=2)
    model(x, ei).sum().backward()
    ctl.remove()
    ctl.remove()  # idempotent
    assert [
        (len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()
    ] == hooks_before
    assert not hasattr(model, "_gact_graph_controller")
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd_before[k])
    # and a later forward saves plain tensors again
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(type(t)) or t, lambda t: t):
        model(x, ei)
    assert all(t is torch.Tensor or t is nn.Parameter for t in seen)


def test_exception_in_forward_leaves_no_hooks_active():
    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            self.lin(x).exp()
            raise ValueError("boom")

    m = Boom()
    ctl = compress_gnn(m, bits=2, min_numel=0)
    with pytest.raises(ValueError):
        m(torch.randn(4, 8, requires_grad=True))
    seen = []
    y = torch.randn(4, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        y.exp()
    assert seen and all(isinstance(t, torch.Tensor) and not isinstance(t, Stored) for t in seen)
    ctl.remove()


def test_compressing_twice_is_an_error_and_context_manager_removes():
    model = _mlp()
    with compress_gnn(model, bits=2):
        with pytest.raises(RuntimeError, match="already compressed"):
            compress_gnn(model, bits=2)
    compress_gnn(model, bits=4).remove()


def test_state_dict_round_trip():
    model = _mlp()
    ctl = compress_gnn(model, bits=4)
    for _ in range(3):
        ctl.iterate()
    ctl.plan["0#0"] = 8
    state = ctl.state_dict()
    ctl.remove()
    ctl2 = Controller(model, CompressionConfig(bits=4))
    ctl2.load_state_dict(state)
    assert ctl2.step == 3 and ctl2.plan == {"0#0": 8}
    with pytest.raises(KeyError):
        ctl2.load_state_dict({"step": 1})
    ctl2.remove()


def test_config_validation():
    with pytest.raises(ValueError, match="fixed bits"):
        compress_gnn(_mlp(), bits=3, adaptive=False)
    with pytest.raises(ValueError, match="average budget"):
        compress_gnn(_mlp(), bits=12)  # adaptive (the default): an average in [1, 8]
    with pytest.raises(ValueError, match="group_size"):
        compress_gnn(_mlp(), bits=2, group_size=100)
    with pytest.raises(ValueError, match="opt_level"):
        compress_gnn(_mlp(), bits=2, opt_level="L9")
    with pytest.raises(TypeError):
        compress_gnn("not a model")
    assert CompressionConfig(bits=32).bits is None


def test_stock_count_matches_compressed_orig_bytes():
    torch.manual_seed(0)
    x, ei = _graph(n=3000, e=15000, f=64)
    model = ReluGCN(64, 64, 5)
    stock = count_saved_bytes(lambda: model(x, ei), model)
    with compress_gnn(model, bits=2, sparse=False, pointwise=False) as ctl:
        model(x, ei)
        st = ctl.stats()
    assert st["total"]["orig_bytes"] == stock
    act = st["by_kind"]["activation"]
    assert act["stored_bytes"] < act["orig_bytes"] / 10  # 2 bits + bf16 group metadata


def test_report_lists_modules():
    torch.manual_seed(0)
    x, ei = _graph()
    model = ReluGCN(32, 32, 5)
    with compress_gnn(model, bits=2) as ctl:
        model(x, ei)
        rep = ctl.report()
    assert "convs.0" in rep and "total" in rep


def test_import_does_not_initialize_cuda():
    # (torch_geometric itself imports triton when it is installed; our own modules' laziness
    # is tested in test_kernels_quantize.py)
    code = (
        "import torch, gact_graph, gact_graph.models, gact_graph.datasets;"
        "assert not torch.cuda.is_initialized()"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("layout", ["coo", "csr", "csc"])
def test_sparse_saved_tensors_count_their_index_and_value_bytes(layout):
    # numel() of a sparse tensor is its dense size: 100k x 100k would count as 40 GB
    from gact_graph.core.saved import view_bytes
    from gact_graph.memory import saved_bytes_stats

    n, e = 100_000, 500_000
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, n, (2, e), generator=g)
    adj = torch.sparse_coo_tensor(idx, torch.rand(e, generator=g), (n, n)).coalesce()
    adj = {"coo": adj, "csr": adj.to_sparse_csr(), "csc": adj.to_sparse_csc()}[layout]
    nnz = adj._nnz()
    idx_bytes = {"coo": 2 * nnz * 8, "csr": (n + 1) * 8 + nnz * 8, "csc": (n + 1) * 8 + nnz * 8}
    assert view_bytes(adj) == idx_bytes[layout] + nnz * 4

    class Prop(nn.Module):
        def forward(self, x):
            return torch.sparse.mm(adj, x) if layout == "coo" else adj @ x

    x = torch.randn(n, 4, requires_grad=True)
    stats = saved_bytes_stats(Prop(), lambda: Prop()(x * 1.0))
    assert stats["total"]["orig_bytes"] < 10 * view_bytes(adj) + x.numel() * 4 * 4


class _Interrupted(nn.Module):
    """Stops its forward the way Ctrl-C does, after ops that saved tensors and a pointwise op."""

    def __init__(self, exc):
        super().__init__()
        self.lin, self.exc = nn.Linear(64, 64), exc

    def forward(self, x):
        torch.relu(self.lin(x))  # saves tensors and enters the pointwise mode
        raise self.exc


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(1), RuntimeError("boom")])
def test_base_exception_in_forward_leaves_no_hooks_behind(exc):
    model = nn.Sequential(nn.Linear(64, 64), _Interrupted(exc))
    ctl = compress_gnn(model, bits=2, min_numel=0)
    with pytest.raises(type(exc)):
        model(torch.randn(100, 64))
    assert not torch.overrides._get_current_function_mode_stack()  # pointwise mode left
    # another, never compressed model trains exactly: no saved-tensor hook is left either
    other = _mlp(seed=1)
    x = torch.randn(50, 64)
    other(x).sum().backward()
    after_interrupt = other[0].weight.grad.clone()
    other.zero_grad()
    ctl.remove()
    other(x).sum().backward()
    assert torch.equal(after_interrupt, other[0].weight.grad)
    assert "forward" not in model.__dict__


class _Scaled(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale, self.lin = scale, nn.Linear(8, 4)

    def forward(self, x):
        return self.lin(x * self.scale)  # the Linear saves its input: ~1e300


def test_float64_activation_beyond_fp32_range_is_kept_and_warned_about():
    model = _Scaled(1e300).double()
    ctl = compress_gnn(model, bits=2, adaptive=False, min_numel=0, pointwise=False)
    x = torch.randn(100, 8, dtype=torch.float64)
    with pytest.warns(UserWarning, match="beyond fp32's range"):
        model(x).sum().backward()
    kept = [r for r in ctl.stats()["tensors"] if r["kind"] == "activation" and r["bits"] is None]
    assert kept
    assert torch.isfinite(model.lin.weight.grad).all()
    ctl.remove()


def test_a_module_shared_by_two_models_is_compressed_by_one_controller_at_a_time():
    shared = GCNConv(16, 16)
    a = nn.ModuleList([shared, nn.Linear(16, 4)])
    b = nn.ModuleList([nn.Linear(16, 16), shared])
    ctl_a = compress_gnn(a, bits=2)
    with pytest.raises(RuntimeError, match=r"module '1' \(GCNConv\) is part of another"):
        compress_gnn(b, bits=2)
    assert "forward" in shared.__dict__  # a's patch only, untouched by the refused attempt
    ctl_a.remove()
    assert "forward" not in shared.__dict__
    ctl_b = compress_gnn(b, bits=2)  # free again once a's controller is gone
    ctl_b.remove()
    assert "forward" not in shared.__dict__


def test_autocast_weight_copies_are_parameters_not_quantized():
    """Under autocast F.linear saves the bf16 copy of its weight, transposed. It is a
    parameter: quantizing it put 2-bit noise into every input gradient below (and crashed
    the reference quantizer on square weights)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 8))  # fmt: skip
    x = torch.randn(500, 64)
    ctl = compress_gnn(model, bits=2, adaptive=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    rows = ctl.stats()["tensors"]
    weights = [r for r in rows if tuple(r["shape"]) in ((256, 256), (64, 256), (256, 8))]
    assert weights and all(r["kind"] == "param" and r["bits"] is None for r in weights), rows
    out.float().square().mean().backward()
    ctl.remove()
