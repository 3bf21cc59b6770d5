"""A thread-local switch under which backward kernels trade speed for memory.

The sensitivity probe runs its partial backwards on top of the user's own backward, so what
one of them holds adds to the step's peak (issue 13); the user's backward, outside the switch,
keeps its faster one-pass kernels. A kernel that has a leaner variant (e.g. the fused graph
attention releasing its dequantized features before allocating their gradient) checks
`is_lean` in its backward.

`scratch` names tensors the probe owns and reads no more once the backward it runs returns (its
noisy copy of a dequantized activation): a lean backward may write its result into them rather
than into a tensor of its own.
"""

from __future__ import annotations

import contextlib
import threading

from gact_graph.switch import ThreadSwitch

_STATE = threading.local()  # the scratch tensors
_LEAN = ThreadSwitch()


def is_lean() -> bool:
    """Whether the current thread runs inside `lean_backward`."""
    return _LEAN.is_on()


def is_scratch(t) -> bool:
    """Whether ``t`` may be overwritten by a lean backward (see `scratch`)."""
    return is_lean() and id(t) in getattr(_STATE, "scratch", ())


@contextlib.contextmanager
def scratch(*tensors):
    """Inside (and inside `lean_backward`), a backward may write into ``tensors``."""
    prev = getattr(_STATE, "scratch", ())
    _STATE.scratch = prev + tuple(id(t) for t in tensors)
    try:
        yield
    finally:
        _STATE.scratch = prev


def lean_backward():
    """Backward kernels run inside prefer their lower-memory variant (a context manager;
    nests)."""
    return _LEAN.on()
