"""Autocast (mixed precision) for the fused paths' autograd Functions.

Autocast re-casts the inputs of the matmul-like ops it lists (``mm``, ``bmm``, ``addmm``,
``einsum`` through ``bmm``, ...) to its lower precision, inside custom Functions too, and in
their backward when ``backward()`` is called inside the autocast region. Our Functions choose
their compute and result dtypes themselves (see each one), so they run their internal products
with autocast off: otherwise a CSR product whose fp32 operands we prepared would be cast back to
bf16/fp16, for which the CPU sparse library has no kernel.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

__all__ = ["autocast_enabled", "autocast_off", "add_into"]


def autocast_enabled(device: torch.device) -> bool:
    """Whether autocast is on for ``device``'s type (False for types autocast does not know)."""
    kind = device.type
    return torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)


def autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    """A context with autocast off for ``device``'s type (a no-op when it is not on)."""
    if autocast_enabled(device):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def add_into(out: Tensor, t: Tensor) -> Tensor:
    """``out + t``, written into ``out`` (a fresh result that nothing saved: no second tensor
    of its size) where the dtype stays what stock's out-of-place sum gives; under autocast an
    fp16/bf16 product plus an fp32 bias or residual is fp32, so that sum is made out of place.
    ``out`` must not be a view (in place on a view adds a ``CopySlices`` node to the graph,
    which clones the gradient in backward)."""
    if torch.promote_types(out.dtype, t.dtype) == out.dtype:
        return out.add_(t)
    return out + t
