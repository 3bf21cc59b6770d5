"""The fused GAT / GATv2 backward kernels (and GATv2's statistics pass) reading node features
from the quantizer's packed codes (`gact_graph.kernels.gat_rows.CodedFeatures`): every value
and gradient equals, bit for bit, the same kernels fed the dequantized features, and the
stock-autograd reference at the dequantized features within the kernels' tolerance; for 1, 2,
4 and 8 bits, dropout on and off, fp32 / bf16 / fp16 features, empty rows, a huge-degree row,
H = 1 and 8, C not a power of two, and groups of several rows (padded), of one row and of part
of a row, with constant and non-finite groups among them.

Without CUDA these run in Triton's CPU interpreter (``test_interpreter_in_subprocess`` re-runs
the file in a fresh process with ``TRITON_INTERPRET=1``); the graphs are tiny.
"""

import pytest
import torch

from gact_graph.core.quantize import quantize
from gact_graph.kernels import gat_edge as ge
from gact_graph.kernels import gat_rows as gr
from gact_graph.kernels import gatv2_edge as ge2
from tests.kernels.interpreted import DEVICE, interpreter_test, kernel_test
from tests.kernels.test_gat_edge import TOL, assert_close, graph

#: (channels, group size): groups of several whole rows with padding (5 x 3 = 15 of 16), of
#: several rows without (4 x 4), of exactly one row (16), of part of a row (20: two groups of
#: 16, the second padded), and the library's default group size on a width of 17
LAYOUTS = {"rows_padded": (5, 16), "rows": (4, 16), "one_row": (16, 16), "split": (20, 16),
           "default": (17, 256)}  # fmt: skip


@pytest.fixture(autouse=True)
def untuned(monkeypatch):
    monkeypatch.setattr(gr, "TUNE", False)


def coded(x: torch.Tensor, bits: int, group_size: int, seed: int = 3):
    """``(CodedFeatures, the dequantized copy N x H x C)`` of ``x`` (N x H x C) quantized as
    the controller would quantize its (N * H) x C view."""
    n, heads, channels = x.shape
    q = quantize(x.reshape(-1, channels), bits, group_size=group_size, seed=seed)
    codes = gr.coded_features(q.packed, q.meta, q.bits, q.layout, q.dtype, heads)
    assert codes.shape == x.shape
    return codes, q.dequantize().view(n, heads, channels)


def features(n, heads, channels, dtype, seed, special=False):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, heads, channels, generator=g) * 2).to(dtype)
    if special:
        x[2] = 0.75  # constant groups
        x[n - 1, heads - 1, channels - 1] = float("nan")  # a non-finite group
    return x.to(DEVICE)


def assert_equal(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a, b) or torch.allclose(a, b, rtol=0, atol=0, equal_nan=True), (
        f"{what}: max difference {(a.float() - b.float()).abs().nan_to_num().max().item():.3g}"
    )


# ---------------------------------------------------------------------------- GAT
def gat_grads(x, a_src, a_dst, rowptr, col, p, seed, grad_out, m, s):
    t_rowptr, t_col, t_pos = gr.csr_transpose(rowptr, col, a_src.shape[0])
    return ge.gat_edge_backward(
        grad_out, x, a_src, a_dst, rowptr, col, t_rowptr, t_col, t_pos, m, s, 0.2, p, seed
    )


def check_gat(kind, heads, layout, dtype, bits, p, n=14, special=False):
    channels, group_size = LAYOUTS[layout]
    rowptr, col, n = graph(kind, n=n)
    x = features(n, heads, channels, dtype, seed=bits + heads, special=special)
    g = torch.Generator().manual_seed(4)
    a_src = (torch.randn(n, heads, generator=g) * 2).to(DEVICE)
    a_dst = (torch.randn(n, heads, generator=g) * 2).to(DEVICE)
    grad_out = torch.randn(n, heads, channels, generator=g).to(DEVICE)
    seed = torch.tensor([77], dtype=torch.int64, device=DEVICE) if p > 0 else None
    codes, x_hat = coded(x, bits, group_size)
    # the forward ran on the exact features; backward reads what was saved
    _, m, s = ge.gat_edge_forward(x, a_src, a_dst, rowptr, col, 0.2, p, seed,
                                  out_dtype=torch.float32)  # fmt: skip
    got = gat_grads(codes, a_src, a_dst, rowptr, col, p, seed, grad_out, m, s)
    want = gat_grads(x_hat, a_src, a_dst, rowptr, col, p, seed, grad_out, m, s)
    for name, a, b in zip(("x", "a_src", "a_dst"), got, want):
        assert_equal(a, b, f"grad {name}")
    if special:
        return got
    # the reference at the dequantized features: its softmax from the same logits, so the
    # same coefficients as the saved statistics give
    keep = ge.gat_edge_dropout_keep(seed, col.numel(), heads, p) if p > 0 else None
    leaves = [t.detach().float().requires_grad_() for t in (x_hat, a_src, a_dst)]
    ge.gat_edge_reference(*leaves, rowptr, col, 0.2, p, keep).backward(grad_out)
    for name, a, leaf in zip(("x", "a_src", "a_dst"), got, leaves):
        assert_close(a, leaf.grad, TOL[dtype] * 2, f"grad {name} vs reference")
    return got


# every width and every case once each (the interpreter runs a launch in seconds)
@kernel_test
@pytest.mark.parametrize(
    "kind, heads, layout, dtype, p, bits",
    [("empty_rows", 1, "rows_padded", torch.float32, 0.0, 1),
     ("huge_row", 2, "split", torch.bfloat16, 0.4, 2),
     ("plain", 8, "default", torch.float32, 0.3, 4),
     ("huge_row", 2, "default", torch.float32, 0.0, 8)],
)  # fmt: skip
def test_gat_backward_reads_codes_as_the_dequantized_copy(kind, heads, layout, dtype, p, bits):
    check_gat(kind, heads, layout, dtype, bits, p, n=8 if heads == 8 else 14)


@kernel_test
@pytest.mark.parametrize("layout", ["rows", "one_row"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gat_half_features_and_layouts(layout, dtype):
    check_gat("huge_row", 2, layout, dtype, 2, 0.0)


@kernel_test
def test_constant_and_non_finite_groups_decode_as_dequantized():
    """A constant group comes back exact, a non-finite one NaN, in the gradients as in the
    dequantized copy's (NaN where the copy gives NaN)."""
    grads = check_gat("plain", 2, "rows_padded", torch.float32, 4, 0.0, special=True)
    assert torch.isnan(grads[1]).any()  # the NaN group reached the logits' gradient


# ---------------------------------------------------------------------------- GATv2
def v2_run(x_l, x_r, att, rowptr, col, p, seed, grad_out):
    """GATv2's backward as the fused Function runs it on saved features that are not the
    forward's: the statistics recomputed from them (stats only), then the two passes."""
    none, m, s = ge2.gatv2_edge_forward(x_l, x_r, att, rowptr, col, 0.2, stats_only=True)
    assert none is None
    t_rowptr, t_col, t_pos = gr.csr_transpose(rowptr, col, x_l.shape[0])
    grads = ge2.gatv2_edge_backward(
        grad_out, x_l, x_r, att, rowptr, col, t_rowptr, t_col, t_pos, m, s, 0.2, p, seed
    )
    return (m, s, *grads)


def check_v2(kind, heads, layout, dtype, bits_l, bits_r, p, n=14, same=False):
    """``bits_r`` None: ``x_r`` dense (a lossless one beside a compressed one)."""
    channels, group_size = LAYOUTS[layout]
    rowptr, col, n = graph(kind, n=n)
    x_l = features(n, heads, channels, dtype, seed=bits_l)
    g = torch.Generator().manual_seed(8)
    att = torch.randn(1, heads, channels, generator=g).to(DEVICE)
    grad_out = torch.randn(n, heads, channels, generator=g).to(DEVICE)
    seed = torch.tensor([123], dtype=torch.int64, device=DEVICE) if p > 0 else None
    l_codes, l_hat = coded(x_l, bits_l, group_size)
    if same:
        r_codes, r_hat = l_codes, l_hat
    elif bits_r is None:
        r_codes = r_hat = features(n, heads, channels, dtype, seed=50)
    else:
        r_codes, r_hat = coded(features(n, heads, channels, dtype, seed=51), bits_r, group_size)
    got = v2_run(l_codes, r_codes, att, rowptr, col, p, seed, grad_out)
    want = v2_run(l_hat, r_hat, att, rowptr, col, p, seed, grad_out)
    for name, a, b in zip(("m", "s", "x_l", "x_r", "att"), got, want):
        assert_equal(a, b, name)
    keep = ge.gat_edge_dropout_keep(seed, col.numel(), heads, p) if p > 0 else None
    leaves = [t.detach().float().requires_grad_() for t in (l_hat, r_hat, att)]
    ge2.gatv2_edge_reference(*leaves, rowptr, col, 0.2, p, keep).backward(grad_out)
    for name, a, leaf in zip(("x_l", "x_r", "att"), got[2:], leaves):
        assert_close(a, leaf.grad, TOL[dtype] * 2, f"grad {name} vs reference")


@kernel_test
@pytest.mark.parametrize(
    "kind, heads, layout, dtype, p, bits",
    [("empty_rows", 1, "rows_padded", torch.float32, 0.0, 8),
     ("huge_row", 2, "split", torch.bfloat16, 0.5, 1),
     ("plain", 8, "default", torch.float32, 0.0, 2),
     ("huge_row", 2, "default", torch.float32, 0.3, 4)],
)  # fmt: skip
def test_gatv2_reads_codes_as_the_dequantized_copy(kind, heads, layout, dtype, p, bits):
    check_v2(kind, heads, layout, dtype, bits, {1: 8, 2: 4, 4: 2, 8: 1}[bits], p,
             n=8 if heads == 8 else 14)  # fmt: skip


@kernel_test
@pytest.mark.parametrize(
    "layout, dtype, bits_r, same",
    [("one_row", torch.float16, None, False), ("rows", torch.float32, None, True),
     ("rows_padded", torch.bfloat16, 2, False)],
)  # fmt: skip
def test_gatv2_one_input_coded_shared_and_half(layout, dtype, bits_r, same):
    """``x_r`` dense beside a coded ``x_l``; ``x_r`` the very codes of ``x_l`` (shared
    weights); fp16 features (clamped to fp16's range as the dequantizer clamps)."""
    check_v2("huge_row", 2, layout, dtype, 2, bits_r, 0.3, same=same)


def test_coded_features_refuse_what_they_cannot_read():
    q = quantize(torch.randn(12, 5), 2, group_size=16, seed=0)
    with pytest.raises(ValueError, match="bits"):
        gr.coded_features(q.packed, q.meta, 3, q.layout, q.dtype, 3)
    with pytest.raises(ValueError, match="N \\* 5"):
        gr.coded_features(q.packed, q.meta, 2, q.layout, q.dtype, 5)
    with pytest.raises(ValueError, match="packed codes"):
        gr.coded_features(q.packed[:-1], q.meta, 2, q.layout, q.dtype, 3)
    with pytest.raises(ValueError, match="dequantize to"):
        gr.coded_features(q.packed, q.meta, 2, q.layout, torch.float64, 3)
    codes = gr.coded_features(q.packed, q.meta, 2, q.layout, q.dtype, 3)
    assert codes.shape == (4, 3, 5) and codes.meta.dtype == torch.int32


test_interpreter_in_subprocess = interpreter_test()
