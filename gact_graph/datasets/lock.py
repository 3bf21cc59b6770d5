"""One process at a time builds a dataset's processed files.

PyG's datasets process their raw files on first load and write the result with a plain
``torch.save``; two processes loading the same root at once (parallel runs of the example, a
DDP launch, the accuracy table's ``--jobs``) both process, and one can read the other's
half-written file (``--jobs 2`` on a fresh Cora root does). An advisory lock on a file in
the dataset's folder serializes the first load; later loads only read, under the same lock,
which costs nothing measurable.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks; loads are not serialized
    fcntl = None

__all__ = ["LOCK_NAME", "dataset_lock"]

LOCK_NAME = ".gact_graph.lock"


@contextlib.contextmanager
def dataset_lock(folder: str) -> Iterator[None]:
    """Hold an exclusive lock on ``<folder>/.gact_graph.lock`` (created if needed)."""
    if fcntl is None:
        yield
        return
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, LOCK_NAME), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
