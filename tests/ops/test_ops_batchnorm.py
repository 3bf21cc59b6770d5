"""BatchNorm saving its normalized input: equal to PyTorch's BatchNorm (values, gradients,
running statistics) when nothing is quantized, and stable under 2-bit quantization where
saving the raw input is not (the deep test lives in tests/test_scale_deep.py)."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gact_graph import compress_gnn
from gact_graph.ops import PointwiseMode
from gact_graph.ops.batchnorm import BatchNormFunction
from tests.devices import DEVICES

TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-3}


def _inputs(shape, dtype, device, affine, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = shape[1]
    # channels with large means and small spreads: what makes the raw input a poor thing to save
    x = torch.randn(shape, generator=g) * torch.rand(c, generator=g).view(
        1, c, *[1] * (len(shape) - 2)
    )
    x = x + 10 * torch.randn(c, generator=g).view(1, c, *[1] * (len(shape) - 2))
    w = torch.randn(c, generator=g) if affine else None
    b = torch.randn(c, generator=g) if affine else None
    grad = torch.randn(shape, generator=g)
    to = dict(device=device)
    x = x.to(dtype=dtype, **to).requires_grad_()
    w = None if w is None else w.to(dtype=dtype, **to).requires_grad_()
    b = None if b is None else b.to(dtype=dtype, **to).requires_grad_()
    return x, w, b, grad.to(dtype=dtype, **to)


def _close_rel(a, b, tol):
    scale = b.float().abs().max().item() + 1e-12
    return (a.float() - b.float()).abs().max().item() <= tol * scale


def _bn(x, w, b, rm, rv, grad, use_mode, momentum=0.1):
    saved = []
    mode = PointwiseMode()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        if use_mode:
            with mode:
                y = F.batch_norm(x, rm, rv, w, b, True, momentum, 1e-5)
        else:
            y = F.batch_norm(x, rm, rv, w, b, True, momentum, 1e-5)
    ins = [t for t in (x, w, b) if t is not None]
    return y, torch.autograd.grad(y, ins, grad), saved, mode.counts


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(300, 17), (40, 6, 11), (2, 3)])
@pytest.mark.parametrize("affine", [True, False])
def test_equals_pytorch_batchnorm(shape, dtype, affine, device):
    x, w, b, grad = _inputs(shape, dtype, device, affine)
    c = shape[1]
    stats = [
        (torch.zeros(c, dtype=dtype, device=device), torch.ones(c, dtype=dtype, device=device))
        for _ in range(2)
    ]
    y_ref, g_ref, saved_ref, _ = _bn(x, w, b, *stats[0], grad, use_mode=False)
    y, g, saved, counts = _bn(x, w, b, *stats[1], grad, use_mode=True)
    assert counts == {"batch_norm": 1}
    tol = TOL[dtype]
    # On CPU the forward is PyTorch's own kernel, bit for bit. On CUDA stock picks cuDNN for
    # some shapes, which does not return the normalized input; ours runs native_batch_norm.
    same = torch.equal if device == "cpu" else partial(_close_rel, tol=tol)
    assert same(y, y_ref)
    for got, ref in zip(g, g_ref):
        scale = ref.float().abs().max().item() + 1e-12
        assert (got.float() - ref.float()).abs().max().item() <= tol * scale
    for got, ref in zip(stats[1], stats[0]):
        assert same(got, ref)  # running statistics updated identically
    # what is saved: the normalized input, per channel invstd, the weight (no raw input)
    big = [t for t in saved if t.numel() == x.numel()]
    assert len(big) == 1 and not torch.equal(big[0], x)
    xhat = big[0].double()
    dims = [0, *range(2, len(shape))]
    if dtype != torch.bfloat16 and shape[0] * (shape[2] if len(shape) > 2 else 1) > 10:
        assert (
            xhat.mean(dims).abs().max() < 0.05
            and (xhat.var(dims, unbiased=False) - 1).abs().max() < 0.05
        )


def test_module_forms_and_momentum_none_match_stock():
    torch.manual_seed(0)
    for make in (lambda: nn.BatchNorm1d(24), lambda: nn.BatchNorm1d(24, momentum=None),
                 lambda: nn.BatchNorm1d(24, affine=False)):  # fmt: skip
        ref_bn, bn = make(), make()
        bn.load_state_dict(ref_bn.state_dict())
        x = torch.randn(500, 24) * 4 + 3
        # a loss whose bias gradient is not zero: with y.square().sum() it is 2 * sum(y), zero up
        # to rounding, and comparing rounding noise depends on the CPU's summation order
        r = torch.randn(500, 24)
        for _ in range(3):  # running averages over several steps, num_batches_tracked
            xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
            (ref_bn(xr) * r).square().sum().backward()
            with PointwiseMode() as mode:
                (bn(xo) * r).square().sum().backward()
            assert mode.counts == {"batch_norm": 1}
            assert torch.allclose(xo.grad, xr.grad, rtol=1e-4, atol=1e-5)
        for k, v in ref_bn.state_dict().items():
            assert torch.allclose(bn.state_dict()[k].float(), v.float()), k
        if bn.affine:
            assert torch.allclose(bn.weight.grad, ref_bn.weight.grad, rtol=1e-4, atol=1e-4)
            assert torch.allclose(bn.bias.grad, ref_bn.bias.grad, rtol=1e-4, atol=1e-4)


def test_eval_mode_and_no_grad_are_not_intercepted():
    bn = nn.BatchNorm1d(8).eval()
    x = torch.randn(50, 8, requires_grad=True)
    with PointwiseMode() as mode:
        bn(x)
        bn.train()
        with torch.no_grad():
            bn(x)
        bn(torch.randn(50, 8))  # input needs no gradient
    assert mode.counts == {}


def test_errors_match_pytorch_for_one_value_per_channel():
    bn = nn.BatchNorm1d(8)
    x = torch.randn(1, 8, requires_grad=True)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        with PointwiseMode():
            bn(x)


def test_double_backward_raises():
    x = torch.randn(30, 4, dtype=torch.float64, requires_grad=True)
    w = torch.ones(4, dtype=torch.float64, requires_grad=True)
    y = BatchNormFunction.apply(x, None, None, w, None, 0.1, 1e-5)
    with pytest.raises(RuntimeError, match="bits=None, pointwise=False, sparse=False"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)


def test_compressed_model_lossless_equals_stock_and_2_bits_stays_close():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 5))
    x = torch.randn(2000, 32) * 3
    y = torch.randint(0, 5, (2000,))

    def grads():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    ref = grads()
    with compress_gnn(model, bits=None) as ctl:
        lossless = grads()
        assert ctl.module_paths.get("1") == "pointwise"
    assert torch.allclose(lossless, ref, rtol=1e-4, atol=1e-6)
    errs = []
    for pointwise in (True, False):
        with compress_gnn(model, bits=2, adaptive=False, min_numel=0, pointwise=pointwise):
            errs.append(((grads() - ref).norm() / ref.norm()).item())
    assert errs[0] < 0.5 and errs[0] < errs[1], errs


def test_backward_reads_a_row_chunked_normalized_input_as_the_dense_one(monkeypatch):
    """In the probe's partial backwards the normalized input arrives as a `RowChunked` (read
    a row chunk at a time, no dense copy): same gradients as from its dense dequantization."""
    from gact_graph.core.chunked import RowChunked
    from gact_graph.core.quantize import QTensor, quantize

    read = []  # rows of every dequantization
    real = QTensor.dequantize
    monkeypatch.setattr(QTensor, "dequantize", lambda q: read.append(q.shape[0]) or real(q))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, 48, generator=g).requires_grad_()  # 144,000 elements: 3 chunks
    w = torch.rand(48, generator=g).add_(0.5).requires_grad_()
    b = torch.randn(48, generator=g).requires_grad_()
    grad = torch.randn(3000, 48, generator=g)
    got = {}
    for mode in ("dense", "chunked"):

        def pack(t):
            return quantize(t, 4, seed=0) if t.dim() == 2 else t

        def unpack(p, mode=mode):
            if not isinstance(p, QTensor):
                return p
            return RowChunked(p) if mode == "chunked" else p.dequantize()

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = BatchNormFunction.apply(x, None, None, w, b, 0.1, 1e-5)
        read.clear()
        got[mode] = torch.autograd.grad(y, (x, w, b), grad)
        if mode == "chunked":
            assert read and max(read) < 3000, read  # never the whole matrix at once
    for dense, chunked in zip(got["dense"], got["chunked"]):
        torch.testing.assert_close(chunked, dense, rtol=1e-5, atol=1e-5)
