"""A thread-local switch around work a training run does once per graph, not every step.

Building a graph's adjacency (sorting its edges, hashing them for the cache, the transposed
CSR) happens in the first step that meets the graph; later steps find it cached. What that work
holds while it runs is part of the first step's peak but of no later step's, so the memory-
budget planner, which predicts later steps from the first (its profile step), counts it apart
(`gact_graph.budget.profile.LiveBytes`). Code that does once-per-graph work runs it inside
`once_per_graph`.
"""

from __future__ import annotations

from gact_graph.switch import ThreadSwitch

__all__ = ["is_once_per_graph", "once_per_graph"]

_ONCE = ThreadSwitch()


def is_once_per_graph() -> bool:
    """Whether the current thread runs inside `once_per_graph`."""
    return _ONCE.is_on()


def once_per_graph():
    """Work inside is done once per graph (a context manager; nests)."""
    return _ONCE.on()
