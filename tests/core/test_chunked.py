"""`QTensor.rows` and `RowChunked`: a compressed matmul input read a row chunk at a time."""

import pytest
import torch
import torch.nn.functional as F

from gact_graph.core import chunked
from gact_graph.core.chunked import RowChunked, chunked_tmm, row_ranges
from gact_graph.core.quantize import QTensor, quantize
from tests.devices import DEVICES

# groups of whole rows (cols < 256), rows split into groups (cols > 256), a ragged last group
SHAPES = [(1000, 64), (37, 5), (300, 700), (9, 256)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_rows_dequantize_to_the_same_rows(shape, bits, device):
    """On CUDA the rows' codes are a view at an offset, read by the Triton kernel."""
    q = quantize(torch.randn(shape, device=device), bits, seed=3)
    full = q.dequantize()
    step = q.row_step()
    starts = [0, step, (shape[0] // 2) // step * step]
    for r0 in starts:
        for r1 in {r0, min(shape[0], r0 + 1), min(shape[0], r0 + step + 3), shape[0]}:
            part = q.rows(r0, r1)
            assert part.nbytes <= q.nbytes
            assert torch.equal(part.dequantize(), full[r0:r1]), (r0, r1)


def test_rows_refuse_a_start_inside_a_group():
    q = quantize(torch.randn(100, 8), 2, seed=0)  # 32 rows per group
    assert q.row_step() == 32
    with pytest.raises(ValueError, match="do not start on a group"):
        q.rows(5, 40)
    with pytest.raises(ValueError, match="do not start on a group"):
        q.rows(0, 101)


@pytest.mark.parametrize("shape", SHAPES)
def test_row_ranges_cover_every_row_once_on_group_starts(shape):
    q = quantize(torch.randn(shape), 2, seed=0)
    ranges = list(row_ranges(q, chunk_elems=700))
    assert ranges[0][0] == 0 and ranges[-1][1] == shape[0]
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(r0 % q.row_step() == 0 for r0, _ in ranges)


@pytest.mark.parametrize("shape", SHAPES)
def test_chunked_tmm_equals_the_dense_product(shape):
    q = quantize(torch.randn(shape), 2, seed=1)
    g = torch.randn(shape[0], 7)
    ref = q.dequantize().t() @ g
    torch.testing.assert_close(chunked_tmm(q, g, chunk_elems=500), ref, rtol=1e-5, atol=1e-4)


class _Dequantized:
    """Shapes of every `QTensor.dequantize` while active."""

    def __init__(self, monkeypatch):
        self.shapes = []
        original = QTensor.dequantize

        def spy(q):
            self.shapes.append(tuple(q.shape))
            return original(q)

        monkeypatch.setattr(QTensor, "dequantize", spy)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["mm", "linear", "addmm"])
def test_matmul_backward_reads_it_in_chunks_with_the_dense_gradients(op, device, monkeypatch):
    """``mm`` (row-major ``mat2``: ``mat1.t().mm(G)``), ``linear`` and ``addmm`` (column-major
    ``mat2``: ``G.t().mm(mat1).t()``): the weight gradient equals the one from the dense
    dequantized input, and no dequantization is larger than a chunk."""
    torch.manual_seed(0)
    q = quantize(torch.randn(2000, 64, device=device), 2, seed=2)
    x = q.dequantize()
    w = torch.randn(64, 9, device=device, requires_grad=True)
    lin = torch.randn(9, 64, device=device, requires_grad=True)
    bias = torch.zeros(9, device=device, requires_grad=True)

    def run(x):
        if op == "mm":
            return x.mm(w), w
        if op == "linear":
            return F.linear(x, lin), lin
        return torch.addmm(bias, x, lin.t()), lin

    def unpack(t):
        return RowChunked(q) if t is x else t

    monkeypatch.setattr(chunked, "MIN_CHUNK_ELEMS", 64 * 256)  # 2000 rows: 8 chunks of 256
    spy = _Dequantized(monkeypatch)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        y, weight = run(x)
    g = torch.randn(y.shape, device=device)
    (got,) = torch.autograd.grad(y, [weight], g)
    assert len(spy.shapes) == 8 and max(r for r, _ in spy.shapes) <= 256, spy.shapes
    y_ref, weight = run(x)
    (ref,) = torch.autograd.grad(y_ref, [weight], g)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)


def test_other_operations_see_the_dense_tensor():
    q = quantize(torch.randn(50, 16), 4, seed=0)
    lazy, dense = RowChunked(q), q.dequantize()
    assert lazy.shape == dense.shape and lazy.dtype == dense.dtype
    torch.testing.assert_close(lazy * 2 + 1, dense * 2 + 1)
    torch.testing.assert_close(lazy.t().sum(0), dense.t().sum(0))
    g = torch.randn(50, 3)
    torch.testing.assert_close(lazy.t() @ g, dense.t() @ g)  # matmul, not mm: the fallback
    assert "RowChunked((50, 16), 4 bits)" in repr(lazy)


def test_only_matrices():
    with pytest.raises(ValueError, match="matrix"):
        RowChunked(quantize(torch.randn(4, 5, 6), 2, seed=0))
