"""Graph workloads: real datasets (OGB, GraphSAINT, Planetoid), read offline from their
on-disk formats, and seeded synthetic graphs of the same sizes.

>>> from gact_graph.datasets import load_dataset, evaluate
>>> data = load_dataset("synthetic-ogbn-arxiv", scale=0.01)
>>> data.num_classes, data.metric
(40, 'acc')
"""

from gact_graph.datasets.info import DATASETS, DatasetInfo, dataset_info
from gact_graph.datasets.preprocess import (
    DatasetNotFoundError,
    ProcessedDataError,
    RawDataError,
    compact_adj_t,
    gcn_normalized_adjacency,
    normalized_adjacency,
    undirected_coalesced,
)
from gact_graph.datasets.registry import (
    accuracy,
    available_datasets,
    evaluate,
    load_dataset,
    micro_f1,
)
from gact_graph.datasets.synthetic import load_synthetic, make_synthetic_graph

__all__ = [
    "DATASETS",
    "DatasetInfo",
    "DatasetNotFoundError",
    "ProcessedDataError",
    "RawDataError",
    "accuracy",
    "available_datasets",
    "compact_adj_t",
    "dataset_info",
    "evaluate",
    "gcn_normalized_adjacency",
    "load_dataset",
    "load_synthetic",
    "make_synthetic_graph",
    "micro_f1",
    "normalized_adjacency",
    "undirected_coalesced",
]
