"""Policies on top of the compression core: which bits each saved tensor gets (`adaptive`,
measured by `sensitivity`) and where it lives between forward and backward (`levels`: swap to
host memory, compressed checkpointing), and `watch`, which warns when compression noise
makes the gradients blow up."""

from gact_graph.policy.adaptive import Adapter, allocate_bits, attach_adapter
from gact_graph.policy.levels import install_level
from gact_graph.policy.watch import GradientWatch, attach_watch

__all__ = [
    "Adapter",
    "GradientWatch",
    "allocate_bits",
    "attach_adapter",
    "attach_watch",
    "install_level",
]
