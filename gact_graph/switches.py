"""Thread-local switches that nest: the probe's lean backward, once-per-graph work, and the
package's own work stepping out of the forward's op-rewriting mode.

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
- **reading rows** (`reading_rows`, `is_reading_rows`): a Function that can read a compressed
  matrix a row range at a time wraps its ``ctx.saved_tensors`` in it, switched on by its
  class attribute ``reads_rows_every_step`` (the fused graph-attention Functions, whose
  kernels read packed codes), and the controller's unpack hook then hands a compressed 2-D
  activation back as a `~gact_graph.core.chunked.RowChunked` instead of a dequantized copy,
  in every step (`gact_graph.core.controller.Stored.unpack_rows`; with grad mode on it stays
  dense). Inside the sensitivity probe every Function with ``reads_row_chunks`` reads so.
- **package work** (`package_work`): the forward runs inside a ``TorchFunctionMode`` that
  rewrites the user's pointwise ops (`gact_graph.ops.mode`), and every torch call made while it
  is the innermost mode pays a Python ``__torch_function__`` call, the package's own bookkeeping
  too (the pack hook's storage and view look-ups, the adjacency cache's look-up, the SpMM
  and graph-attention Functions' forwards). A function wrapped in `package_work` runs with
  such a mode taken off the mode stack, and put back when it returns: the mode never rewrites
  what the package calls, so only the Python calls go. A mode says it may be stepped past with
  the class attribute `PACKAGE_MODE_ATTR`; any other mode (the user's own, a profiler's) stays
  where it is, and tensor subclasses keep their ``__torch_function__``. Work that Dynamo must
  not trace (it would build a `StorageWeakRef` itself and drop it half made) is wrapped in
  `eager_when_compiling`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

__all__ = [
    "ThreadSwitch",
    "eager_when_compiling",
    "is_lean",
    "is_once_per_graph",
    "is_reading_rows",
    "is_scratch",
    "lean_backward",
    "once_per_graph",
    "package_work",
    "reading_rows",
    "PACKAGE_MODE_ATTR",
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
_ROWS = ThreadSwitch()
_SCRATCH = threading.local()  # ids of the tensors a lean backward may write into


def is_lean() -> bool:
    """Whether the current thread runs inside `lean_backward`."""
    return _LEAN.is_on()


def lean_backward():
    """Backward kernels run inside prefer their lower-memory variant (a context manager;
    nests)."""
    return _LEAN.on()


def is_scratch(t) -> bool:
    """Whether ``t`` may be overwritten by a lean backward (see `scratch`): one of those
    tensors, or another tensor on one of their storages (a Function's saved *output* comes
    back from ``ctx.saved_tensors`` as a new tensor on the unpacked tensor's storage)."""
    if not is_lean():
        return False
    if id(t) in getattr(_SCRATCH, "ids", ()):
        return True
    storages = getattr(_SCRATCH, "storages", ())
    return bool(storages) and _storage_of(t) in storages


def _storage_of(t) -> int:
    """The address of ``t``'s storage; 0 where it has none to write into (a wrapper subclass,
    an empty storage)."""
    try:
        return t.untyped_storage().data_ptr()
    except (AttributeError, NotImplementedError, RuntimeError, TypeError):
        return 0


@contextlib.contextmanager
def scratch(*tensors):
    """Inside (and inside `lean_backward`), a backward may write into ``tensors`` (their
    storages)."""
    prev, prev_storages = getattr(_SCRATCH, "ids", ()), getattr(_SCRATCH, "storages", ())
    _SCRATCH.ids = prev + tuple(id(t) for t in tensors)
    _SCRATCH.storages = prev_storages + tuple(ptr for ptr in map(_storage_of, tensors) if ptr)
    try:
        yield
    finally:
        _SCRATCH.ids, _SCRATCH.storages = prev, prev_storages


def is_once_per_graph() -> bool:
    """Whether the current thread runs inside `once_per_graph`."""
    return _ONCE.is_on()


def once_per_graph():
    """Work inside is done once per graph (a context manager; nests)."""
    return _ONCE.on()


#: Whether `reading_rows` is on in every step; off, Functions that set ``reads_rows_every_step``
#: are handed dequantized copies outside the sensitivity probe (whose own reads do not depend
#: on it). The same values either way: the tests switch it off for their reference.
ROWS_IN_EVERY_STEP = True


@contextlib.contextmanager
def reading_rows(on: bool = True) -> Iterator[None]:
    """Around a backward's ``ctx.saved_tensors``: the controller's unpack may hand a
    compressed 2-D activation back as a `RowChunked` (see the module docstring); nothing
    when ``on`` (the Function's ``reads_rows_every_step``) or `ROWS_IN_EVERY_STEP` is off."""
    if not (on and ROWS_IN_EVERY_STEP):
        yield
        return
    with _ROWS.on():
        yield


def is_reading_rows() -> bool:
    """Whether the current thread runs inside `reading_rows` (with `ROWS_IN_EVERY_STEP` on)."""
    return _ROWS.is_on()


#: Class attribute (True) of a ``TorchFunctionMode`` that `package_work` steps past.
PACKAGE_MODE_ATTR = "gact_graph_package_steps_aside"

_stack_len = torch._C._len_torch_function_stack
_stack_at = torch._C._get_function_stack_at
_stack_pop = torch._C._pop_torch_function_stack
_stack_push = torch._C._push_on_torch_function_stack
_compiling = torch.compiler.is_compiling

F = TypeVar("F", bound=Callable)


def package_work(fn: F) -> F:
    """``fn`` runs with the innermost torch-function mode taken off the stack when that mode
    has `PACKAGE_MODE_ATTR` set (the forward's pointwise rewriting), and put back afterwards,
    also on an exception. Only for the package's own work, which that mode never rewrites; under
    ``torch.compile`` tracing the stack is left alone."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        n = _stack_len()
        if not n or not getattr(_stack_at(n - 1), PACKAGE_MODE_ATTR, False) or _compiling():
            return fn(*args, **kwargs)
        mode = _stack_pop()
        try:
            return fn(*args, **kwargs)
        finally:
            _stack_push(mode)

    return wrapper  # type: ignore[return-value]


def eager_when_compiling(fn: F) -> F:
    """``fn``, run out of Dynamo's trace (eagerly, on the real tensors) when it is called while
    ``torch.compile`` traces, and as itself otherwise. The disabled copy is made at the first
    compiled call: ``torch.compiler.disable`` imports Dynamo (and, through it, Triton), which
    importing this package must not."""
    eager = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal eager
        if not _compiling():
            return fn(*args, **kwargs)
        if eager is None:
            eager = torch.compiler.disable(fn)
        return eager(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
