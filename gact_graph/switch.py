"""`ThreadSwitch`: a thread-local on/off switch that nests, the shape of `gact_graph.lean`'s
and `gact_graph.once`'s switches."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["ThreadSwitch"]


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
