"""A thread-local switch under which backward kernels trade speed for memory.

The sensitivity probe runs its partial backwards on top of the user's own backward, so what
one of them holds adds to the step's peak (issue 13); the user's backward, outside the switch,
keeps its faster one-pass kernels. A kernel that has a leaner variant (e.g. the fused graph
attention releasing its dequantized features before allocating their gradient) checks
`is_lean` in its backward.
"""

from __future__ import annotations

import contextlib
import threading

_STATE = threading.local()


def is_lean() -> bool:
    """Whether the current thread runs inside `lean_backward`."""
    return getattr(_STATE, "depth", 0) > 0


@contextlib.contextmanager
def lean_backward():
    """Backward kernels run inside prefer their lower-memory variant (nests)."""
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield
    finally:
        _STATE.depth -= 1
