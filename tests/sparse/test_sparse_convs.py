"""Patched PyG convolutions: lossless mode equals stock PyG (outputs and every gradient) for
each adjacency format; remove() restores stock exactly; the adjacency is stored once."""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch_geometric.nn import APPNP, GCN2Conv, GCNConv, GINConv, GraphConv, SAGEConv

from gact_graph import compress_gnn
from gact_graph.memory import saved_bytes_stats
from gact_graph.sparse.convs import LABEL
from tests.devices import DEVICES

warnings.filterwarnings("ignore", message=".*[Ss]parse.*")


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


F_IN, HID = 12, 16
FORMATS = ["edge_index", "coo", "csr", "sparsetensor"]


def _awkward_graph(n=301, e=1500, seed=0):
    """Isolated nodes (the last 7), self-loops (one node with two) and duplicate edges."""
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n - 7, (2, e), generator=g)
    extra = torch.tensor([[4, 4, 4, 8, 8, 20, 20], [4, 4, 9, 8, 3, 21, 21]])
    return torch.cat([ei, extra], dim=1), n


def _as_format(ei, n, fmt, values=None, torch_sparse=None):
    if fmt == "edge_index":
        return ei
    if fmt == "sparsetensor":  # adj_t: row = target, col = source
        return torch_sparse.SparseTensor(row=ei[1], col=ei[0], value=values, sparse_sizes=(n, n))
    vals = torch.ones(ei.size(1)) if values is None else values
    coo = torch.sparse_coo_tensor(torch.stack([ei[1], ei[0]]), vals, (n, n)).coalesce()
    return coo if fmt == "coo" else coo.to_sparse_csr()


def _torch_sparse_for(fmt, request):
    """The `torch_sparse` fixture (tests/fake_torch_sparse.py), for the SparseTensor format only:
    the stand-in patches PyG for the duration of a test."""
    return request.getfixturevalue("torch_sparse") if fmt == "sparsetensor" else None


class Wrap(nn.Module):
    """A root module around one conv (the controller hooks the root's forward)."""

    def __init__(self, conv, kind="plain"):
        super().__init__()
        self.conv, self.kind = conv, kind

    def forward(self, x, adj, ew=None, x0=None):
        if self.kind == "gcn2":
            return self.conv(x, x0, adj, ew)
        return self.conv(x, adj) if ew is None else self.conv(x, adj, ew)


# name -> (factory, kind, takes edge_weight)
CASES = {
    "gcn": (lambda: GCNConv(F_IN, HID), "plain", True),
    "gcn-improved": (lambda: GCNConv(F_IN, HID, improved=True), "plain", True),
    "gcn-no-loops": (lambda: GCNConv(F_IN, HID, add_self_loops=False), "plain", True),
    "gcn-unnormalized": (lambda: GCNConv(F_IN, HID, normalize=False), "plain", True),
    "gcn-cached": (lambda: GCNConv(F_IN, HID, cached=True, bias=False), "plain", False),
    "gcn2": (lambda: GCN2Conv(F_IN, alpha=0.1, theta=0.5, layer=2), "gcn2", True),
    "gcn2-unshared": (lambda: GCN2Conv(F_IN, alpha=0.2, shared_weights=False), "gcn2", False),
    "sage-mean": (lambda: SAGEConv(F_IN, HID), "plain", False),
    "sage-sum": (lambda: SAGEConv(F_IN, HID, aggr="sum"), "plain", False),
    "sage-norm-noroot": (
        lambda: SAGEConv(F_IN, HID, normalize=True, root_weight=False),
        "plain",
        False,
    ),  # fmt: skip
    "sage-project": (lambda: SAGEConv(F_IN, HID, project=True), "plain", False),
    "graphconv": (lambda: GraphConv(F_IN, HID), "plain", True),
    "graphconv-mean": (lambda: GraphConv(F_IN, HID, aggr="mean"), "plain", True),
    "gin": (
        lambda: GINConv(
            nn.Sequential(nn.Linear(F_IN, HID), nn.Tanh(), nn.Linear(HID, HID)), train_eps=True
        ),
        "plain",
        False,
    ),  # fmt: skip
    "appnp": (lambda: APPNP(K=3, alpha=0.1), "plain", True),
}


def _make(case, seed=0):
    factory, kind, _ = CASES[case]
    torch.manual_seed(seed)
    model = Wrap(factory(), kind)
    if case == "gin":
        with torch.no_grad():
            model.conv.eps.fill_(0.3)
    return model


def _run(model, x, adj, ew=None, x0=None, seed=1, calls=1):
    """Forward (``calls`` times: cached layers), loss, grads of x, x0, ew and parameters."""
    x = x.detach().clone().requires_grad_()
    x0 = None if x0 is None else x0.detach().clone().requires_grad_()
    ew = None if ew is None else ew.detach().clone().requires_grad_(ew.requires_grad)
    for _ in range(calls):
        torch.manual_seed(seed)
        out = model(x, adj, ew, x0)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out)
    inputs = [t for t in (x, x0, ew) if t is not None and t.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad((out * g).sum(), inputs + params, allow_unused=True)
    names = ["x", "x0", "ew"][: len(inputs)] if x0 is not None else ["x", "ew"][: len(inputs)]
    names += [n for n, p in model.named_parameters() if p.requires_grad]
    return out.detach(), dict(zip(names, grads))


def _close(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    scale = b.abs().max().item() if b.numel() else 1.0
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(scale, 1.0), msg=what)


def _compare(case, fmt, ew_mode, graph=None, seed=0, torch_sparse=None):
    _, kind, takes_ew = CASES[case]
    ei, n = graph if graph is not None else _awkward_graph(seed=seed)
    g = torch.Generator().manual_seed(seed + 10)
    x = torch.randn(n, F_IN, generator=g)
    x0 = torch.randn(n, F_IN, generator=g) if kind == "gcn2" else None
    ew = None
    values = None
    if ew_mode != "none":
        w = torch.rand(ei.size(1), generator=g) + 0.1
        if fmt == "edge_index":
            ew = w.requires_grad_(ew_mode == "learnable")
        else:
            values = w  # a sparse matrix carries its weights as values
    adj = _as_format(ei, n, fmt, values, torch_sparse)

    stock = _make(case, seed)
    ours = copy.deepcopy(stock)
    calls = 2 if "cached" in case else 1
    ref_out, ref_grads = _run(stock, x, adj, ew, x0, calls=calls)
    ctl = compress_gnn(ours, bits=None, pointwise=False)
    out, grads = _run(ours, x, adj, ew, x0, calls=calls)
    assert ctl.module_paths["conv"] == LABEL, ctl.module_paths["conv"]
    _close(out, ref_out, f"{case}/{fmt}/{ew_mode}: output")
    assert grads.keys() == ref_grads.keys()
    for k in ref_grads:
        _close(grads[k], ref_grads[k], f"{case}/{fmt}/{ew_mode}: grad {k}")
    ctl.remove()
    return ours, stock


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", list(CASES))
def test_lossless_equals_stock(case, fmt, request):
    _compare(case, fmt, "none", torch_sparse=_torch_sparse_for(fmt, request))


@pytest.mark.parametrize("fmt", ["edge_index", "csr", "sparsetensor"])
@pytest.mark.parametrize("case", [c for c, v in CASES.items() if v[2]])
def test_lossless_equals_stock_with_edge_weights(case, fmt, request):
    _compare(case, fmt, "fixed", torch_sparse=_torch_sparse_for(fmt, request))


@pytest.mark.parametrize("case", [c for c, v in CASES.items() if v[2]])
def test_learnable_edge_weights_get_stock_gradients(case):
    _compare(case, "edge_index", "learnable")


@pytest.mark.parametrize("case", ["gcn", "sage-mean"])
def test_graph_with_more_than_65535_nodes(case):
    n, e = 70_003, 200_000
    g = torch.Generator().manual_seed(5)
    ei = torch.randint(0, n, (2, e), generator=g)
    ei[:, :3] = torch.tensor([[70_002, 70_001, 3], [0, 70_002, 70_002]])
    _compare(case, "edge_index", "none", graph=(ei, n))


def test_appnp_edge_dropout_in_training_draws_stocks_masks():
    ei, n = _awkward_graph(seed=3)
    x = torch.randn(n, F_IN)
    for ew in (None, torch.rand(ei.size(1)) + 0.1):
        stock = Wrap(APPNP(K=3, alpha=0.1, dropout=0.4)).train()
        ours = copy.deepcopy(stock)
        ref_out, ref_grads = _run(stock, x, ei, ew, seed=7)
        ctl = compress_gnn(ours, bits=None, pointwise=False)
        out, grads = _run(ours, x, ei, ew, seed=7)
        assert ctl.module_paths["conv"] == LABEL
        _close(out, ref_out, "appnp dropout: output")
        _close(grads["x"], ref_grads["x"], "appnp dropout: grad x")
        ctl.remove()


@pytest.mark.parametrize("case", list(CASES))
def test_remove_restores_stock_bitwise(case):
    ei, n = _awkward_graph(seed=4)
    _, kind, _ = CASES[case]
    x = torch.randn(n, F_IN)
    x0 = torch.randn(n, F_IN) if kind == "gcn2" else None
    never = _make(case)
    model = copy.deepcopy(never)
    ctl = compress_gnn(model, bits=None, pointwise=False)
    assert "forward" in model.conv.__dict__
    model(x, ei, None, x0)
    never(x, ei, None, x0)  # same history for cached layers
    ctl.remove()
    assert "forward" not in model.conv.__dict__
    assert not hasattr(ctl, "_gg_adjacency_cache")
    for p in (None,):
        assert torch.equal(model(x, ei, p, x0), never(x, ei, p, x0))


class ThreeLayerGCN(nn.Module):
    def __init__(self, fresh_copies):
        super().__init__()
        self.convs = nn.ModuleList([GCNConv(F_IN, HID), GCNConv(HID, HID), GCNConv(HID, 4)])
        self.fresh_copies = fresh_copies

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            # fresh_copies: every layer receives another tensor object with equal content
            x = conv(x, edge_index.clone() if self.fresh_copies else edge_index)
            if i < 2:
                x = torch.relu(x)
        return x


@pytest.mark.parametrize("fresh_copies", [False, True])
def test_adjacency_is_stored_once_for_all_layers(fresh_copies):
    ei, n = _awkward_graph(seed=6)
    x = torch.randn(n, F_IN)
    torch.manual_seed(0)
    model = ThreeLayerGCN(fresh_copies)
    stock = saved_bytes_stats(model, lambda: model(x, ei))
    ctl = compress_gnn(model, bits=None)
    out = model(x, ei)
    cache = ctl._gg_adjacency_cache
    assert cache.builds == 1
    (adj,) = list(cache._recent.values())
    idx = ctl.stats()["by_kind"]["index"]
    assert idx["count"] == len(adj.tensors())  # each adjacency tensor recorded once
    assert idx["stored_bytes"] == adj.nbytes
    uses = [r["uses"] for r in ctl.stats()["tensors"] if r["kind"] == "index"]
    assert uses and all(u == 3 for u in uses)  # ...and used by all three layers
    # stock keeps an edge index (and more) per layer
    assert stock["by_kind"]["index"]["orig_bytes"] > 2 * idx["stored_bytes"]
    out.sum().backward()
    ctl.remove()


def test_two_graphs_are_two_adjacencies():
    class TwoGraphs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = GCNConv(F_IN, HID), GCNConv(HID, HID)

        def forward(self, x, e1, e2):
            return self.b(self.a(x, e1), e2)

    e1, n = _awkward_graph(seed=7)
    e2, _ = _awkward_graph(seed=8)
    model = TwoGraphs()
    ctl = compress_gnn(model, bits=None)
    model(torch.randn(n, F_IN), e1, e2).sum().backward()
    adjs = list(ctl._gg_adjacency_cache._recent.values())
    assert len(adjs) == 2
    idx = ctl.stats()["by_kind"]["index"]
    assert idx["stored_bytes"] == sum(a.nbytes for a in adjs)
    ctl.remove()


def test_report_shows_a_truthful_path_for_every_module():
    class MyGCN(GCNConv):
        def message(self, x_j, edge_weight):
            return 2 * super().message(x_j, edge_weight)

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fused = GCNConv(F_IN, HID)
            self.subclass = MyGCN(HID, HID)
            self.maxaggr = SAGEConv(HID, HID, aggr="max")
            self.bip = SAGEConv(HID, HID)
            self.flow = GraphConv(HID, HID, flow="target_to_source")

        def forward(self, x, ei):
            h = self.maxaggr(self.subclass(self.fused(x, ei), ei), ei)
            h = self.bip((h, h[: h.size(0) // 2]), ei[:, ei[1] < h.size(0) // 2])
            return self.flow(torch.cat([h, h]), ei)

    ei, n = _awkward_graph(n=300, seed=9)
    torch.manual_seed(0)
    model = Mixed()
    stock = copy.deepcopy(model)
    x = torch.randn(n, F_IN)
    ctl = compress_gnn(model, bits=None, pointwise=False)
    out = model(x, ei)
    paths = ctl.module_paths
    assert paths["fused"] == LABEL
    assert paths["subclass"] == "generic (subclass MyGCN of GCNConv)"
    assert paths["maxaggr"] == "generic (aggr=max)"
    assert paths["bip"] == "generic (bipartite)"
    assert paths["flow"] == "generic (flow=target_to_source)"
    assert "forward" not in model.subclass.__dict__ and "forward" not in model.flow.__dict__
    report = ctl.report()
    for p in ("fused", "subclass", "maxaggr", "bip", "flow"):
        assert any(line.startswith(p + " ") for line in report.splitlines())
    torch.testing.assert_close(out, stock(x, ei), rtol=1e-5, atol=1e-5)
    ctl.remove()


@pytest.mark.parametrize("kwargs", [dict(sparse=False), dict(opt_level="L0")])
def test_sparse_paths_off(kwargs):
    model = Wrap(GCNConv(F_IN, HID))
    ctl = compress_gnn(model, bits=None, **kwargs)
    assert "forward" not in model.conv.__dict__
    assert not ctl.module_paths.get("conv", "generic").startswith("sparse")
    ctl.remove()


def test_quantized_training_step_runs_and_stays_close():
    """Not exactness (that is lossless mode's job): 8-bit compression with the fused path
    gives gradients close to stock, and backward releases everything it held."""
    ei, n = _awkward_graph(n=2000, e=12000, seed=10)
    x = torch.randn(n, F_IN)
    torch.manual_seed(0)
    model = ThreeLayerGCN(False)
    stock = copy.deepcopy(model)
    ctl = compress_gnn(model, bits=8, min_numel=0)
    model(x, ei).square().sum().backward()
    stock(x, ei).square().sum().backward()
    for p, q in zip(model.parameters(), stock.parameters()):
        rel = ((p.grad - q.grad).norm() / q.grad.norm()).item()
        assert rel < 0.05, rel
    assert ctl.stats()["live_stored_bytes"] == 0
    ctl.remove()


def _max_err(a, ref):
    return 0.0 if a is None else (a.double().cpu() - ref.cpu()).abs().max().item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_device_lossless_equals_stock(case, device):
    """Lossless mode on each device is as exact as stock PyG on that device is (the same body
    runs on CPU in CI, so a mistake visible there fails there). Both are measured against
    stock in float64 on the CPU: stock's CUDA scatter-add sums in a nondeterministic order,
    so a fixed tolerance would either fail stock itself or hide a real error; ours may err
    at most 4x stock's own error (plus fp32 resolution of the value's scale)."""
    _, kind, _ = CASES[case]
    ei, n = _awkward_graph(n=5000, e=40_000, seed=11)
    x = torch.randn(n, F_IN, dtype=torch.float64)
    x0 = torch.randn(n, F_IN, dtype=torch.float64) if kind == "gcn2" else None
    stock = _make(case)
    ref_out, ref_grads = _run(copy.deepcopy(stock).double(), x, ei, None, x0)
    stock = stock.to(device)
    ours = copy.deepcopy(stock)
    xc, x0c = x.float().to(device), None if x0 is None else x0.float().to(device)
    st_out, st_grads = _run(stock, xc, ei.to(device), None, x0c)
    ctl = compress_gnn(ours, bits=None, pointwise=False)
    out, grads = _run(ours, xc, ei.to(device), None, x0c)
    assert ctl.module_paths["conv"] == LABEL
    ctl.remove()
    for k, ref in [("output", ref_out), *ref_grads.items()]:
        got, st = (out, st_out) if k == "output" else (grads[k], st_grads[k])
        if ref is None:
            assert got is None and st is None, k
            continue
        bound = 4 * _max_err(st, ref) + 1e-6 * max(ref.abs().max().item(), 1.0)
        assert _max_err(got, ref) <= bound, f"{case}/{device} {k}: {_max_err(got, ref)} > {bound}"
