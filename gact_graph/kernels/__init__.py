"""Triton kernels and their PyTorch references.

Importing this package imports nothing heavy: each kernel module (``gact_graph.kernels.<op>``)
guards its own ``import triton`` and is loaded by the caller only when it is needed.
"""

from __future__ import annotations

import importlib.util
import os

__all__ = ["force_triton", "triton_available"]


def triton_available() -> bool:
    """True when Triton can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def force_triton() -> bool:
    """True when ``GACT_GRAPH_FORCE_TRITON=1``: use Triton kernels even on CPU tensors.

    Only meaningful together with ``TRITON_INTERPRET=1`` (set before Triton is imported),
    which runs the kernels in Triton's CPU interpreter; used by the kernel tests.
    """
    return os.environ.get("GACT_GRAPH_FORCE_TRITON", "0") == "1"
