"""Thread-local switches that nest: the probe's lean backward and once-per-graph work.

`ThreadSwitch` is on in a thread while that thread runs inside ``on()`` (nested: until the
outermost exits); other threads are not affected. Two of them live here:

- **lean backward** (`lean_backward`, `is_lean`): the sensitivity probe runs its partial
  backwards on top of the user's own backward, so what one of them holds adds to the step's
  peak; the user's backward, outside the switch, keeps its faster one-pass kernels. A kernel
  with a leaner variant (the fused graph attention releasing its dequantized features before
  allocating their gradient) checks `is_lean` in its backward. `scratch` names tensors the
  probe owns and reads no more once the backward it runs returns (its noisy copy of a
  dequantized activation): a lean backward may write its result into them.
- **once per graph** (`once_per_graph`, `is_once_per_graph`): building a graph's adjacency
  (sorting its edges, hashing them for the cache, the transposed CSR) happens in the first step
  that meets the graph; later steps find it cached. What that work holds is part of the first
  step's peak but of no later step's, so the memory-budget planner, which predicts later steps
  from its profile step, counts it apart (`gact_graph.budget.profile.LiveBytes`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = [
    "ThreadSwitch",
    "is_lean",
    "is_once_per_graph",
    "is_scratch",
    "lean_backward",
    "once_per_graph",
    "scratch",
]


class ThreadSwitch:
    """On in a thread while that thread runs inside `on()` (nests: on until the outermost
    exits); other threads are not affected."""

    def __init__(self) -> None:
        self._state = threading.local()

    def is_on(self) -> bool:
        return getattr(self._state, "depth", 0) > 0

    @contextlib.contextmanager
    def on(self) -> Iterator[None]:
        self._state.depth = getattr(self._state, "depth", 0) + 1
        try:
            yield
        finally:
            self._state.depth -= 1


_LEAN = ThreadSwitch()
_ONCE = ThreadSwitch()
_SCRATCH = threading.local()  # ids of the tensors a lean backward may write into


def is_lean() -> bool:
    """Whether the current thread runs inside `lean_backward`."""
    return _LEAN.is_on()


def lean_backward():
    """Backward kernels run inside prefer their lower-memory variant (a context manager;
    nests)."""
    return _LEAN.on()


def is_scratch(t) -> bool:
    """Whether ``t`` may be overwritten by a lean backward (see `scratch`)."""
    return is_lean() and id(t) in getattr(_SCRATCH, "ids", ())


@contextlib.contextmanager
def scratch(*tensors):
    """Inside (and inside `lean_backward`), a backward may write into ``tensors``."""
    prev = getattr(_SCRATCH, "ids", ())
    _SCRATCH.ids = prev + tuple(id(t) for t in tensors)
    try:
        yield
    finally:
        _SCRATCH.ids = prev


def is_once_per_graph() -> bool:
    """Whether the current thread runs inside `once_per_graph`."""
    return _ONCE.is_on()


def once_per_graph():
    """Work inside is done once per graph (a context manager; nests)."""
    return _ONCE.on()
