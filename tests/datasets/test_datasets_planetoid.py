"""Planetoid loaders: the real Cora (copied from the shared read-only data) and tiny
CiteSeer/PubMed files in the original ``ind.<name>.*`` pickle format."""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import types
import zipfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from torch_geometric.utils import is_undirected

from gact_graph.datasets import (
    DatasetNotFoundError,
    ProcessedDataError,
    RawDataError,
    load_dataset,
)

sp = pytest.importorskip("scipy.sparse")


def test_real_cora_public_split(cora_root):
    data = load_dataset("cora", root=cora_root)

    assert data.num_nodes == 2708
    assert data.x.shape == (2708, 1433) and data.x.dtype == torch.float32
    assert data.edge_index.size(1) == 10556  # 5,278 undirected edges after PyG's cleaning
    assert is_undirected(data.edge_index, num_nodes=2708)
    assert data.y.shape == (2708,) and data.y.dtype == torch.long
    assert int(data.y.min()) == 0 and int(data.y.max()) == 6 and data.num_classes == 7
    assert [int(m.sum()) for m in (data.train_mask, data.val_mask, data.test_mask)] == [
        140,
        500,
        1000,
    ]
    assert torch.bincount(data.y[data.train_mask]).tolist() == [20] * 7
    assert data.metric == "acc" and data.multilabel is False and data.name == "cora"
    # Row-normalized bag of words (NormalizeFeatures), unless asked for the raw 0/1 features.
    torch.testing.assert_close(data.x.sum(1), torch.ones(2708))
    raw = load_dataset("cora", root=cora_root, normalize_features=False)
    assert set(raw.x.unique().tolist()) == {0.0, 1.0}
    torch.testing.assert_close(data.x, raw.x / raw.x.sum(1, keepdim=True))


def write_planetoid(raw_dir, prefix: str, *, gaps: bool, seed: int = 0) -> dict:
    """Tiny ``ind.<prefix>.*`` files. Planetoid's public split needs 500 validation nodes
    right after the training nodes, so the graph has ~560 nodes. ``gaps`` leaves test indices
    unused, like CiteSeer's isolated nodes."""
    rng = np.random.default_rng(seed)
    num_classes, feats, num_train, num_all = 3, 5, 9, 530
    test_index = np.arange(num_all, num_all + (40 if gaps else 30))
    if gaps:
        test_index = test_index[::4][:10].tolist() + test_index[1::4][:10].tolist()
        test_index = np.array(sorted(test_index))
    rng.shuffle(test_index)  # files list test nodes in arbitrary order

    def onehot(n):
        y = np.zeros((n, num_classes), dtype=np.int32)
        y[np.arange(n), rng.integers(0, num_classes, n)] = 1
        return y

    allx = sp.csr_matrix(rng.random((num_all, feats)).astype(np.float32))
    tx = sp.csr_matrix(rng.random((len(test_index), feats)).astype(np.float32))
    ally, ty = onehot(num_all), onehot(len(test_index))
    num_nodes = int(test_index.max()) + 1
    graph = defaultdict(list)
    for s, d in rng.integers(0, num_nodes, (800, 2)).tolist():
        graph[s].append(d)
    items = {
        "x": allx[:num_train], "y": ally[:num_train], "allx": allx, "ally": ally,
        "tx": tx, "ty": ty, "graph": graph,
    }  # fmt: skip
    os.makedirs(raw_dir)
    for name, obj in items.items():
        with open(os.path.join(raw_dir, f"ind.{prefix}.{name}"), "wb") as f:
            pickle.dump(obj, f)
    with open(os.path.join(raw_dir, f"ind.{prefix}.test.index"), "w") as f:
        f.write("\n".join(map(str, test_index.tolist())) + "\n")
    return {"num_nodes": num_nodes, "test_index": test_index, "ty": ty, "num_train": num_train}


@pytest.mark.parametrize(("name", "folder", "gaps"), [
    ("citeseer", "CiteSeer", True),
    ("pubmed", "PubMed", False),
])  # fmt: skip
def test_tiny_planetoid_files(tmp_path, name, folder, gaps):
    files = write_planetoid(tmp_path / folder / "raw", name, gaps=gaps)
    data = load_dataset(name, root=tmp_path)
    n = files["num_nodes"]
    assert data.num_nodes == n and data.x.shape == (n, 5)
    assert is_undirected(data.edge_index, num_nodes=n)
    assert int(data.train_mask.sum()) == files["num_train"]
    assert int(data.val_mask.sum()) == 500
    assert int(data.test_mask.sum()) == len(files["test_index"])
    test = torch.from_numpy(files["test_index"])
    assert bool(data.test_mask[test].all())
    # Test labels land on their listed node ids (the file order is not the node order).
    assert torch.equal(data.y[test], torch.from_numpy(files["ty"].argmax(1)).long())
    assert data.num_classes == {"citeseer": 6, "pubmed": 3}[name]


def test_planetoid_missing_files_raise_clear_error(tmp_path):
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset("citeseer", root=tmp_path)
    assert os.path.join(str(tmp_path), "CiteSeer", "raw", "ind.citeseer.graph") in str(err.value)
    assert not (tmp_path / "CiteSeer").exists()


def _copy_cora_raw(cora_root, root):
    shutil.copytree(cora_root / "Cora" / "raw", root / "Cora" / "raw")
    return root


@pytest.mark.parametrize("cogdl_first", [True, False], ids=["cogdl-first", "ours-first"])
def test_cogdl_and_our_loader_share_one_root(cora_root, tmp_path, cogdl_first):
    """The README's command and every example of docs/integrations.md use one root: CogDL's
    ``CoraDataset`` and ``load_dataset("cora")`` each keep their own processed file there and
    read it back, whichever ran first."""
    pytest.importorskip("cogdl")
    from cogdl.datasets.planetoid_data import CoraDataset

    import gact_graph.integrations.cogdl  # noqa: F401  (CogDL 0.6 shims, as the docs import it)

    root = _copy_cora_raw(cora_root, tmp_path)

    def ours():
        return load_dataset("cora", root=root).num_nodes

    def cogdl():
        return CoraDataset(data_path=str(root)).data.num_nodes

    first, second = (cogdl, ours) if cogdl_first else (ours, cogdl)
    assert [first(), second(), first()] == [2708] * 3  # the third run reads its cached file
    assert (root / "Cora" / "processed_gact_graph" / "data.pt").is_file()


@pytest.mark.parametrize("part", ["allx", "graph"])
def test_truncated_raw_file_is_named(cora_root, tmp_path, part):
    """A truncated download raised PyG's ``UnpicklingError: pickle data was truncated``,
    naming no file; the error names it and where to get it again, and a fresh copy loads."""
    root = _copy_cora_raw(cora_root, tmp_path)
    path = root / "Cora" / "raw" / f"ind.cora.{part}"
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(RawDataError, match="truncated or corrupt") as err:
        load_dataset("cora", root=root)
    assert repr(str(path)) in str(err.value) and f"/ind.cora.{part}" in str(err.value)
    path.write_bytes(good)  # what the message says to do
    assert load_dataset("cora", root=root).num_nodes == 2708


def _write_foreign(path, kind: str) -> None:
    """A ``data.pt`` that PyG's ``Planetoid`` did not write, one per way reading it fails."""
    if kind == "another object":  # what a CogDL processed file loads as: not PyG's tuple
        torch.save({"x": torch.zeros(2, 3)}, path)
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "not a torch file":
        path.write_bytes(b"processed by something else")
    elif kind == "broken archive":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("archive/data.pkl", b"truncated")
    else:  # a pickled class whose package is not installed here
        name = "_gact_graph_test_absent_module"
        module = types.ModuleType(name)
        exec("class Graph:\n    pass", module.__dict__)
        sys.modules[name] = module
        try:
            torch.save(module.Graph(), path)
        finally:
            del sys.modules[name]


@pytest.mark.filterwarnings("ignore:Weights only load failed")  # PyG retries unsafely, warns
@pytest.mark.parametrize(
    "kind", ["another object", "empty", "not a torch file", "broken archive", "absent class"]
)
def test_foreign_processed_file_names_the_folder_to_delete(cora_root, tmp_path, kind):
    root = _copy_cora_raw(cora_root, tmp_path)
    folder = root / "Cora" / "processed_gact_graph"
    folder.mkdir()
    _write_foreign(folder / "data.pt", kind)
    with pytest.raises(ProcessedDataError, match="Delete the folder") as err:
        load_dataset("cora", root=root)
    assert repr(str(folder)) in str(err.value)
    shutil.rmtree(folder)  # what the message says to do
    assert load_dataset("cora", root=root).num_nodes == 2708


def test_first_load_is_serialized_across_processes(cora_root, tmp_path):
    """Two processes loading a fresh root at once both processed the raw files and one read the
    other's half-written file (``--jobs 2`` of the accuracy table did). The first load now
    holds a lock in the dataset's folder: a second process waits for it, then reads."""
    import subprocess

    from gact_graph.datasets.lock import dataset_lock

    _copy_cora_raw(cora_root, tmp_path)
    code = (
        "import sys; from gact_graph.datasets import load_dataset; print('ready', flush=True); "
        "print(load_dataset('cora', root=sys.argv[1]).num_nodes)"
    )
    repo = str(Path(__file__).resolve().parents[2])
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
    )
    processed = tmp_path / "Cora" / "processed_gact_graph"
    with dataset_lock(str(tmp_path / "Cora")):
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().strip() == "ready"  # imported; now loading
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=2.0)  # blocked on the lock
        assert not (processed.is_dir() and any(processed.iterdir()))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out.split()[-1] == "2708"
