"""Policies on top of the compression core: which bits each saved tensor gets (`adaptive`
under an average budget, `acgc` under a bound on the added gradient variance, both measured by
`sensitivity`) and where it lives between forward and backward (`levels`: swap to
host memory, compressed checkpointing), and `watch`, which rescues (raises the bits of) a run
whose gradients compression noise makes blow up, or warns, or stops it (``on_divergence``)."""

from gact_graph.policy.acgc import AcgcAdapter, allocate_bits_bounded, attach_acgc
from gact_graph.policy.adaptive import Adapter, allocate_bits, attach_adapter
from gact_graph.policy.levels import install_level
from gact_graph.policy.watch import DivergenceError, GradientWatch, attach_watch

__all__ = [
    "AcgcAdapter",
    "Adapter",
    "DivergenceError",
    "GradientWatch",
    "allocate_bits",
    "allocate_bits_bounded",
    "attach_acgc",
    "attach_adapter",
    "attach_watch",
    "install_level",
]
