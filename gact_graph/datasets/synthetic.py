"""Seeded synthetic graphs with a real dataset's size and a learnable signal.

Each node gets a planted class (mildly imbalanced); edges connect same-class nodes with the real
graph's homophily and random nodes otherwise, with heavy-tailed (log-normal) degrees; features
are a class centroid plus Gaussian noise, weak enough that a feature-only model is far from
perfect and neighbourhood aggregation helps. For a multi-label dataset (Yelp) nodes belong to
latent communities that drive edges, features and label probabilities.

Everything is vectorized and edges are generated in chunks into one int64 key array, so the
arxiv-sized graph builds in seconds and products/Reddit-sized graphs need a few GB.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor
from torch_geometric.data import Data

from gact_graph.datasets.info import DatasetInfo, dataset_info
from gact_graph.datasets.preprocess import (
    finalize,
    index_to_mask,
    pairs_to_compact_adj_t,
    pairs_to_edge_index,
    sorted_unique_,
)

__all__ = ["SYNTHETIC_DEFAULT", "make_synthetic_graph", "load_synthetic", "synthetic_info"]

# The small default graph of ``examples/train_full_batch.py``: arxiv-like degree and features.
SYNTHETIC_DEFAULT = DatasetInfo(
    "synthetic", "synthetic", 20_000, 120_000, 128, 16,
    homophily=0.6, split=("fractions", 0.5, 0.25, 0.25),
)  # fmt: skip


def synthetic_info(name: str) -> DatasetInfo:
    """Statistics a synthetic name stands for: ``"synthetic"`` or ``"synthetic-<real name>"``."""
    key = name.lower()
    if key == "synthetic":
        return SYNTHETIC_DEFAULT
    if not key.startswith("synthetic-"):
        raise KeyError(f"not a synthetic dataset name: {name!r}")
    return dataset_info(key[len("synthetic-") :])


def make_synthetic_graph(
    num_nodes: int,
    num_edges: int,
    num_features: int,
    num_classes: int,
    *,
    multilabel: bool = False,
    homophily: float = 0.7,
    class_sep: float = 2.5,
    degree_skew: float = 1.0,
    stored_symmetric: bool = False,
    split: tuple = ("fractions", 0.6, 0.2, 0.2),
    seed: int = 0,
    name: str = "synthetic",
    chunk_size: int = 1 << 22,
    compact: bool = False,
) -> Data:
    """Build a planted-class graph.

    Args:
        num_nodes: nodes.
        num_edges: edges as stored by the real dataset; ``stored_symmetric`` says whether that
            count already includes both directions. The result is undirected and coalesced, so
            it holds about ``2 * num_edges`` (or ``num_edges``) directed edges, fewer by the
            rare duplicates and self-loops dropped.
        num_features: feature width.
        num_classes: classes (labels when ``multilabel``).
        multilabel: ``y`` is ``[N, num_classes]`` {0, 1} driven by latent communities.
        homophily: fraction of edges joining two nodes of the same class (community); at
            least the chance level, and reached only where classes are large enough to hold
            that many distinct intra-class edges (dense graphs shrunk to a few thousand nodes
            fall short).
        class_sep: expected distance between two class centroids, in noise standard
            deviations; independent of ``num_features``.
        degree_skew: sigma of the log-normal degree propensity (0: Erdos-Renyi-like degrees).
        split: ``("fractions", tr, va, te)`` or ``("per_class", k, val, test)``.
        seed: the graph is a deterministic function of the arguments and this seed.
        chunk_size: edges generated per chunk (bounds temporary memory).
        compact: give the graph as ``adj_t`` (`compact_adj_t`, 4 bytes an edge) instead of
            ``edge_index``, built without an int64 edge list at any point.
    """
    for arg, value, least in (
        ("num_nodes", num_nodes, 2),
        ("num_edges", num_edges, 0),
        ("num_features", num_features, 1),
        ("num_classes", num_classes, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
            raise ValueError(f"{name}: {arg} must be an int >= {least}, got {value!r}")
    if not 0.0 <= homophily <= 1.0:
        raise ValueError(f"homophily must be in [0, 1], got {homophily}")
    g = torch.Generator().manual_seed(seed)
    n = int(num_nodes)

    # Planted groups: classes, or latent communities for multi-label graphs.
    num_groups = max(2, num_classes // 2) if multilabel else num_classes
    group_p = torch.arange(1, num_groups + 1, dtype=torch.float).pow(-0.5)
    group = torch.multinomial(group_p / group_p.sum(), n, replacement=True, generator=g)

    pairs = _planted_pairs(
        group, num_groups, num_edges // 2 if stored_symmetric else num_edges,
        homophily, degree_skew, g, chunk_size,
    )  # fmt: skip
    graph = (
        {"adj_t": pairs_to_compact_adj_t(pairs, n)}
        if compact
        else {"edge_index": pairs_to_edge_index(pairs, n)}
    )
    del pairs

    scale = class_sep / math.sqrt(2 * num_features)
    centroids = torch.randn(num_groups, num_features, generator=g) * scale
    x = torch.randn(n, num_features, generator=g)
    if multilabel:
        # Each community favours a few labels; features also carry the node's own labels.
        core = torch.rand(num_groups, num_classes, generator=g) < 4.0 / num_classes
        prob = torch.where(core, 0.8, 0.02)
        label_dirs = torch.randn(num_classes, num_features, generator=g) * scale
    y = torch.empty(n, num_classes) if multilabel else group
    step = 1 << 16  # rows per chunk: bounds the [rows, F] temporaries
    for start in range(0, n, step):
        rows = slice(start, min(n, start + step))
        x[rows] += centroids[group[rows]]
        if multilabel:
            p = prob[group[rows]]
            y[rows] = (torch.rand(p.shape, generator=g) < p).float()
            x[rows] += y[rows] @ label_dirs

    data = Data(x=x, y=y, num_nodes=n, **graph)
    train, val, test = _split(group, num_groups, split, g)
    empty = [part for part, idx in (("train", train), ("val", val), ("test", test)) if not len(idx)]
    if empty:
        raise ValueError(
            f"{name} with {n} nodes leaves no {' / '.join(empty)} nodes under its split "
            f"{split}; give it more nodes (num_nodes, or a larger scale)"
        )
    data.train_mask = index_to_mask(train, n)
    data.val_mask = index_to_mask(val, n)
    data.test_mask = index_to_mask(test, n)
    return finalize(
        data,
        name=name,
        num_classes=num_classes,
        multilabel=multilabel,
        metric="micro_f1" if multilabel else "acc",
        make_undirected=False,  # built undirected and coalesced already
    )


def _planted_pairs(
    group: Tensor,
    num_groups: int,
    num_pairs: int,
    homophily: float,
    degree_skew: float,
    g: torch.Generator,
    chunk_size: int,
) -> Tensor:
    """``num_pairs`` distinct undirected edges, no self-loops: sorted canonical keys
    ``min * N + max``."""
    n = group.numel()
    # Nodes sorted by group; sampling by inverse CDF over the cumulative degree propensity
    # gives weighted sampling over all nodes or, restricted to a group's range, within it.
    order = torch.argsort(group, stable=True)
    counts = torch.bincount(group, minlength=num_groups)
    ptr = torch.zeros(num_groups + 1, dtype=torch.long)
    ptr[1:] = torch.cumsum(counts, 0)
    weight = torch.exp(degree_skew * torch.randn(n, generator=g, dtype=torch.float64))
    cum = torch.cumsum(weight[order], 0)
    total = cum[-1].item()
    lo_cum = torch.where(ptr[:-1] > 0, cum[(ptr[:-1] - 1).clamp(min=0)], cum.new_zeros(()))
    hi_cum = cum[(ptr[1:] - 1).clamp(min=0)]
    group_sorted = group[order]
    # A cross-group endpoint still lands in the source's group with probability
    # sum_c (W_c / W)^2 (W: degree propensity mass); plant fewer intra-group edges to
    # compensate, so the edge homophily of the result is ``homophily`` itself.
    chance = ((hi_cum - lo_cum) / total).pow(2).sum().item()
    planted = max(0.0, (homophily - chance) / (1.0 - chance)) if chance < 1.0 else 1.0

    def sample_pairs(m: int) -> Tensor:
        """Canonical keys ``min * n + max`` of ``m`` sampled pairs, self-loops dropped."""
        u = torch.rand(m, generator=g, dtype=torch.float64) * total
        src_pos = torch.searchsorted(cum, u, right=True).clamp_(max=n - 1)
        c = group_sorted[src_pos]
        same = torch.rand(m, generator=g) < planted
        t = torch.rand(m, generator=g, dtype=torch.float64)
        t = torch.where(same, lo_cum[c] + t * (hi_cum[c] - lo_cum[c]), t * total)
        dst_pos = torch.searchsorted(cum, t, right=True)
        # Float round-off at a group boundary must not leave the group.
        dst_pos = torch.where(same, torch.minimum(dst_pos.clamp(min=ptr[c]), ptr[c + 1] - 1),
                              dst_pos.clamp(max=n - 1))  # fmt: skip
        src, dst = order[src_pos], order[dst_pos]
        keep = src != dst
        src, dst = src[keep], dst[keep]
        return torch.minimum(src, dst) * n + torch.maximum(src, dst)

    # Heavy-tailed degrees make duplicate pairs common on small graphs: sample again for the
    # deficit until there are enough distinct pairs, then keep exactly ``num_pairs`` of them.
    num_pairs = min(num_pairs, n * (n - 1) // 2)
    pairs = torch.empty(0, dtype=torch.long)
    new_per_sample = 1.0  # distinct new pairs per sampled pair, measured each round
    for _ in range(50):
        deficit = num_pairs - pairs.numel()
        if deficit <= 0:
            break
        want = int(deficit / max(new_per_sample, 0.02) * (1.0 if pairs.numel() == 0 else 1.1))
        want += 16
        before = pairs.numel()
        chunks = [pairs]
        for start in range(0, want, chunk_size):
            chunks.append(sorted_unique_(sample_pairs(min(chunk_size, want - start))))
        pairs = torch.cat(chunks)
        del chunks
        pairs = sorted_unique_(pairs)
        new_per_sample = (pairs.numel() - before) / want
    if pairs.numel() > num_pairs:
        # Drop the few surplus pairs at random positions (a mask, not a full permutation).
        keep = torch.ones(pairs.numel(), dtype=torch.bool)
        excess = pairs.numel() - num_pairs
        while excess > 0:
            keep[torch.randint(pairs.numel(), (excess,), generator=g)] = False
            excess = int(keep.sum()) - num_pairs
        pairs = pairs[keep]
    return pairs


def _split(
    group: Tensor, num_groups: int, split: tuple, g: torch.Generator
) -> tuple[Tensor, Tensor, Tensor]:
    n = group.numel()
    perm = torch.randperm(n, generator=g)
    kind = split[0]
    if kind == "fractions":
        _, f_tr, f_va, _ = split
        n_tr, n_va = round(f_tr * n), round(f_va * n)
        return perm[:n_tr], perm[n_tr : n_tr + n_va], perm[n_tr + n_va :]
    if kind == "per_class":
        _, k, n_val, n_test = split
        # Rank of each node within its class in the random order; train = the first k of each.
        grp = group[perm]
        by_class = torch.argsort(grp, stable=True)
        counts = torch.bincount(grp, minlength=num_groups)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.empty(n, dtype=torch.long)
        rank[by_class] = torch.arange(n) - starts[grp[by_class]]
        is_train = rank < k
        train, rest = perm[is_train], perm[~is_train]
        n_val = min(n_val, rest.numel() // 3)
        n_test = min(n_test, rest.numel() - n_val)
        return train, rest[:n_val], rest[n_val : n_val + n_test]
    raise ValueError(f"unknown split kind {kind!r}")


def load_synthetic(
    name: str = "synthetic",
    *,
    scale: float = 1.0,
    num_nodes: int | None = None,
    num_edges: int | None = None,
    seed: int = 0,
    **kwargs,
) -> Data:
    """A synthetic stand-in for ``name`` (``"synthetic"`` or ``"synthetic-<real name>"``).

    Args:
        scale: multiplies nodes and edges (the average degree is kept), e.g. ``0.01``.
        num_nodes: absolute node count instead of ``scale`` (edges follow proportionally unless
            ``num_edges`` is given).
        num_edges: absolute edge count (as stored, see :func:`make_synthetic_graph`).
        seed: generator seed.
        **kwargs: passed to :func:`make_synthetic_graph` (``homophily``, ``class_sep``, ...).
    """
    info = synthetic_info(name)
    if num_nodes is None:
        if (
            isinstance(scale, bool)
            or not isinstance(scale, numbers.Real)
            or not 0 < scale < math.inf
        ):
            raise ValueError(f"{name}: scale must be a finite number > 0, got {scale!r}")
        num_nodes = round(info.num_nodes * scale)
        if num_nodes < 2:
            raise ValueError(
                f"{name}: scale={scale!r} gives {num_nodes} of its {info.num_nodes} nodes; a "
                "graph needs at least 2"
            )
    if num_edges is None:
        num_edges = max(1, round(info.num_edges * num_nodes / info.num_nodes))
    params = dict(
        multilabel=info.multilabel,
        homophily=info.homophily,
        stored_symmetric=info.stored_symmetric,
        split=info.split,
        seed=seed,
        name=name.lower(),
    )
    params.update(kwargs)
    return make_synthetic_graph(num_nodes, num_edges, info.num_features, info.num_classes, **params)
