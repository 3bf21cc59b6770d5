"""Activation compression in a plain PyTorch Geometric training loop.

A thin callback over `compress_gnn` / `Controller` that reads like the rest of a PyG example::

    gact = GactCallback(model, bits=2)
    gact.on_train_start()
    for epoch in range(200):
        model.train()

        def closure():
            optimizer.zero_grad()
            out = model(data.x, data.edge_index)
            loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
            loss.backward()
            return loss

        loss = gact.step(closure, optimizer)
    gact.on_train_end()

`step` runs the closure (forward, ``zero_grad``, backward), the optimizer step, then
``ctl.iterate(closure)`` (GACT's API: the adaptive planner may call the closure again to
re-estimate sensitivities). Evaluation under ``torch.no_grad()`` costs nothing: the controller
installs no hook when grad is disabled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gact_graph.api import compress_gnn
from gact_graph.core.controller import Controller

__all__ = ["GactCallback"]


class GactCallback:
    """Compresses ``model``'s saved activations between `on_train_start` and `on_train_end`.

    Args:
        model: the GNN (its forward is what gets compressed).
        bits: as `compress_gnn` (``None``: lossless; with ``adaptive=True`` an average).
        **kwargs: any other `compress_gnn` argument (``adaptive``, ``opt_level``, ...).

    Also a context manager: ``with GactCallback(model, bits=2) as gact: ...``.
    """

    def __init__(self, model: nn.Module, bits: float | None = 2, **kwargs: Any) -> None:
        self.model = model
        self.bits = bits
        self.kwargs = kwargs
        self.ctl: Controller | None = None
        self._pending_state: dict[str, Any] | None = None

    # ---------------------------------------------------------------- lifecycle
    def on_train_start(self) -> Controller:
        """Compress ``model`` (idempotent); restores a state given to `load_state_dict`."""
        if self.ctl is None:
            self.ctl = compress_gnn(self.model, bits=self.bits, **self.kwargs)
            if self._pending_state is not None:
                self.ctl.load_state_dict(self._pending_state)
                self._pending_state = None
        return self.ctl

    def on_train_end(self) -> None:
        """Remove every hook and patch: ``model`` is exactly as before."""
        if self.ctl is not None:
            self._pending_state = self.ctl.state_dict()  # a later on_train_start resumes
            self.ctl.remove()
            self.ctl = None

    def __enter__(self) -> GactCallback:
        self.on_train_start()
        return self

    def __exit__(self, *exc) -> None:
        self.on_train_end()

    # ---------------------------------------------------------------- per step
    def step(
        self, closure: Callable[[], Any], optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        """One training step: ``loss = closure()`` (forward, zero_grad, backward), then
        ``optimizer.step()`` when given, then ``ctl.iterate(closure)``. Returns the loss."""
        ctl = self.on_train_start()
        loss = closure()
        if optimizer is not None:
            optimizer.step()
        ctl.iterate(closure)
        return loss

    def on_train_batch_end(self) -> None:
        """For loops that run their own step: call once per step, after ``optimizer.step()``
        (the adaptive planner then keeps the current plan instead of re-running a closure)."""
        self.on_train_start().iterate()

    # ---------------------------------------------------------------- reporting and state
    def stats(self) -> dict[str, Any]:
        """`Controller.stats()` of the last training forward (``{}`` before training)."""
        return self.ctl.stats() if self.ctl is not None else {}

    def report(self) -> str:
        return self.ctl.report() if self.ctl is not None else ""

    def state_dict(self) -> dict[str, Any]:
        """The controller's state (step, bit plan, adaptive estimates), for checkpoints."""
        if self.ctl is not None:
            return self.ctl.state_dict()
        return dict(self._pending_state or {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state now, or at `on_train_start` if training has not started."""
        if self.ctl is not None:
            self.ctl.load_state_dict(state)
        else:
            self._pending_state = dict(state)
