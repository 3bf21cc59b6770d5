"""Identity and kind of a tensor that autograd saves for backward.

Two saved tensors are the same object to store when they are the same view of the same live
storage at the same version: then one compressed copy serves both (GACT's "footprint"). Storage
identity uses a weak reference to the C++ storage, which keeps its address from being reused
while we look at it but never keeps its memory alive, so a freed-and-reallocated buffer can
never be mistaken for an alias.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from gact_graph.switches import eager_when_compiling

__all__ = [
    "KINDS",
    "PARAM_COPY_NODES",
    "StorageSet",
    "ViewKey",
    "is_plain_strided",
    "storage_ref",
    "view_key",
    "view_bytes",
    "is_autocast_param_copy",
    "tensors_in",
]

#: What a saved tensor is. ``param`` and ``input`` are held by the model / the caller anyway and
#: are kept by reference; ``activation`` is float data computed in forward; ``index`` integer
#: data (edge indices, argmax positions); ``mask`` boolean data; ``other`` whatever we do not
#: look inside (sparse layouts, tensor subclasses, meta tensors).
KINDS = ("activation", "index", "mask", "param", "input", "other")


class ViewKey(NamedTuple):
    storage: int  # address of the C++ StorageImpl (kept alive by a StorageWeakRef)
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    version: int


def is_plain_strided(t: torch.Tensor) -> bool:
    """A dense tensor on a real device whose storage we can inspect."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout == torch.strided
        and t.device.type != "meta"
    )


@eager_when_compiling  # Dynamo would build the reference itself and drop it half made
def storage_ref(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def view_key(t: torch.Tensor, ref: StorageWeakRef) -> ViewKey:
    return ViewKey(
        ref.cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version
    )


_SPARSE_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def view_bytes(t: torch.Tensor) -> int:
    """Bytes that keeping ``t`` alive costs: its elements, but never more than its storage
    (an expanded view of a small tensor costs only the small tensor); for a sparse tensor, its
    index and value tensors (``numel`` of a sparse tensor is that of its dense shape)."""
    parts = _SPARSE_PARTS.get(t.layout)
    if parts is not None:
        return sum(view_bytes(getattr(t, p)()) for p in parts)
    n = t.numel() * t.element_size()
    if is_plain_strided(t):
        n = min(n, t.untyped_storage().nbytes())
    return n


class StorageSet:
    """A set of storages held weakly (e.g. the parameters of a model)."""

    def __init__(self, tensors: Iterable[torch.Tensor] = ()) -> None:
        self._refs: dict[int, StorageWeakRef] = {}
        for t in tensors:
            self.add(t)

    def add(self, t: torch.Tensor) -> None:
        if isinstance(t, torch.Tensor) and is_plain_strided(t):
            ref = storage_ref(t)
            self._refs[ref.cdata] = ref

    def __contains__(self, cdata: int) -> bool:
        ref = self._refs.get(cdata)
        return ref is not None and not ref.expired()

    def __len__(self) -> int:
        return len(self._refs)


#: autograd nodes of views that keep a tensor's values (what lies between a copy and its use)
_VIEW_NODES = frozenset(
    {"TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
     "UnsafeViewBackward0", "ReshapeAliasBackward0", "ExpandBackward0"}
)  # fmt: skip


#: autograd nodes where `is_autocast_param_copy` can answer True (a copy, or a view of one)
PARAM_COPY_NODES = _VIEW_NODES | {"ToCopyBackward0"}


def is_autocast_param_copy(t: torch.Tensor, params: StorageSet) -> bool:
    """True for the fp16/bf16 copy of a parameter that autocast makes (and caches) in forward,
    or a view of it (``F.linear`` saves the copy transposed): it is a parameter, never
    quantized (2-bit weights in ``grad_input = G W`` would reach every layer below)."""
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in _VIEW_NODES and len(fn.next_functions) == 1:
        fn = fn.next_functions[0][0]
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    for nxt, _ in fn.next_functions:
        var = getattr(nxt, "variable", None)
        if var is not None and is_plain_strided(var) and storage_ref(var).cdata in params:
            return True
    return False


def tensors_in(obj) -> list[torch.Tensor]:
    """Every tensor inside nested tuples/lists/dicts and PyG-like objects with tensor attributes."""
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif hasattr(o, "to_dict") and callable(o.to_dict) and not isinstance(o, nn.Module):
            with contextlib.suppress(Exception):
                stack.extend(o.to_dict().values())
    return out
