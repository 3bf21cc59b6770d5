"""`compress_gnn`: the one entry point."""

from __future__ import annotations

from typing import Any

from torch import nn

from gact_graph.budget import attach_budget
from gact_graph.config import CompressionConfig
from gact_graph.core.controller import Controller
from gact_graph.ops import install_pointwise_ops
from gact_graph.policy.acgc import attach_acgc
from gact_graph.policy.adaptive import attach_adapter
from gact_graph.policy.levels import install_level
from gact_graph.policy.watch import attach_watch
from gact_graph.sparse import install_sparse_paths

__all__ = ["compress_gnn"]


def compress_gnn(
    model: nn.Module,
    bits: float | None = 2,
    *,
    adaptive: bool = True,
    group_size: int = 256,
    min_numel: int = 2048,
    seed: int = 0,
    sparse: bool = True,
    pointwise: bool = True,
    opt_level: str = "L1",
    adapt_interval: int | None = None,
    memory_budget: int | str | None = None,
    policy: str = "adaptive",
    loss_bound: float | None = None,
    config: CompressionConfig | None = None,
    **extra: Any,
) -> Controller:
    """Compress what ``model`` saves for backward; returns the `Controller`.

    ``bits=None`` (or 32) stores everything losslessly. ``policy="acgc", loss_bound=e2`` chooses
    bits per tensor so that compression adds at most ``e2`` times the gradient's measured squared
    norm to its variance (AC-GC; `gact_graph.policy.acgc`). The model itself is not modified beyond
    hooks and patches that ``Controller.remove()`` undoes exactly; it can also be used as a
    context manager. ``memory_budget="16GiB"`` (or bytes) lets a planner choose per saved tensor
    keep / compress / recompute / swap so that each step fits (`gact_graph.budget`). A run whose
    gradients the watch sees blowing up gets the bits of what is compressed raised, with a
    warning (``on_divergence="rescue"``, the default; ``"warn"`` only warns; ``"raise"`` raises
    `gact_graph.policy.watch.DivergenceError` from ``ctl.iterate()``)::

        with compress_gnn(model, bits=2) as ctl:
            train(model)
    """
    if config is None:
        config = CompressionConfig(
            bits=bits,
            adaptive=adaptive,
            group_size=group_size,
            min_numel=min_numel,
            seed=seed,
            sparse=sparse,
            pointwise=pointwise,
            opt_level=opt_level,
            adapt_interval=adapt_interval,
            memory_budget=memory_budget,
            policy=policy,
            loss_bound=loss_bound,
            extra=extra,
        )
    elif not isinstance(config, CompressionConfig):
        raise TypeError(f"config must be a CompressionConfig, got {type(config).__name__}")
    ctl = Controller(model, config)
    if config.sparse and config.opt_level != "L0":
        install_sparse_paths(ctl)
    if config.pointwise and config.opt_level != "L0":
        install_pointwise_ops(ctl)
    if config.opt_level in ("L2", "CB1"):
        install_level(ctl)  # L2: swap to pinned CPU memory; CB1: compressed checkpointing
    if config.adaptive and not config.lossless:
        # bits per tensor from measured sensitivity: under an average budget (policy.adaptive)
        # or under a bound on the added gradient variance (policy.acgc)
        (attach_acgc if config.policy == "acgc" else attach_adapter)(ctl)
    if config.memory_budget is not None:
        attach_budget(ctl)  # per tensor keep/compress/recompute/swap under the budget (budget/)
    if not config.lossless:
        attach_watch(ctl)  # raises bits (or warns, or stops: on_divergence) when gradients blow up
    if config.opt_level != "L0":
        ctl.guard_interrupts()  # last: it wraps whatever forward the root has now
    return ctl
