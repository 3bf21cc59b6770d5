"""OGB node-property-prediction datasets (``ogbn-arxiv``, ``ogbn-products``) through
:class:`ogb.nodeproppred.PygNodePropPredDataset`, offline.

On-disk layout (what ``arxiv.zip`` / ``products.zip`` from snap.stanford.edu unpacks to)::

    <root>/ogbn_arxiv/RELEASE_v1.txt
    <root>/ogbn_arxiv/raw/{edge,node-feat,node-label,node_year,num-node-list,num-edge-list}.csv.gz
    <root>/ogbn_arxiv/split/time/{train,valid,test}.csv.gz
    <root>/ogbn_arxiv/processed/geometric_data_processed.pt   (written on first load)
"""

from __future__ import annotations

import contextlib
import os.path as osp

import torch
from torch_geometric.data import Data

from gact_graph.datasets.info import dataset_info
from gact_graph.datasets.lock import dataset_lock
from gact_graph.datasets.preprocess import finalize, index_to_mask, require_files

__all__ = ["load_ogbn", "ogb_required_files"]


def _meta(name: str):
    import pandas as pd
    from ogb import nodeproppred

    master = osp.join(osp.dirname(nodeproppred.__file__), "master.csv")
    return pd.read_csv(master, index_col=0, keep_default_na=False)[name]


def _dataset_dir(name: str, root: str) -> str:
    # OGB itself prefers "<dir>_pyg" when that folder exists.
    base = osp.join(root, "_".join(name.split("-")))
    return base + "_pyg" if osp.exists(base + "_pyg") else base


def ogb_required_files(name: str, root: str) -> tuple[str, list[str]]:
    """``(dataset_dir, files relative to it)`` that must exist before OGB is asked to load."""
    meta = _meta(name)
    base = _dataset_dir(name, root)
    raw = ["edge.csv.gz"]
    if meta["has_node_attr"] == "True":
        raw.append("node-feat.csv.gz")
    if meta["has_edge_attr"] == "True":
        raw.append("edge-feat.csv.gz")
    # PyG checks raw_file_names even when processed data exists; processing reads the rest.
    files = [f"RELEASE_v{meta['version']}.txt"] + [f"raw/{f}" for f in raw]
    if not osp.isfile(osp.join(base, "processed", "geometric_data_processed.pt")):
        extra = ["node-label.csv.gz", "num-node-list.csv.gz", "num-edge-list.csv.gz"]
        if meta["additional node files"] != "None":
            extra += [f"{f}.csv.gz" for f in meta["additional node files"].split(",")]
        files += [f"raw/{f}" for f in extra]
    split = meta["split"]
    files += [f"split/{split}/{part}.csv.gz" for part in ("train", "valid", "test")]
    return base, files


@contextlib.contextmanager
def _allow_pyg_pickles():
    """OGB 1.3.6 reads its processed file with a bare ``torch.load(path)``. Since torch 2.6
    that means ``weights_only=True``, which refuses PyG's ``Data`` classes. Allow-list exactly
    those storage classes for the duration of the load instead of switching the unpickler to
    arbitrary code (``weights_only=False``)."""
    safe_globals = getattr(torch.serialization, "safe_globals", None)
    if safe_globals is None:  # torch < 2.5: weights_only defaulted to False anyway
        yield
        return
    from torch_geometric.data.data import Data as _Data
    from torch_geometric.data.data import DataEdgeAttr, DataTensorAttr
    from torch_geometric.data.storage import EdgeStorage, GlobalStorage, NodeStorage

    with safe_globals([_Data, DataEdgeAttr, DataTensorAttr, GlobalStorage, NodeStorage,
                       EdgeStorage]):  # fmt: skip
        yield


def load_ogbn(name: str, root: str) -> Data:
    """Load ``ogbn-arxiv`` or ``ogbn-products`` from ``root`` as an undirected, coalesced graph
    with the official split as ``train/val/test_mask`` and ``y`` of shape ``[N]``.

    Raises:
        DatasetNotFoundError: a required file is missing (nothing is downloaded).
        ImportError: the ``ogb`` package is not installed.
    """
    info = dataset_info(name)
    try:
        from ogb.nodeproppred import PygNodePropPredDataset
    except ImportError as e:  # pragma: no cover - ogb is a test dependency
        raise ImportError(f"{name} needs the `ogb` package: pip install 'gact_graph[ogb]'") from e

    base, files = ogb_required_files(info.name, root)
    url = _meta(info.name)["url"]
    require_files(
        info.name, base, files,
        f"Get them from {url} (unzip into {root!r} and rename the folder to "
        f"{osp.basename(base)!r}).",
    )  # fmt: skip
    with dataset_lock(base), _allow_pyg_pickles():
        dataset = PygNodePropPredDataset(info.name, root=root)
        split = dataset.get_idx_split()
    data = dataset[0]
    n = data.num_nodes
    data.train_mask = index_to_mask(split["train"], n)
    data.val_mask = index_to_mask(split["valid"], n)
    data.test_mask = index_to_mask(split["test"], n)
    return finalize(
        data, name=info.name, num_classes=info.num_classes, multilabel=False, metric=info.metric
    )
