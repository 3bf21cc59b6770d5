"""Regenerated dropout: bit-identical outputs, gradients and RNG stream to PyTorch's dropout,
while saving only the generator state (no per-element memory)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gact_graph.ops.dropout as D
from gact_graph import compress_gnn
from gact_graph.memory import saved_bytes_stats
from gact_graph.ops import PointwiseMode

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CUDA = torch.cuda.is_available()


def needs_cuda(test):
    """Skipped without a GPU; selected by ``-m cuda`` with one."""
    return pytest.mark.cuda(pytest.mark.skipif(not CUDA, reason="needs a CUDA device")(test))


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def _gen_state(device):
    if torch.device(device).type == "cuda":
        return torch.cuda.get_rng_state(torch.device(device))
    return torch.get_rng_state()


def _run(op, x, grad, seed, device, use_mode):
    """Forward with ``seed``; return output, gradient, saved tensors and the generator state
    after forward and after backward."""
    torch.manual_seed(seed)  # seeds CUDA too
    saved = []
    mode = PointwiseMode()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        if use_mode:
            with mode:
                y = op(x)
        else:
            y = op(x)
    after_fwd = _gen_state(device)
    (g,) = torch.autograd.grad(y, x, grad)
    after_bwd = _gen_state(device)
    return y, g, saved, after_fwd, after_bwd, mode.counts


def _check_bitwise(op, x, device="cpu", seed=1234, intercepted=1):
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(7)).to(x.dtype).to(device)
    y0, g0, _, f0, b0, _ = _run(op, x, grad, seed, device, use_mode=False)
    y1, g1, saved, f1, b1, counts = _run(op, x, grad, seed, device, use_mode=True)
    assert sum(counts.values()) == intercepted, counts
    assert torch.equal(y1, y0)
    assert torch.equal(g1, g0)
    assert torch.equal(f1, f0)  # forward consumed the generator exactly like PyTorch's dropout
    assert torch.equal(b1, b0)  # backward left the caller's RNG stream untouched
    assert torch.equal(b1, f1)
    return saved


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_bitwise_awkward_shape_fp32(p):
    x = torch.randn(1823, 781, requires_grad=True)
    saved = _check_bitwise(lambda t: F.dropout(t, p), x)
    # only the generator state is saved: no per-element tensor
    assert [(t.dtype, t.numel()) for t in saved] == [(torch.uint8, torch.get_rng_state().numel())]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "make",
    [
        lambda t: F.dropout(t, 0.3),
        lambda t: F.dropout(t * 1, 0.3, inplace=True),
        lambda t: nn.Dropout(0.6)(t),
        lambda t: nn.Dropout(0.2, inplace=True)(t * 1),
        lambda t: torch.dropout(t, 0.4, True),
        lambda t: torch.dropout_(t * 1, 0.4, True),
    ],
    ids=["F", "F_inplace", "nn", "nn_inplace", "torch", "torch_"],
)
def test_bitwise_variants_and_dtypes(make, dtype):
    x = torch.randn(7, 131, 33, dtype=dtype).requires_grad_()
    _check_bitwise(make, x)


def test_non_contiguous_input():
    x = torch.randn(781, 257).t().requires_grad_()
    _check_bitwise(lambda t: F.dropout(t, 0.5), x)
    x = torch.randn(64, 300)[:, ::3].requires_grad_()
    _check_bitwise(lambda t: F.dropout(t, 0.5), x)


def test_scaling_is_one_over_one_minus_p():
    p = 0.25
    x = torch.ones(400, 300, requires_grad=True)
    with PointwiseMode():
        y = F.dropout(x, p)
    kept = y != 0
    assert torch.equal(y[kept], torch.full_like(y[kept], 1 / (1 - p)))
    assert abs(kept.float().mean().item() - (1 - p)) < 0.01
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(g, y.detach())  # d/dx (x * noise) = noise


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_p_zero_and_one_edge_cases(p):
    x = torch.randn(129, 65, requires_grad=True)
    # not intercepted: PyTorch's own identity / multiplication by zero, bit for bit
    _check_bitwise(lambda t: F.dropout(t, p), x, intercepted=0)
    with PointwiseMode():
        y = F.dropout(x, p)
    if p == 0.0:
        assert torch.equal(y, x)
    else:
        assert torch.equal(y, torch.zeros_like(x))
        assert torch.equal(torch.autograd.grad(y.sum(), x)[0], torch.zeros_like(x))


def test_eval_mode_is_identity_and_not_intercepted():
    x = torch.randn(64, 32, requires_grad=True)
    m = nn.Dropout(0.5).eval()
    mode = PointwiseMode()
    state = torch.get_rng_state()
    with mode:
        y = m(x)
        y2 = F.dropout(x, 0.5, training=False)
    assert torch.equal(y, x) and torch.equal(y2, x)
    assert mode.counts == {}
    assert torch.equal(torch.get_rng_state(), state)


def test_invalid_p_raises_pytorch_error():
    x = torch.randn(4, requires_grad=True)
    with PointwiseMode(), pytest.raises(ValueError, match="dropout probability"):
        F.dropout(x, 1.5)
    with pytest.raises(ValueError, match="dropout probability"):
        D.dropout(x, -0.1)


def test_rng_used_between_forward_and_backward_does_not_change_gradients():
    x = torch.randn(300, 200, requires_grad=True)
    grad = torch.randn(300, 200)

    def step(use_mode):
        torch.manual_seed(5)
        with (
            PointwiseMode()
            if use_mode
            else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        ):
            a = F.dropout(x, 0.5)
            b = F.dropout(a * 2, 0.3)
        torch.rand(1000)  # the training loop draws more random numbers before backward
        state = torch.get_rng_state()
        (g,) = torch.autograd.grad(b, x, grad)
        assert torch.equal(torch.get_rng_state(), state)
        return b, g

    b0, g0 = step(False)
    b1, g1 = step(True)
    assert torch.equal(b0, b1) and torch.equal(g0, g1)


def test_retain_graph_and_double_backward():
    x = torch.randn(50, 40, dtype=torch.float64, requires_grad=True)
    with PointwiseMode():
        y = F.dropout(x, 0.4)
    (g1,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
    (g2,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    assert torch.equal(g1, g2)

    def fixed_mask_dropout(t):
        torch.manual_seed(3)  # the same mask at every evaluation gradcheck makes
        return D.dropout(t, 0.5)

    torch.autograd.gradcheck(fixed_mask_dropout, (x[:5, :4].detach().requires_grad_(),))
    torch.autograd.gradgradcheck(fixed_mask_dropout, (x[:5, :4].detach().requires_grad_(),))


def test_training_run_is_bit_identical_to_stock():
    def train(compress):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(32, 64),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(64, 64),
            nn.ReLU(),
            nn.Dropout(0.3),
            nn.Linear(64, 4),
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(256, 32), torch.randint(0, 4, (256,))
        ctl = compress_gnn(model, bits=None) if compress else None
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        if ctl is not None:
            ctl.remove()
        return [p.detach().clone() for p in model.parameters()], torch.get_rng_state()

    ref, ref_state = train(False)
    got, state = train(True)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert torch.equal(state, ref_state)


@pytest.mark.parametrize("bits", [None, 2])
def test_memory_per_element_is_zero(bits):
    class Drop(nn.Module):
        def forward(self, x):
            return F.dropout(x * 1.0, 0.5)

    n, f = 1823, 781
    model = Drop()
    x = torch.randn(n, f, requires_grad=True)
    stock = saved_bytes_stats(model, lambda: model(x))
    # stock CPU dropout keeps its float noise tensor: 4 bytes per element in float32
    assert stock["total"]["orig_bytes"] == n * f * 4
    with compress_gnn(model, bits=bits, min_numel=0) as ctl:
        y = model(x)
        st = ctl.stats()
        y.sum().backward()
    assert st["by_kind"]["activation"]["count"] == 0
    assert st["by_kind"]["mask"]["count"] == 0
    state_bytes = torch.get_rng_state().numel()  # 5056 bytes, whatever the tensor size
    assert st["total"]["stored_bytes"] == state_bytes
    assert st["total"]["stored_bytes"] / (n * f) < 0.004  # bytes per element


# ---------------------------------------------------------------------------------- CUDA
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inplace", [False, True])
def test_cuda_bitwise(dtype, inplace):
    x = torch.randn(1823, 781, dtype=dtype, device="cuda", requires_grad=True)
    op = (
        (lambda t: F.dropout(t * 1, 0.3, inplace=True))
        if inplace
        else (lambda t: F.dropout(t, 0.3))
    )
    saved = _check_bitwise(op, x, device="cuda")
    assert [t.dtype for t in saved] == [torch.uint8]  # fused path regenerates: state only


@needs_cuda
def test_cuda_unaligned_input_saves_a_mask_and_stays_exact():
    base = torch.randn(1823 * 781 + 1, device="cuda")
    x = base[1:].view(1823, 781).requires_grad_()  # 4-byte offset: kernel may vectorize differently
    assert not D.can_regenerate(x)
    saved = _check_bitwise(lambda t: F.dropout(t, 0.5), x, device="cuda")
    assert [t.dtype for t in saved] == [torch.bool]


@needs_cuda
def test_cuda_memory_per_element_is_zero():
    class Drop(nn.Module):
        def forward(self, x):
            return F.dropout(x * 1.0, 0.5)

    model = Drop()
    x = torch.randn(4096, 256, device="cuda", requires_grad=True)
    stock = saved_bytes_stats(model, lambda: model(x))
    assert stock["total"]["orig_bytes"] == 4096 * 256  # CUDA keeps a bool mask: 1 byte/element
    with compress_gnn(model, bits=2) as ctl:
        model(x)
        assert ctl.stats()["total"]["stored_bytes"] == 16  # seed + offset


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1024, 384), (1822, 781), (1823, 781)])  # vector 4, 2, 1
@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_cuda_gradient_through_the_kernel_is_bitwise(dtype, shape, p):
    """The fused path's backward runs the dropout kernel on the gradient itself (when the
    gradient is drawn like the input): bitwise stock's gradient for each vector width."""
    x = torch.randn(shape, dtype=dtype, device="cuda", requires_grad=True)
    _check_bitwise(lambda t: F.dropout(t, p), x, device="cuda")


@needs_cuda
def test_cuda_unaligned_gradient_falls_back_to_the_mask_and_stays_exact():
    x = torch.randn(1024, 384, device="cuda", requires_grad=True)
    base = torch.randn(1024 * 384 + 1, device="cuda")
    grad = base[1:].view(1024, 384)  # 4-byte offset: the kernel would vectorize differently
    assert not D.can_regenerate(grad)
    outs = []
    for mode in (contextlib.nullcontext(), PointwiseMode()):  # stock, ours
        torch.manual_seed(3)
        with mode:
            y = F.dropout(x, 0.4)
        outs.append(torch.autograd.grad(y, x, grad)[0])
    assert torch.equal(outs[0], outs[1])


@needs_cuda
def test_cuda_backward_allocates_only_the_gradient_and_the_mask():
    """The regenerating backward holds the result and the kernel's 1-byte mask, not an
    input-sized dummy and its dropped-out copy besides (2.25 -> 1.25 input sizes at its peak,
    the worst of GAT's default-mode steps on a GPU)."""
    n = 1 << 22
    x = torch.randn(n, device="cuda", requires_grad=True)
    grad = torch.randn(n, device="cuda")
    with PointwiseMode():
        y = F.dropout(x, 0.5)
    D._kernel_scale_is_exact(x.device, 0.5)  # the one-time calibration, outside the window
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    (g,) = torch.autograd.grad(y, x, grad)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    assert peak <= 4 * n + n + (1 << 20), peak / n  # the gradient (4 B) + the mask (1 B)
