"""CogDL integration. The ``test`` extra installs CogDL 0.6 (as ``gact_graph[cogdl]`` does), so
CI runs these; CogDL JIT-compiles its C++ extensions the first time it is imported (about a
minute). Skipped only where CogDL is not installed."""

import copy
import sys

import pytest
import torch

cogdl = pytest.importorskip("cogdl")

from cogdl.datasets.planetoid_data import CoraDataset  # noqa: E402
from cogdl.models.nn.gcn import GCN as CogGCN  # noqa: E402

from gact_graph.integrations import cogdl as gact_cogdl  # noqa: E402
from gact_graph.integrations.cogdl import GactModel, compress_cogdl  # noqa: E402
from gact_graph.memory import saved_bytes_stats  # noqa: E402


@pytest.fixture(scope="module")
def cora(cora_root):
    return cora_root, CoraDataset(data_path=str(cora_root))


def _grads(model, graph):
    model.zero_grad(set_to_none=True)
    out = model(graph)
    out[graph.train_mask].log_softmax(-1).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_routed_spmm_is_exact_and_saves_less(cora):
    _, ds = cora
    graph = ds.data
    torch.manual_seed(0)
    stock_model = CogGCN(ds.num_features, 32, ds.num_classes, 3, 0.0)
    ref = _grads(stock_model, graph)
    stock = saved_bytes_stats(stock_model, lambda: stock_model(graph))
    assert gact_cogdl._spmm_utils.spmm is gact_cogdl._ORIGINAL_SPMM

    ctl = compress_cogdl(stock_model, bits=None)
    import cogdl.layers.gcn_layer as gcn_layer

    assert gcn_layer.spmm is gact_cogdl.routed_spmm  # routed while a controller uses it
    got = _grads(stock_model, graph)
    ours = ctl.stats()
    ctl.remove()
    assert gcn_layer.spmm is gact_cogdl._ORIGINAL_SPMM
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-6)
    # stock CogDL (CPU training path) saves the edge indices of every layer; the routed
    # SpMM saves one shared adjacency, counted once
    s_idx = stock["by_kind"]["index"]["orig_bytes"]
    o_idx = ours["by_kind"]["index"]["stored_bytes"]
    s_tot, o_tot = stock["total"]["orig_bytes"], ours["total"]["stored_bytes"]
    print(f"cogdl GCN x3 on Cora: index bytes stock {s_idx}, routed {o_idx}; total {s_tot} {o_tot}")
    assert o_idx < s_idx / 2
    assert ours["total"]["stored_bytes"] < stock["total"]["orig_bytes"]


def test_gat_learnable_edge_weights_match_stock():
    """CogDL's GAT sets its attention as ``graph.edge_weight`` for its edge softmax and
    per-head SpMM: in lossless mode output and every gradient (``a_l``/``a_r`` included) are
    stock's, on a graph whose edges are not in CSR order."""
    from cogdl.data import Graph
    from cogdl.models.nn.gat import GAT

    g = torch.Generator().manual_seed(0)
    edge_index = torch.randint(0, 40, (2, 200), generator=g)
    graph = Graph(x=torch.randn(40, 8, generator=g), edge_index=edge_index)
    torch.manual_seed(1)
    model = GAT(8, 6, 3, num_layers=2, dropout=0.0, attn_drop=0.0, alpha=0.2, nhead=2,
                residual=False, last_nhead=1)  # fmt: skip
    weight = torch.randn(40, 3, generator=g)

    def run(m):
        m.zero_grad(set_to_none=True)
        out = m(graph)
        (out * weight).sum().backward()
        return out.detach(), {n: p.grad for n, p in model.named_parameters()}

    ref_out, ref = run(model)
    wrapped = GactModel(model, bits=None)
    try:
        out, got = run(wrapped)
        paths = dict(wrapped.ctl.module_paths)
    finally:
        wrapped.remove()
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    for k, v in ref.items():
        assert got[k] is not None, k
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-6)
    assert paths["cogdl.spmm (learnable edge weights)"] == "generic (CogDL's own)"


def test_deepcopy_gives_an_independent_compressed_model(cora):
    _, ds = cora
    torch.manual_seed(0)
    model = GactModel(CogGCN(ds.num_features, 16, ds.num_classes, 2, 0.5), bits=2)
    model.train()
    model(ds.data).sum().backward()
    clone = copy.deepcopy(model)
    assert isinstance(clone, GactModel) and clone.ctl is not model.ctl
    assert clone.model is not model.model
    clone(ds.data).sum().backward()
    model(ds.data).sum().backward()
    assert model.controller() is model.ctl  # the last training step ran here
    assert clone.ctl.stats()["total"]["ratio"] > 2
    del clone
    model.remove()
    assert getattr(model.model, "_gact_graph_controller", None) is None


def test_experiment_trains_gcn_on_cora_compressed(cora, tmp_path, monkeypatch, capsys):
    from cogdl import experiment

    root, ds = cora
    monkeypatch.chdir(tmp_path)  # CogDL writes ./checkpoints
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # CogDL's argument parser rewrites argv
    torch.manual_seed(0)
    model = GactModel(CogGCN(ds.num_features, 64, ds.num_classes, 2, 0.5), bits=2)
    epochs = 30
    result = experiment(
        dataset=ds, model=model, epochs=epochs, cpu=True, seed=[0], progress_bar="none",
        checkpoint_path=str(tmp_path / "model.pt"),
    )  # fmt: skip
    (acc,) = [r["test_acc"] for rs in result.values() for r in rs]
    ctl = model.controller()
    total = ctl.stats()["total"]
    with capsys.disabled():
        print(f"\ncogdl experiment GCN on Cora, 2 bits: test acc {acc:.3f}, {total}")
    assert acc > 0.75
    assert ctl.step == epochs - 1  # iterate() ran between the training steps
    assert ctl.module_paths.get("cogdl.spmm") == "sparse-spmm"
    # the graph's own tensors are inputs (free); the shared adjacency is most of what is left
    assert total["ratio"] > 3


def test_doc_example_runs(cora, doc_example, tmp_path, monkeypatch):
    root, _ = cora
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    ns = doc_example.run(
        "cogdl", [('root = "data"', f"root = {str(root)!r}"), ("epochs=200", "epochs=20")]
    )
    assert ns["model"].controller().step == 19
