"""The `TorchFunctionMode` that routes pointwise ops to the memory-saving Functions.

Why a mode: the user's model is not modified and nothing global is patched. The controller
enters the mode around the root model's forward only (``ctl.add_forward_context``), so the
interception covers every way a model reaches these ops (``F.relu``, ``torch.relu``,
``x.relu()``, ``nn.ReLU``, a function object captured at import time such as
``{"elu": F.elu}``) and ends exactly when the forward ends, including on exceptions. Module
forward hooks would miss the functional calls GNN code is full of, and monkey-patching
``torch.nn.functional`` would leak into other models and threads.

Cost: the mode sees every torch call of the forward; for the ones it does not handle it pays
one dict lookup on the function object before calling it untouched. The package's own work
inside the forward (the saved-tensor hook, the adjacency cache, the SpMM and graph-attention
Functions) is wrapped in `gact_graph.switches.package_work`, which takes this mode off the stack
while it runs (``PACKAGE_MODE_ATTR``): the mode would never rewrite those calls, so it need not
see them.

A handler only intercepts when the call needs a gradient (grad mode on, the input requires
grad) on a plain dense floating tensor with the arguments it understands; anything else —
``out=``, tensor bounds, tensor subclasses, ``p`` outside (0, 1), eval mode — returns
``NotImplemented`` and the original op runs exactly as without us.

An input the controller would keep as it is (``min_bytes``, `Controller.keeps_as_is`) runs the
original op too, before any handler: what PyTorch's op saves is never larger than its input, so
it is kept uncompressed either way, and the Functions would only add a Python call, more
launches (a mask packed, a dropout mask drawn again in backward) and no saved byte.
"""

from __future__ import annotations

from collections.abc import Callable
from numbers import Real
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from gact_graph.ops.batchnorm import batch_norm
from gact_graph.ops.dropout import DropoutFunction
from gact_graph.ops.inverted import DerivativeFunction, EluFunction
from gact_graph.ops.masks import (
    ClampMaskFunction,
    HardtanhMaskFunction,
    LeakyReluMaskFunction,
    ReluMaskFunction,
)
from gact_graph.switches import PACKAGE_MODE_ATTR

__all__ = ["PointwiseMode", "HANDLERS"]

Handler = Callable[[tuple, dict], Any]
_nn = torch._C._nn


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _input(args: tuple, kwargs: dict) -> Any:
    if args:
        return args[0]
    return kwargs.get("input", kwargs.get("self"))


def _wants_grad(x: Any, kwargs: dict) -> bool:
    """Intercept only plain dense floating tensors that need a gradient."""
    return (
        (type(x) is Tensor or type(x) is nn.Parameter)
        and x.requires_grad
        and torch.is_grad_enabled()
        and x.layout == torch.strided
        and x.is_floating_point()
        and "out" not in kwargs
    )


def _is_number(v: Any) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool)


# ---------------------------------------------------------------------------- masks
def _relu(inplace_fixed: bool | None) -> Handler:
    def handler(args, kwargs):
        x = _input(args, kwargs)
        if not _wants_grad(x, kwargs):
            return NotImplemented
        inplace = inplace_fixed
        if inplace is None:
            inplace = bool(_arg(args, kwargs, 1, "inplace", False))
        return ReluMaskFunction.apply(x, inplace)

    return handler


def _leaky_relu(functional: bool, inplace_fixed: bool) -> Handler:
    def handler(args, kwargs):
        x = _input(args, kwargs)
        if not _wants_grad(x, kwargs):
            return NotImplemented
        slope = _arg(args, kwargs, 1, "negative_slope", 0.01)
        inplace = bool(_arg(args, kwargs, 2, "inplace", False)) if functional else inplace_fixed
        if not _is_number(slope):
            return NotImplemented
        return LeakyReluMaskFunction.apply(x, slope, inplace)

    return handler


def _hardtanh(functional: bool, inplace_fixed: bool) -> Handler:
    def handler(args, kwargs):
        x = _input(args, kwargs)
        if not _wants_grad(x, kwargs):
            return NotImplemented
        lo = _arg(args, kwargs, 1, "min_val", -1.0)
        hi = _arg(args, kwargs, 2, "max_val", 1.0)
        inplace = bool(_arg(args, kwargs, 3, "inplace", False)) if functional else inplace_fixed
        if not (_is_number(lo) and _is_number(hi)) or lo > hi:
            return NotImplemented  # PyTorch raises its own error
        return HardtanhMaskFunction.apply(x, lo, hi, inplace, False)

    return handler


def _relu6(functional: bool, inplace_fixed: bool) -> Handler:
    def handler(args, kwargs):
        x = _input(args, kwargs)
        if not _wants_grad(x, kwargs):
            return NotImplemented
        inplace = bool(_arg(args, kwargs, 1, "inplace", False)) if functional else inplace_fixed
        return HardtanhMaskFunction.apply(x, 0.0, 6.0, inplace, True)

    return handler


def _clamp(args, kwargs):
    x = _input(args, kwargs)
    if not _wants_grad(x, kwargs):
        return NotImplemented
    lo = _arg(args, kwargs, 1, "min")
    hi = _arg(args, kwargs, 2, "max")
    if lo is None and hi is None:
        return NotImplemented
    if not ((lo is None or _is_number(lo)) and (hi is None or _is_number(hi))):
        return NotImplemented  # tensor bounds: stock path
    return ClampMaskFunction.apply(x, lo, hi)


# ---------------------------------------------------------------------------- dropout
def _dropout(functional: bool, inplace_fixed: bool) -> Handler:
    def handler(args, kwargs):
        x = _input(args, kwargs)
        if not _wants_grad(x, kwargs):
            return NotImplemented
        p = _arg(args, kwargs, 1, "p", 0.5)
        if functional:
            training = _arg(args, kwargs, 2, "training", True)
            inplace = bool(_arg(args, kwargs, 3, "inplace", False))
        else:  # torch.dropout(input, p, train)
            training = _arg(args, kwargs, 2, "train")
            inplace = inplace_fixed
        if (
            training is not True
            or not _is_number(p)
            or not 0.0 < p < 1.0
            or x.numel() == 0
            or x.device.type not in ("cpu", "cuda")
        ):
            return NotImplemented  # identity, p == 1, errors: PyTorch's own path
        return DropoutFunction.apply(x, float(p), inplace)

    return handler


# ---------------------------------------------------------------------------- activations
def _elu(functional: bool, inplace_fixed: bool) -> Handler:
    def handler(args, kwargs):
        x = _input(args, kwargs)
        if not _wants_grad(x, kwargs):
            return NotImplemented
        alpha = _arg(args, kwargs, 1, "alpha", 1.0)
        if functional:
            inplace = bool(_arg(args, kwargs, 2, "inplace", False))
        else:  # torch._C._nn.elu(input, alpha, scale, input_scale)
            if (
                _arg(args, kwargs, 2, "scale", 1) != 1
                or _arg(args, kwargs, 3, "input_scale", 1) != 1
            ):
                return NotImplemented
            inplace = inplace_fixed
        if not _is_number(alpha):
            return NotImplemented
        if inplace:
            return EluFunction.apply(x, float(alpha))
        return DerivativeFunction.apply(x, "elu", float(alpha), False)

    return handler


def _gelu(args, kwargs):
    x = _input(args, kwargs)
    if not _wants_grad(x, kwargs):
        return NotImplemented
    approximate = _arg(args, kwargs, 1, "approximate", "none")
    if approximate not in ("none", "tanh"):
        return NotImplemented  # PyTorch raises its own error
    return DerivativeFunction.apply(x, "gelu", approximate, False)


def _silu(functional: bool, inplace_fixed: bool) -> Handler:
    def handler(args, kwargs):
        x = _input(args, kwargs)
        if not _wants_grad(x, kwargs):
            return NotImplemented
        inplace = bool(_arg(args, kwargs, 1, "inplace", False)) if functional else inplace_fixed
        return DerivativeFunction.apply(x, "silu", None, inplace)

    return handler


# ---------------------------------------------------------------------------- batch norm
_BN_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum",
            "eps")  # fmt: skip
_BN_DEFAULTS = (None, None, None, None, None, False, 0.1, 1e-5)


def _batch_norm(args, kwargs):
    a = [_arg(args, kwargs, i, k, d) for i, (k, d) in enumerate(zip(_BN_ARGS, _BN_DEFAULTS))]
    x, rm, rv, w, b, training, momentum, eps = a
    if (
        not training
        or not _wants_grad(x, kwargs)
        or x.dim() < 2
        or not _is_number(momentum)
        or not _is_number(eps)
        or any(t is not None and type(t) not in (Tensor, nn.Parameter) for t in (rm, rv, w, b))
    ):
        return NotImplemented
    return batch_norm(x, rm, rv, w, b, float(momentum), float(eps))


#: torch function -> handler(args, kwargs) returning the result or NotImplemented.
HANDLERS: dict[Any, Handler] = {
    F.relu: _relu(None),
    torch.relu: _relu(False),
    torch.relu_: _relu(True),  # also F.relu_
    Tensor.relu: _relu(False),
    Tensor.relu_: _relu(True),
    F.leaky_relu: _leaky_relu(True, False),
    _nn.leaky_relu: _leaky_relu(False, False),
    _nn.leaky_relu_: _leaky_relu(False, True),  # also F.leaky_relu_
    F.hardtanh: _hardtanh(True, False),
    _nn.hardtanh: _hardtanh(False, False),
    _nn.hardtanh_: _hardtanh(False, True),  # also F.hardtanh_
    F.relu6: _relu6(True, False),
    _nn.relu6: _relu6(False, False),
    _nn.relu6_: _relu6(False, True),
    torch.clamp: _clamp,
    torch.clip: _clamp,
    Tensor.clamp: _clamp,
    Tensor.clip: _clamp,
    F.dropout: _dropout(True, False),
    torch.dropout: _dropout(False, False),
    torch.dropout_: _dropout(False, True),
    F.elu: _elu(True, False),
    _nn.elu: _elu(False, False),
    _nn.elu_: _elu(False, True),  # also F.elu_
    F.gelu: _gelu,  # F.gelu is torch._C._nn.gelu
    F.silu: _silu(True, False),
    _nn.silu: _silu(False, False),
    _nn.silu_: _silu(False, True),
    F.batch_norm: _batch_norm,
}


def _inside_torch_checkpoint() -> bool:
    """Whether the innermost saved-tensor hooks are ``torch.utils.checkpoint``'s (its
    non-reentrant forward). Its recomputation runs outside our forward, hence without this
    mode, and must save exactly what the forward saved: so inside a checkpoint the mode steps
    aside and the stock ops run (the checkpoint keeps none of their tensors anyway)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and getattr(hooks[0], "__module__", "") == "torch.utils.checkpoint"


class PointwiseMode(TorchFunctionMode):
    """Routes the ops in `HANDLERS` to mask-saving / regenerating / derivative-keeping Functions.

    ``counts`` (op name -> calls intercepted) shows what the mode did in its last use.
    """

    def __init__(
        self,
        handlers: dict[Any, Handler] | None = None,
        keeps_as_is: Callable[[Tensor], bool] | None = None,
    ) -> None:
        super().__init__()
        self.handlers = HANDLERS if handlers is None else handlers
        self.counts: dict[str, int] = {}
        self.keeps_as_is = keeps_as_is

    def __torch_function__(self, func, types, args=(), kwargs=None):
        try:
            handler = self.handlers.get(func)
        except TypeError:  # an unhashable callable
            handler = None
        if handler is None:  # most calls: straight through
            return func(*args, **kwargs) if kwargs else func(*args)
        small = self.keeps_as_is
        if small is not None:
            x = args[0] if args else (kwargs or {}).get("input", (kwargs or {}).get("self"))
            # Everything the stock op saves is at most its input's size, so the controller
            # keeps it as it is anyway: the stock op is exact and costs fewer launches and no
            # Python Function. Sizes only: the check costs less than the handler would.
            if type(x) is Tensor and small(x):
                return func(*args, **kwargs) if kwargs else func(*args)
        if kwargs is None:
            kwargs = {}
        if not _inside_torch_checkpoint():
            out = handler(args, kwargs)
            if out is not NotImplemented:
                name = getattr(func, "__name__", str(func))
                self.counts[name] = self.counts.get(name, 0) + 1
                return out
        return func(*args, **kwargs)


# the package's own work steps past this mode (`gact_graph.switches.package_work`)
setattr(PointwiseMode, PACKAGE_MODE_ATTR, True)
