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

__all__ = ["autocast_enabled", "autocast_off"]


def autocast_enabled(device: torch.device) -> bool:
    """Whether autocast is on for ``device``'s type (False for types autocast does not know)."""
    kind = device.type
    return torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)


def autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    """A context with autocast off for ``device``'s type (a no-op when it is not on)."""
    if autocast_enabled(device):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()
