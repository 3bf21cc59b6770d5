"""``load_dataset``/``evaluate`` dispatch and the cached normalized adjacency."""

from __future__ import annotations

import pytest
import torch
from torch_geometric.nn.conv.gcn_conv import gcn_norm

from gact_graph.datasets import (
    DatasetNotFoundError,
    accuracy,
    available_datasets,
    evaluate,
    gcn_normalized_adjacency,
    load_dataset,
    micro_f1,
    normalized_adjacency,
    undirected_coalesced,
)


def test_available_names_and_unknown_name():
    names = available_datasets()
    for name in ["ogbn-arxiv", "ogbn-products", "flickr", "reddit", "yelp", "cora",
                 "citeseer", "pubmed", "synthetic", "synthetic-ogbn-arxiv"]:  # fmt: skip
        assert name in names
    with pytest.raises(KeyError, match="unknown dataset"):
        load_dataset("not-a-dataset", root="/nonexistent")


@pytest.mark.parametrize("name", [None, 3, b"cora"])
def test_a_name_that_is_not_a_string_is_a_type_error(name):
    with pytest.raises(TypeError, match=r"load_dataset expects a dataset name \(str\), got"):
        load_dataset(name)


def test_unknown_loader_option(tmp_path):
    with pytest.raises(TypeError):
        load_dataset("flickr", root=tmp_path, normalize_features=True)


def test_missing_real_dataset_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError):  # DatasetNotFoundError subclasses it
        load_dataset("flickr", root=tmp_path)
    assert issubclass(DatasetNotFoundError, FileNotFoundError)


def test_metrics():
    logits = torch.tensor([[2.0, 1.0], [0.0, 3.0], [1.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([0, 1, 1, 1])
    assert accuracy(logits, y) == 0.75
    assert evaluate("cora", logits, y, torch.tensor([True, True, False, False])) == 1.0
    assert evaluate("synthetic", logits, y) == 0.75
    ml_logits = torch.tensor([[1.0, -1.0, 1.0], [-1.0, -1.0, 1.0]])
    ml_y = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    # tp = 2, fp = 1, fn = 1 -> 2 * 2 / (4 + 1 + 1)
    assert micro_f1(ml_logits, ml_y) == pytest.approx(4 / 6)
    assert evaluate("yelp", ml_logits, ml_y) == pytest.approx(4 / 6)
    assert evaluate("synthetic-yelp", ml_logits, ml_y) == pytest.approx(4 / 6)


def test_undirected_coalesced():
    ei = torch.tensor([[0, 1, 1, 3, 0], [1, 0, 2, 3, 1]])
    out = undirected_coalesced(ei, 4)
    assert out.tolist() == [[0, 1, 1, 2, 3], [1, 0, 2, 1, 3]]


def test_normalized_adjacency_matches_gcn_norm_and_is_cached():
    data = load_dataset("synthetic", num_nodes=400)
    assert "adj_t" not in data
    adj = normalized_adjacency(data)
    assert adj.layout == torch.sparse_csr and adj.shape == (400, 400)
    assert normalized_adjacency(data) is adj and data.adj_t is adj
    ei, w = gcn_norm(data.edge_index, num_nodes=400)
    dense = torch.zeros(400, 400).index_put_((ei[1], ei[0]), w, accumulate=True)
    torch.testing.assert_close(adj.to_dense(), dense)
    eager = load_dataset("synthetic", num_nodes=400, adj_t=True)
    torch.testing.assert_close(eager.adj_t.to_dense(), dense)


def test_normalized_adjacency_keeps_existing_self_loop_weight():
    ei = torch.tensor([[0, 1, 1], [1, 0, 1]])
    w = torch.tensor([1.0, 1.0, 3.0])
    adj = gcn_normalized_adjacency(ei, 2, w).to_dense()
    ref_ei, ref_w = gcn_norm(ei, w, num_nodes=2)
    ref = torch.zeros(2, 2).index_put_((ref_ei[1], ref_ei[0]), ref_w, accumulate=True)
    torch.testing.assert_close(adj, ref)


def test_compact_and_normalized_adj_t_are_one_or_the_other():
    with pytest.raises(ValueError, match="both set data.adj_t"):
        load_dataset("synthetic", num_nodes=50, adj_t=True, compact=True)
