"""GraphSAINT loaders (Flickr, Reddit = PyG ``Reddit2``, Yelp) read tiny graphs written in
GraphSAINT's exact release format, through PyG's own dataset classes (offline)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from torch_geometric.utils import is_undirected

sp = pytest.importorskip("scipy.sparse")

from gact_graph.datasets import DatasetNotFoundError, evaluate, load_dataset  # noqa: E402

DIRS = {"flickr": "flickr", "reddit": "reddit2", "yelp": "yelp"}
CLASSES = {"flickr": 7, "reddit": 41, "yelp": 100}


def write_graphsaint(root, name: str, num_nodes: int = 50, seed: int = 0) -> dict:
    """``raw/{adj_full.npz, feats.npy, class_map.json, role.json}`` as GraphSAINT ships them."""
    rng = np.random.default_rng(seed)
    raw = os.path.join(root, DIRS[name], "raw")
    os.makedirs(raw)
    pairs = rng.integers(0, num_nodes, (120, 2))
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    adj = sp.coo_matrix(
        (np.ones(len(pairs)), (pairs[:, 0], pairs[:, 1])), shape=(num_nodes, num_nodes)
    )
    adj = ((adj + adj.T) > 0).astype(np.float32).tocsr()  # symmetric, as adj_full is
    sp.save_npz(os.path.join(raw, "adj_full.npz"), adj)
    np.save(os.path.join(raw, "feats.npy"), rng.standard_normal((num_nodes, 6)))
    if name == "yelp":
        labels = (rng.random((num_nodes, CLASSES[name])) < 0.1).astype(int)
        class_map = {str(i): labels[i].tolist() for i in range(num_nodes)}
    else:
        labels = rng.integers(0, CLASSES[name], num_nodes)
        class_map = {str(i): int(labels[i]) for i in range(num_nodes)}
    with open(os.path.join(raw, "class_map.json"), "w") as f:
        json.dump(class_map, f)
    perm = rng.permutation(num_nodes).tolist()
    role = {"tr": perm[:25], "va": perm[25:35], "te": perm[35:]}
    with open(os.path.join(raw, "role.json"), "w") as f:
        json.dump(role, f)
    return {"adj": adj, "labels": labels, "role": role}


@pytest.mark.parametrize("name", ["flickr", "reddit", "yelp"])
def test_graphsaint_loads_release_files(tmp_path, name):
    files = write_graphsaint(tmp_path, name)
    data = load_dataset(name, root=tmp_path)

    assert data.num_nodes == 50
    assert data.x.shape == (50, 6) and data.x.dtype == torch.float32
    assert data.num_classes == CLASSES[name] and data.name == name
    assert is_undirected(data.edge_index, num_nodes=50)
    assert data.edge_index.size(1) == files["adj"].nnz
    keys = data.edge_index[0] * 50 + data.edge_index[1]
    assert bool((keys[1:] > keys[:-1]).all())
    for mask, role in [("train_mask", "tr"), ("val_mask", "va"), ("test_mask", "te")]:
        m = getattr(data, mask)
        assert m.dtype == torch.bool and int(m.sum()) == len(files["role"][role])
        assert bool(m[files["role"][role]].all())
    if name == "yelp":
        assert data.multilabel is True and data.metric == "micro_f1"
        assert data.y.shape == (50, 100) and data.y.dtype == torch.float32
        assert torch.equal(data.y, torch.from_numpy(files["labels"]).float())
    else:
        assert data.multilabel is False and data.metric == "acc"
        assert data.y.shape == (50,) and data.y.dtype == torch.long
        assert torch.equal(data.y, torch.from_numpy(files["labels"]))
        assert 0 <= int(data.y.min()) and int(data.y.max()) < CLASSES[name]


def test_yelp_micro_f1(tmp_path):
    write_graphsaint(tmp_path, "yelp")
    data = load_dataset("yelp", root=tmp_path)
    perfect = data.y * 20 - 10  # positive logit exactly where a label is set
    assert evaluate(data, perfect, data.y, data.test_mask) == 1.0
    assert evaluate("yelp", -perfect, data.y, data.test_mask) == 0.0


def test_graphsaint_missing_files_raise_clear_error(tmp_path):
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset("reddit", root=tmp_path)
    msg = str(err.value)
    for f in ["adj_full.npz", "feats.npy", "class_map.json", "role.json"]:
        assert os.path.join(str(tmp_path), "reddit2", "raw", f) in msg
    assert not (tmp_path / "reddit2").exists()
