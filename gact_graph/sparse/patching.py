"""Routing known PyG convolutions through graph-aware paths, and undoing it exactly.

A patcher is ``fn(ctl, path, module) -> None``: it patches one module instance (an instance
attribute ``forward`` shadowing the class's; `install_forward` does it and registers the undo
with ``ctl.add_undo``) and records in ``ctl.module_paths[path]`` which path runs. Patchers are
registered per exact class with `register_patcher`; `install_sparse_paths` applies them. A
subclass of a registered class is never patched (it may override ``message``/``aggregate``):
it stays on the generic path, and the report says why.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "register_patcher",
    "install_sparse_paths",
    "install_forward",
    "message_passing_reason",
    "PATCHERS",
]

Patcher = Callable[[Any, str, nn.Module], None]

#: exact class -> patcher
PATCHERS: dict[type, Patcher] = {}

#: modules of this package whose import registers patchers
_BUILTIN_PATCHER_MODULES = ("gact_graph.sparse.convs", "gact_graph.sparse.gat_convs")

_MP_HOOK_DICTS = (
    "_propagate_forward_pre_hooks",
    "_propagate_forward_hooks",
    "_message_forward_pre_hooks",
    "_message_forward_hooks",
    "_aggregate_forward_pre_hooks",
    "_aggregate_forward_hooks",
    "_message_and_aggregate_forward_pre_hooks",
    "_message_and_aggregate_forward_hooks",
    "_edge_update_forward_pre_hooks",
    "_edge_update_forward_hooks",
)


def register_patcher(*conv_classes: type) -> Callable[[Patcher], Patcher]:
    """Decorator: ``fn(ctl, path, module)`` patches instances of exactly these classes."""
    if not conv_classes:
        raise TypeError("register_patcher needs at least one class")

    def deco(fn: Patcher) -> Patcher:
        for cls in conv_classes:
            PATCHERS[cls] = fn
        return fn

    return deco


def install_forward(
    ctl, path: str, module: nn.Module, forward: Callable, label: str = "sparse-fused"
) -> None:
    """Shadow ``module.forward`` with ``forward`` on the instance (`Controller.patch_forward`:
    ``ctl.remove()`` restores the previous state exactly) and label the module's path."""
    ctl.patch_forward(module, forward)
    ctl.module_paths[path] = label


def message_passing_reason(module: nn.Module) -> str | None:
    """Why a `MessagePassing` module must run PyG's own code right now (None: a fused path
    may replace its propagate): options or hooks that change what propagate does,
    ``torch.jit.trace`` (which records no custom autograd Function) or a ``torch.func``
    transform (its wrapped tensors have no storage to key an adjacency on, and the fused
    Functions define no ``setup_context``)."""
    if torch.jit.is_tracing():
        return "torch.jit.trace"
    if torch._C._functorch.maybe_current_level() is not None:
        return "torch.func transform"
    if getattr(module, "flow", "source_to_target") != "source_to_target":
        return "flow=target_to_source"
    if getattr(module, "node_dim", -2) not in (-2, 0):
        return f"node_dim={module.node_dim}"
    if getattr(module, "decomposed_layers", 1) != 1:
        return "decomposed_layers"
    if getattr(module, "explain", None):
        return "explain"
    for name in _MP_HOOK_DICTS:
        if getattr(module, name, None):
            return "message-passing hooks"
    return None


def _load_builtin_patchers() -> None:
    for mod in _BUILTIN_PATCHER_MODULES:
        if importlib.util.find_spec(mod) is None:
            continue
        try:
            importlib.import_module(mod)
        except Exception as e:  # a broken optional path must not break the others
            warnings.warn(f"gact_graph: could not load patchers from {mod}: {e!r}", stacklevel=3)


def install_sparse_paths(ctl) -> dict[str, str]:
    """Patch every module of ``ctl.model`` whose exact class has a registered patcher.

    Returns ``{path: what runs}`` for the modules considered (patched, or left generic with
    the reason); ``ctl.module_paths`` holds the same.
    """
    _load_builtin_patchers()
    result: dict[str, str] = {}
    for name, module in ctl.model.named_modules():
        path = name or "<root>"
        patcher = PATCHERS.get(type(module))
        if patcher is None:
            base = next((c for c in PATCHERS if isinstance(module, c)), None)
            if base is not None:
                ctl.module_paths[path] = (
                    f"generic (subclass {type(module).__name__} of {base.__name__})"
                )
                result[path] = ctl.module_paths[path]
            continue
        patcher(ctl, path, module)
        result[path] = ctl.module_paths.get(path, "generic")
    return result
