"""GCN, GAT, GCNII: shapes, gradients, determinism, adjacency formats, depth, presets."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch_geometric.nn import GATConv, GCN2Conv, GCNConv

from gact_graph.datasets import load_dataset, normalized_adjacency
from gact_graph.models import GAT, GCN, GCNII, MODELS, PRESETS, build_model, preset


@pytest.fixture(scope="module")
def graph():
    data = load_dataset("synthetic", num_nodes=300, seed=0)
    normalized_adjacency(data)
    return data


SMALL = {
    "gcn": {"hidden_channels": 16, "num_layers": 3},
    "gat": {"hidden_channels": 8, "num_layers": 3, "heads": 2, "batch_norm": True},
    "gatv2": {"hidden_channels": 8, "num_layers": 3, "heads": 2, "batch_norm": True},
    "gcnii": {"hidden_channels": 16, "num_layers": 4},
}


def _build(name, data, seed=0, **kwargs):
    torch.manual_seed(seed)
    return build_model(name, data.num_features, data.num_classes, **{**SMALL[name], **kwargs})


def _train_step(model, data, adj=None):
    model.train()
    out = model(data.x, data.edge_index if adj is None else adj)
    loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
    loss.backward()
    return out, loss


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_backward_shapes(graph, name):
    model = _build(name, graph)
    out, loss = _train_step(model, graph)
    assert out.shape == (graph.num_nodes, graph.num_classes)
    assert torch.isfinite(loss)
    for pname, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, pname
        assert torch.isfinite(p.grad).all(), pname


@pytest.mark.parametrize("name", sorted(MODELS))
def test_deterministic_with_seed(graph, name):
    results = []
    for _ in range(2):
        model = _build(name, graph, seed=7)
        torch.manual_seed(123)  # dropout masks
        out, _ = _train_step(model, graph)
        results.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    other = _build(name, graph, seed=8)
    assert any(
        not torch.equal(p, q) for p, q in zip(other.parameters(), _build(name, graph).parameters())
    )


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sparse_adjacency_is_passed_through(graph, name):
    # A torch.sparse adjacency (row = target) gives the same output as edge_index.
    model = _build(name, graph).eval()
    n = graph.num_nodes
    ones = torch.ones(graph.num_edges)
    adj = torch.sparse_coo_tensor(graph.edge_index.flip(0), ones, (n, n)).coalesce()
    with torch.no_grad():
        ref = model(graph.x, graph.edge_index)
        torch.testing.assert_close(model(graph.x, adj), ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model(graph.x, adj.to_sparse_csr()), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["gcn", "gcnii"])
def test_prenormalized_adj_t_matches_edge_index(graph, name):
    model = _build(name, graph).eval()
    pre = _build(name, graph, normalize=False).eval()
    pre.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(
            pre(graph.x, graph.adj_t), model(graph.x, graph.edge_index), rtol=1e-4, atol=1e-5
        )


def test_gcn_edge_weight_is_used(graph):
    model = _build("gcn", graph).eval()
    w = torch.rand(graph.num_edges, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.allclose(
            model(graph.x, graph.edge_index, w), model(graph.x, graph.edge_index)
        )
    with pytest.raises(ValueError, match="edge_weight"):
        _build("gat", graph)(graph.x, graph.edge_index, w)


def test_layers_are_stock_pyg_convs_uncached(graph):
    gcn, gat, gcnii = (_build(n, graph) for n in ("gcn", "gat", "gcnii"))
    assert all(type(c) is GCNConv and not c.cached for c in gcn.convs)
    assert all(type(c) is GATConv for c in gat.convs)
    assert all(type(c) is GCN2Conv and not c.cached for c in gcnii.convs)
    assert len(gcn.bns) == 2 and len(gat.bns) == 2
    # GCNII's beta_l = log(theta / l + 1), l = 1..L.
    assert [c.beta for c in gcnii.convs] == pytest.approx(
        [torch.log(torch.tensor(0.5 / l + 1)).item() for l in range(1, 5)]
    )
    assert gcnii.convs[0].weight2 is None  # shared weights, as in the paper
    assert _build("gcnii", graph, shared_weights=False).convs[0].weight2 is not None


def test_gcn_edits_to_edge_index_are_seen(graph):
    # cached=False by default: a new graph is never answered from a stale normalization.
    model = _build("gcn", graph).eval()
    with torch.no_grad():
        full = model(graph.x, graph.edge_index)
        half = model(graph.x, graph.edge_index[:, ::2])
    assert not torch.allclose(full, half)


@pytest.mark.parametrize(("name", "kwargs"), [
    ("gcn", {"residual": True, "batch_norm": True}),
    ("gat", {"heads": 1, "hidden_channels": 4, "residual": True}),
    ("gcnii", {}),
])  # fmt: skip
def test_deep_variants_at_64_layers(graph, name, kwargs):
    model = _build(name, graph, num_layers=64, **kwargs)
    assert len(model.convs) == 64
    out, loss = _train_step(model, graph)
    assert out.shape == (graph.num_nodes, graph.num_classes) and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_gcnii_builds_and_runs_at_128_layers(graph):
    model = _build("gcnii", graph, num_layers=128, hidden_channels=8)
    out, loss = _train_step(model, graph, graph.adj_t)
    assert torch.isfinite(loss) and model.convs[0].weight1.grad is not None


def test_gcnii_parameter_groups_cover_every_parameter(graph):
    model = _build("gcnii", graph, batch_norm=True)
    groups = model.parameter_groups(0.01, 5e-4)
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    assert [g["weight_decay"] for g in groups] == [0.01, 5e-4]


@pytest.mark.parametrize(("model", "dataset"), [
    (m, d) for m in ("gcn", "gat", "gcnii")
    for d in ("ogbn-arxiv", "synthetic-ogbn-arxiv", "cora", "synthetic")
])  # fmt: skip
def test_presets_build_and_run(graph, model, dataset):
    cfg = preset(model, dataset)
    assert {"model", "lr", "weight_decay", "epochs", "patience"} <= set(cfg)
    net = build_model(model, graph.num_features, graph.num_classes, **cfg["model"])
    if cfg["model"]["num_layers"] > 16:
        return  # depth is exercised by the deep-variant tests
    with torch.no_grad():
        assert net.eval()(graph.x, graph.edge_index).shape == (graph.num_nodes, graph.num_classes)


def test_published_presets():
    arxiv = preset("gcn", "ogbn-arxiv")
    assert arxiv["model"] == {
        "num_layers": 3, "hidden_channels": 256, "dropout": 0.5, "batch_norm": True
    } and (arxiv["lr"], arxiv["epochs"]) == (0.01, 500)  # fmt: skip
    gcnii = preset("gcnii", "ogbn-arxiv")
    assert (gcnii["model"]["num_layers"], gcnii["model"]["hidden_channels"]) == (16, 256)
    assert (gcnii["model"]["dropout"], gcnii["model"]["alpha"], gcnii["lr"]) == (0.1, 0.1, 1e-3)
    gat = preset("gat", "ogbn-arxiv")["model"]
    assert (gat["num_layers"], gat["heads"], gat["activation"]) == (3, 3, "elu")
    assert preset("gcnii", "cora")["model"]["num_layers"] == 64
    assert preset("gat", "pubmed") == preset("gat", "synthetic-cora")  # same family
    preset("gcn", "cora")["model"]["num_layers"] = 99  # a copy: the table is untouched
    assert PRESETS[("gcn", "planetoid")]["model"]["num_layers"] == 2


def test_graph_over_65535_nodes():
    data = load_dataset("synthetic-ogbn-arxiv", num_nodes=70_000, seed=1)
    model = GCN(data.num_features, 8, data.num_classes, num_layers=2)
    out, loss = _train_step(model, data)
    assert out.shape == (70_000, 40) and torch.isfinite(loss)


def test_constructor_validation():
    for cls in (GCN, GAT, GCNII):
        with pytest.raises(ValueError):
            cls(4, 8, 2, num_layers=0)
    with pytest.raises(ValueError):
        GAT(4, 8, 2, activation="tanh")


def test_compressed_gcn_forward_holds_at_most_four_activations():
    """Once what backward needs is compressed, the forward's in-flight fp32 activations are a
    step's peak: a GCN layer's widest moment (its BatchNorm: convolution output, BatchNorm
    output, normalized input) plus the quantizer's block. Names that kept the layer input,
    the previous ReLU output, the projection and the un-biased product alive made it 5.4
    activations, counted as live tensor bytes beyond inputs and parameters."""
    from gact_graph import compress_gnn
    from gact_graph.budget.profile import LiveBytes

    n, f = 20_000, 64
    g = torch.Generator().manual_seed(0)
    x, ei = torch.randn(n, f, generator=g), torch.randint(0, n, (2, 4 * n), generator=g)
    torch.manual_seed(0)
    model = build_model("gcn", f, 8, num_layers=3, hidden_channels=64)
    ctl = compress_gnn(model, bits=2, adaptive=False)
    model(x, ei).sum().backward()  # the shared adjacency and the RNG cache exist before
    static = [x, ei, *model.parameters(), *model.buffers()]
    with LiveBytes(exclude=static) as live:
        model(x, ei)
    ctl.remove()
    assert live.peak <= 4.5 * n * 64 * 4, live.peak / (n * 64 * 4)
