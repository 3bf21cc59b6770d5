"""The chunked edge stages reading compressed inputs in parts (`SourceRows` and
`DestinationRows` of `gact_graph.sparse.coded_rows`): where GATv2's ``x_l`` and ``x_r``, or
GAT's ``x_src``, arrive as matrices read a row range at a time (`RowChunked`, what the
sensitivity probe hands a Function that sets ``reads_row_chunks``), backward never
dequantizes them whole, and gives the gradients of the same backward handed them dequantized
whole (GAT: bit for bit) and of the stock-autograd reference evaluated at their dequantized
values."""

import contextlib

import pytest
import torch

from gact_graph.core.chunked import RowChunked
from gact_graph.core.quantize import quantize
from gact_graph.sparse import coded_rows as scoded
from gact_graph.sparse import edge_chunks as sedge
from gact_graph.sparse import gat as sgat
from gact_graph.sparse import gatv2 as sgatv2
from gact_graph.switches import lean_backward
from tests.sparse.allocations import LargeAllocations
from tests.sparse.quantized_saves import dequantized, saved_as


def _graph(n, e, seed):
    """A destination-sorted CSR on ``n`` nodes whose last three have no edge at all, with one
    node of far higher in-degree than the rest (its row spans several edge chunks)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, n - 3, (e,), generator=g)
    dst = torch.randint(0, n - 3, (e,), generator=g)
    dst[: e // 4] = 1  # the high-degree row
    dst, order = dst.sort(stable=True)
    rowptr = torch.zeros(n + 1, dtype=torch.long)
    rowptr[1:] = torch.bincount(dst, minlength=n).cumsum(0)
    return rowptr, src[order].to(torch.int32)


def _saved_as(mode, bits):
    """`saved_as` on every saved float matrix (``x_l`` and ``x_r`` are saved as their
    (N * H) x C views)."""
    return saved_as(mode, bits, lambda t: t.dim() == 2)


@pytest.mark.parametrize("heads,channels", [(1, 16), (8, 5), (3, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("lean", [False, True])
def test_compressed_inputs_read_in_parts_match_the_reference(heads, channels, dtype, dropout,
                                                              shared, lean):  # fmt: skip
    """Output and every gradient against the reference at the dequantized inputs, and the
    same gradients as the backward handed both inputs dequantized whole."""
    n, bits = 90, 4
    rowptr, col = _graph(n, 700, seed=heads + channels)
    g = torch.Generator().manual_seed(5)
    x_l = torch.randn(n, heads, channels, generator=g).to(dtype).requires_grad_()
    x_r = x_l if shared else torch.randn(n, heads, channels, generator=g).to(dtype)
    att = torch.randn(1, heads, channels, generator=g).requires_grad_()
    if not shared:
        x_r.requires_grad_()
    inputs = (x_l, att) if shared else (x_l, x_r, att)
    grads = {}
    for mode in ("dense", "rows"):
        torch.manual_seed(7)
        with _saved_as(mode, bits):
            out = sgatv2.gatv2_attention(x_l, x_r, att, rowptr, col, 0.2, dropout, None, 2048)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
        with lean_backward() if lean else contextlib.nullcontext():
            grads[mode] = torch.autograd.grad((out * w).sum(), inputs)

    # the reference: stock autograd at the dequantized inputs (in fp32: ours accumulates half
    # inputs in fp32), the same dropout draw
    xl_hat = dequantized(x_l, bits).float().requires_grad_()
    xr_hat = xl_hat if shared else dequantized(x_r, bits).float().requires_grad_()
    ref_inputs = (xl_hat, att) if shared else (xl_hat, xr_hat, att)
    torch.manual_seed(7)
    ref = sgatv2.gatv2_attention_reference(xl_hat, xr_hat, att, rowptr, col.long(), 0.2, dropout)
    g_ref = torch.autograd.grad((ref * w).sum(), ref_inputs)
    torch.manual_seed(7)
    out = sgatv2.gatv2_attention(x_l, x_r, att, rowptr, col, 0.2, dropout, None, 2048)
    ref_at_inputs = sgatv2.gatv2_attention_reference(
        x_l.float(), x_r.float(), att, rowptr, col.long(), 0.2, 0.0
    ) if dropout == 0 else None  # fmt: skip
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-2}
    if ref_at_inputs is not None:
        torch.testing.assert_close(out.float(), ref_at_inputs.float(), **tol)
    names = ("x_l", "att") if shared else ("x_l", "x_r", "att")
    for name, a, b, r in zip(names, grads["rows"], grads["dense"], g_ref, strict=True):
        assert a.shape == b.shape == r.shape, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(a.float(), r.float(), **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("channels", [16, 5, 256, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [1, 2, 8])
def test_readers_give_the_dequantized_rows_bit_for_bit(channels, dtype, bits):
    """Gathered rows (any order, repeats) equal the same rows of the whole dequantization, for
    layouts whose groups hold several rows, one row, or part of a row (read whole), with a
    constant group and a non-finite one among them."""
    n, heads = 37, 3
    x = (torch.randn(n, heads, channels) * 3).to(dtype)
    x[4] = 1.25  # constant groups
    x[9, 1, 0] = float("inf")  # a non-finite group
    q = quantize(x.reshape(-1, channels), bits, seed=3)
    whole = q.dequantize().view(n, heads, channels)
    idx = torch.tensor([5, 0, 36, 9, 4, 4, 17, 36, 2])
    src = scoded.SourceRows(RowChunked(q), heads, channels)
    expect_parts = channels in (16, 256)  # groups of whole rows, no padding
    assert (src.x is None) == expect_parts
    exact = {"rtol": 0, "atol": 0, "equal_nan": True}
    torch.testing.assert_close(src.index_select(0, idx), whole[idx], **exact)
    # destination rows: contiguous per gather chunk of a destination-sorted CSR
    rowptr, _ = _graph(n, 400, seed=channels)
    dst = sedge.csr_destinations(rowptr, int(rowptr[-1]))
    rows = scoded.DestinationRows(RowChunked(q), rowptr, heads, channels)
    assert rows.compressed
    chunk = 23
    rows.bounds(chunk)
    for s in range(0, dst.numel(), chunk):
        d = dst[s : s + chunk]
        torch.testing.assert_close(rows.gather(s, d), whole[d], **exact)


def test_compressed_inputs_are_never_dequantized_whole():
    """Under `lean_backward` with both inputs read in parts, no ATen op makes a tensor the
    size of ``x_l`` or ``x_r`` but the two gradients (N x H x C each)."""

    n, heads, channels = 400, 2, 32
    rowptr, col = _graph(n, 3000, seed=2)
    x_l = torch.randn(n, heads, channels, requires_grad=True)
    x_r = torch.randn(n, heads, channels, requires_grad=True)
    att = torch.randn(1, heads, channels, requires_grad=True)
    with _saved_as("rows", 2):
        out = sgatv2.gatv2_attention(x_l, x_r, att, rowptr, col, 0.2, 0.0, None, 1 << 20)
    big = x_l.numel() * 4

    w = torch.randn(out.shape)
    sizes = LargeAllocations(big)
    with sizes, lean_backward():
        torch.autograd.grad(out, (x_l, x_r, att), w)
    assert sorted(sizes.made) == ["aten.zeros.default"] * 2, sizes.made


def _gat_inputs(n, heads, channels, dtype, needs, seed=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, channels, generator=g).to(dtype)
    a_src = torch.randn(n, heads, generator=g)
    a_dst = torch.randn(n, heads, generator=g)
    return [t.requires_grad_(need) for t, need in zip((x, a_src, a_dst), needs)]


@pytest.mark.parametrize("heads,channels", [(1, 5), (3, 32), (1, 32), (3, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("lean", [False, True])
@pytest.mark.parametrize("needs", [(True, True, True), (True, False, False), (False, True, True)])
def test_gat_features_read_in_parts_give_the_dense_gradients(heads, channels, dtype, dropout,
                                                              lean, needs):  # fmt: skip
    """GAT's ``x_src`` saved as its (N * H) x C view and handed as a `RowChunked`: every
    gradient equals, bit for bit, that of the backward handed it dequantized whole, and the
    reference's at the dequantized features. 32 channels: groups of whole rows, read from
    the unpacked codes; 5: groups with padding, which `_Codes` cannot read: a dense copy."""
    n, bits = 90, 2
    rowptr, col = _graph(n, 700, seed=heads + channels)
    leaves = _gat_inputs(n, heads, channels, dtype, needs)
    wanted = [t for t in leaves if t.requires_grad]
    readers = []

    class Spy(sgat.SourceRows):
        def __init__(self, *args):
            super().__init__(*args)
            readers.append(self.x is None)

    grads = {}
    for mode in ("dense", "rows"):
        readers.clear()
        torch.manual_seed(7)
        with saved_as(mode, bits, lambda t: tuple(t.shape) == (n * heads, channels)) as packed:
            out = sgat.gat_attention(*leaves, rowptr, col, 0.2, dropout, None, 2048)
        assert packed == [(n * heads, channels)], packed  # x_src, as its (N * H) x C view
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
        lean_or_not = lean_backward() if lean else contextlib.nullcontext()
        with pytest.MonkeyPatch.context() as m, lean_or_not:
            m.setattr(sgat, "SourceRows", Spy)
            grads[mode] = torch.autograd.grad((out * w).sum(), wanted)
        # the codes are read where `_Codes` reads the layout, else a dense copy is handed
        assert readers == [mode == "rows" and channels == 32], (mode, readers)
    for a, b in zip(grads["rows"], grads["dense"], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    x_hat = dequantized(leaves[0], bits).float().requires_grad_(needs[0])
    ref_leaves = [x_hat, leaves[1], leaves[2]]
    torch.manual_seed(7)
    ref = sgat.gat_attention_reference(*ref_leaves, rowptr, col.long(), 0.2, dropout)
    g_ref = torch.autograd.grad((ref * w.float()).sum(), [t for t in ref_leaves if t.requires_grad])
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-2}
    for a, r in zip(grads["rows"], g_ref, strict=True):
        torch.testing.assert_close(a.float(), r.float(), **tol)


def test_gat_features_are_never_dequantized_whole():
    """Under `lean_backward` with ``x_src`` read in parts, no ATen op makes a tensor the size
    of ``x_src`` but its gradient (N x H x C)."""
    n, heads, channels = 400, 2, 32
    rowptr, col = _graph(n, 3000, seed=2)
    leaves = _gat_inputs(n, heads, channels, torch.float32, (True, True, True))
    big = leaves[0].numel() * 4
    with saved_as("rows", 2, lambda t: tuple(t.shape) == (n * heads, channels)) as packed:
        # edge chunks whose gathers stay below the features' size
        out = sgat.gat_attention(*leaves, rowptr, col, 0.2, 0.3, None, big // 2)
    assert packed == [(n * heads, channels)], packed
    w = torch.randn(out.shape)
    sizes = LargeAllocations(big)
    with sizes, lean_backward():
        torch.autograd.grad(out, leaves, w)
    assert sorted(sizes.made) == ["aten.zeros.default"], sizes.made
