"""Activation compression in a Lightning ``Trainer``: `GactCallback` (alias
`CompressionCallback`).

::

    from lightning.pytorch import Trainer
    from gact_graph.integrations.lightning import GactCallback

    trainer = Trainer(callbacks=[GactCallback(bits=2, module="model")])
    trainer.fit(lit_module)

What it does:

- ``on_train_start``: ``compress_gnn(target, ...)`` with ``target`` the LightningModule, or the
  submodule named by ``module`` (use it when ``training_step`` calls ``self.model(...)``
  rather than ``self(...)``: the controller compresses what runs inside the target's
  forward). A state restored from a checkpoint is applied here.
- validation / test / predict run under ``no_grad``: the controller installs no hook then,
  so they cost nothing (graph-aware convolution paths still run; they are exact).
- ``on_train_batch_end`` (after the optimizer step): ``ctl.iterate()`` and, with
  ``log_stats``, ``pl_module.log`` of ``{prefix}/orig_MB``, ``stored_MB`` and ``ratio`` of
  the batch's forward (``ctl.stats()["total"]``). With gradient accumulation it iterates once
  per batch (each forward gets fresh rounding seeds).
- checkpoints: the callback's ``state_dict`` is ``{"controller": ctl.state_dict()}`` (step,
  bit plan, adaptive estimates); Lightning saves it with every checkpoint and restores it on
  ``trainer.fit(..., ckpt_path=...)``.
- ``on_train_end`` / ``on_exception`` / ``teardown``: ``ctl.remove()``; the model is exactly
  as before.

Lightning's training closure is not reachable from a callback, so ``iterate`` gets no
``step_fn``: the default adaptive estimator (``probe``) needs none, GACT's ``two_seed`` one
then keeps its plan (and says so once).
"""

from __future__ import annotations

import warnings
from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError as e:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "gact_graph.integrations.lightning needs Lightning: pip install gact_graph[lightning]"
    ) from e

from torch import nn

from gact_graph.api import compress_gnn
from gact_graph.core.controller import Controller

__all__ = ["GactCallback", "CompressionCallback"]


class GactCallback(Callback):
    """Compresses the activations a LightningModule saves for backward, in training only.

    Args:
        bits: as `compress_gnn` (``None``: lossless; with ``adaptive=True`` an average).
        module: dotted name of the submodule to compress (e.g. ``"model"``); ``None``: the
            LightningModule itself.
        log_stats: log the byte figures of every training batch.
        log_prefix: prefix of the logged names.
        **kwargs: any other `compress_gnn` argument (``adaptive``, ``opt_level``, ...).
    """

    def __init__(
        self,
        bits: float | None = 2,
        *,
        module: str | None = None,
        log_stats: bool = True,
        log_prefix: str = "gact",
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.bits = bits
        self.module = module
        self.log_stats = log_stats
        self.log_prefix = log_prefix
        self.kwargs = kwargs
        self.ctl: Controller | None = None
        self._pending_state: dict[str, Any] | None = None
        self._forward_id = 0
        self._warned = False

    @property
    def state_key(self) -> str:
        return self._generate_state_key(module=self.module)

    # ---------------------------------------------------------------- lifecycle
    def _target(self, pl_module: nn.Module) -> nn.Module:
        return pl_module if self.module is None else pl_module.get_submodule(self.module)

    def on_train_start(self, trainer, pl_module) -> None:
        if self.ctl is None:
            self.ctl = compress_gnn(self._target(pl_module), bits=self.bits, **self.kwargs)
            if self._pending_state is not None:
                self.ctl.load_state_dict(self._pending_state)
                self._pending_state = None

    def _remove(self) -> None:
        if self.ctl is not None:
            self._pending_state = self.ctl.state_dict()
            self.ctl.remove()
            self.ctl = None

    def on_train_end(self, trainer, pl_module) -> None:
        self._remove()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._remove()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._remove()

    # ---------------------------------------------------------------- per batch
    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        if self.ctl is not None:
            self._forward_id = self.ctl._forward_id

    def on_train_batch_end(
        self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        ctl = self.ctl
        if ctl is None:
            return
        if ctl._forward_id == self._forward_id:
            if not self._warned:
                self._warned = True
                name = self.module or type(pl_module).__name__
                warnings.warn(
                    f"gact_graph: no forward of {name!r} ran during this training step, so "
                    "nothing was compressed; if training_step calls a submodule (e.g. "
                    "self.model(...)), pass GactCallback(module='model')",
                    stacklevel=2,
                )
            return
        ctl.iterate()
        if self.log_stats:
            total = ctl.stats()["total"]
            pl_module.log_dict(
                {
                    f"{self.log_prefix}/orig_MB": total["orig_bytes"] / 2**20,
                    f"{self.log_prefix}/stored_MB": total["stored_bytes"] / 2**20,
                    f"{self.log_prefix}/ratio": float(total["ratio"]),
                },
                on_step=True,
                on_epoch=False,
                batch_size=1,
            )

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        if self.ctl is not None:
            return {"controller": self.ctl.state_dict()}
        if self._pending_state is not None:
            return {"controller": dict(self._pending_state)}
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("controller")
        if state is None:
            return
        if self.ctl is not None:
            self.ctl.load_state_dict(state)
        else:
            self._pending_state = dict(state)


#: The same callback under a descriptive name.
CompressionCallback = GactCallback
