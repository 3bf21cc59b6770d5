"""Synthetic stand-ins: real sizes, determinism, structure, and a signal a GNN can learn."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from torch_geometric.utils import homophily, is_undirected

from gact_graph.datasets import (
    DATASETS,
    gcn_normalized_adjacency,
    load_dataset,
    make_synthetic_graph,
)


def _check_structure(data) -> None:
    n = data.num_nodes
    ei = data.edge_index
    assert ei.dtype == torch.long and int(ei.min()) >= 0 and int(ei.max()) < n
    assert is_undirected(ei, num_nodes=n)
    keys = ei[0] * n + ei[1]
    assert bool((keys[1:] > keys[:-1]).all()), "not coalesced"
    assert not bool((ei[0] == ei[1]).any()), "self-loops"
    masks = data.train_mask.long() + data.val_mask.long() + data.test_mask.long()
    assert int(masks.max()) == 1, "splits overlap"


def test_default_synthetic_is_small_and_deterministic():
    a = load_dataset("synthetic", num_nodes=3000, seed=3)
    b = load_dataset("synthetic", num_nodes=3000, seed=3)
    c = load_dataset("synthetic", num_nodes=3000, seed=4)
    _check_structure(a)
    assert torch.equal(a.edge_index, b.edge_index) and torch.equal(a.x, b.x)
    assert torch.equal(a.y, b.y) and torch.equal(a.train_mask, b.train_mask)
    assert not torch.equal(a.y, c.y)
    assert a.x.shape == (3000, 128) and a.num_classes == 16 and a.metric == "acc"
    assert int(a.y.max()) < 16


@pytest.mark.parametrize("name", ["ogbn-arxiv", "flickr", "reddit", "ogbn-products"])
def test_scaled_sizes_follow_the_real_dataset(name):
    info = DATASETS[name]
    scale = 2000 / info.num_nodes
    data = load_dataset(f"synthetic-{name}", scale=scale)
    _check_structure(data)
    assert data.num_nodes == 2000
    assert data.num_features == info.num_features and data.num_classes == info.num_classes
    # Undirected count: 2x the stored edges, or the stored count when stored symmetric.
    stored = round(info.num_edges * scale)
    assert data.num_edges == (2 * (stored // 2) if info.stored_symmetric else 2 * stored)


@pytest.mark.parametrize("name", ["ogbn-arxiv", "flickr"])
def test_edge_homophily_matches_the_real_dataset(name):
    data = load_dataset(f"synthetic-{name}", num_nodes=20_000)
    assert homophily(data.edge_index, data.y) == pytest.approx(DATASETS[name].homophily, abs=0.03)


def test_real_counts_at_full_scale_for_cora():
    data = load_dataset("synthetic-cora")
    _check_structure(data)
    assert data.num_nodes == 2708 and data.num_features == 1433 and data.num_classes == 7
    assert data.num_edges == 2 * 5429
    # Planetoid-style split: 20 per class, 500 validation, 1000 test.
    assert torch.bincount(data.y[data.train_mask]).tolist() == [20] * 7
    assert int(data.val_mask.sum()) == 500 and int(data.test_mask.sum()) == 1000


def test_multilabel_yelp():
    data = load_dataset("synthetic-yelp", num_nodes=3000)
    _check_structure(data)
    assert data.multilabel is True and data.metric == "micro_f1"
    assert data.y.shape == (3000, 100) and data.y.dtype == torch.float32
    assert set(data.y.unique().tolist()) <= {0.0, 1.0}
    per_node = data.y.sum(1)
    assert 1.0 < float(per_node.mean()) < 20.0


def _nearest_centroid_accuracy(h, y, train, test) -> float:
    num_classes = int(y.max()) + 1
    centroids = torch.zeros(num_classes, h.size(1)).index_add_(0, y[train], h[train])
    centroids /= torch.bincount(y[train], minlength=num_classes).clamp(min=1)[:, None]
    pred = torch.cdist(h[test], centroids).argmin(1)
    return (pred == y[test]).float().mean().item()


def test_signal_is_learnable_and_needs_the_graph():
    # Closed-form check, no training: features alone classify poorly, two rounds of GCN
    # propagation classify far better, and both beat chance (1/40) by a wide margin.
    data = load_dataset("synthetic-ogbn-arxiv", num_nodes=8000)
    adj = gcn_normalized_adjacency(data.edge_index, data.num_nodes)
    smoothed = adj @ (adj @ data.x)
    args = (data.y, data.train_mask, data.test_mask)
    acc_x = _nearest_centroid_accuracy(data.x, *args)
    acc_ax = _nearest_centroid_accuracy(smoothed, *args)
    assert acc_x > 3 / 40
    assert acc_ax > acc_x + 0.15


def test_large_graph_over_65535_nodes():
    # Index arithmetic past 2^16 nodes (a known bug class in peer libraries).
    data = load_dataset("synthetic-ogbn-arxiv", num_nodes=70_000)
    _check_structure(data)
    assert data.num_nodes == 70_000 and int(data.edge_index.max()) > 65_535
    assert int(torch.bincount(data.edge_index[0], minlength=70_000).gt(0).sum()) > 65_535


def test_make_synthetic_graph_validates_and_honours_options():
    with pytest.raises(ValueError):
        make_synthetic_graph(100, 100, 4, 3, homophily=1.5)
    pure = make_synthetic_graph(500, 2000, 4, 3, homophily=1.0, seed=1)
    assert homophily(pure.edge_index, pure.y) == 1.0
    assert pure.x.shape == (500, 4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"scale": -1}, "scale must be a finite number > 0, got -1"),
        ({"scale": 0}, "scale must be a finite number > 0, got 0"),
        ({"scale": float("nan")}, "scale must be a finite number > 0"),
        ({"scale": 1e-4}, "scale=0.0001 gives 0 of its 2708 nodes"),
        ({"scale": 1e-3}, "leaves no val / test nodes"),
        ({"num_edges": -10}, "num_edges must be an int >= 0, got -10"),
        ({"num_nodes": 1}, "num_nodes must be an int >= 2, got 1"),
        ({"num_nodes": 50.0}, "num_nodes must be an int >= 2, got 50.0"),
    ],
)
def test_bad_sizes_are_refused_naming_them(kwargs, match):
    """A size that gives no usable graph raises naming it (scale <= 0 gave 2 nodes, 0 edges and
    0 test nodes; a negative num_edges failed in torch's random_)."""
    with pytest.raises(ValueError, match=re.escape(match)):
        load_dataset("synthetic-cora", **kwargs)


def test_an_edgeless_graph_is_a_graph():
    data = load_dataset("synthetic", num_nodes=40, num_edges=0)
    assert data.edge_index.shape == (2, 0) and int(data.test_mask.sum()) > 0


def test_compact_build_is_the_same_graph_without_an_edge_list():
    """``compact=True`` builds the graph straight from its pair keys: the same CSR as
    `compact_adj_t` of the edge-list build (past 2^16 nodes), int32, the same features."""
    from gact_graph.datasets import compact_adj_t, make_synthetic_graph

    kwargs = dict(num_nodes=70_000, num_edges=140_000, num_features=4, num_classes=3)
    full = make_synthetic_graph(**kwargs)
    data = make_synthetic_graph(**kwargs, compact=True)
    assert "edge_index" not in data and torch.equal(data.x, full.x)
    want = compact_adj_t(full.edge_index, full.num_nodes)
    assert data.adj_t.col_indices().dtype == torch.int32
    assert torch.equal(data.adj_t.crow_indices(), want.crow_indices())
    assert torch.equal(data.adj_t.col_indices(), want.col_indices())


def test_a_compact_build_says_no_torch_notice():
    """torch's notices on sparse CSR tensors (said once per process) are the package's own
    business: a fresh process that builds a compact graph with warnings as errors runs."""
    code = (
        "from gact_graph.datasets import load_dataset\n"
        "load_dataset('synthetic', num_nodes=50, compact=True)"
    )
    subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code], check=True)


def test_pairs_to_compact_adj_t_across_chunks():
    """The stable placement holds across chunk boundaries, self-loops (one entry) included."""
    from gact_graph.datasets import compact_adj_t
    from gact_graph.datasets.preprocess import (
        pairs_to_compact_adj_t,
        pairs_to_edge_index,
        sorted_unique_,
    )

    n, g = 50, torch.Generator().manual_seed(0)
    a, b = torch.randint(0, n, (2, 400), generator=g)
    pairs = sorted_unique_(torch.minimum(a, b) * n + torch.maximum(a, b))
    got = pairs_to_compact_adj_t(pairs, n, chunk=37)
    want = compact_adj_t(pairs_to_edge_index(pairs.clone(), n), n)
    assert torch.equal(got.crow_indices(), want.crow_indices())
    assert torch.equal(got.col_indices(), want.col_indices())
