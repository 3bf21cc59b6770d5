"""The compression core: the `Controller` that installs saved-tensor hooks, the records of
what was saved (`saved`), and the quantizer with its `QTensor` (`quantize`). Policies
(`gact_graph.policy`) and graph-aware paths (`gact_graph.sparse`, `gact_graph.ops`) build on it;
it builds only on `gact_graph.kernels` and `gact_graph.config`."""

from gact_graph.core.controller import Controller, Stored
from gact_graph.core.quantize import QTensor, quantize

__all__ = ["Controller", "QTensor", "Stored", "quantize"]
