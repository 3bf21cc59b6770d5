"""Mask-saving ReLU / LeakyReLU / Hardtanh / ReLU6 / clamp: bit-identical to PyTorch, 1 bit per
element, and an unbiased 2-bit gradient where quantizing ReLU's output is biased."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gact_graph.ops.masks as M
from gact_graph import compress_gnn
from gact_graph.memory import saved_bytes_stats
from gact_graph.ops import PointwiseMode
from tests.devices import DEVICES
from tests.toy_models import ReluGCN

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# name -> op on a tensor that requires grad (in-place ops work on a non-leaf copy)
OPS = {
    "F.relu": lambda x: F.relu(x),
    "F.relu_inplace": lambda x: F.relu(x * 1, inplace=True),
    "torch.relu": torch.relu,
    "torch.relu_": lambda x: torch.relu_(x * 1),
    "Tensor.relu": lambda x: x.relu(),
    "Tensor.relu_": lambda x: (x * 1).relu_(),
    "nn.ReLU": nn.ReLU(),
    "nn.ReLU(inplace)": lambda x: nn.ReLU(inplace=True)(x * 1),
    "F.leaky_relu": lambda x: F.leaky_relu(x, 0.2),
    "F.leaky_relu_inplace": lambda x: F.leaky_relu(x * 1, 0.1, inplace=True),
    "nn.LeakyReLU": nn.LeakyReLU(0.3),
    "F.hardtanh": lambda x: F.hardtanh(x, -0.5, 1.25),
    "F.hardtanh_inplace": lambda x: F.hardtanh(x * 1, -1.0, 0.5, inplace=True),
    "F.relu6": F.relu6,
    "nn.ReLU6(inplace)": lambda x: nn.ReLU6(inplace=True)(x * 1),
    "torch.clamp": lambda x: torch.clamp(x, -1, 1),
    "clamp_min": lambda x: x.clamp(min=0.25),
    "clamp_max": lambda x: torch.clamp(x, max=-0.25),
    "torch.clip": lambda x: torch.clip(x, -0.5, 2.0),
    "clamp_lo>hi": lambda x: torch.clamp(x, 1.0, -1.0),
}


def _input(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2
    flat = x.view(-1)
    # exact boundary values of every op above, and signed zeros
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 6.0, 0.25, -0.25, -0.5, 1.25, 0.5, 2.0])
    flat[: special.numel()] = special
    return x.to(dtype=dtype, device=device).requires_grad_()


def _stock_and_ours(op, x, seed=1):
    grad = torch.randn(op(x.detach()).shape, generator=torch.Generator().manual_seed(seed))
    grad = grad.to(dtype=x.dtype, device=x.device)
    y_ref = op(x)
    (g_ref,) = torch.autograd.grad(y_ref, x, grad)
    saved = []
    mode = PointwiseMode()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with mode:
            y = op(x)
    (g,) = torch.autograd.grad(y, x, grad)
    return (y_ref, g_ref), (y, g), saved, mode.counts


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPS))
def test_bit_identical_to_pytorch_awkward_shape_fp32(name, device):
    x = _input((1823, 781), torch.float32, device)
    (y_ref, g_ref), (y, g), saved, counts = _stock_and_ours(OPS[name], x)
    assert sum(counts.values()) == 1, counts  # intercepted exactly once
    assert torch.equal(y, y_ref)
    assert torch.equal(g, g_ref)
    # the op saved one bool mask, nothing else
    assert [t.dtype for t in saved] == [torch.bool]
    assert saved[0].shape == x.shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(OPS))
def test_bit_identical_across_dtypes_and_3d(name, dtype, device):
    x = _input((7, 129, 33), dtype, device, seed=3)
    (y_ref, g_ref), (y, g), saved, counts = _stock_and_ours(OPS[name], x)
    assert sum(counts.values()) == 1
    assert torch.equal(y, y_ref)
    assert torch.equal(g, g_ref)
    assert [t.dtype for t in saved] == [torch.bool]


@pytest.mark.parametrize(
    "name", ["F.relu", "F.leaky_relu", "F.hardtanh", "torch.clamp", "clamp_min"]
)
def test_nan_and_inf_follow_pytorch(name):
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -1.0, 2.0]).requires_grad_()
    (y_ref, g_ref), (y, g), _, _ = _stock_and_ours(OPS[name], x)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=0, equal_nan=True)


def test_non_contiguous_input():
    x = _input((781, 1823), torch.float32, "cpu").detach().t().requires_grad_()
    for name in ("F.relu", "F.leaky_relu_inplace", "torch.clamp"):
        (y_ref, g_ref), (y, g), _, _ = _stock_and_ours(OPS[name], x)
        assert torch.equal(y, y_ref) and torch.equal(g, g_ref)


def test_not_intercepted_without_grad_or_with_tensor_bounds():
    x = torch.randn(64, 32)
    mode = PointwiseMode()
    with mode:
        F.relu(x)  # no grad needed
        with torch.no_grad():
            F.relu(x.requires_grad_())
        torch.clamp(x, torch.zeros(32), torch.ones(32))  # tensor bounds: stock path
        torch.relu(torch.randint(-3, 3, (5,)))  # integer tensor
    assert mode.counts == {}
    # argument errors stay PyTorch's own
    with mode, pytest.raises(ValueError, match="min_val cannot be greater"):
        F.hardtanh(torch.randn(4, requires_grad=True), 1.0, -1.0)


def test_inplace_on_leaf_raises_like_pytorch():
    x = torch.randn(8, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        F.relu(x, inplace=True)
    with PointwiseMode(), pytest.raises(RuntimeError, match="leaf Variable"):
        F.relu(x, inplace=True)


def test_double_backward_matches_pytorch():
    # The mask backward is linear in grad: higher-order gradients through it stay exact.
    x = torch.randn(50, 20, dtype=torch.float64, requires_grad=True)
    w = torch.randn(20, 20, dtype=torch.float64, requires_grad=True)

    def f(use_mode):
        with (
            PointwiseMode()
            if use_mode
            else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        ):
            h = F.leaky_relu(x @ w, 0.1).relu() @ w
        (gx,) = torch.autograd.grad(h.square().sum(), x, create_graph=True)
        return torch.autograd.grad(gx.square().sum(), w)[0]

    assert torch.equal(f(True), f(False))
    torch.autograd.gradcheck(lambda t: M.leaky_relu(t, 0.2), (x[:4, :5].detach().requires_grad_(),))
    torch.autograd.gradgradcheck(lambda t: M.relu(t) * t, (x[:4, :5].detach().requires_grad_(),))


def test_functional_entry_points():
    x = _input((300, 70), torch.float32, "cpu")
    for ours, ref in [
        (lambda t: M.relu(t), torch.relu),
        (lambda t: M.leaky_relu(t, 0.05), lambda t: F.leaky_relu(t, 0.05)),
        (lambda t: M.hardtanh(t, -0.25, 0.5), lambda t: F.hardtanh(t, -0.25, 0.5)),
        (M.relu6, F.relu6),
        (lambda t: M.clamp(t, min=0.25), lambda t: torch.clamp(t, min=0.25)),
    ]:
        y, y_ref = ours(x), ref(x)
        assert torch.equal(y, y_ref)
        g = torch.autograd.grad(y.sin().sum(), x)[0]
        assert torch.equal(g, torch.autograd.grad(y_ref.sin().sum(), x)[0])


# ---------------------------------------------------------------- memory, inside compress_gnn
class _Act(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x):
        return self.op(x * 1.0)  # x * 1.0 saves nothing; the op's input is an activation


@pytest.mark.parametrize("name", ["F.relu", "F.leaky_relu", "F.hardtanh", "F.relu6", "torch.clamp"])
@pytest.mark.parametrize("bits", [None, 2])
def test_one_bit_per_element_in_controller(name, bits):
    n, f = 1823, 781
    model = _Act(OPS[name])
    x = torch.randn(n, f, requires_grad=True)
    stock = saved_bytes_stats(model, lambda: model(x))
    assert stock["total"]["orig_bytes"] == n * f * 4  # stock: a full float32 tensor
    with compress_gnn(model, bits=bits, min_numel=0) as ctl:
        y = model(x)
        st = ctl.stats()
        y.sum().backward()
    assert st["by_kind"]["mask"]["count"] == 1
    assert st["by_kind"]["activation"]["count"] == 0
    assert st["total"]["stored_bytes"] == (n * f + 7) // 8  # 1 bit per element, packed
    assert ctl.module_paths  # report still works
    assert "total" in ctl.report()


def test_pointwise_false_and_L0_keep_stock_saves():
    model = _Act(torch.relu)
    x = torch.randn(512, 64, requires_grad=True)
    with compress_gnn(model, bits=None, pointwise=False) as ctl:
        model(x)
        assert ctl.stats()["by_kind"]["mask"]["count"] == 0
    with compress_gnn(model, bits=None) as ctl:
        model(x)
        assert ctl.stats()["by_kind"]["mask"]["count"] == 1
    # after remove() nothing is intercepted any more
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.dtype) or t, lambda t: t):
        model(x)
    assert seen == [torch.float32]


def test_module_paths_mark_pointwise_modules():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 2))
    with compress_gnn(model, bits=2) as ctl:
        assert ctl.module_paths["1"] == "pointwise" and ctl.module_paths["2"] == "pointwise"
        assert ctl.module_paths["0"] == "generic"


# ---------------------------------------------------------------- unbiasedness at 2 bits
def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss().backward()
    return [p.grad.clone() for p in model.parameters()]


def _mean_grad_error(model, loss, ref, n, pointwise):
    ctl = compress_gnn(model, bits=2, min_numel=0, pointwise=pointwise, sparse=False)
    acc = [torch.zeros_like(r) for r in ref]
    for _ in range(n):
        for a, g in zip(acc, _grads(model, loss)):
            a += g
        ctl.iterate()  # new step -> new rounding seeds
    ctl.remove()
    return max(((a / n - r).norm() / r.norm()).item() for a, r in zip(acc, ref))


def test_bits2_relu_gradient_is_unbiased_with_pointwise_masks():
    """The setup of test_controller::test_bits2_quantized_relu_output_biases_the_gradient (2
    GCN layers here, to keep the test fast), with pointwise=True: ReLU's backward reads the
    exact 1-bit mask, the quantized activations enter backward linearly, so the mean of n 2-bit
    gradients approaches FP32 like 1/sqrt(n)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 32, generator=g)
    ei = torch.randint(0, 400, (2, 2000), generator=g)
    model = ReluGCN(32, 32, 4, layers=2)
    target = torch.randn(400, 4)

    def loss():
        return F.mse_loss(model(x, ei), target)

    ref = _grads(model, loss)
    e_small = _mean_grad_error(model, loss, ref, 4, pointwise=True)
    e_large = _mean_grad_error(model, loss, ref, 64, pointwise=True)
    # measured: 0.117 (n=4), 0.062 (n=16), 0.030 (n=64): 16x more samples, 4x less error
    assert e_large < e_small / 2.5, (e_small, e_large)
    assert e_large < 0.05
    # the stock path (2-bit ReLU output) plateaus at its bias: 0.33 (n=4), 0.30 (n=16, 64)
    e_biased = _mean_grad_error(model, loss, ref, 4, pointwise=False)
    assert e_biased > 5 * e_large, (e_biased, e_large)


# ---------------------------------------------------------------- whole models, lossless
def test_gcn_with_bn_relu_dropout_lossless_forward_is_bit_identical_to_stock():
    """The OGB GCN (BatchNorm, ReLU, dropout) on a graph with more than 65,535 nodes: with
    bits=None the masks and dropout change what is saved, not a single bit of the forward or
    the RNG stream; BatchNorm's backward is computed from its normalized input, which agrees
    with PyTorch's to float rounding."""
    from gact_graph.models import GCN

    g = torch.Generator().manual_seed(0)
    n = 70_000
    x = torch.randn(n, 16, generator=g)
    ei = torch.randint(0, n, (2, 4 * n), generator=g)
    y = torch.randint(0, 5, (n,), generator=g)

    def step(compress):
        torch.manual_seed(0)
        model = GCN(16, 32, 5, num_layers=3, dropout=0.5, batch_norm=True)
        ctl = compress_gnn(model, bits=None, sparse=False) if compress else None
        torch.manual_seed(1)
        loss = F.cross_entropy(model(x, ei), y)
        st = ctl.stats() if ctl is not None else None
        loss.backward()
        if ctl is not None:
            ctl.remove()
        return [p.grad for p in model.parameters()], torch.get_rng_state(), st, loss.detach()

    ref, ref_rng, _, ref_loss = step(False)
    got, rng, st, got_loss = step(True)
    assert torch.equal(got_loss, ref_loss)  # the forward: not a bit changed
    # (whole-vector norm: the conv biases before BatchNorm have a zero gradient up to rounding)
    got_v, ref_v = torch.cat([a.flatten() for a in got]), torch.cat([b.flatten() for b in ref])
    assert (got_v - ref_v).norm() <= 1e-5 * ref_v.norm()
    assert torch.equal(rng, ref_rng)
    assert st["by_kind"]["mask"]["count"] == 2  # the two hidden ReLUs
    assert st["by_kind"]["mask"]["stored_bytes"] == 2 * ((n * 32 + 7) // 8)
