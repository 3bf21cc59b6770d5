"""Piecewise-linear activations that save a 1-bit mask instead of a tensor.

The backward of ReLU, LeakyReLU, Hardtanh/ReLU6 and scalar ``clamp`` only needs to know which
linear piece each element was on. Stock autograd keeps a full tensor for that (ReLU its output,
the others their input); these Functions keep one ``bool`` per element, which the controller
packs to 1 bit. The comparisons are exactly the ones PyTorch's backward formulas make
(``derivatives.yaml``), NaN included, so the gradients are bit-identical to PyTorch's at any
``bits``: a quantized ReLU *output* would flip small positives to zero and bias the gradient
(GACT's footnote 1); the mask does not.

==============  ===================  ===============================  =====================
op              stock saves          mask saved here                  grad where mask set
==============  ===================  ===============================  =====================
relu            output               ``y <= 0``                       0
leaky_relu      input                ``x > 0``                        grad (else grad*slope)
hardtanh/relu6  input                ``x <= lo or x >= hi``           0
clamp(lo, hi)   input                ``x >= lo and x <= hi``          grad (else 0)
==============  ===================  ===============================  =====================

In-place variants modify their input (``ctx.mark_dirty``) exactly as PyTorch does; the mask is
taken from the input before it is overwritten.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "ReluMaskFunction",
    "LeakyReluMaskFunction",
    "HardtanhMaskFunction",
    "ClampMaskFunction",
    "relu",
    "leaky_relu",
    "hardtanh",
    "relu6",
    "clamp",
]

_ZERO = 0.0


class ReluMaskFunction(torch.autograd.Function):
    """ReLU saving ``y <= 0`` (PyTorch's ``threshold_backward(grad, y, 0)`` test)."""

    @staticmethod
    def forward(ctx, x: Tensor, inplace: bool) -> Tensor:
        if inplace:
            ctx.mark_dirty(x)
            y = torch.relu_(x)
        else:
            y = torch.relu(x)
        ctx.save_for_backward(y <= 0)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        (dead,) = ctx.saved_tensors
        return grad.masked_fill(dead, _ZERO), None


class LeakyReluMaskFunction(torch.autograd.Function):
    """LeakyReLU saving ``x > 0`` (``leaky_relu_backward``'s test on its input)."""

    @staticmethod
    def forward(ctx, x: Tensor, negative_slope: float, inplace: bool) -> Tensor:
        pos = x > 0
        if inplace:
            ctx.mark_dirty(x)
            y = torch._C._nn.leaky_relu_(x, negative_slope)
        else:
            y = torch._C._nn.leaky_relu(x, negative_slope)
        ctx.negative_slope = negative_slope
        ctx.save_for_backward(pos)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        (pos,) = ctx.saved_tensors
        return torch.where(pos, grad, grad * ctx.negative_slope), None, None


class HardtanhMaskFunction(torch.autograd.Function):
    """Hardtanh / ReLU6 saving ``x <= lo or x >= hi`` (``hardtanh_backward``'s test)."""

    @staticmethod
    def forward(ctx, x: Tensor, min_val: float, max_val: float, inplace: bool, relu6: bool):
        flat = (x <= min_val).logical_or_(x >= max_val)
        if inplace:
            ctx.mark_dirty(x)
            y = torch._C._nn.relu6_(x) if relu6 else torch._C._nn.hardtanh_(x, min_val, max_val)
        else:
            y = torch._C._nn.relu6(x) if relu6 else torch._C._nn.hardtanh(x, min_val, max_val)
        ctx.save_for_backward(flat)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        (flat,) = ctx.saved_tensors
        return grad.masked_fill(flat, _ZERO), None, None, None, None


class ClampMaskFunction(torch.autograd.Function):
    """``clamp`` with scalar bounds saving ``lo <= x <= hi`` (``clamp_backward``'s test)."""

    @staticmethod
    def forward(ctx, x: Tensor, min_val: float | None, max_val: float | None) -> Tensor:
        if min_val is not None and max_val is not None:
            keep = (x >= min_val).logical_and_(x <= max_val)
        elif min_val is not None:
            keep = x >= min_val
        else:
            keep = x <= max_val
        ctx.save_for_backward(keep)
        return torch.clamp(x, min_val, max_val)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (keep,) = ctx.saved_tensors
        return (
            torch.where(keep, grad, torch.zeros((), dtype=grad.dtype, device=grad.device)),
            None,
            None,
        )


# --------------------------------------------------------------------------------------------
# functional entry points
# --------------------------------------------------------------------------------------------
def relu(x: Tensor, inplace: bool = False) -> Tensor:
    """`torch.relu` that saves a 1-bit mask for backward."""
    return ReluMaskFunction.apply(x, inplace)


def leaky_relu(x: Tensor, negative_slope: float = 0.01, inplace: bool = False) -> Tensor:
    """`torch.nn.functional.leaky_relu` that saves a 1-bit mask for backward."""
    return LeakyReluMaskFunction.apply(x, negative_slope, inplace)


def hardtanh(
    x: Tensor, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False
) -> Tensor:
    """`torch.nn.functional.hardtanh` that saves a 1-bit mask for backward."""
    if min_val > max_val:
        F.hardtanh(x, min_val, max_val)  # raises PyTorch's own error
    return HardtanhMaskFunction.apply(x, min_val, max_val, inplace, False)


def relu6(x: Tensor, inplace: bool = False) -> Tensor:
    """`torch.nn.functional.relu6` that saves a 1-bit mask for backward."""
    return HardtanhMaskFunction.apply(x, 0.0, 6.0, inplace, True)


def clamp(x: Tensor, min: float | None = None, max: float | None = None) -> Tensor:  # noqa: A002
    """`torch.clamp` with scalar bounds that saves a 1-bit mask for backward."""
    if min is None and max is None:
        return torch.clamp(x, min, max)  # raises PyTorch's own error
    return ClampMaskFunction.apply(x, min, max)
