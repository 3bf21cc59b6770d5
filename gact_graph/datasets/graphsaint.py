"""GraphSAINT's datasets (Flickr, Reddit, Yelp) through PyG's ``Flickr``, ``Reddit2`` and ``Yelp``
classes, with their standard splits, offline.

On-disk layout (GraphSAINT's release files; PyG reads them from ``<dir>/raw``)::

    <root>/flickr/raw/{adj_full.npz, feats.npy, class_map.json, role.json}
    <root>/reddit2/raw/{adj_full.npz, feats.npy, class_map.json, role.json}
    <root>/yelp/raw/{adj_full.npz, feats.npy, class_map.json, role.json}

``adj_full.npz`` is a scipy CSR matrix (``scipy.sparse.save_npz``), ``feats.npy`` an ``[N, F]``
array, ``class_map.json`` maps node id to a class (or to a 0/1 list for Yelp), ``role.json``
holds the ``tr``/``va``/``te`` node lists.
"""

from __future__ import annotations

import os.path as osp

from torch_geometric.data import Data

from gact_graph.datasets.info import dataset_info
from gact_graph.datasets.lock import dataset_lock
from gact_graph.datasets.preprocess import finalize, require_files

__all__ = ["load_graphsaint", "GRAPHSAINT_DIRS", "GRAPHSAINT_RAW_FILES"]

# Folder under root per dataset; "reddit" is GraphSAINT's Reddit (PyG ``Reddit2``), which has
# other files than PyG's ``Reddit``, hence its own folder name.
GRAPHSAINT_DIRS = {"flickr": "flickr", "reddit": "reddit2", "yelp": "yelp"}
GRAPHSAINT_RAW_FILES = ["adj_full.npz", "feats.npy", "class_map.json", "role.json"]
_SOURCE = "https://github.com/GraphSAINT/GraphSAINT (Google Drive links in its README)"


def _pyg_class(name: str):
    from torch_geometric.datasets import Flickr, Reddit2, Yelp

    return {"flickr": Flickr, "reddit": Reddit2, "yelp": Yelp}[name]


def load_graphsaint(name: str, root: str) -> Data:
    """Load ``flickr``, ``reddit`` (GraphSAINT's, = PyG ``Reddit2``) or ``yelp`` from ``root``.

    Yelp is multi-label: ``y`` is ``[N, 100]`` float {0, 1} and the metric is micro-F1.

    Raises:
        DatasetNotFoundError: a required file is missing (nothing is downloaded).
    """
    info = dataset_info(name)
    base = osp.join(root, GRAPHSAINT_DIRS[info.name])
    # PyG checks raw files even when processed/data.pt exists, and downloads if one is absent.
    require_files(
        info.name, base, [f"raw/{f}" for f in GRAPHSAINT_RAW_FILES], f"Get them from {_SOURCE}."
    )
    with dataset_lock(base):
        data = _pyg_class(info.name)(base)[0]
    return finalize(
        data,
        name=info.name,
        num_classes=info.num_classes,
        multilabel=info.multilabel,
        metric=info.metric,
    )
