"""SpmmFunction: exact forward/backward, what it saves, and that backward stays O(N F + E)."""

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gact_graph.sparse.adjacency_build import get_adjacency
from gact_graph.sparse.spmm import SpmmFunction, spmm, spmm_reference

warnings.filterwarnings("ignore", message=".*[Ss]parse.*")


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def _graph(n=1823, e=9000, seed=0, weighted=True, dtype=torch.float64):
    """Awkward sizes, isolated nodes, self-loops, duplicate edges."""
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n - 20, (2, e), generator=g)
    ei = torch.cat([ei, torch.tensor([[5, 5, 5, 6], [5, 5, 7, 7]])], dim=1)
    w = torch.rand(ei.size(1), generator=g, dtype=dtype) if weighted else None
    return ei, w, n


def _dense_adj(ei, w, n, dtype=torch.float64):
    a = torch.zeros(n, n, dtype=dtype)
    w = torch.ones(ei.size(1), dtype=dtype) if w is None else w.to(dtype)
    return a.index_put((ei[1], ei[0]), w, accumulate=True)


@pytest.mark.parametrize("reduce", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [True, False])
def test_forward_and_input_grad_match_dense(reduce, weighted):
    ei, w, n = _graph(weighted=weighted)
    adj = get_adjacency(None, ei, n, add_self_loops=False, edge_weight=w)
    x = torch.randn(n, 37, dtype=torch.float64, requires_grad=True)
    a = _dense_adj(ei, w, n)
    cnt = torch.bincount(ei[1], minlength=n).clamp(min=1).to(torch.float64).unsqueeze(-1)
    x_ref = x.detach().clone().requires_grad_()
    ref = a @ x_ref
    if reduce == "mean":
        ref = ref / cnt
    out = spmm(adj, x, reduce=reduce)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(ref)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(
        spmm_reference(adj.rowptr, adj.col, adj.weight, x.detach(), reduce), ref.detach()
    )


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_learnable_weight_gradcheck_and_chunks(reduce):
    ei, w, n = _graph(n=30, e=60, seed=1)
    for keep_perm in (True, False):  # per-call weights with and without a kept perm
        adj = get_adjacency(None, ei, n, add_self_loops=False, edge_weight=w, keep_perm=keep_perm)
        x = torch.randn(n, 3, dtype=torch.float64, requires_grad=True)
        wc = torch.rand(adj.num_edges, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(
            lambda x, wc, adj=adj: SpmmFunction.apply(x, wc, adj, reduce, 2**20), (x, wc)
        )
    # chunking (64 bytes = 1 edge per chunk) gives the same gradient as one chunk
    g = torch.randn(n, 3, dtype=torch.float64)
    grads = [
        torch.autograd.grad(SpmmFunction.apply(x, wc, adj, reduce, cb), (x, wc), g)
        for cb in (64, 2**30)
    ]
    torch.testing.assert_close(grads[0], grads[1])


def test_weight_grad_alone_and_3d_features():
    ei, w, n = _graph(n=300, e=2000, seed=2, dtype=torch.float32)
    adj = get_adjacency(None, ei, n, add_self_loops=True, keep_perm=True)
    x = torch.randn(n, 3, 4)  # e.g. heads x channels: treated as n x 12
    wc = torch.rand(adj.num_edges, requires_grad=True)
    out = spmm(adj, x, wc)
    assert out.shape == (n, 3, 4)
    ref = spmm(adj, x.reshape(n, 12), wc).reshape(n, 3, 4)
    torch.testing.assert_close(out, ref)
    (gw,) = torch.autograd.grad(out.square().sum(), wc)
    a_ei = adj.edge_index()
    xj = x.reshape(n, 12)[a_ei[0]]
    ref_gw = (2 * out.reshape(n, 12)[a_ei[1]] * xj).sum(-1)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-5, atol=1e-5)


def test_empty_graph_and_half_precision():
    n = 10
    adj = get_adjacency(None, torch.empty(2, 0, dtype=torch.long), n, add_self_loops=False)
    x = torch.randn(n, 3, requires_grad=True)
    out = spmm(adj, x, reduce="mean")
    assert torch.equal(out, torch.zeros(n, 3))
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros(n, 3))
    ei, w, n = _graph(n=200, e=900, dtype=torch.float32)
    adj = get_adjacency(None, ei, n, add_self_loops=False, edge_weight=w)
    xb = torch.randn(n, 8).to(torch.bfloat16)
    out = spmm(adj, xb)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), spmm(adj, xb.float()), rtol=2e-2, atol=2e-2)


def test_saves_only_the_shared_adjacency():
    ei, w, n = _graph(n=500, e=3000, dtype=torch.float32)
    adj = get_adjacency(None, ei, n, add_self_loops=True, normalize=True, dtype=torch.float32)
    x = torch.randn(n, 64, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = spmm(adj, x)
    adj_ptrs = {t.data_ptr() for t in adj.tensors()}
    assert saved and all(t.data_ptr() in adj_ptrs for t in saved)
    assert not any(t.dim() == 2 for t in saved)  # nothing node-level (N x F)
    out.sum().backward()
    # learnable weights: the input x is saved (for grad_w), and only it is node-level
    saved.clear()
    adj = adj.explicit()  # normalized weights written out, one a learnable weight per edge
    wc = adj.weight.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        spmm(adj, x, wc)
    node_level = [t for t in saved if t.dim() == 2]
    assert len(node_level) == 1 and node_level[0] is x


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("learnable", [False, True])
def test_backward_never_materializes_edges_times_features(learnable):
    n, e, f = 2000, 200_000, 64  # E x F = 12.8M elements, N x F = 128k
    g = torch.Generator().manual_seed(0)
    ei = torch.randint(0, n, (2, e), generator=g)
    adj = get_adjacency(None, ei, n, add_self_loops=True, normalize=True, dtype=torch.float32)
    if learnable:  # the normalized weights written out, learnable
        adj = adj.explicit()
    x = torch.randn(n, f, requires_grad=True)
    wc = adj.weight.clone().requires_grad_() if learnable else None
    with _LargestTensor() as fwd:
        out = spmm(adj, x, wc, chunk_bytes=2**20)
    with _LargestTensor() as bwd:
        out.backward(torch.randn(n, f))
    limit = max(n * f, adj.num_edges) * 2  # O(N F + E), far below E x F
    assert fwd.largest <= limit and bwd.largest <= limit, (fwd.largest, bwd.largest)
    assert bwd.largest < adj.num_edges * f // 20


def test_cpu_product_makes_one_output_sized_tensor():
    """On CPU the CSR product writes into one fresh buffer (``torch.sparse.mm`` there is
    zeros + addmm, two at once: what a probe or recomputation stacking on backward adds up)."""
    from gact_graph.budget.profile import LiveBytes

    n, f = 3000, 64
    ei = torch.randint(0, n, (2, 8 * n), generator=torch.Generator().manual_seed(0))
    adj = get_adjacency(None, ei, n, add_self_loops=True, normalize=True, dtype=torch.float32)
    x = torch.randn(n, f)
    with torch.no_grad():
        spmm(adj, x)  # the adjacency's lazy CSR views exist before
        with LiveBytes(exclude=[x]) as live:
            out = spmm(adj, x)
    assert n * f * 4 <= live.peak < 1.5 * n * f * 4, live.peak
    ref_adj = adj.explicit()
    ref = spmm_reference(ref_adj.rowptr, ref_adj.col, ref_adj.weight, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_peak_rss_stays_far_below_edges_times_features():
    """End to end: forward+backward of the fused SpMM raises the process's peak RSS by far
    less than one E x F float tensor, while PyG's gather-scatter needs several. (Blocks this
    big are mmapped by the allocator: they always show in the RSS, and leave it when freed.)"""
    from torch_geometric.nn.conv.gcn_conv import gcn_norm
    from torch_geometric.utils import scatter

    from gact_graph.memory import PeakMemory

    n, e, f = 4000, 500_000, 128  # one E x F fp32 tensor: 256 MB; N x F: 2 MB
    torch.manual_seed(0)
    ei = torch.randint(0, n, (2, e))
    x = torch.randn(n, f, requires_grad=True)
    g = torch.randn(n, f)
    adj = get_adjacency(None, ei, n, add_self_loops=True, normalize=True, dtype=torch.float32)
    learnable = adj.explicit()
    w = learnable.weight.clone().requires_grad_()
    adj.transpose()
    ei2, w2 = gcn_norm(ei, None, n)
    runs = {
        "fused": lambda: spmm(adj, x),
        "learnable": lambda: spmm(learnable, x, w, chunk_bytes=8 * 2**20),
        "stock": lambda: scatter(x[ei2[0]] * w2[:, None], ei2[1], 0, dim_size=n, reduce="sum"),
    }
    extra = {}
    for mode, run in runs.items():
        run().backward(g)  # warm up lazy state
        x.grad = w.grad = None
        with PeakMemory() as pm:
            run().backward(g)
        x.grad = w.grad = None
        extra[mode] = pm.peak_bytes - pm.baseline_bytes
    ef = e * f * 4
    assert extra["fused"] < ef / 4, extra
    assert extra["learnable"] < ef / 4, extra
    assert extra["stock"] > ef, extra  # the measurement does see E x F tensors


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_cuda_matches_cpu(reduce):
    ei, w, n = _graph(n=70_001, e=300_000, seed=3, dtype=torch.float32)
    x = torch.randn(n, 48)
    wc_cpu = None
    results = []
    for device in ("cpu", "cuda"):
        adj = get_adjacency(
            None, ei.to(device), n, add_self_loops=True, edge_weight=w.to(device), keep_perm=True
        )
        if wc_cpu is None:
            wc_cpu = torch.rand(adj.num_edges)
        # detached leaves on each device: `.to("cpu")` of a CPU tensor is the tensor itself
        xd = x.to(device).detach().requires_grad_()
        wc = wc_cpu.to(device).detach().requires_grad_()
        out = spmm(adj, xd, wc, reduce)
        out.square().sum().backward()
        results.append([t.detach().cpu() for t in (out, xd.grad, wc.grad)])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
