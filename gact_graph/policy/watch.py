"""Warn before compression noise loses a run: the gradient norm is watched across steps.

Fixed low bits can drive some models to diverge silently (PyG's 64-layer ``gcn2_cora.py`` at
fixed 2 bits: the gradient norm grows about 10x in 20 epochs, then the loss goes NaN). The
watch sees every step's gradient through ``ctl.iterate()`` and warns once, with what to do:
when the norm grows more than ``growth`` times over the median of the steps before, or when
gradients are non-finite in several steps of one window (a single non-finite step is what
AMP's ``GradScaler`` produces and skips on purpose).

Cost: one fused norm over the parameters' gradients per step, kept on the device; the values
are read once every ``every`` steps, on CUDA through an asynchronous copy to pinned host memory
that is looked at in a later step, once it has landed (no step waits for the device).
"""

from __future__ import annotations

import math
import statistics
import warnings

import torch

__all__ = ["GradientWatch", "attach_watch"]


class GradientWatch:
    """Watches the gradient norm of ``ctl.model`` at each ``ctl.iterate()``.

    Args:
        every: steps between reads of the recorded norms (one sync each).
        window: steps of history the growth is measured against (their median).
        growth: how many times the median a norm may reach before the warning.
        nonfinite: non-finite steps within one read that count as divergence.
    """

    def __init__(self, every: int = 10, window: int = 50, growth: float = 10.0, nonfinite=3):
        self.every, self.window, self.growth, self.nonfinite = every, window, growth, nonfinite
        self.pending: list[torch.Tensor] = []
        self.history: list[float] = []
        self.warned = False
        #: (pinned host copy, event recorded after it, step of its last norm) while in flight
        self._copy: tuple[torch.Tensor, torch.cuda.Event, int] | None = None

    def after_step(self, ctl) -> None:
        grads = [p.grad for p in ctl.model.parameters() if p.grad is not None]
        if not grads or self.warned:
            return
        norms = torch._foreach_norm([g.detach() for g in grads])  # no sync: stays on device
        dev = norms[0].device
        self.pending.append(
            torch.linalg.vector_norm(torch.stack([n.float().to(dev) for n in norms]))
        )
        if len(self.pending) >= self.every or self._copy is not None:
            self._check(ctl)

    def _read(self, ctl) -> tuple[list[float], int] | None:
        """The recorded norms and the step of the last one, without waiting for the device. On
        CUDA the first call starts a copy to pinned host memory and returns None; a later call
        returns the values once the copy has landed (norms recorded meanwhile wait for the
        next read)."""
        if self._copy is None:
            values = torch.stack(self.pending)
            self.pending.clear()
            if values.device.type != "cuda":
                return values.tolist(), ctl.step
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self._copy = (host, done, ctl.step)
        host, done, last_step = self._copy
        if not done.query():
            return None
        self._copy = None
        return host.tolist(), last_step

    def _check(self, ctl) -> None:
        read = self._read(ctl)
        if read is None:
            return
        values, last_step = read
        bad = [v for v in values if not math.isfinite(v)]
        if len(bad) >= self.nonfinite:
            self._warn(ctl, f"gradients were non-finite in {len(bad)} of the last "
                            f"{len(values)} steps (step {last_step})")  # fmt: skip
            return
        for i, v in enumerate(values):
            if not math.isfinite(v):
                continue
            ref = self.history[-self.window :]
            if len(ref) >= self.window // 2:
                base = statistics.median(ref)
                if base > 0 and v > self.growth * base:
                    step = last_step - len(values) + 1 + i
                    self._warn(ctl, f"the gradient norm grew {v / base:.0f}x over the median "
                                    f"of the {len(ref)} steps before step {step}")  # fmt: skip
                    return
            self.history.append(v)
        del self.history[: -self.window]

    def _warn(self, ctl, what: str) -> None:
        self.warned = True
        cfg = ctl.config
        mode = f"adaptive {cfg.bits:g}-bit" if cfg.adaptive else f"fixed {cfg.bits}-bit"
        advice = (
            "raise bits (e.g. bits=4)"
            if cfg.adaptive
            else "use adaptive bits (the default) or raise bits (e.g. bits=4)"
        )
        warnings.warn(
            f"gact_graph: {what} with {mode} compression; this run may be diverging because of "
            f"compression noise: {advice}, or compare with bits=None to see whether the model "
            "diverges without compression",
            RuntimeWarning,
            stacklevel=5,  # _warn, _check, after_step, Controller.iterate, the caller
        )


def attach_watch(ctl) -> GradientWatch:
    """Give ``ctl`` a :class:`GradientWatch` (``compress_gnn`` does, whenever it quantizes)."""
    watch = GradientWatch()
    ctl.add_step_hook(watch.after_step)
    return watch
