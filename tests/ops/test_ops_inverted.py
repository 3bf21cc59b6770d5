"""Inverted activations (ELU, GELU, SiLU): save the output plus a 1-bit branch indicator and
rebuild f'(f^-1(y)). ELU exact; GELU/SiLU within the documented error."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gact_graph.ops.inverted as I
from gact_graph import compress_gnn
from gact_graph.memory import saved_bytes_stats
from gact_graph.ops import PointwiseMode
from tests.devices import DEVICES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}

#: documented max |f'(f^-1(y)) - PyTorch's f'(x)| per dtype of y (docs/design.md), with margin
#: over the measured values (float32: 1.1e-4 GELU, 1.1e-4 GELU-tanh, 7.7e-5 SiLU).
MAX_DERIV_ERR = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 2.5e-2}
#: documented mean error (measured float32: 1.1e-7 / 6.3e-8 / 1.5e-7).
MEAN_DERIV_ERR = {torch.float32: 5e-7, torch.float16: 3e-4, torch.bfloat16: 2e-3}

INVERTED = {
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


# ---------------------------------------------------------------------------------- ELU
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("alpha", [1.0, 0.3, 2.5])
def test_elu_matches_pytorch_backward_from_the_output_bitwise(alpha, dtype, device):
    x = _x((1823, 781), dtype, device)
    grad = torch.randn_like(x)
    y, g, saved, counts = _run(lambda t: F.elu(t, alpha), x, grad, use_mode=True)
    assert counts == {"elu": 1}
    assert torch.equal(y, F.elu(x, alpha))
    # PyTorch's own backward from the output (the formula of in-place elu_) -- bit for bit
    ref_from_y = torch.ops.aten.elu_backward(grad, alpha, 1, 1, True, y.detach())
    assert torch.equal(g, ref_from_y)
    # ... and the out-of-place backward (from x: alpha * exp(x)) up to the rounding of y
    _, g_ref, _, _ = _run(lambda t: F.elu(t, alpha), x, grad, use_mode=False)
    eps = EPS[dtype]
    bound = grad.abs().float() * (alpha + 1) * 2 * eps + g_ref.abs().float() * 2 * eps + _sub(dtype)
    assert ((g.float() - g_ref.float()).abs() <= bound).all()
    # saved: the output itself (same storage as what it returns) and a bool indicator
    assert [t.dtype for t in saved] == [dtype, torch.bool]
    assert saved[0].untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
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
    _, g2, _, counts = _run(nn.ELU(0.7), x, grad, use_mode=True)
    assert counts == {"elu": 1}


def test_elu_negative_alpha_and_float64_double_backward():
    # the indicator comes from x, so alpha <= 0 (y > 0 for x < 0) is still right
    x = _x((300, 40), torch.float64, seed=2)
    grad = torch.randn_like(x)
    for alpha in (-0.5, 0.0, 1.0):
        _, g0, _, _ = _run(lambda t, a=alpha: F.elu(t, a), x, grad, use_mode=False)
        _, g1, _, _ = _run(lambda t, a=alpha: F.elu(t, a), x, grad, use_mode=True)
        torch.testing.assert_close(g1, g0, rtol=1e-13, atol=1e-15)
    # backward is differentiable in y: exact second derivatives
    small = x[:6, :5].detach().requires_grad_()
    torch.autograd.gradcheck(lambda t: I.elu(t, 1.3), (small,))
    torch.autograd.gradgradcheck(lambda t: I.elu(t, 1.3), (small,))


# ---------------------------------------------------------------------------------- GELU / SiLU
@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_documented_derivative_error(name, dtype):
    err = I.measure_error(name, dtype, n=200_001)
    assert err["max_abs_err"] < MAX_DERIV_ERR[dtype], err
    assert err["mean_abs_err"] < MEAN_DERIV_ERR[dtype], err
    # far tails too: x in [-100, 100] (y underflows to -0 on the left, f' == 1 on the right)
    wide = I.measure_error(name, dtype, lo=-100.0, hi=100.0, n=200_001)
    assert wide["max_abs_err"] < MAX_DERIV_ERR[dtype], wide


def test_tables_alone_are_float32_accurate():
    # With y exact (float64 -> float32 rounding only at the table), the error away from the
    # minimum's ill-conditioned neighbourhood is at float32 resolution.
    for name, spec in I.INVERTED_SPECS.items():
        x = torch.linspace(-30, 30, 600_001, dtype=torch.float64)
        tb = I._tables(name, x.device)
        far = (x - tb.x_star).abs() > 0.05
        d = I.inverse_derivative(spec.f(x).float(), x >= tb.x_star, name).double()
        assert (d - spec.df(x))[far].abs().max() < 1e-6, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(INVERTED))
@pytest.mark.parametrize(
    "dtype,shape",
    [(torch.float32, (1823, 781)), (torch.float16, (7, 129, 33)), (torch.bfloat16, (7, 129, 33))],
)
def test_gelu_silu_within_documented_error(name, dtype, shape, device):
    x = _x(shape, dtype, device, seed=4)
    grad = torch.randn_like(x)
    y0, g0, _, _ = _run(INVERTED[name], x, grad, use_mode=False)
    y1, g1, saved, counts = _run(INVERTED[name], x, grad, use_mode=True)
    assert sum(counts.values()) == 1
    assert torch.equal(y0, y1)  # forward untouched
    eps = EPS[dtype]
    bound = grad.abs().float() * MAX_DERIV_ERR[dtype] + g0.abs().float() * 2 * eps + _sub(dtype)
    assert ((g1.float() - g0.float()).abs() <= bound).all()
    assert [t.dtype for t in saved] == [dtype, torch.bool]


def test_branch_indicator_decides_near_the_minimum():
    # the same y reached from both sides of the minimum gives derivatives of opposite sign
    for name in ("gelu", "silu"):
        x_star = I._tables(name, torch.device("cpu")).x_star
        x = torch.tensor(
            [x_star - 0.3, x_star + 0.3, x_star - 1.0, x_star + 1.0], requires_grad=True
        )
        op = F.silu if name == "silu" else F.gelu
        _, g0, _, _ = _run(op, x, torch.ones(4), use_mode=False)
        _, g1, _, _ = _run(op, x, torch.ones(4), use_mode=True)
        assert (g0[0::2] < 0).all() and (g0[1::2] > 0).all()
        torch.testing.assert_close(g1, g0, rtol=0, atol=1e-5)


def test_not_intercepted_float64_or_without_grad():
    mode = PointwiseMode()
    with mode:
        F.gelu(torch.randn(10, dtype=torch.float64, requires_grad=True))  # stock: exact in f64
        F.silu(torch.randn(10))
        with torch.no_grad():
            F.elu(torch.randn(10, requires_grad=True))
    assert mode.counts == {}


def test_double_backward_through_gelu_raises():
    x = torch.randn(20, requires_grad=True)
    with PointwiseMode():
        y = F.gelu(x)
    with pytest.raises(RuntimeError, match="bits=None, pointwise=False, sparse=False"):
        torch.autograd.grad(y.sum() + x.square().sum(), x, create_graph=True)
    (g,) = torch.autograd.grad(y.sum(), x)  # first-order backward is fine
    assert g.shape == x.shape


# ------------------------------------------------------------------------ in the controller
class _LinActLin(nn.Module):
    def __init__(self, act, d=781, hidden=256):
        super().__init__()
        self.lin1 = nn.Linear(d, hidden)
        self.act = act
        self.lin2 = nn.Linear(hidden, 8)

    def forward(self, x):
        return self.lin2(self.act(self.lin1(x)))


@pytest.mark.parametrize("act", [nn.ELU(), nn.GELU(), nn.SiLU()], ids=["elu", "gelu", "silu"])
def test_output_is_stored_once_with_the_next_layers_input(act):
    n = 1823
    model = _LinActLin(act)
    x = torch.randn(n, 781)
    stock = saved_bytes_stats(model, lambda: model(x))
    # stock: the activation's input and its output (lin2's input), float32 each
    assert stock["total"]["orig_bytes"] == 2 * n * 256 * 4
    with compress_gnn(model, bits=None) as ctl:
        out = model(x)
        st = ctl.stats()
        out.sum().backward()
    acts = [r for r in st["tensors"] if r["kind"] == "activation"]
    assert len(acts) == 1 and acts[0]["uses"] == 2  # saved by the activation and by lin2
    assert st["by_kind"]["mask"]["count"] == 1
    assert st["total"]["stored_bytes"] == n * 256 * 4 + (n * 256 + 7) // 8


def test_bits2_elu_gradient_is_unbiased_with_the_indicator():
    """ELU's negative-branch derivative y + alpha is linear in y: with the exact branch bit, a
    2-bit stochastically rounded y gives an unbiased gradient. Stock ELU saves x and evaluates
    alpha*exp(x_hat), a convex function of the rounded x: biased."""

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
    """GAT: ELU between layers (inverted), LeakyReLU on the attention logits (mask), dropout
    (regenerated). bits=None: same forward bits, gradients equal up to ELU's rounding."""
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
    assert st["by_kind"]["mask"]["count"] == 2 + 3  # ELU indicators + attention LeakyReLU masks


def test_the_probes_elu_replay_writes_into_its_copy_with_the_same_estimates(monkeypatch):
    """In the sensitivity probe's replay, ELU's backward writes its gradient into the probe's
    noisy copy of its output (`scratch`, recognised by storage: a saved output comes back
    from ``ctx.saved_tensors`` as a new tensor): the estimates (GELU's replay after the
    network too) are those of the backward that makes a new tensor, value for value."""
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
