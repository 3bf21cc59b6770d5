"""A thread-local switch around work a training run does once per graph, not every step.

Building a graph's adjacency (sorting its edges, hashing them for the cache, the transposed
CSR) happens in the first step that meets the graph; later steps find it cached. What that work
holds while it runs is part of the first step's peak but of no later step's, so the memory-
budget planner, which predicts later steps from the first (its profile step), measures it
apart: its meters (`gact_graph.budget.profile`) register here as listeners and are told when
such work starts and ends. Code that does once-per-graph work runs it inside `once_per_graph`.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Protocol

__all__ = ["OncePerGraphListener", "is_once_per_graph", "once_per_graph", "add_listener",
           "remove_listener"]

_STATE = threading.local()


class OncePerGraphListener(Protocol):
    def once_per_graph_started(self) -> None: ...

    def once_per_graph_ended(self) -> None: ...


def is_once_per_graph() -> bool:
    """Whether the current thread runs inside `once_per_graph`."""
    return getattr(_STATE, "depth", 0) > 0


@contextlib.contextmanager
def once_per_graph():
    """Work inside is done once per graph (nests: listeners hear the outermost only)."""
    depth = getattr(_STATE, "depth", 0)
    listeners = list(getattr(_STATE, "listeners", ())) if depth == 0 else []
    for listener in listeners:
        listener.once_per_graph_started()
    _STATE.depth = depth + 1
    try:
        yield
    finally:
        _STATE.depth = depth
        for listener in reversed(listeners):
            listener.once_per_graph_ended()


def add_listener(listener: OncePerGraphListener) -> None:
    """From now on ``listener`` hears when once-per-graph work starts and ends (this thread)."""
    _STATE.listeners = (*getattr(_STATE, "listeners", ()), listener)


def remove_listener(listener: OncePerGraphListener) -> None:
    """``listener`` hears no more (a no-op if it was not listening)."""
    _STATE.listeners = tuple(x for x in getattr(_STATE, "listeners", ()) if x is not listener)
