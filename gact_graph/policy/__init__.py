"""Policies on top of the compression core: which bits each saved tensor gets (`adaptive`,
measured by `sensitivity`) and where it lives between forward and backward (`levels`: swap to
host memory, compressed checkpointing)."""

from gact_graph.policy.adaptive import Adapter, allocate_bits, attach_adapter
from gact_graph.policy.levels import install_level

__all__ = ["Adapter", "allocate_bits", "attach_adapter", "install_level"]
