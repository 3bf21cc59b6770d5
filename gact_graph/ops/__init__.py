"""Lossless memory savings for pointwise ops, inside `compress_gnn` with no model changes.

- `gact_graph.ops.masks`: ReLU, LeakyReLU, Hardtanh/ReLU6, scalar ``clamp`` save a 1-bit mask.
- `gact_graph.ops.dropout`: dropout saves the RNG state and regenerates its mask in backward.
- `gact_graph.ops.inverted`: ELU, GELU, SiLU save their derivative instead of their input (a
  backward linear in what it keeps: unbiased when that is rounded); in-place ELU saves its
  output plus a 1-bit branch indicator.
- `gact_graph.ops.batchnorm`: training-mode BatchNorm saves its normalized input instead of its
  raw input (same bytes; its rounding error is not amplified by small channel spreads, as the raw
  input's is).
- `gact_graph.ops.mode`: the `TorchFunctionMode` that routes those calls during the model's
  forward.

`install_pointwise_ops(ctl)` enters the mode around every forward of the controller's model.
The functional forms (``gact_graph.ops.masks.relu``, ``gact_graph.ops.dropout.dropout``,
``gact_graph.ops.inverted.gelu``, ...) can also be called directly; they are not re-exported
here so that the submodule names stay importable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from gact_graph.ops.dropout import DropoutFunction
from gact_graph.ops.inverted import DerivativeFunction, EluFunction
from gact_graph.ops.masks import (
    ClampMaskFunction,
    HardtanhMaskFunction,
    LeakyReluMaskFunction,
    ReluMaskFunction,
)
from gact_graph.ops.mode import HANDLERS, PointwiseMode

if TYPE_CHECKING:
    from gact_graph.core.controller import Controller

__all__ = [
    "install_pointwise_ops",
    "PointwiseMode",
    "HANDLERS",
    "POINTWISE_MODULES",
    "ReluMaskFunction",
    "LeakyReluMaskFunction",
    "HardtanhMaskFunction",
    "ClampMaskFunction",
    "DropoutFunction",
    "DerivativeFunction",
    "EluFunction",
]

#: modules whose forward is one of the intercepted ops (shown as path "pointwise" in reports).
POINTWISE_MODULES = (
    nn.ReLU,
    nn.LeakyReLU,
    nn.Hardtanh,  # includes nn.ReLU6
    nn.Dropout,
    nn.ELU,
    nn.GELU,
    nn.SiLU,
    nn.modules.batchnorm._BatchNorm,  # training mode: saves the normalized input
)


def install_pointwise_ops(ctl: Controller) -> PointwiseMode:
    """Route the model's pointwise ops through the memory-saving Functions during its forward.

    Returns the mode object (re-entered on every forward; its ``counts`` show the ops it
    intercepted). Removed with the controller (``ctl.remove()`` drops the forward context).
    """
    # a tensor the controller keeps as it is (``min_bytes``) runs PyTorch's own op
    mode = PointwiseMode(keeps_as_is=ctl.keeps_as_is)

    def enter() -> PointwiseMode:
        mode.counts = {}
        return mode

    ctl.add_forward_context(enter)
    for name, module in ctl.model.named_modules():
        path = name or "<root>"
        if (
            isinstance(module, POINTWISE_MODULES)
            and ctl.module_paths.get(path, "generic") == "generic"
        ):
            ctl.module_paths[path] = "pointwise"
    return mode
