"""``@differentiable_once(what)``: the sparse paths' backwards are not differentiable again.

PyTorch's ``once_differentiable`` defers its error to the second backward, where the message
names no setting, and it cannot raise at all when the incoming gradient needs no gradient
itself (the second-order term is then dropped without a word). This decorator refuses a
``create_graph=True`` backward at once, naming the settings that do support it
(:data:`gact_graph.config.DOUBLE_BACKWARD_HELP`), and otherwise runs the backward without
building a graph, as ``once_differentiable`` does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from gact_graph.config import DOUBLE_BACKWARD_HELP

__all__ = ["differentiable_once"]


def differentiable_once(what: str) -> Callable:
    def wrap(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def checked(ctx, *grads):
            if torch.is_grad_enabled():  # the engine runs a create_graph backward in grad mode
                raise RuntimeError(
                    f"gact_graph: {what} is differentiable once; " + DOUBLE_BACKWARD_HELP
                )
            return backward(ctx, *grads)

        return checked

    return wrap
