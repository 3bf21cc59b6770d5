"""torch's notices about the package's own sparse tensors, kept quiet where the package builds
them.

torch says once a process, when a sparse tensor is built, that CSR support is "in beta" and,
unless the builder opts in or out, that invariant checks are off. About the package's
transient CSR views and the sparse tensors PyG's functions build inside the package's graph
build, neither is news to a user: each is kept quiet there (`quiet_sparse_notices`,
`sparse_csr_tensor`), and the user's warning filters are never touched, so the user's own code
hears torch as before.
"""

from __future__ import annotations

import contextlib
import threading
import warnings

import torch
from torch import Tensor

__all__ = ["quiet_sparse_notices", "sparse_csr_tensor"]

NOTICES = (
    "Sparse CSR tensor support is in beta state",
    "Sparse invariant checks are implicitly disabled",
)
#: `warnings.catch_warnings` swaps process-wide state: the package's uses take turns.
_LOCK = threading.RLock()
#: Whether torch has said its "in beta" notice in this process: once said, building a CSR needs
#: no quieting (unless ``torch.set_warn_always``, under which torch says it each time).
_CSR_NOTICE_SAID = [False]


@contextlib.contextmanager
def quiet_sparse_notices():
    """`NOTICES` left unsaid around the package's own sparse tensor builds (a graph's, once)."""
    with _LOCK, warnings.catch_warnings():
        for message in NOTICES:
            warnings.filterwarnings("ignore", message=message)
        yield


def sparse_csr_tensor(crow: Tensor, col: Tensor, values: Tensor, size: tuple) -> Tensor:
    """`torch.sparse_csr_tensor` of a CSR the package made (its invariants hold by
    construction: unchecked), without torch's notice; quieted only until torch has said it,
    so a step's products pay nothing for it."""
    if _CSR_NOTICE_SAID[0] and not torch.is_warn_always_enabled():
        return torch.sparse_csr_tensor(crow, col, values, size, check_invariants=False)
    with quiet_sparse_notices():
        csr = torch.sparse_csr_tensor(crow, col, values, size, check_invariants=False)
    _CSR_NOTICE_SAID[0] = True
    return csr
