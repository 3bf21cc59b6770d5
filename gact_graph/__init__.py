"""gact_graph: graph-aware activation compression for GNN training.

Importing this package never initializes CUDA. Our own modules never import Triton at import
time (torch_geometric itself may, when Triton is installed); kernels are compiled lazily the first
time a CUDA tensor is compressed, and every kernel has a PyTorch reference that is the CPU path.
"""

from gact_graph.api import compress_gnn
from gact_graph.config import CompressionConfig
from gact_graph.core import Controller, QTensor, quantize

__all__ = ["compress_gnn", "CompressionConfig", "Controller", "QTensor", "quantize"]
__version__ = "0.1.0"
