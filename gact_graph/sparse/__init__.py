"""Graph-aware paths: one shared compact adjacency per graph, fused SpMM / attention autograd
Functions that save only node-level tensors, and patching of known PyG convolutions."""

from gact_graph.sparse import gat_convs  # noqa: F401  (registers the GATConv/GATv2Conv patchers)
from gact_graph.sparse.adjacency import CompactAdjacency
from gact_graph.sparse.adjacency_build import differentiable_edge_weight, get_adjacency
from gact_graph.sparse.patching import install_sparse_paths, register_patcher
from gact_graph.sparse.spmm import SpmmFunction, spmm

__all__ = [
    "CompactAdjacency",
    "get_adjacency",
    "differentiable_edge_weight",
    "register_patcher",
    "install_sparse_paths",
    "SpmmFunction",
    "spmm",
]
