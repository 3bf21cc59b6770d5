"""A dispatch mode that records the large storages an operation makes (shared by the memory
tests of the attention's backwards)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LargeAllocations(TorchDispatchMode):
    """Records the op of every new storage of at least ``min_bytes`` made under it (a result
    sharing an argument's storage, a view or an in-place op, is not new)."""

    def __init__(self, min_bytes: int):
        super().__init__()
        self.min_bytes, self.made = min_bytes, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = func(*args, **(kwargs or {}))
        given = {
            a.untyped_storage().data_ptr()
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor) and type(a) is torch.Tensor
        }
        for t in torch.utils._pytree.tree_leaves(res):
            if not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() not in given and storage.nbytes() >= self.min_bytes:
                self.made.append(str(func))
        return res
