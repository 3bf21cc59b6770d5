"""Planetoid citation graphs (Cora, CiteSeer, PubMed) through PyG's ``Planetoid`` with the public
split (20 labelled nodes per class, 500 validation, 1000 test), offline.

On-disk layout (the original Planetoid files, as ``Planetoid(root, "Cora")`` expects)::

    <root>/Cora/raw/ind.cora.{x,tx,allx,y,ty,ally,graph,test.index}
    <root>/CiteSeer/raw/ind.citeseer.{...}
    <root>/PubMed/raw/ind.pubmed.{...}
"""

from __future__ import annotations

import os.path as osp

from torch_geometric.data import Data

from gact_graph.datasets.info import dataset_info
from gact_graph.datasets.preprocess import finalize, require_files

__all__ = ["load_planetoid", "PLANETOID_NAMES", "planetoid_raw_files"]

# PyG's spelling: the folder under root and the name passed to ``Planetoid``.
PLANETOID_NAMES = {"cora": "Cora", "citeseer": "CiteSeer", "pubmed": "PubMed"}
_PARTS = ["x", "tx", "allx", "y", "ty", "ally", "graph", "test.index"]
_SOURCE = "https://github.com/kimiyoung/planetoid/raw/master/data"


def planetoid_raw_files(name: str) -> list[str]:
    """Raw file names of a Planetoid dataset, e.g. ``ind.cora.x``."""
    return [f"ind.{name.lower()}.{part}" for part in _PARTS]


def load_planetoid(name: str, root: str, normalize_features: bool = True) -> Data:
    """Load ``cora``, ``citeseer`` or ``pubmed`` (public split) from ``root``.

    ``normalize_features`` row-normalizes the bag-of-words features to sum to one, as
    ``torch_geometric.transforms.NormalizeFeatures`` does and as the GCN, GAT and GCNII papers
    (and PyG's examples) train on them.

    Raises:
        DatasetNotFoundError: a required file is missing (nothing is downloaded).
    """
    from torch_geometric.datasets import Planetoid

    info = dataset_info(name)
    pyg_name = PLANETOID_NAMES[info.name]
    base = osp.join(root, pyg_name)
    require_files(
        info.name,
        base,
        [f"raw/{f}" for f in planetoid_raw_files(info.name)],
        f"Get them from {_SOURCE}.",
    )
    data = Planetoid(root, pyg_name, split="public")[0]
    if normalize_features:
        x = data.x - data.x.min()
        data.x = x / x.sum(dim=-1, keepdim=True).clamp(min=1.0)
    return finalize(
        data, name=info.name, num_classes=info.num_classes, multilabel=False, metric=info.metric
    )
