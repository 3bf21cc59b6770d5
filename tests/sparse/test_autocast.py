"""Mixed precision: every fused graph path under `torch.autocast`, bf16 and fp16, CPU and CUDA.

What stock does there, and so what we check: an autocast ``Linear`` hands the convolution
bf16/fp16 features, and PyG's message passing (gather, ``w * x_j``, scatter) holds no op that
autocast lowers, so its results promote (fp32 GCN weights times bf16 features give fp32). The
fused paths must give the output dtype stock gives, gradients in the dtypes of the parameters,
and, lossless, values as close to stock as stock is to itself in fp32:

    rel_err(ours, stock) <= K * max(rel_err(stock, fp32 run), u)

per output and per gradient (relative L2 error; ``u`` the unit roundoff of the autocast dtype,
a floor for tensors stock happens to get almost exact). Two results that are each about as far
from fp32 differ by up to ~sqrt(2) times that. Measured with the models below (1000 nodes, 12
seeds): worst ratio 1.20 over every path but GATv2, and 1.48 for the `torch.sparse` inputs, so
K = 3. GATv2 gets K = 5: its gradients of ``x_r`` flow only through the slope changes of
``leaky_relu(x_j + x_i)`` across a node's edges (the softmax gradient sums to zero per node), so
single sign flips of near-zero sums move them by percents, stock's luck included; over 100 seeds
its worst ratio was 3.47 (fp16; median 1.05) and 2.25 (bf16), always in ``lin_r``'s gradients.

The models put no ReLU between the layers on purpose: a ReLU makes the comparison hinge on the
sign of single near-zero pre-activations (one flip moves a 16k-element gradient by ~2%, stock
included); pointwise ops are compared on their own in tests/ops/test_ops_autocast.py.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import (
    APPNP,
    GATConv,
    GATv2Conv,
    GCN2Conv,
    GCNConv,
    GINConv,
    GraphConv,
    SAGEConv,
)
from torch_geometric.utils import to_torch_csr_tensor

from gact_graph import compress_gnn
from gact_graph.models import GAT, GCN, GCNII
from gact_graph.sparse.adjacency_build import get_adjacency
from gact_graph.sparse.gat import gat_attention
from gact_graph.sparse.gatv2 import gatv2_attention
from gact_graph.sparse.spmm import spmm
from tests.devices import AUTOCAST_DTYPES, DEVICES, UNIT_ROUNDOFF, train_under_autocast

warnings.filterwarnings("ignore", message=".*[Ss]parse.*")

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

DTYPES = AUTOCAST_DTYPES
U = UNIT_ROUNDOFF
K = 3.0
#: GATv2's tolerance factor (module docstring)
K_GATV2 = 5.0
H = 16

#: kind -> (label ctl.module_paths shows for the fused path, convolution factory)
CONVS = {
    "gcn": ("sparse-spmm", lambda: GCNConv(H, H)),
    "gcn_learnable_weights": ("sparse-spmm", lambda: GCNConv(H, H)),
    "sage_mean": ("sparse-spmm", lambda: SAGEConv(H, H)),
    "sage_sum": ("sparse-spmm", lambda: SAGEConv(H, H, aggr="sum")),
    "graph": ("sparse-spmm", lambda: GraphConv(H, H)),
    "gin": ("sparse-spmm", lambda: GINConv(nn.Linear(H, H), train_eps=True)),
    "appnp": ("sparse-spmm", lambda: APPNP(K=2, alpha=0.1)),
    "appnp_edge_dropout": ("sparse-spmm", lambda: APPNP(K=2, alpha=0.1, dropout=0.2)),
    "gcn2": ("sparse-spmm", lambda: GCN2Conv(H, alpha=0.1, theta=0.5, layer=1)),
    "gat": ("sparse-fused", lambda: GATConv(H, 4, heads=4)),
    "gatv2": ("sparse-fused", lambda: GATv2Conv(H, 4, heads=4)),
}
#: the SpMM paths that also take a `torch.sparse` adjacency
SPARSE_INPUT = ["gcn", "sage_mean", "graph", "gin", "appnp", "gcn2"]


def _skip_unsupported(device, dtype):
    if device == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")


class Net(nn.Module):
    """conv on the fp32 input -> autocast Linear (bf16/fp16 out) -> conv on that -> head."""

    def __init__(self, kind: str, num_edges: int):
        super().__init__()
        self.convs = nn.ModuleList(CONVS[kind][1]() for _ in range(2))
        self.lin = nn.Linear(H, H)
        self.head = nn.Linear(H, 4)
        learnable = kind == "gcn_learnable_weights"
        self.edge_weight = nn.Parameter(torch.rand(num_edges) + 0.5) if learnable else None

    def _conv(self, conv, x, edge_index, edge_weight):
        if self.edge_weight is not None:
            edge_weight = self.edge_weight
        if isinstance(conv, GCN2Conv):
            return conv(x, x, edge_index)
        if isinstance(conv, (GCNConv, GraphConv)):
            return conv(x, edge_index, edge_weight)
        return conv(x, edge_index)

    def forward(self, x, edge_index, edge_weight=None):
        h = self.lin(self._conv(self.convs[0], x, edge_index, edge_weight))
        return self.head(self._conv(self.convs[1], h, edge_index, edge_weight))


def _graph(n, seed, device):
    """Random graph with duplicate edges and self-loops, positive edge weights, and 4 classes
    read off the features (learnable in a few steps)."""
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, 5 * n), generator=g)
    ew = torch.rand(ei.size(1), generator=g) + 0.5
    x = torch.randn(n, H, generator=g)
    y = (x @ torch.randn(H, 4, generator=g)).argmax(-1)
    return x.to(device), ei.to(device), ew.to(device), y.to(device)


def _run(model, x, graph, edge_weight, y, device, dtype, autocast=True):
    """(output, [grad x, grads of the parameters]) of one forward/backward; the same dropout
    draws on every call."""
    torch.manual_seed(123)
    x = x.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=dtype, enabled=autocast):
        out = model(x, graph, edge_weight)
    F.cross_entropy(out.float(), y).backward()
    return out.detach(), [x.grad] + [p.grad for p in model.parameters()]


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _tensors(result):
    out, grads = result
    return [out, *grads]


def _assert_as_accurate(ours, stock, stock_fp32, dtype, k=K, ours_fp32=None):
    """Output and every gradient: the dtype stock gives (gradients: the parameters' fp32), and
    values within ``k`` x stock's own error (module docstring). Measured as the distance to stock
    when both ran on the same graph, else (``ours_fp32``: our fp32 run) to our fp32 run."""
    ours_ref = None if ours_fp32 is None else _tensors(ours_fp32)
    triples = zip(_tensors(ours), _tensors(stock), _tensors(stock_fp32))
    for i, (a, s, s_ref) in enumerate(triples):
        assert a.dtype == s.dtype, i
        tol = k * max(_rel(s, s_ref), U[dtype])
        err = _rel(a, s) if ours_ref is None else _rel(a, ours_ref[i])
        assert err <= tol, f"tensor {i}: error {err:.2e} > {tol:.2e}"


# ---------------------------------------------------------------------------- lossless vs stock
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(CONVS))
def test_lossless_matches_stock(kind, dtype, device):
    _skip_unsupported(device, dtype)
    torch.manual_seed(0)
    x, ei, ew, y = _graph(1000, 0, device)
    model = Net(kind, ei.size(1)).to(device)
    ref = _run(model, x, ei, ew, y, device, dtype, autocast=False)
    stock = _run(model, x, ei, ew, y, device, dtype)
    ctl = compress_gnn(model, bits=None)
    try:
        ours = _run(model, x, ei, ew, y, device, dtype)
        assert ctl.module_paths["convs.0"] == ctl.module_paths["convs.1"] == CONVS[kind][0]
    finally:
        ctl.remove()
    _assert_as_accurate(ours, stock, ref, dtype, k=K_GATV2 if kind == "gatv2" else K)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", SPARSE_INPUT)
def test_sparse_adjacency_input(kind, dtype, device):
    """A `torch.sparse` adjacency takes the fused path too. Stock multiplies it with
    `torch.sparse.mm`, which autocast lowers, and on CPU the sparse library has no bf16/fp16
    kernel (stock raises); ours runs and is as accurate as stock's edge_index path."""
    _skip_unsupported(device, dtype)
    torch.manual_seed(0)
    x, ei, _, y = _graph(1000, 1, device)
    adj_t = to_torch_csr_tensor(ei.flip(0), size=(x.size(0), x.size(0)))
    model = Net(kind, ei.size(1)).to(device)
    ref_stock = _run(model, x, ei, None, y, device, dtype, autocast=False)
    stock = _run(model, x, ei, None, y, device, dtype)
    ref_ours = _run(model, x, adj_t, None, y, device, dtype, autocast=False)
    ctl = compress_gnn(model, bits=None)
    try:
        ours = _run(model, x, adj_t, None, y, device, dtype)
        assert ctl.module_paths["convs.0"] == ctl.module_paths["convs.1"] == CONVS[kind][0]
    finally:
        ctl.remove()
    _assert_as_accurate(ours, stock, ref_stock, dtype, ours_fp32=ref_ours)


# ---------------------------------------------------------------------------- 2-bit training
def _train(model, x, graph, edge_weight, y, device, dtype, bits=2, steps=10, lr=0.05):
    """Losses of ``steps`` Adam steps under autocast (``bits=None``: uncompressed stock), the
    controller's stats of the last step and its module paths. fp16 uses a GradScaler, as fp16
    training does."""
    return train_under_autocast(model, (x, graph, edge_weight), y, device, dtype, bits, steps, lr)


def _assert_trains(make_model, x, graph, edge_weight, y, device, dtype, conv_label):
    """2-bit training under autocast decreases the loss by at least half as much as stock
    training does in the same steps, its convolutions run the fused path, and bf16/fp16
    activations went through the quantizer at 2 bits."""
    torch.manual_seed(0)
    stock, _, _ = _train(make_model(), x, graph, edge_weight, y, device, dtype, bits=None)
    torch.manual_seed(0)
    losses, stats, paths = _train(make_model(), x, graph, edge_weight, y, device, dtype)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert stock[0] - stock[-1] > 0.02, stock  # the task is learnable in these steps
    assert losses[0] - losses[-1] >= 0.5 * (stock[0] - stock[-1]), (losses, stock)
    convs = {p for name, p in paths.items() if name.startswith("convs.") and name.count(".") == 1}
    assert convs == {conv_label}, paths
    low = str(dtype).removeprefix("torch.")
    assert any(r["dtype"] == low and r["bits"] == 2 for r in stats["tensors"]), stats["tensors"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(CONVS))
def test_two_bit_trains(kind, dtype, device):
    _skip_unsupported(device, dtype)
    x, ei, ew, y = _graph(400, 2, device)
    _assert_trains(
        lambda: Net(kind, ei.size(1)).to(device), x, ei, ew, y, device, dtype, CONVS[kind][0]
    )


MODELS = {
    "gcn": lambda: GCN(H, 32, 4, num_layers=3, dropout=0.2, batch_norm=True),
    "gat": lambda: GAT(H, 8, 4, num_layers=2, heads=2, dropout=0.2, attn_dropout=0.1),
    "gcnii": lambda: GCNII(H, 32, 4, num_layers=4, dropout=0.2, batch_norm=True),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(MODELS))
def test_models_train_two_bit(name, dtype, device):
    """The package's models end to end (the issue's report: GCN raised under autocast):
    convolutions, BatchNorm, ReLU/ELU and dropout all on their compressed paths."""
    _skip_unsupported(device, dtype)
    x, ei, _, y = _graph(400, 3, device)
    label = "sparse-fused" if name == "gat" else "sparse-spmm"
    _assert_trains(lambda: MODELS[name]().to(device), x, ei, None, y, device, dtype, label)


# ---------------------------------------------------------------------------- the Functions
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_spmm_dtypes_follow_pyg_messages(dtype, device):
    """Under autocast ``A @ x`` promotes like PyG's ``w * x_j`` (fp32 weights, low-precision
    features: fp32), has the features' dtype without weights, and hands gradients back in the
    dtypes of ``x`` and of the weights; outside autocast it keeps ``x``'s dtype."""
    _skip_unsupported(device, dtype)
    x, ei, _, _ = _graph(300, 4, device)
    x = x.to(dtype).requires_grad_()
    weighted = get_adjacency(
        None, ei, 300, add_self_loops=True, normalize=True, dtype=torch.float32
    )
    plain = get_adjacency(None, ei, 300, add_self_loops=False)
    learnable = torch.rand(plain.num_edges, device=device, requires_grad=True)
    with torch.autocast(device, dtype=dtype):
        assert spmm(weighted, x).dtype == torch.float32
        assert spmm(plain, x, reduce="mean").dtype == dtype
        out = spmm(plain, x, learnable)
    assert out.dtype == torch.float32
    gx, gw = torch.autograd.grad(out.sum(), (x, learnable))
    assert gx.dtype == dtype and gw.dtype == torch.float32
    assert spmm(weighted, x).dtype == dtype


def _seeded(fn, *args, **kwargs):
    torch.manual_seed(7)  # the same attention-dropout mask in every call
    return fn(*args, **kwargs)


def _function_cases(device, dtype):
    """(name, fn(*inputs) -> output, inputs) for the fused autograd Functions: bf16/fp16
    node features as an autocast Linear gives them, fp32 weights and attention vectors."""
    g = torch.Generator().manual_seed(5)
    n = 200
    ei = torch.randint(0, n, (2, 1000), generator=g).to(device)

    def feats(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    adj = get_adjacency(None, ei, n, add_self_loops=True, normalize=True, dtype=torch.float32)
    plain = get_adjacency(None, ei, n, add_self_loops=False, keep_perm=True)
    w = torch.rand(plain.num_edges, generator=g).to(device)
    gat_adj = get_adjacency(None, ei, n, add_self_loops=True, loop_mode="replace")
    rc = (gat_adj.rowptr, gat_adj.col)
    a_src, a_dst = torch.randn(n, 2, generator=g), torch.randn(n, 2, generator=g)
    att = torch.randn(1, 2, 8, generator=g).to(device)
    return [
        ("spmm", lambda x: spmm(adj, x), [feats(n, 8)]),
        ("spmm_learnable_weights", lambda x, w: spmm(plain, x, w), [feats(n, 8), w]),
        (
            "gat",
            lambda x, s, d: _seeded(gat_attention, x, s, d, *rc, dropout=0.3),
            [feats(n, 2, 8), a_src.to(device), a_dst.to(device)],
        ),
        (
            "gatv2",
            lambda xl, xr, att: _seeded(gatv2_attention, xl, xr, att, *rc, dropout=0.3),
            [feats(n, 2, 8), feats(n, 2, 8), att],
        ),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_inside_autocast_equals_outside(dtype, device):
    """``loss.backward()`` called inside the autocast region (allowed, if not recommended) gives
    the very gradients of a backward outside: the Functions choose their own dtypes there too
    (before the fix the CPU SpMM raised, and GATv2's attention gradient ran its bmm in bf16)."""
    _skip_unsupported(device, dtype)
    for name, fn, inputs in _function_cases(device, dtype):
        inputs = [t.requires_grad_() for t in inputs]
        grads = []
        for inside in (True, False, False):
            with torch.autocast(device, dtype=dtype):
                out = fn(*inputs)
                if inside:
                    grads.append(torch.autograd.grad(out.float().square().sum(), inputs))
            if not inside:
                grads.append(torch.autograd.grad(out.float().square().sum(), inputs))
        for g_in, g_out, g_again, t in zip(*grads, inputs):
            assert g_in.dtype == t.dtype, name
            if device == "cpu":
                assert torch.equal(g_in, g_out), name
                continue
            # CUDA's atomic scatter-adds sum in any order: two backwards outside differ by
            # rounding already, and where the fp32 sum lies near a rounding boundary of the
            # input's dtype, its final cast flips by one unit in the last place (H200, bf16
            # GATv2: one element 2^-10 apart, both runs outside equal). So each element may
            # be one ulp of its dtype off, and few may be: a bf16 matmul in backward would
            # move most elements, by ~1e-3 relative.
            spread = (g_out - g_again).abs().max().item()
            scale = g_out.abs().max().item()
            diff = (g_in - g_out).float().abs()
            ulp = g_out.float().abs() * torch.finfo(t.dtype).eps  # spacing at |x| <= eps |x|
            assert (diff <= max(4 * spread, 1e-5 * scale) + ulp).all(), name
            if t.dtype in (torch.bfloat16, torch.float16):
                # flips happen as often as the two runs outside differ (H200: GATv2's bf16 x_l
                # 2-4 % of elements, one element in another run), not on most elements
                flipped = ((g_in != g_out) & (g_out == g_again)).float().mean().item()
                apart = (g_out != g_again).float().mean().item()
                assert flipped <= 2 * apart + 0.01, (name, flipped, apart)
