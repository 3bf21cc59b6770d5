"""Fused GAT / GATv2 edge-stage kernels (`gact_graph.kernels.gat_edge`, `gatv2_edge`) against
their references: values and every gradient, dropout on and off (the kernels' own mask,
materialized by `gat_edge_dropout_keep`, fed to the reference), fp32/bf16/fp16, empty rows, one
huge-degree row, H = 1 and 8, C not a power of two; the patched `GATConv` / `GATv2Conv` on the
kernels against the chunked PyTorch stage (and under CB1's recomputation); on CUDA, a
70,000-node graph and no host sync in a steady-state step (`test_compiled.py` compiles every
kernel for sm_90 without a GPU).

Without CUDA the kernel tests run in Triton's CPU interpreter, which has to be switched on
(``TRITON_INTERPRET=1``) before Triton is imported; the conftest's imports (PyG) import Triton
first, so ``test_interpreter_in_subprocess`` re-runs this file in a fresh interpreter with that
variable set. Running the file directly with ``TRITON_INTERPRET=1`` works too. The graphs are
tiny: the interpreter runs every program in Python.
"""

import pytest
import torch

from gact_graph.kernels import gat_edge as ge
from gact_graph.kernels import gat_rows as gr
from gact_graph.kernels import gatv2_edge as ge2
from tests.kernels.interpreted import (
    DEVICE,
    HAS_CUDA,
    HAS_TRITON,
    interpreter_test,
    needs_kernels,
)

cuda = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]
#: tolerance of the kernels against the fp32 reference, by input dtype (the reference
#: computes in fp32 on the same rounded inputs; the kernels' sums run in another order)
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.fixture(autouse=True)
def untuned(monkeypatch):
    """The default blocking, untimed: on a GPU every timed candidate is one more compilation
    per test (the tests that check the tuner switch it back on)."""
    monkeypatch.setattr(gr, "TUNE", False)


# ---------------------------------------------------------------------------- graphs
def csr(src: torch.Tensor, dst: torch.Tensor, n: int, device=DEVICE):
    dst, order = dst.sort(stable=True)
    rowptr = torch.zeros(n + 1, dtype=torch.long)
    rowptr[1:] = torch.bincount(dst, minlength=n).cumsum(0)
    return rowptr.to(device), src[order].to(torch.int32).to(device)


def graph(kind: str, n: int = 14, e: int = 50, seed: int = 0):
    """``(rowptr, col, n)``: ``"empty_rows"`` (the last 4 nodes receive no edge, two send
    none), ``"huge_row"`` (node 0 receives 80 edges, several blocks), ``"plain"``."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, n, (e,), generator=g)
    dst = torch.randint(0, n, (e,), generator=g)
    if kind == "empty_rows":
        dst = torch.randint(0, n - 4, (e,), generator=g)
        src = torch.randint(2, n, (e,), generator=g)
    elif kind == "huge_row":
        src = torch.cat([src, torch.randint(0, n, (80,), generator=g)])
        dst = torch.cat([dst, torch.zeros(80, dtype=torch.long)])
    elif kind != "plain":
        raise ValueError(kind)
    return (*csr(src, dst, n), n)


def inputs(n: int, heads: int, channels: int, dtype, has_dst=True, seed=1, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, channels, generator=g).to(dtype)
    a_src = torch.randn(n, heads, generator=g) * 2
    a_dst = torch.randn(n, heads, generator=g) * 2 if has_dst else None
    return [None if t is None else t.to(device) for t in (x, a_src, a_dst)]


def run_kernels(x, a_src, a_dst, rowptr, col, slope, p, seed, grad_out, config=None):
    out, m, s = ge.gat_edge_forward(
        x, a_src, a_dst, rowptr, col, slope, p, seed,
        out_dtype=torch.promote_types(x.dtype, a_src.dtype), config=config,
    )  # fmt: skip
    t_rowptr, t_col, t_pos = gr.csr_transpose(rowptr, col, x.shape[0])
    grads = ge.gat_edge_backward(
        grad_out, x, a_src, a_dst, rowptr, col, t_rowptr, t_col, t_pos, m, s, slope, p, seed,
        config=config,
    )  # fmt: skip
    return out, grads


def run_reference(x, a_src, a_dst, rowptr, col, slope, p, keep, grad_out):
    leaves = [t.detach().float().requires_grad_() if t is not None else None
              for t in (x, a_src, a_dst)]  # fmt: skip
    out = ge.gat_edge_reference(*leaves, rowptr, col, slope, p, keep)
    out.float().backward(grad_out.float())
    return out, [None if t is None else t.grad for t in leaves]


def count_calls(monkeypatch, module, name: str) -> list:
    """Wrap ``module.<name>``: the returned list gains a 1 per call."""
    calls, fn = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def assert_close(a, b, tol, what):
    scale = max(1.0, b.abs().max().item())
    err = (a.float() - b.float()).abs().max().item() / scale
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def check_against_reference(kind, heads, channels, dtype, p=0.0, has_dst=True, config=None,
                            n=14):  # fmt: skip
    rowptr, col, n = graph(kind, n=n)
    x, a_src, a_dst = inputs(n, heads, channels, dtype, has_dst)
    seed = torch.tensor([20261126], dtype=torch.int64, device=x.device) if p > 0 else None
    grad_out = torch.randn(n, heads, channels, device=x.device)
    out, grads = run_kernels(x, a_src, a_dst, rowptr, col, 0.2, p, seed, grad_out, config)
    keep = ge.gat_edge_dropout_keep(seed, col.numel(), heads, p) if p > 0 else None
    ref, ref_grads = run_reference(x, a_src, a_dst, rowptr, col, 0.2, p, keep, grad_out)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert_close(out, ref, TOL[dtype], "out")
    for name, g, r in zip(("x", "a_src", "a_dst"), grads, ref_grads):
        if r is None:
            assert g is None
            continue
        want = {"x": x, "a_src": a_src, "a_dst": a_dst}[name]
        assert g.dtype == want.dtype and g.shape == want.shape, name
        assert_close(g, r, TOL[dtype], f"grad {name}")
    return out


# ---------------------------------------------------------------------------- kernels
@needs_kernels
@pytest.mark.parametrize(
    "kind, heads, channels, has_dst",
    [("empty_rows", 1, 3, True), ("plain", 8, 17, True), ("huge_row", 2, 5, True),
     ("empty_rows", 3, 4, False)],
)  # fmt: skip
def test_matches_reference_fp32(kind, heads, channels, has_dst):
    n = 8 if heads == 8 else 14  # (the interpreter's time grows with nodes x heads)
    check_against_reference(kind, heads, channels, torch.float32, has_dst=has_dst, n=n)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference_half(dtype):
    check_against_reference("huge_row", 2, 6, dtype)


@needs_kernels
@pytest.mark.parametrize("kind, heads, p", [("empty_rows", 1, 0.3), ("huge_row", 2, 0.6)])
def test_dropout_regenerated_in_backward(kind, heads, p):
    """The gradients equal the reference's under the kernels' own mask: backward drew the
    very mask forward drew."""
    out = check_against_reference(kind, heads, 5, torch.float32, p=p)
    rowptr, col, n = graph(kind)
    seed = torch.tensor([20261126], dtype=torch.int64, device=DEVICE)
    again, _, _ = ge.gat_edge_forward(*inputs(n, heads, 5, torch.float32), rowptr, col, 0.2, p,
                                      seed)  # fmt: skip
    assert torch.equal(out, again)  # one seed, one mask


@needs_kernels
def test_dropout_one_drops_everything():
    out = check_against_reference("empty_rows", 1, 3, torch.float32, p=1.0)
    assert not out.any()


@needs_kernels
@pytest.mark.parametrize("config, p", [((32, 4, 4), 0.0), ((16, 3, 4), 0.5)])
def test_rows_per_program_and_block_width(config, p):
    """Several rows per program (the last program partly past the end) and wider blocks."""
    check_against_reference("huge_row", 1, 5, torch.float32, p=p, config=config)


@needs_kernels
def test_dropout_mask_statistics():
    seed = torch.tensor([7], dtype=torch.int64, device=DEVICE)
    keep = ge.gat_edge_dropout_keep(seed, 1000, 4, 0.3)
    assert keep.shape == (1000, 4) and keep.dtype == torch.bool
    frac, sd = keep.float().mean().item(), (0.3 * 0.7 / 4000) ** 0.5
    assert abs(frac - 0.7) < 5 * sd
    assert torch.equal(keep, ge.gat_edge_dropout_keep(seed, 1000, 4, 0.3))
    other = ge.gat_edge_dropout_keep(seed + 1, 1000, 4, 0.3)
    assert (other != keep).float().mean().item() > 0.3  # a new seed, a new mask
    # heads and edges draw independently: no two heads share a column of the mask
    assert all(not torch.equal(keep[:, 0], keep[:, h]) for h in range(1, 4))


@needs_kernels
def test_matches_chunked_stage_and_its_gradients():
    """The kernels through `GatFusedFunction` against the chunked `GatAttentionFunction`."""
    from gact_graph.sparse import gat as sgat
    from gact_graph.sparse import gat_fused as sfused

    rowptr, col, n = graph("empty_rows")
    leaves = [t.requires_grad_() for t in inputs(n, 2, 7, torch.float32)]
    grad_out = torch.randn(n, 2, 7, device=DEVICE)
    fused = sfused.gat_attention_fused(*leaves, rowptr, col, 0.2)
    g_fused = torch.autograd.grad(fused, leaves, grad_out)
    chunked = sgat.gat_attention(*leaves, rowptr, col, 0.2)
    g_chunked = torch.autograd.grad(chunked, leaves, grad_out)
    assert_close(fused, chunked, 2e-5, "out")
    for g, r in zip(g_fused, g_chunked):
        assert_close(g, r, 2e-5, "grad")


@needs_kernels
def test_function_redraws_its_seed_reproducibly():
    """`GatFusedFunction` draws its seed on the default generator: under one manual seed,
    the reference fed the mask of the same draw gives the same values and gradients."""
    from gact_graph.sparse import gat_fused as sfused

    rowptr, col, n = graph("plain")
    leaves = [t.requires_grad_() for t in inputs(n, 2, 4, torch.float32)]
    grad_out = torch.randn(n, 2, 4, device=DEVICE)
    torch.manual_seed(5)
    out = sfused.gat_attention_fused(*leaves, rowptr, col, 0.2, dropout=0.4)
    grads = torch.autograd.grad(out, leaves, grad_out)
    torch.manual_seed(5)
    keep = ge.gat_edge_dropout_keep(gr.draw_seed(DEVICE), col.numel(), 2, 0.4)
    ref, ref_grads = run_reference(*leaves, rowptr, col, 0.2, 0.4, keep, grad_out)
    assert_close(out, ref, 2e-5, "out")
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, 2e-5, "grad")


@needs_kernels
def test_patched_gatconv_on_kernels_matches_chunked(monkeypatch):
    """A compressed GATConv routed to the kernels (`EDGE_KERNEL = "triton"`) against the
    same layer on the chunked stage, lossless so that only the edge stage differs; and with
    attention dropout in a compressed mode the kernels run and train."""
    from torch_geometric.nn import GATConv

    from gact_graph import compress_gnn
    from gact_graph.sparse import gat_convs as sconvs
    from gact_graph.sparse import gat_fused as sfused

    torch.manual_seed(0)
    n = 16
    ei = torch.randint(0, n, (2, 60)).to(DEVICE)
    x = torch.randn(n, 6, device=DEVICE)
    results = {}
    calls = count_calls(monkeypatch, ge, "gat_edge_forward")
    for kernel in ("chunked", "triton"):
        monkeypatch.setattr(sfused, "EDGE_KERNEL", kernel)
        torch.manual_seed(1)
        conv = GATConv(6, 5, heads=2).to(DEVICE)
        compress_gnn(conv, bits=None)
        out = conv(x, ei)
        out.square().sum().backward()
        results[kernel] = (out.detach(), [p.grad.clone() for p in conv.parameters()])
    assert calls == [1]  # the chunked run did not call the kernels, the other did
    assert_close(results["triton"][0], results["chunked"][0], 2e-5, "out")
    for g, r in zip(results["triton"][1], results["chunked"][1]):
        assert_close(g, r, 5e-5, "parameter grad")

    monkeypatch.setattr(sfused, "EDGE_KERNEL", "triton")
    conv = GATConv(6, 5, heads=2, dropout=0.5).to(DEVICE)
    ctl = compress_gnn(conv, bits=2, min_numel=0)
    conv.train()
    kept = []
    get_adjacency = sconvs.get_adjacency
    monkeypatch.setattr(
        sconvs, "get_adjacency",
        lambda *a, **k: kept.append(k["keep_perm"]) or get_adjacency(*a, **k),
    )  # fmt: skip
    conv(x, ei).sum().backward()
    assert kept == [False]  # the kernels draw in CSR order: no stock order kept
    assert all(p.grad is not None and p.grad.isfinite().all() for p in conv.parameters())
    # only the projection is quantized: the node logits and the softmax statistics are not
    quantized = [r["shape"] for r in ctl.stats()["tensors"] if r["bits"]]
    assert quantized == [(n * 2, 5)], quantized  # x_src, saved as its (N * H) x C view


# ---------------------------------------------------------------------------- GATv2
def check_v2_against_reference(kind, heads, channels, dtype, p=0.0, config=None, same=False,
                               n=14):  # fmt: skip
    """GATv2's kernels against `gatv2_edge_reference` (``same``: x_r is x_l, as in a
    `GATv2Conv` with shared weights)."""
    rowptr, col, n = graph(kind, n=n)
    g = torch.Generator().manual_seed(3)
    x_l = torch.randn(n, heads, channels, generator=g).to(DEVICE, dtype)
    x_r = x_l if same else torch.randn(n, heads, channels, generator=g).to(DEVICE, dtype)
    att = torch.randn(1, heads, channels, generator=g).to(DEVICE)
    seed = torch.tensor([99], dtype=torch.int64, device=DEVICE) if p > 0 else None
    grad_out = torch.randn(n, heads, channels, device=DEVICE)
    out, m, s = ge2.gatv2_edge_forward(
        x_l, x_r, att, rowptr, col, 0.2, p, seed, out_dtype=torch.float32, config=config
    )
    t_rowptr, t_col, t_pos = gr.csr_transpose(rowptr, col, n)
    grads = ge2.gatv2_edge_backward(
        grad_out, x_l, x_r, att, rowptr, col, t_rowptr, t_col, t_pos, m, s, 0.2, p, seed,
        config=config,
    )  # fmt: skip
    keep = ge.gat_edge_dropout_keep(seed, col.numel(), heads, p) if p > 0 else None
    leaves = [t.detach().float().requires_grad_() for t in (x_l, x_r, att)]
    ref = ge2.gatv2_edge_reference(*leaves, rowptr, col, 0.2, p, keep)
    ref.backward(grad_out)
    assert_close(out, ref, TOL[dtype], "out")
    for name, got, leaf, want in zip(("x_l", "x_r", "att"), grads, leaves, (x_l, x_r, att)):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert_close(got, leaf.grad, TOL[dtype] * 2, f"grad {name}")


@needs_kernels
@pytest.mark.parametrize(
    "kind, heads, channels, p, same",
    [("empty_rows", 1, 3, 0.0, False), ("plain", 8, 17, 0.0, True),
     ("huge_row", 2, 5, 0.5, False)],
)  # fmt: skip
def test_gatv2_matches_reference(kind, heads, channels, p, same):
    n = 8 if heads == 8 else 14  # (the interpreter's time grows with nodes x heads)
    check_v2_against_reference(kind, heads, channels, torch.float32, p=p, same=same, n=n)


@needs_kernels
@pytest.mark.parametrize("dtype, config", [(torch.bfloat16, (32, 3, 4)), (torch.float16, None)])
def test_gatv2_half_and_blocking(dtype, config):
    check_v2_against_reference("huge_row", 2, 6, dtype, config=config)


@needs_kernels
def test_gatv2_stats_only_equals_the_forwards_statistics():
    rowptr, col, n = graph("huge_row")
    g = torch.Generator().manual_seed(5)
    x_l, x_r = (torch.randn(n, 2, 6, generator=g).to(DEVICE) for _ in range(2))
    att = torch.randn(1, 2, 6, generator=g).to(DEVICE)
    out, m, s = ge2.gatv2_edge_forward(x_l, x_r, att, rowptr, col, 0.2)
    none, m2, s2 = ge2.gatv2_edge_forward(x_l, x_r, att, rowptr, col, 0.2, stats_only=True)
    assert none is None
    torch.testing.assert_close(m2, m, rtol=0, atol=0)
    torch.testing.assert_close(s2, s, rtol=0, atol=0)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gatv2_backward_of_compressed_features_is_the_gradient_at_them(dtype):
    """A compressing controller hands backward other features than the forward's (here: the
    pack hook adds noise, as rounding does). With ``recompute_stats`` the gradients are those
    of the edge stage at the features handed back: a softmax that sums to one there."""
    from gact_graph.sparse import gat_fused as sfused

    rowptr, col, n = graph("huge_row")
    g = torch.Generator().manual_seed(6)
    x_l, x_r = (torch.randn(n, 2, 6, generator=g).to(DEVICE, dtype) for _ in range(2))
    att = torch.randn(1, 2, 6, generator=g).to(DEVICE)
    noise = {id(t): (torch.randn(t.shape, generator=g) * 0.5).to(DEVICE, dtype)
             for t in (x_l, x_r)}  # fmt: skip
    leaves = [t.clone().requires_grad_() for t in (x_l, x_r, att)]
    noisy = {}

    def pack(t):
        for leaf, orig in zip(leaves[:2], (x_l, x_r)):
            if t is leaf or t._base is leaf:  # (saved as its (N * H) x C view)
                noisy[id(orig)] = (leaf.detach() + noise[id(orig)]).view(t.shape)
                return noisy[id(orig)]
        return t

    grad_out = torch.randn(n, 2, 6, generator=g).to(DEVICE)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = sfused.gatv2_attention_fused(*leaves, rowptr, col, 0.2, recompute_stats=True)
    out.float().backward(grad_out)
    assert len(noisy) == 2, "the test's pack hook saw neither feature tensor"
    at = [noisy[id(x_l)].view(x_l.shape).float().requires_grad_(),
          noisy[id(x_r)].view(x_r.shape).float().requires_grad_(),
          att.detach().clone().requires_grad_()]  # fmt: skip
    ge2.gatv2_edge_reference(*at, rowptr, col, 0.2, 0.0, None).backward(grad_out)
    for name, leaf, want in zip(("x_l", "x_r", "att"), leaves, at):
        assert_close(leaf.grad, want.grad, TOL[dtype] * 2, f"grad {name}")


@needs_kernels
def test_patched_gatv2conv_on_kernels_matches_chunked(monkeypatch):
    from torch_geometric.nn import GATv2Conv

    from gact_graph import compress_gnn
    from gact_graph.sparse import gat_fused as sfused

    calls = count_calls(monkeypatch, ge2, "gatv2_edge_forward")
    torch.manual_seed(0)
    n = 14
    ei = torch.randint(0, n, (2, 40)).to(DEVICE)
    x = torch.randn(n, 6, device=DEVICE)
    for share in (False, True):
        results = {}
        for kernel in ("chunked", "triton"):
            monkeypatch.setattr(sfused, "EDGE_KERNEL", kernel)
            torch.manual_seed(1)
            conv = GATv2Conv(6, 4, heads=2, share_weights=share).to(DEVICE)
            compress_gnn(conv, bits=None)
            out = conv(x, ei)
            out.square().sum().backward()
            results[kernel] = (out.detach(), [p.grad.clone() for p in conv.parameters()])
        assert_close(results["triton"][0], results["chunked"][0], 2e-5, "out")
        for g, r in zip(results["triton"][1], results["chunked"][1]):
            assert_close(g, r, 5e-5, "parameter grad")
    assert calls == [1, 1]


@needs_kernels
def test_checkpointed_recompute_redraws_the_same_mask_and_statistics(monkeypatch):
    """Under CB1 (each block checkpointed, recomputed from its quantized input in backward)
    the recomputation saves its own softmax statistics and redraws the same dropout seed (the
    checkpoint restores the RNG), so its gradient stays as close to L1's as quantization
    allows. (Statistics kept from the forward would not match the recomputed logits.)"""
    from gact_graph.models import GAT
    from gact_graph.sparse import gat_fused as sfused
    from tests.policy.test_levels import _graph as levels_graph
    from tests.policy.test_levels import _rel, _step

    monkeypatch.setattr(sfused, "EDGE_KERNEL", "triton")
    calls = count_calls(monkeypatch, ge, "gat_edge_forward")
    x, ei = levels_graph(n=10, f=8, e=24)
    torch.manual_seed(0)
    model = GAT(8, 6, 3, num_layers=2, heads=1, dropout=0.5, attn_dropout=0.3,
                batch_norm=True).to(DEVICE).train()  # fmt: skip
    x, ei = x.to(DEVICE), ei.to(DEVICE)
    l1, _, _, _ = _step(model, x, ei, bits=8)
    assert calls == [1] * 2  # every layer ran on the kernels
    cb1, _, _, counters = _step(model, x, ei, bits=8, opt_level="CB1")
    assert counters["recomputed_tensors"] > 0 and len(calls) > 4
    assert _rel(cb1, l1) < 0.05


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_blocking_is_timed_once_per_key_and_skips_what_does_not_fit(monkeypatch):
    """The tuner's bookkeeping (timings faked: this runs without a GPU): the fastest candidate
    wins, is cached under its key (a second graph in the same degree bucket is not timed
    again), a candidate the device cannot hold is skipped."""
    import triton

    timed = []
    cost = {(16, 1, 4): 3.0, (32, 1, 4): 1.0, (16, 4, 4): 2.0}

    def fake_time(run, config):
        timed.append(config)
        if config not in cost:
            raise triton.runtime.errors.OutOfResources(1, 0, "shared memory")
        return cost[config]

    monkeypatch.setattr(gr, "_time_ms", fake_time)
    monkeypatch.setattr(gr, "_TUNED", {})
    monkeypatch.setattr(gr, "TUNE", True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    cuda_dev = torch.device("cuda")
    key = ("fwd", 3, 128, gr.degree_bucket(14_000, 1_000))
    assert gr.tuned_blocking(key, key[-1], None, cuda_dev) == (32, 1, 4)
    assert len(timed) == len(gr._candidates(key[-1])) > 3  # others raised and were skipped
    again = ("fwd", 3, 128, gr.degree_bucket(15_500, 1_100))
    assert again == key and gr.tuned_blocking(again, again[-1], None, cuda_dev) == (32, 1, 4)
    assert len(timed) == len(gr._candidates(key[-1]))  # not timed again
    assert gr.tuned_blocking(key, 16, None, cuda_dev, config=(64, 2, 8)) == (64, 2, 8)
    monkeypatch.setattr(gr, "TUNE", False)
    assert gr.tuned_blocking(("other",), 16, None, cuda_dev) == gr._candidates(16)[0]


def test_degree_bucket_is_coarse():
    assert gr.degree_bucket(0, 10) == 1
    assert gr.degree_bucket(14 * 1000, 1000) == 16
    assert gr.degree_bucket(15 * 1000 + 7, 1000) == 16  # nearby sizes share a key
    assert gr.degree_bucket(10**9, 1) == 1024


def test_reference_needs_the_mask_under_dropout():
    rowptr, col, n = graph("plain", n=5, e=8)
    x, a_src, a_dst = inputs(n, 1, 2, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="keep-mask"):
        ge.gat_edge_reference(x, a_src, a_dst, rowptr.cpu(), col.cpu(), 0.2, 0.5)


# ---------------------------------------------------------------------------- CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_cuda_moderate_graph(dtype, p, request):
    """70,000 nodes (past 65,535: grid and index bugs), H = 3, C = 24, against the chunked
    stage (without dropout) or the reference under the kernels' mask."""
    for mark in cuda:
        request.applymarker(mark)
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    n, e, heads, channels = 70_000, 400_000, 3, 24
    src, dst = torch.randint(0, n, (e,)), torch.randint(0, n - 10, (e,))
    rowptr, col = csr(src, dst, n, "cuda")
    x, a_src, a_dst = inputs(n, heads, channels, dtype, device="cuda")
    seed = torch.tensor([11], dtype=torch.int64, device="cuda") if p else None
    grad_out = torch.randn(n, heads, channels, device="cuda")
    out, grads = run_kernels(x, a_src, a_dst, rowptr, col, 0.2, p, seed, grad_out)
    keep = ge.gat_edge_dropout_keep(seed, e, heads, p) if p else None
    ref, ref_grads = run_reference(x, a_src, a_dst, rowptr, col, 0.2, p, keep, grad_out)
    tol = TOL[dtype] * 2
    assert_close(out, ref, tol, "out")
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, tol, "grad")


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_cuda_gatv2_moderate_graph(p, request):
    for mark in cuda:
        request.applymarker(mark)
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    n, e, heads, channels = 70_000, 400_000, 3, 24
    src, dst = torch.randint(0, n, (e,)), torch.randint(0, n - 10, (e,))
    rowptr, col = csr(src, dst, n, "cuda")
    x_l, x_r = torch.randn(2, n, heads, channels, device="cuda")
    att = torch.randn(1, heads, channels, device="cuda")
    seed = torch.tensor([11], dtype=torch.int64, device="cuda") if p else None
    grad_out = torch.randn(n, heads, channels, device="cuda")
    out, m, s = ge2.gatv2_edge_forward(x_l, x_r, att, rowptr, col, 0.2, p, seed)
    grads = ge2.gatv2_edge_backward(
        grad_out, x_l, x_r, att, rowptr, col, *gr.csr_transpose(rowptr, col, n), m, s, 0.2, p,
        seed,
    )  # fmt: skip
    keep = ge.gat_edge_dropout_keep(seed, e, heads, p) if p else None
    leaves = [t.clone().requires_grad_() for t in (x_l, x_r, att)]
    ref = ge2.gatv2_edge_reference(*leaves, rowptr, col, 0.2, p, keep)
    ref.backward(grad_out)
    assert_close(out, ref, 1e-4, "out")
    for g, leaf in zip(grads, leaves):
        assert_close(g, leaf.grad, 1e-4, "grad")


def test_cuda_dropout_is_unbiased(request):
    """E[out] over the kernels' masks (fresh seeds) = out without dropout: the dropout is
    inverted, its draws independent across seeds."""
    for mark in cuda:
        request.applymarker(mark)
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    rowptr, col, n = graph("huge_row")
    rowptr, col = rowptr.cuda(), col.cuda()
    x, a_src, a_dst = [t.cuda() for t in inputs(n, 2, 4, torch.float32, device="cpu")]
    expected, _, _ = ge.gat_edge_forward(x, a_src, a_dst, rowptr, col, 0.2)
    torch.manual_seed(0)
    draws = torch.stack([
        ge.gat_edge_forward(x, a_src, a_dst, rowptr, col, 0.2, 0.2, gr.draw_seed("cuda"))[0]
        for _ in range(1000)
    ])  # fmt: skip
    assert not torch.equal(draws[0], draws[1])
    err = (draws.mean(0) - expected).abs().mean() / expected.abs().mean()
    assert err.item() < 0.03


def test_cuda_steady_state_makes_no_host_sync(request, monkeypatch):
    for mark in cuda:
        request.applymarker(mark)
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    monkeypatch.setattr(gr, "TUNE", True)  # the tuner's first calls sync; later ones must not
    from gact_graph.sparse import gat_fused as sfused

    rowptr, col, n = graph("huge_row", n=3000, e=30000)
    rowptr, col = rowptr.cuda(), col.cuda()
    leaves = [t.cuda().requires_grad_() for t in inputs(n, 3, 32, torch.float32, device="cpu")]
    transpose = gr.csr_transpose(rowptr, col, n)
    for _ in range(2):  # the first call tunes the blocking (timed: syncs)
        sfused.gat_attention_fused(*leaves, rowptr, col, 0.2, 0.3, transpose).sum().backward()
    torch.cuda.synchronize()
    att = torch.randn(1, 3, 32, device="cuda", requires_grad=True)
    for _ in range(2):
        sfused.gatv2_attention_fused(leaves[0], leaves[0], att, rowptr, col, 0.2, 0.3,
                                   transpose).sum().backward()  # fmt: skip
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sfused.gat_attention_fused(*leaves, rowptr, col, 0.2, 0.3, transpose).sum().backward()
        sfused.gatv2_attention_fused(leaves[0], leaves[0], att, rowptr, col, 0.2, 0.3,
                                   transpose).sum().backward()  # fmt: skip
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("conv_name", ["GATConv", "GATv2Conv"])
def test_cuda_patched_layer_steady_state_makes_no_host_sync(conv_name, request, monkeypatch):
    """A patched layer on the kernels (lossless, so nothing is quantized: the layer's own
    wiring is what is checked) makes no host sync once its graph is cached and tuned."""
    for mark in cuda:
        request.applymarker(mark)
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    import torch_geometric.nn as pyg_nn

    from gact_graph import compress_gnn

    torch.manual_seed(0)
    n = 5000
    ei = torch.randint(0, n, (2, 40_000), device="cuda")
    x = torch.randn(n, 32, device="cuda")
    conv = getattr(pyg_nn, conv_name)(32, 16, heads=3).cuda()
    op = (ge, "gat_edge_forward") if conv_name == "GATConv" else (ge2, "gatv2_edge_forward")
    calls = count_calls(monkeypatch, *op)
    compress_gnn(conv, bits=None)
    for _ in range(2):
        conv(x, ei).sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        conv(x, ei).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(calls) == 3  # every call ran on the kernels


# ---------------------------------------------------------------------------- interpreter
test_interpreter_in_subprocess = interpreter_test("not subprocess and not cuda")
