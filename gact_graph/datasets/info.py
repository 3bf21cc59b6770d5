"""What is known about each supported dataset before loading it: sizes, task, metric, split."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DatasetInfo", "DATASETS", "dataset_info"]


@dataclass(frozen=True)
class DatasetInfo:
    """Published statistics of a node-classification dataset.

    Args:
        name: canonical name used by :func:`gact_graph.datasets.load_dataset`.
        source: ``"ogb"``, ``"graphsaint"`` or ``"planetoid"``: which loader reads the files.
        num_nodes: number of nodes.
        num_edges: number of edges as the dataset stores them (see ``stored_symmetric``).
        num_features: node feature width.
        num_classes: number of classes (labels, for multi-label tasks).
        multilabel: whether each node has several binary labels (trained with BCE).
        metric: ``"acc"`` (multi-class accuracy) or ``"micro_f1"`` (multi-label micro-F1).
        stored_symmetric: ``True`` when ``num_edges`` already counts both directions of every
            undirected edge (GraphSAINT's ``adj_full``); ``False`` when each edge is stored once
            (OGB's ``edge.csv.gz``, Planetoid's undirected edge count).
        homophily: approximate edge homophily of the real graph; the synthetic stand-in plants
            the same fraction of intra-class edges.
        split: ``("fractions", train, val, test)`` or ``("per_class", train_per_class, val,
            test)`` (Planetoid's public split: 20 per class, 500 val, 1000 test).
    """

    name: str
    source: str
    num_nodes: int
    num_edges: int
    num_features: int
    num_classes: int
    multilabel: bool = False
    metric: str = "acc"
    stored_symmetric: bool = False
    homophily: float = 0.7
    split: tuple = ("fractions", 0.6, 0.2, 0.2)


DATASETS: dict[str, DatasetInfo] = {
    info.name: info
    for info in [
        DatasetInfo(
            "ogbn-arxiv", "ogb", 169_343, 1_166_243, 128, 40,
            homophily=0.65, split=("fractions", 0.537, 0.176, 0.287),
        ),
        DatasetInfo(
            "ogbn-products", "ogb", 2_449_029, 61_859_140, 100, 47,
            homophily=0.81, split=("fractions", 0.080, 0.016, 0.904),
        ),
        DatasetInfo(
            "flickr", "graphsaint", 89_250, 899_756, 500, 7,
            stored_symmetric=True, homophily=0.32, split=("fractions", 0.50, 0.25, 0.25),
        ),
        DatasetInfo(
            "reddit", "graphsaint", 232_965, 23_213_838, 602, 41,
            stored_symmetric=True, homophily=0.78, split=("fractions", 0.66, 0.10, 0.24),
        ),
        DatasetInfo(
            "yelp", "graphsaint", 716_847, 13_954_819, 300, 100, multilabel=True,
            metric="micro_f1", stored_symmetric=True, homophily=0.7,
            split=("fractions", 0.75, 0.10, 0.15),
        ),
        DatasetInfo(
            "cora", "planetoid", 2_708, 5_429, 1_433, 7,
            homophily=0.81, split=("per_class", 20, 500, 1000),
        ),
        DatasetInfo(
            "citeseer", "planetoid", 3_327, 4_732, 3_703, 6,
            homophily=0.74, split=("per_class", 20, 500, 1000),
        ),
        DatasetInfo(
            "pubmed", "planetoid", 19_717, 44_338, 500, 3,
            homophily=0.80, split=("per_class", 20, 500, 1000),
        ),
    ]
}  # fmt: skip

# Spellings users type for the same datasets.
_ALIASES = {"arxiv": "ogbn-arxiv", "products": "ogbn-products", "reddit2": "reddit"}


def dataset_info(name: str) -> DatasetInfo:
    """The :class:`DatasetInfo` of a real dataset name (case-insensitive, ``arxiv`` and
    ``reddit2`` accepted as aliases)."""
    key = name.lower()
    key = _ALIASES.get(key, key)
    if key not in DATASETS:
        raise KeyError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    return DATASETS[key]
