"""ELU, GELU and SiLU keep their derivative ``f'(x)``; in-place ELU keeps its output.

Stock autograd keeps the input ``x`` of ELU, GELU and SiLU and evaluates ``f'(x)`` in backward.
`DerivativeFunction` evaluates ``f'(x)`` in the forward instead (PyTorch's own backward kernel
at an incoming gradient of one, in ``x``'s dtype) and keeps only that tensor, the size of ``x``:

- its backward, ``grad * f'(x)``, is linear in what it keeps, so stochastic rounding of the
  kept tensor gives an unbiased gradient (the guarantee GACT and ActNN prove for linear
  backwards). Keeping ``x`` instead, as stock does, evaluates ``f'`` of a rounded input, and
  keeping the output ``y`` (inverted activations) evaluates ``f'(f^{-1})`` of a rounded
  output: both are nonlinear in the rounded tensor, hence biased, and for GELU and SiLU,
  whose ``f'(f^{-1}(y))`` has a square-root singularity at their minimum, strongly so
  (`docs/design.md`, "Pointwise ops");
- it keeps nothing that aliases the output, so the model may change the output in place
  (``h = F.gelu(conv(x)); h += skip``), as stock allows;
- ``f'`` is bounded (ELU: ``(0, max(1, alpha)]``; GELU, SiLU: about ``[-0.17, 1.13]``), so
  its quantization groups are narrow.

Without rounding (``bits=None``) the gradient is ``grad * f'(x)`` with ``f'(x)`` rounded to
``x``'s dtype once: stock's gradient in float32 and float64 (bit for bit or within one
rounding), within two roundings of it in half precision.

In-place ELU (``F.elu(x, inplace=True)``) is `EluFunction`: like stock's ``elu_`` it keeps its
output, which has overwritten the input, so changing that output in place again is refused
as stock refuses it. It keeps a 1-bit branch indicator ``x > 0`` beside it: the derivative is
``1`` there and ``y + alpha`` elsewhere, affine in ``y``, so a rounded ``y`` still gives an
unbiased gradient, and a rounded ``y`` near 0 cannot pick the wrong branch.

Double backward: ELU's in-place backward is differentiable in ``y`` and gives the exact second
derivative; `DerivativeFunction` keeps no graph to ``x``, so a ``create_graph=True`` backward
through it raises (compress with ``pointwise=False`` for higher-order gradients through it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gact_graph.config import DOUBLE_BACKWARD_HELP
from gact_graph.switches import is_scratch

__all__ = ["DerivativeFunction", "EluFunction", "elu", "gelu", "silu"]

_nn = torch._C._nn
_aten = torch.ops.aten


class DerivativeFunction(torch.autograd.Function):
    """ELU (out of place), GELU or SiLU keeping ``f'(x)`` in ``x``'s dtype: ``name`` one of
    ``"elu"`` (``arg`` its alpha), ``"gelu"`` (``arg`` its ``approximate``), ``"silu"``.

    In the sensitivity probe's replay (`lean_backward`) the kept derivative arrives as the
    probe's own noisy copy, which the backward may overwrite (`scratch`): the gradient is
    written into it, so that the replay makes no tensor of its own (`lean_backward_bytes`)."""

    @staticmethod
    def forward(ctx, x: Tensor, name: str, arg, inplace: bool) -> Tensor:
        one = x.new_ones(()).expand_as(x)  # the incoming gradient of PyTorch's backward kernel
        if name == "elu":
            d = _aten.elu_backward(one, arg, 1, 1, False, x)
            y = _nn.elu(x, arg)
        elif name == "gelu":
            d = _aten.gelu_backward(one, x, approximate=arg)
            y = _nn.gelu(x, approximate=arg)
        else:
            d = _aten.silu_backward(one, x)
            if inplace:
                ctx.mark_dirty(x)
                y = _nn.silu_(x)
            else:
                y = _nn.silu(x)
        ctx.name = name
        ctx.save_for_backward(d)
        return y

    @staticmethod
    def lean_backward_bytes(ctx, layouts=(), walk: bool = False) -> int | None:
        """An upper bound of the bytes `backward` run under `lean_backward` creates and holds
        at once (its output included; its saved tensor and ``grad`` not), in the sensitivity
        probe's replay of the kept derivative, ``layouts`` the group layouts of the compressed
        tensors the node read: the replay hands the derivative as its own noisy copy, which the
        backward writes the product into (`scratch`; ``grad`` has the derivative's dtype and
        shape, those of the output): nothing made. None in the probe's walk (``walk``: the
        derivative is dequantized whole inside the node) and for any other reads than the one
        derivative."""
        if walk or len(list(layouts)) != 1:
            return None
        return 0

    @staticmethod
    def backward(ctx, grad: Tensor):
        if torch.is_grad_enabled():
            # once_differentiable would let a create_graph backward run and silently drop the
            # second-order term whenever ``grad`` itself needs no gradient; refuse instead.
            raise RuntimeError(
                f"gact_graph: {ctx.name} keeps its derivative, not its input, and is "
                "differentiable once; " + DOUBLE_BACKWARD_HELP
            )
        (d,) = ctx.saved_tensors
        if is_scratch(d):  # the probe's own copy, read no more: the product goes into it
            return d.mul_(grad), None, None, None
        return grad * d, None, None, None


class EluFunction(torch.autograd.Function):
    """In-place ELU saving its output and the 1-bit indicator ``x > 0``.

    In the sensitivity probe's replay (`lean_backward`) the saved output arrives as the
    probe's own noisy copy, which the backward may overwrite (`scratch`): the gradient is
    written into it, so that the replay makes no tensor of its own (`lean_backward_bytes`)."""

    @staticmethod
    def forward(ctx, x: Tensor, alpha: float) -> Tensor:
        pos = x > 0
        ctx.mark_dirty(x)
        y = _nn.elu_(x, alpha)
        ctx.alpha = alpha
        ctx.save_for_backward(y, pos)
        # what `lean_backward_bytes` reads (the saved tensors themselves would be unpacked)
        ctx.shapes = (y.numel(), y.dtype)
        return y

    @staticmethod
    def lean_backward_bytes(ctx, layouts=(), walk: bool = False) -> int | None:
        """An upper bound of the bytes `backward` run under `lean_backward` creates and holds
        at once (its output included; its saved tensors, ``grad`` and the unpacking of the
        saved indicator not: `gact_graph.budget.probe_cost` counts a packed mask's unpacking
        itself), in the sensitivity probe's replay of the saved output, ``layouts`` the group
        layouts of the compressed tensors the node read: the replay hands the output as its
        own noisy copy, which the backward writes into where ``grad`` has its dtype (`scratch`:
        nothing made); in half precision the float32 product and its cast. None in the probe's
        walk (``walk``: the output is dequantized whole inside the node) and for any other
        reads than the one output."""
        if walk or len(list(layouts)) != 1:
            return None
        numel, dtype = ctx.shapes
        if dtype in (torch.float16, torch.bfloat16):
            # the float32 (y + alpha) * grad beside its cast; then the cast beside the
            # selection's result, less
            return numel * (4 + torch.finfo(dtype).bits // 8)
        return 0

    @staticmethod
    def backward(ctx, grad: Tensor):
        y, pos = ctx.saved_tensors
        if grad.dtype in (torch.float16, torch.bfloat16):
            # (y + alpha) * grad in float32, in one new tensor (``grad`` is widened exactly
            # inside the in-place product), then cast
            neg = y.to(torch.float32, copy=True).add_(ctx.alpha).mul_(grad).to(grad.dtype)
            return torch.where(pos, grad, neg), None
        # grad * (y + alpha) where x <= 0, grad elsewhere, in one new tensor rather than three:
        # the sensitivity probe runs this backward on top of the user's, so temporaries add up
        # (same rounding as PyTorch's elu_backward: (y + alpha) first, then times grad); in
        # the probe's replay, in its own copy of ``y`` (`scratch`), none
        if torch.is_grad_enabled():  # create_graph: no out= under autograd
            return torch.where(pos, grad, torch.add(y, ctx.alpha).mul_(grad)), None
        if is_scratch(y) and y.dtype == grad.dtype and y.shape == grad.shape:
            out = y.add_(ctx.alpha).mul_(grad)
        else:
            out = torch.add(y, ctx.alpha).mul_(grad)
        return torch.where(pos, grad, out, out=out), None


# --------------------------------------------------------------------------------------------
# functional entry points (also used by the TorchFunctionMode)
# --------------------------------------------------------------------------------------------
def elu(x: Tensor, alpha: float = 1.0, inplace: bool = False) -> Tensor:
    """`torch.nn.functional.elu` that keeps its derivative (in place: its output and a 1-bit
    branch indicator)."""
    if inplace:
        return EluFunction.apply(x, float(alpha))
    return DerivativeFunction.apply(x, "elu", float(alpha), False)


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """`torch.nn.functional.gelu` that keeps its derivative."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return DerivativeFunction.apply(x, "gelu", approximate, False)


def silu(x: Tensor, inplace: bool = False) -> Tensor:
    """`torch.nn.functional.silu` that keeps its derivative."""
    return DerivativeFunction.apply(x, "silu", None, inplace)
