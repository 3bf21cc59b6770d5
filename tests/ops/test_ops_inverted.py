"""ELU, GELU, SiLU keep their derivative f'(x) (in-place ELU: its output plus a 1-bit branch
indicator): stock's gradient without rounding, an unbiased one with it, and the output free to
change in place as stock allows."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gact_graph.ops.inverted as I
from gact_graph import compress_gnn
from gact_graph.memory import saved_bytes_stats
from gact_graph.ops import PointwiseMode, install_pointwise_ops
from tests.devices import DEVICES

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
EPS = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8,
       torch.float64: 2.0**-53}  # fmt: skip

KEEP_DERIVATIVE = {
    "elu": lambda t: F.elu(t),
    "elu(0.3)": lambda t: F.elu(t, 0.3),
    "elu(-0.5)": lambda t: F.elu(t, -0.5),
    "nn.ELU": nn.ELU(1.7),
    "gelu": lambda t: F.gelu(t),
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "nn.GELU": nn.GELU(),
    "silu": F.silu,
    "silu_inplace": lambda t: F.silu(t * 1, inplace=True),
    "nn.SiLU": nn.SiLU(),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def _sub(dtype):
    """Spacing of subnormals: relative bounds stop working there."""
    return 4 * torch.finfo(dtype).smallest_normal * EPS[dtype]


def _run(op, x, grad, use_mode):
    saved = []
    mode = PointwiseMode()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        if use_mode:
            with mode:
                y = op(x)
        else:
            y = op(x)
    (g,) = torch.autograd.grad(y, x, grad)
    return y, g, saved, mode.counts


def _x(shape, dtype, device="cpu", seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype=dtype, device=device).requires_grad_()


# ---------------------------------------------------------------------- the derivative kept
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(KEEP_DERIVATIVE))
def test_derivative_kept_gives_stocks_gradient(name, dtype, device):
    """Forward bit for bit; gradient ``grad * f'(x)`` with ``f'(x)`` rounded once to the
    input's dtype: stock's within a rounding or two (stock rounds the product once); one
    tensor kept, the derivative, the input's size and dtype, not on the output's storage."""
    x = _x((517, 263), dtype, device, seed=4)
    grad = torch.randn_like(x)
    y0, g0, _, _ = _run(KEEP_DERIVATIVE[name], x, grad, use_mode=False)
    y1, g1, saved, counts = _run(KEEP_DERIVATIVE[name], x, grad, use_mode=True)
    assert sum(counts.values()) == 1
    assert torch.equal(y0, y1)
    bound = g0.abs().double() * 4 * EPS[dtype] + _sub(dtype)
    assert ((g1.double() - g0.double()).abs() <= bound).all()
    assert [(t.dtype, t.shape) for t in saved] == [(dtype, x.shape)]
    assert saved[0].untyped_storage().data_ptr() != y1.untyped_storage().data_ptr()


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu"])
def test_derivative_kept_at_4_bits_gives_an_unbiased_gradient(act):
    """The mean gradient over rounding seeds converges to stock's: its error stays at the noise
    floor (the spread of one seed's gradient over sqrt(seeds)). Output kept instead, with a
    branch bit, the derivative read off a rounded output (f'(f^-1(y)), square-root-like at
    the minimum) was biased: 2.4x the floor for GELU, 2.2x for SiLU at 16 seeds (growing
    like sqrt(seeds)); with the derivative kept 1.0-1.1x."""
    op = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 64)
            self.register_buffer("c", torch.randn(64))

        def forward(self, x):
            return (op[act](self.lin(x)) * self.c).sum()  # only the activation's save is lossy

    torch.manual_seed(0)
    model, x = Model(), torch.randn(64, 16)

    def grads():
        model.zero_grad(set_to_none=True)
        model(x).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    ref, seeds = grads(), 16
    with compress_gnn(model, bits=4, adaptive=False, min_numel=0, sparse=False) as ctl:
        runs = []
        for _ in range(seeds):
            runs.append(grads())
            ctl.iterate()  # the next step's rounding
    runs = torch.stack(runs)
    mean = runs.mean(0)
    floor = ((runs - mean).square().sum(1).mean() / (seeds - 1)).sqrt()
    assert (mean - ref).norm() < 1.5 * floor, ((mean - ref).norm() / floor).item()


class _ChangesItsOutput(nn.Module):
    """``h = act(a(x))`` changed in place by another branch of the model, as a residual does."""

    def __init__(self, act, change):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 64), nn.Linear(16, 64), nn.Linear(64, 4)
        self.act, self.change = act, change

    def forward(self, x):
        h = self.act(self.a(x))
        self.change(h, self.b(x))
        return self.c(h)


def _iadd(h, s):
    h += s


CHANGED = {
    "gelu +=": (F.gelu, _iadd),
    "silu mul_": (F.silu, torch.Tensor.mul_),
    "silu inplace, add_": (lambda t: F.silu(t, inplace=True), torch.Tensor.add_),
    "elu add_": (F.elu, torch.Tensor.add_),
}


@pytest.mark.parametrize("case", list(CHANGED))
def test_output_changed_in_place_trains_as_stock(case):
    """Stock keeps GELU's, SiLU's and out-of-place ELU's input, so the model may change the
    output in place; kept by reference (``bits=None``), a kept output raised there."""
    torch.manual_seed(0)
    model, x = _ChangesItsOutput(*CHANGED[case]), torch.randn(100, 16)

    def grads():
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    ref = grads()
    ctl = compress_gnn(model, bits=None, sparse=False, pointwise=False)
    mode = install_pointwise_ops(ctl)
    got = grads()
    ctl.remove()
    assert sum(mode.counts.values()) == 1
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_inplace_elu_output_changed_in_place_is_refused_as_by_stock():
    """Stock's in-place ELU keeps its output (its input is gone), and so does ours: changing
    that output in place again is refused, as stock refuses it."""
    torch.manual_seed(0)
    model = _ChangesItsOutput(lambda t: F.elu(t, inplace=True), torch.Tensor.add_)
    x = torch.randn(100, 16)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).sum().backward()
    with compress_gnn(model, bits=None, sparse=False):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            model(x).sum().backward()


# ---------------------------------------------------------------------------------- in-place ELU
@pytest.mark.parametrize("dtype", DTYPES[:3])
def test_elu_inplace_bitwise_to_pytorch_inplace(dtype):
    x = _x((7, 129, 33), dtype, seed=1)
    grad = torch.randn_like(x)
    op = lambda t: F.elu(t * 1, 0.7, inplace=True)  # noqa: E731
    y0, g0, _, _ = _run(op, x, grad, use_mode=False)
    y1, g1, saved, counts = _run(op, x, grad, use_mode=True)
    assert counts == {"elu": 1}
    assert torch.equal(y0, y1) and torch.equal(g0, g1)
    assert [t.dtype for t in saved] == [dtype, torch.bool]
    # nn.ELU goes through the same path
    _, g2, _, counts = _run(nn.ELU(0.7, inplace=True), x * 1, grad, use_mode=True)
    assert counts == {"elu": 1}


def test_inplace_elu_negative_alpha_and_float64_double_backward():
    # the indicator comes from x, so alpha <= 0 (y > 0 for x < 0) is still right
    x = _x((300, 40), torch.float64, seed=2)
    grad = torch.randn_like(x)
    for alpha in (-0.5, 0.0, 1.0):
        ref = torch.ops.aten.elu_backward(grad, alpha, 1, 1, False, x.detach())
        _, g1, _, _ = _run(lambda t, a=alpha: F.elu(t * 1, a, inplace=True), x, grad, True)
        torch.testing.assert_close(g1, ref, rtol=1e-13, atol=1e-15)
    # backward is differentiable in y: exact second derivatives
    small = x[:6, :5].detach().requires_grad_()
    torch.autograd.gradcheck(lambda t: I.elu(t * 1, 1.3, inplace=True), (small,))
    torch.autograd.gradgradcheck(lambda t: I.elu(t * 1, 1.3, inplace=True), (small,))


def test_not_intercepted_without_grad():
    mode = PointwiseMode()
    with mode:
        F.silu(torch.randn(10))
        with torch.no_grad():
            F.elu(torch.randn(10, requires_grad=True))
    assert mode.counts == {}


@pytest.mark.parametrize("op", [F.gelu, F.silu, F.elu])
def test_double_backward_through_a_kept_derivative_raises(op):
    x = torch.randn(20, requires_grad=True)
    with PointwiseMode():
        y = op(x)
    with pytest.raises(RuntimeError, match="bits=None, pointwise=False, sparse=False"):
        torch.autograd.grad(y.sum() + x.square().sum(), x, create_graph=True)
    (g,) = torch.autograd.grad(y.sum(), x)  # first-order backward is fine
    assert g.shape == x.shape


# ------------------------------------------------------------------------ in the controller
@pytest.mark.parametrize("act", [nn.ELU(), nn.GELU(), nn.SiLU()], ids=["elu", "gelu", "silu"])
def test_lossless_keeps_what_stock_keeps(act):
    """Without rounding the derivative costs what stock's kept input does, beside the output
    the next layer keeps; no branch indicator."""
    n = 1023
    model = nn.Sequential(nn.Linear(64, 256), act, nn.Linear(256, 8))
    x = torch.randn(n, 64)
    stock = saved_bytes_stats(model, lambda: model(x))
    # stock: the activation's input and its output (the next layer's input), float32 each
    assert stock["total"]["orig_bytes"] == 2 * n * 256 * 4
    with compress_gnn(model, bits=None) as ctl:
        out = model(x)
        st = ctl.stats()
        out.sum().backward()
    assert st["by_kind"]["mask"]["count"] == 0
    assert st["total"]["stored_bytes"] == stock["total"]["orig_bytes"]


def test_bits2_elu_gradient_is_unbiased():
    """ELU's backward, grad * f'(x), is linear in the derivative it keeps: a 2-bit
    stochastically rounded derivative gives an unbiased gradient. Stock ELU saves x and
    evaluates alpha*exp(x_hat), a convex function of the rounded x: biased."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(32, 64)
            self.register_buffer("c", torch.randn(64))

        def forward(self, x):
            return (F.elu(self.lin(x)) * self.c).sum()  # only ELU's save is lossy

    torch.manual_seed(0)
    model, x = Model(), torch.randn(1000, 32) * 2

    def grads():
        model.zero_grad(set_to_none=True)
        model(x).backward()
        return [p.grad.clone() for p in model.parameters()]

    ref = grads()

    def mean_err(n, pointwise):
        ctl = compress_gnn(model, bits=2, min_numel=0, pointwise=pointwise, sparse=False)
        acc = [torch.zeros_like(r) for r in ref]
        for _ in range(n):
            for a, g in zip(acc, grads()):
                a += g
            ctl.iterate()
        ctl.remove()
        return max(((a / n - r).norm() / r.norm()).item() for a, r in zip(acc, ref))

    e_small, e_large = mean_err(4, True), mean_err(64, True)
    # measured: 0.119 (n=4), 0.059 (n=16), 0.029 (n=64)
    assert e_large < e_small / 2.5, (e_small, e_large)
    e_biased = mean_err(16, False)  # measured: 0.141 (4), 0.128 (16), 0.125 (64)
    assert e_biased > 3 * e_large, (e_biased, e_large)


def test_gat_with_elu_lossless_matches_stock():
    """GAT: ELU between layers (its derivative kept), LeakyReLU on the attention logits
    (mask), dropout (regenerated). bits=None: same forward bits, gradients equal up to the
    rounding of ELU's derivative."""
    from gact_graph.models import GAT

    g = torch.Generator().manual_seed(0)
    n = 3000
    x = torch.randn(n, 16, generator=g)
    ei = torch.randint(0, n, (2, 6 * n), generator=g)
    y = torch.randint(0, 5, (n,), generator=g)

    def step(compress):
        torch.manual_seed(0)
        model = GAT(16, 8, 5, num_layers=3, heads=2, dropout=0.5, attn_dropout=0.2)
        ctl = compress_gnn(model, bits=None, sparse=False) if compress else None
        torch.manual_seed(1)
        out = model(x, ei)
        loss = F.cross_entropy(out, y)
        st = ctl.stats() if ctl is not None else None
        loss.backward()
        if ctl is not None:
            ctl.remove()
        return out.detach(), [p.grad for p in model.parameters()], st

    out_ref, ref, _ = step(False)
    out, got, st = step(True)
    assert torch.equal(out, out_ref)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert st["by_kind"]["mask"]["count"] == 3  # the attention's LeakyReLU masks


def test_the_probes_elu_replay_writes_into_its_copy_with_the_same_estimates(monkeypatch):
    """In the sensitivity probe's replay, ELU's backward writes its gradient into the probe's
    noisy copy of its derivative (`scratch`): the estimates (GELU's replay after the network
    too) are those of the backward that makes a new tensor, value for value."""
    from gact_graph.models import GAT
    from gact_graph.policy.sensitivity import probe_sensitivity

    g = torch.Generator().manual_seed(0)
    n = 300
    x = torch.randn(n, 16, generator=g)
    ei = torch.randint(0, n, (2, 6 * n), generator=g)
    y = torch.randint(0, 4, (n,), generator=g)

    class Net(nn.Module):  # GAT (ELU between its layers), then GELU and a linear head
        def __init__(self):
            super().__init__()
            self.gat = GAT(16, 8, 8, num_layers=3, heads=2, dropout=0.0)
            self.head = nn.Linear(8, 4)

        def forward(self, x, ei):
            return self.head(F.gelu(self.gat(x, ei)))

    torch.manual_seed(0)
    model = Net()
    ctl = compress_gnn(model, bits=2, adaptive=False, min_numel=256)

    def step():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x, ei), y).backward()

    step()
    real = I.is_scratch
    taken = []

    def spy(t):
        taken.append(real(t))
        return taken[-1]

    monkeypatch.setattr(I, "is_scratch", spy)
    got = probe_sensitivity(ctl, step, seed=5)
    assert any(taken), taken  # ELU's replays wrote into the copy
    monkeypatch.setattr(I, "is_scratch", lambda t: False)
    dense = probe_sensitivity(ctl, step, seed=5)
    assert set(got) == set(dense) and len(got) >= 5, sorted(got)
    for name in got:
        assert got[name] == dense[name], name
    ctl.remove()
