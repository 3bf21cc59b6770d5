"""The fused GAT / GATv2 Functions (`GatFusedFunction`, `GatV2FusedFunction`) handed their
compressed features as matrices read by rows (`RowChunked`, what the sensitivity probe hands a
Function that sets ``reads_row_chunks``): the backward kernels read the packed codes
(`_kernel_features`), giving the very gradients of the same backward handed the features
dequantized whole, and the reference's at the dequantized values; and no tensor the size of
the features is made in that backward but the gradients (counted allocations).

The kernels run in Triton's CPU interpreter here (``test_interpreter_in_subprocess`` re-runs
the file with ``TRITON_INTERPRET=1``), so the graphs are tiny.
"""

import pytest
import torch

from gact_graph.core.chunked import RowChunked
from gact_graph.core.quantize import quantize
from gact_graph.kernels import gat_edge as ge
from gact_graph.kernels import gat_rows as gr
from gact_graph.kernels import gatv2_edge as ge2
from gact_graph.sparse import gat_fused as sfused
from tests.kernels.interpreted import DEVICE, interpreter_test, kernel_test
from tests.sparse.allocations import LargeAllocations
from tests.sparse.quantized_saves import dequantized, saved_as


@pytest.fixture(autouse=True)
def untuned(monkeypatch):
    monkeypatch.setattr(gr, "TUNE", False)


def _graph(n, e, seed):
    """Destination-sorted CSR on ``n`` nodes: the last two receive no edge, node 1 receives a
    quarter of them (several edge blocks)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, n, (e,), generator=g)
    dst = torch.randint(0, n - 2, (e,), generator=g)
    dst[: e // 4] = 1
    dst, order = dst.sort(stable=True)
    rowptr = torch.zeros(n + 1, dtype=torch.long)
    rowptr[1:] = torch.bincount(dst, minlength=n).cumsum(0)
    return rowptr.to(DEVICE), src[order].to(torch.int32).to(DEVICE)


def _saved_as(mode, bits, shape):
    """`saved_as` on every saved (N * H) x C feature matrix (``shape``)."""
    return saved_as(mode, bits, lambda t: tuple(t.shape) == shape)


def _inputs(n, heads, channels, dtype, seed=5):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, heads, channels, generator=g) * 2).to(dtype).to(DEVICE)
    a_src = torch.randn(n, heads, generator=g).to(DEVICE)
    a_dst = torch.randn(n, heads, generator=g).to(DEVICE)
    w = torch.randn(n, heads, channels, generator=g).to(DEVICE)
    return x, a_src, a_dst, w


@kernel_test
@pytest.mark.parametrize(
    "heads, channels, dtype, dropout, bits",
    [(1, 6, torch.float32, 0.0, 2), (3, 5, torch.bfloat16, 0.3, 4), (8, 3, torch.float32, 0.5, 1)],
)  # fmt: skip
def test_gat_fused_backward_reads_the_codes(heads, channels, dtype, dropout, bits):
    n = 8 if heads == 8 else 12
    rowptr, col = _graph(n, 60, seed=heads)
    x, a_src, a_dst, w = _inputs(n, heads, channels, dtype)
    leaves = [t.clone().requires_grad_() for t in (x, a_src, a_dst)]
    grads = {}
    for mode in ("dense", "rows"):
        torch.manual_seed(7)  # the same dropout seed
        with _saved_as(mode, bits, (n * heads, channels)) as packed:
            out = sfused.gat_attention_fused(*leaves, rowptr, col, 0.2, dropout)
        assert packed == [(n * heads, channels)], packed  # x_src, as its (N * H) x C view
        grads[mode] = torch.autograd.grad((out * w).sum(), leaves)
    for name, a, b in zip(("x", "a_src", "a_dst"), grads["rows"], grads["dense"]):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    # the reference at the dequantized features (the forward's softmax: the logits are exact)
    torch.manual_seed(7)
    keep = ge.gat_edge_dropout_keep(gr.draw_seed(DEVICE), col.numel(), heads, dropout)
    at = [t.detach().float().requires_grad_() for t in (dequantized(x, bits), a_src, a_dst)]
    ref = ge.gat_edge_reference(*at, rowptr, col, 0.2, dropout, keep if dropout else None)
    ref_grads = torch.autograd.grad((ref * w).sum(), at)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for name, a, r in zip(("x", "a_src", "a_dst"), grads["rows"], ref_grads):
        torch.testing.assert_close(a.float(), r, rtol=tol, atol=tol,
                                   msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip


@kernel_test
@pytest.mark.parametrize(
    "heads, channels, dtype, dropout, bits, shared",
    [(1, 6, torch.float32, 0.0, 2, False), (3, 5, torch.bfloat16, 0.3, 4, False),
     (2, 7, torch.float16, 0.0, 8, True), (8, 3, torch.float32, 0.4, 1, False)],
)  # fmt: skip
def test_gatv2_fused_backward_reads_the_codes(heads, channels, dtype, dropout, bits, shared):
    n = 8 if heads == 8 else 12
    rowptr, col = _graph(n, 60, seed=heads + 1)
    x_l, _, _, w = _inputs(n, heads, channels, dtype)
    x_r = x_l if shared else _inputs(n, heads, channels, dtype, seed=6)[0]
    att = torch.randn(1, heads, channels, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    leaves = [t.clone().requires_grad_() for t in ((x_l, att) if shared else (x_l, x_r, att))]
    grads = {}
    for mode in ("dense", "rows"):
        torch.manual_seed(7)
        with _saved_as(mode, bits, (n * heads, channels)) as packed:
            xl = leaves[0]
            xr = xl if shared else leaves[1]
            out = sfused.gatv2_attention_fused(xl, xr, leaves[-1], rowptr, col, 0.2, dropout,
                                             recompute_stats=True)  # fmt: skip
        assert len(packed) == 2 and set(packed) == {(n * heads, channels)}, packed
        grads[mode] = torch.autograd.grad((out * w).sum(), leaves)
    names = ("x_l", "att") if shared else ("x_l", "x_r", "att")
    for name, a, b in zip(names, grads["rows"], grads["dense"], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    torch.manual_seed(7)
    keep = ge.gat_edge_dropout_keep(gr.draw_seed(DEVICE), col.numel(), heads, dropout)
    xl_hat = dequantized(x_l, bits).float().requires_grad_()
    xr_hat = xl_hat if shared else dequantized(x_r, bits).float().requires_grad_()
    at_att = att.clone().requires_grad_()
    at = (xl_hat, at_att) if shared else (xl_hat, xr_hat, at_att)
    ref = ge2.gatv2_edge_reference(xl_hat, xr_hat, at_att, rowptr, col, 0.2, dropout,
                                  keep if dropout else None)  # fmt: skip
    ref_grads = torch.autograd.grad((ref * w).sum(), at)
    tol = 2e-4 if dtype == torch.float32 else 4e-2
    for name, a, r in zip(names, grads["rows"], ref_grads, strict=True):
        torch.testing.assert_close(a.float(), r, rtol=tol, atol=tol,
                                   msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip


@kernel_test
@pytest.mark.parametrize("model", ["gat", "gatv2"])
def test_backward_makes_no_dequantized_copy(model):
    """Counted allocations of the backward of one edge stage: with both inputs read by rows
    the only tensors the size of one N x H x C feature tensor it makes are its gradients (GAT:
    one, GATv2: two); handed the dequantized copies instead, those copies are made too."""
    n, heads, channels, bits = 40, 2, 16, 2
    rowptr, col = _graph(n, 200, seed=3)
    x, a_src, a_dst, w = _inputs(n, heads, channels, torch.float32)
    x_r = _inputs(n, heads, channels, torch.float32, seed=9)[0]
    att = torch.randn(1, heads, channels).to(DEVICE).requires_grad_()
    made = {}
    for mode in ("dense", "rows"):
        if model == "gat":
            leaves = [t.clone().requires_grad_() for t in (x, a_src, a_dst)]
            with _saved_as(mode, bits, (n * heads, channels)):
                out = sfused.gat_attention_fused(*leaves, rowptr, col, 0.2)
        else:
            leaves = [x.clone().requires_grad_(), x_r.clone().requires_grad_(), att]
            with _saved_as(mode, bits, (n * heads, channels)):
                out = sfused.gatv2_attention_fused(*leaves, rowptr, col, 0.2,
                                                 recompute_stats=True)  # fmt: skip
        meter = LargeAllocations(x.numel() * 4)
        with meter:
            torch.autograd.grad(out, leaves, w)
        made[mode] = sorted(meter.made)
    gradients = ["aten.empty.memory_format"] * (1 if model == "gat" else 2)
    assert made["rows"] == gradients, made
    assert len(made["dense"]) == 2 * len(gradients), made  # + one dequantized copy per input


@kernel_test
def test_the_probe_hands_codes_and_estimates_as_with_dequantized_copies(monkeypatch):
    """A re-planning step of the default mode on a 2-layer GATv2 routed to the kernels: its
    probe's backwards read the features' codes (`CodedFeatures`), nothing fails to probe, and
    the sensitivity estimates equal, bit for bit, those of the same step whose fused
    Functions are handed dequantized copies."""
    import warnings

    import torch.nn.functional as F
    from torch_geometric.nn import GATv2Conv

    from gact_graph import compress_gnn
    from gact_graph.policy import sensitivity

    monkeypatch.setattr(sfused, "EDGE_KERNEL", "triton")
    estimates, kinds = [], []
    result, kernel_features = sensitivity.SensitivityProbe.result, sfused._kernel_features
    monkeypatch.setattr(sensitivity.SensitivityProbe, "result",
                        lambda self: estimates.append(result(self)) or estimates[-1])  # fmt: skip
    monkeypatch.setattr(sfused, "_kernel_features",
                        lambda x, shape: kinds.append(type(kernel_features(x, shape)).__name__)
                        or kernel_features(x, shape))  # fmt: skip

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = GATv2Conv(8, 6, heads=2), GATv2Conv(12, 4, heads=1)

        def forward(self, x, ei):
            return self.c2(F.elu(self.c1(x, ei)), ei)

    used = {}
    for reads in (True, False):
        monkeypatch.setattr(sfused.GatV2FusedFunction, "reads_row_chunks", reads)
        torch.manual_seed(0)
        x, y = torch.randn(16, 8, device=DEVICE), torch.randint(0, 4, (16,), device=DEVICE)
        ei = torch.randint(0, 16, (2, 40), device=DEVICE)
        model = Net().to(DEVICE)
        ctl = compress_gnn(model, bits=2, adaptive=True, min_numel=0)
        kinds.clear()
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="gact_graph: could not probe")
            F.cross_entropy(model(x, ei), y).backward()
            ctl.iterate()
        used[reads] = set(kinds)
        ctl.remove()
    assert len(estimates) == 2 and estimates[0], estimates
    assert estimates[0] == estimates[1]
    assert used == {True: {"CodedFeatures", "Tensor"}, False: {"Tensor"}}, used


def test_kernel_features_of_each_kind():
    """A dense saved view is reshaped (no copy); a `RowChunked` of a `QTensor` becomes its
    codes (any layout); a matrix read by rows of another kind is dequantized whole."""
    x = torch.randn(6, 2, 5)
    rows = x.view(-1, 5)
    dense = sfused._kernel_features(rows, x.shape)
    assert dense.shape == x.shape and dense.data_ptr() == x.data_ptr()
    for group_size in (4, 16, 256):
        q = quantize(rows, 4, group_size=group_size, seed=0)
        codes = sfused._kernel_features(RowChunked(q), x.shape)
        assert isinstance(codes, gr.CodedFeatures) and codes.shape == x.shape
        assert codes.layout == q.layout and codes.bits == 4

    class Other:  # a compressed matrix read by rows that is no QTensor
        def __init__(self):
            self.q = type("Q", (), {"rows": lambda self, r0, r1: None})()

        def dense(self):
            return rows.clone()

    torch.testing.assert_close(sfused._kernel_features(Other(), x.shape), x)


test_interpreter_in_subprocess = interpreter_test()
