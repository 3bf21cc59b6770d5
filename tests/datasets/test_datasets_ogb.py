"""OGB loaders read tiny graphs written in OGB's exact on-disk format, through
``PygNodePropPredDataset`` itself (offline)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch_geometric.utils import is_undirected

pytest.importorskip("ogb")
pd = pytest.importorskip("pandas")

from gact_graph.datasets import DatasetNotFoundError, evaluate, load_dataset  # noqa: E402


def _csv(path, array) -> None:
    pd.DataFrame(array).to_csv(path, header=False, index=False, compression="gzip")


def write_ogbn(root, name: str, num_nodes: int = 60, num_edges: int = 150, seed: int = 0):
    """An ``ogbn-arxiv``/``ogbn-products`` folder as ``arxiv.zip``/``products.zip`` unpack."""
    rng = np.random.default_rng(seed)
    arxiv = name == "ogbn-arxiv"
    base = os.path.join(root, "ogbn_arxiv" if arxiv else "ogbn_products")
    split = "time" if arxiv else "sales_ranking"
    num_classes = 40 if arxiv else 47
    os.makedirs(os.path.join(base, "raw"))
    os.makedirs(os.path.join(base, "split", split))
    raw = os.path.join(base, "raw")
    edges = rng.integers(0, num_nodes, (num_edges, 2))
    edges = edges[edges[:, 0] != edges[:, 1]]
    _csv(os.path.join(raw, "edge.csv.gz"), edges)
    _csv(os.path.join(raw, "node-feat.csv.gz"), rng.standard_normal((num_nodes, 8)))
    labels = rng.integers(0, num_classes, (num_nodes, 1))
    labels[0, 0], labels[1, 0] = 0, num_classes - 1
    _csv(os.path.join(raw, "node-label.csv.gz"), labels)
    _csv(os.path.join(raw, "num-node-list.csv.gz"), np.array([[num_nodes]]))
    _csv(os.path.join(raw, "num-edge-list.csv.gz"), np.array([[len(edges)]]))
    if arxiv:
        _csv(os.path.join(raw, "node_year.csv.gz"), rng.integers(1990, 2021, (num_nodes, 1)))
    perm = rng.permutation(num_nodes)
    parts = {"train": perm[:30], "valid": perm[30:40], "test": perm[40:]}
    for part, idx in parts.items():
        _csv(os.path.join(base, "split", split, f"{part}.csv.gz"), idx[:, None])
    with open(os.path.join(base, "RELEASE_v1.txt"), "w") as f:
        f.write("ogb release v1\n")
    return edges, labels[:, 0], parts


def _assert_coalesced_undirected(edge_index, num_nodes) -> None:
    assert edge_index.dtype == torch.long
    assert is_undirected(edge_index, num_nodes=num_nodes)
    keys = edge_index[0] * num_nodes + edge_index[1]
    assert bool((keys[1:] > keys[:-1]).all()), "not sorted and duplicate-free"


@pytest.mark.parametrize("name", ["ogbn-arxiv", "ogbn-products"])
def test_ogbn_loads_from_raw_files(tmp_path, name):
    edges, labels, parts = write_ogbn(tmp_path, name)
    data = load_dataset(name, root=tmp_path)

    assert data.num_nodes == 60
    assert data.x.shape == (60, 8) and data.x.dtype == torch.float32
    assert data.y.shape == (60,) and data.y.dtype == torch.long
    assert torch.equal(data.y, torch.from_numpy(labels))
    assert int(data.y.min()) >= 0 and int(data.y.max()) < data.num_classes
    assert data.num_classes == (40 if name == "ogbn-arxiv" else 47)
    assert data.multilabel is False and data.metric == "acc" and data.name == name
    _assert_coalesced_undirected(data.edge_index, 60)
    # Every stored edge survives in both directions.
    present = set(map(tuple, data.edge_index.t().tolist()))
    assert all((s, d) in present and (d, s) in present for s, d in edges.tolist())
    assert data.edge_index.size(1) == len({(min(e), max(e)) for e in edges.tolist()}) * 2
    for mask, part in [("train_mask", "train"), ("val_mask", "valid"), ("test_mask", "test")]:
        m = getattr(data, mask)
        assert m.dtype == torch.bool and int(m.sum()) == len(parts[part])
        assert bool(m[torch.from_numpy(parts[part])].all())
    assert not bool((data.train_mask & data.test_mask).any())
    if name == "ogbn-arxiv":
        assert data.node_year.shape == (60, 1)


def test_ogbn_second_load_uses_processed_file(tmp_path):
    write_ogbn(tmp_path, "ogbn-arxiv")
    first = load_dataset("ogbn-arxiv", root=tmp_path)
    processed = tmp_path / "ogbn_arxiv" / "processed" / "geometric_data_processed.pt"
    assert processed.is_file()
    # Processing inputs are no longer needed once processed (torch.load under torch >= 2.6).
    os.remove(tmp_path / "ogbn_arxiv" / "raw" / "node-label.csv.gz")
    second = load_dataset("ogbn-arxiv", root=tmp_path)
    assert torch.equal(first.edge_index, second.edge_index)
    assert torch.equal(first.x, second.x) and torch.equal(first.y, second.y)


def test_ogbn_evaluate_uses_ogb_evaluator(tmp_path):
    write_ogbn(tmp_path, "ogbn-arxiv")
    data = load_dataset("ogbn-arxiv", root=tmp_path)
    logits = torch.randn(data.num_nodes, 40, generator=torch.Generator().manual_seed(0))
    logits[data.test_mask, data.y[data.test_mask]] += 100.0  # test nodes all right
    assert evaluate("ogbn-arxiv", logits, data.y, data.test_mask) == 1.0
    expected = (logits.argmax(-1) == data.y)[data.train_mask].float().mean().item()
    assert evaluate(data, logits, data.y, data.train_mask) == pytest.approx(expected)


def test_ogbn_missing_files_raise_clear_error(tmp_path):
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset("ogbn-arxiv", root=tmp_path)
    msg = str(err.value)
    assert os.path.join(str(tmp_path), "ogbn_arxiv", "raw", "edge.csv.gz") in msg
    assert "split/time/train.csv.gz" in msg and "RELEASE_v1.txt" in msg
    assert "arxiv.zip" in msg
    assert not (tmp_path / "ogbn_arxiv").exists()  # nothing created, nothing downloaded


def test_ogbn_missing_release_file_does_not_prompt(tmp_path):
    # OGB would ask on stdin whether to re-download when RELEASE_v1.txt is absent.
    write_ogbn(tmp_path, "ogbn-arxiv")
    os.remove(tmp_path / "ogbn_arxiv" / "RELEASE_v1.txt")
    with pytest.raises(DatasetNotFoundError, match="RELEASE_v1.txt"):
        load_dataset("ogbn-arxiv", root=tmp_path)


def test_ogbn_compact_gives_the_graph_as_a_compact_adj_t(tmp_path):
    from gact_graph.datasets import compact_adj_t

    write_ogbn(tmp_path, "ogbn-products")
    full = load_dataset("ogbn-products", root=tmp_path)
    data = load_dataset("ogbn-products", root=tmp_path, compact=True)
    assert "edge_index" not in data and torch.equal(data.x, full.x)
    want = compact_adj_t(full.edge_index, full.num_nodes)
    assert torch.equal(data.adj_t.crow_indices(), want.crow_indices())
    assert torch.equal(data.adj_t.col_indices(), want.col_indices())
