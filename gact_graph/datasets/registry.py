"""``load_dataset`` and ``evaluate``: one name space over OGB, GraphSAINT, Planetoid and the
synthetic stand-ins."""

from __future__ import annotations

import functools

from torch import Tensor
from torch_geometric.data import Data

from gact_graph.datasets.info import DATASETS, dataset_info
from gact_graph.datasets.preprocess import compact_adj_t, default_root, normalized_adjacency

__all__ = ["load_dataset", "evaluate", "available_datasets", "accuracy", "micro_f1"]


def available_datasets() -> list[str]:
    """Every name :func:`load_dataset` accepts."""
    return list(DATASETS) + ["synthetic"] + [f"synthetic-{n}" for n in DATASETS]


def load_dataset(
    name: str, root: str | None = None, *, adj_t: bool = False, compact: bool = False, **kwargs
) -> Data:
    """Load a node-classification graph as one :class:`~torch_geometric.data.Data`.

    The result has ``x`` (float32), ``y`` (``[N]`` int64, or ``[N, L]`` float {0, 1} when
    multi-label), an undirected coalesced ``edge_index``, boolean ``train_mask``/``val_mask``/
    ``test_mask``, and the metadata ``name``, ``num_classes``, ``multilabel`` and ``metric``.

    Args:
        name: ``ogbn-arxiv``, ``ogbn-products``, ``flickr``, ``reddit`` (GraphSAINT's, PyG
            ``Reddit2``), ``yelp``, ``cora``, ``citeseer``, ``pubmed``; ``synthetic`` (a small
            default graph) or ``synthetic-<one of those>`` (same sizes, planted classes).
        root: folder holding the real datasets (default ``$GACT_GRAPH_DATA`` or ``./data``);
            ignored for synthetic graphs. Nothing is ever downloaded.
        adj_t: also attach ``data.adj_t``, the ``torch.sparse_csr`` GCN-normalized adjacency
            (otherwise :func:`~gact_graph.datasets.normalized_adjacency` makes it on request).
        compact: give the graph as ``data.adj_t``, the graph itself (not normalized) as
            :func:`~gact_graph.datasets.compact_adj_t` builds it (int32 CSR, 4 bytes an edge),
            with no ``edge_index``: pass ``data.adj_t`` where the model takes ``edge_index``.
            Synthetic graphs are built so without an int64 edge list.
        **kwargs: loader options. Planetoid: ``normalize_features`` (default ``True``: rows
            sum to one, as the papers train). Synthetic graphs: ``scale``, ``num_nodes``,
            ``num_edges``, ``seed``, and :func:`~gact_graph.datasets.make_synthetic_graph`
            options.

    Raises:
        DatasetNotFoundError: a real dataset's files are missing; the message says which files
            to put where.
    """
    if not isinstance(name, str):
        raise TypeError(
            f"load_dataset expects a dataset name (str), got {name!r}; one of "
            f"{available_datasets()}"
        )
    if adj_t and compact:
        raise ValueError(
            "load_dataset: adj_t=True (the GCN-normalized matrix) and compact=True (the graph "
            "itself as adj_t) both set data.adj_t; pass one"
        )
    key = name.lower()
    if key.startswith("synthetic"):
        from gact_graph.datasets.synthetic import load_synthetic

        data = load_synthetic(key, compact=compact, **kwargs)
    else:
        info = dataset_info(key)
        root = default_root() if root is None else str(root)
        if info.source == "ogb":
            from gact_graph.datasets.ogb import load_ogbn as loader
        elif info.source == "graphsaint":
            from gact_graph.datasets.graphsaint import load_graphsaint as loader
        else:
            from gact_graph.datasets.planetoid import load_planetoid as loader
        data = loader(info.name, root, **kwargs)
        if compact:
            data.adj_t = compact_adj_t(data.edge_index, data.num_nodes)
            del data.edge_index
    if adj_t:
        normalized_adjacency(data)
    return data


def accuracy(logits: Tensor, y: Tensor) -> float:
    """Multi-class accuracy of ``argmax(logits)``."""
    if y.numel() == 0:
        return float("nan")
    return (logits.argmax(dim=-1) == y.view(-1)).float().mean().item()


def micro_f1(logits: Tensor, y: Tensor) -> float:
    """Multi-label micro-F1 with a label predicted where its logit is positive."""
    pred = logits > 0
    true = y > 0.5
    tp = (pred & true).sum().item()
    fp = (pred & ~true).sum().item()
    fn = (~pred & true).sum().item()
    denom = 2 * tp + fp + fn
    return 2 * tp / denom if denom else 0.0


@functools.cache
def _ogb_evaluator(name: str):
    from ogb.nodeproppred import Evaluator

    return Evaluator(name)


def evaluate(
    name_or_data: str | Data, logits: Tensor, y: Tensor, mask: Tensor | None = None
) -> float:
    """The dataset's metric of ``logits`` against ``y`` on ``mask``.

    ``ogbn-*``: OGB's :class:`~ogb.nodeproppred.Evaluator` (accuracy); multi-label (Yelp):
    micro-F1; everything else: accuracy.
    """
    if isinstance(name_or_data, Data):
        name, metric = name_or_data.name, name_or_data.metric
    else:
        name = name_or_data.lower()
        if name.startswith("synthetic"):
            from gact_graph.datasets.synthetic import synthetic_info

            metric = synthetic_info(name).metric
        else:
            name = dataset_info(name).name
            metric = dataset_info(name).metric
    logits = logits.detach()
    if mask is not None:
        logits, y = logits[mask], y[mask]
    if metric == "micro_f1":
        return micro_f1(logits, y)
    if name in DATASETS and DATASETS[name].source == "ogb":
        if y.numel() == 0:
            return float("nan")
        result = _ogb_evaluator(name).eval(
            {"y_true": y.view(-1, 1).cpu(), "y_pred": logits.argmax(-1, keepdim=True).cpu()}
        )
        return float(result["acc"])
    return accuracy(logits, y)
